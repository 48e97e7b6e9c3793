"""Check the records of bench/record_check.sh: the fields only a GPU run fills (NVML energy and
utilisation, float8 linears, the fused loss, the memory snapshot of an OOM) are there and of the
record's declared types (hpcfsdp.contracts.record's TypedDicts, as read_record checks them).

    python3 bench/record_check.py SWEEP_DIR [--cpu]    # exit 1 naming each missing field
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcfsdp.contracts.record import read_record

# record status -> fields that must be set (not null) on a GPU / on the CPU
GPU_FIELDS = {
    "ok": ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "memory_capacity_gib", "energy_j", "joules_per_token",
           "gpu_util_mean", "sm_clock_mhz_mean", "power_w_mean", "float8_linears", "final_loss"),
    "oom": ("memory_snapshot", "memory_at_failure", "error", "traceback"),
}  # fmt: skip
CPU_FIELDS = {"ok": ("tokens_per_s_per_gpu", "peak_memory_gib", "final_loss"), "error": ("error", "traceback")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke run: no NVML, float8 or OOM")
    args = parser.parse_args()
    wanted = CPU_FIELDS if args.cpu else GPU_FIELDS
    seen: dict[str, dict] = {}
    for path in sorted(args.sweep_dir.glob("cells/*/result.json")):
        record = read_record(path)  # checks every declared field's type, or raises in one line
        seen[record["status"]] = record
        spec = record["spec"]
        print(f"{path.parent.name}: {record['status']} (strategy {spec['strategy']}, batch {spec['batch_size']})")
        for name in wanted.get(record["status"], ()):
            print(f"    {name} = {str(record.get(name))[:100]}")
    problems = [f"no {status} record" for status in wanted if status not in seen]
    problems += [
        f"{status} record: {name} is null or missing"
        for status, names in wanted.items()
        for name in names
        if status in seen and seen[status].get(name) is None
    ]
    snapshot = seen.get("oom", {}).get("memory_snapshot")
    if snapshot and not Path(snapshot).is_file():
        problems.append(f"oom record: memory_snapshot {snapshot} is not a file")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
