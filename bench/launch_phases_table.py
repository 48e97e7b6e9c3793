"""The table of bench/launch_phases.sh: each cell's phases (its record's `phases`), its launch span
beside its own duration_s, the matrix's wall time and GPU-hours (the local executor's manifest:
each launch's start to end, times its GPUs), and each auto cell's probes.

    python bench/launch_phases_table.py RESULTS/<sweep> [--wall-s SECONDS]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PHASES = (
    "launcher_start",
    "imports",
    "process_group",
    "data",
    "batch_search",
    "model_build",
    "shard",
    "compile",
    "warmup",
    "timed_window",
    "measurement",
    "teardown",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--wall-s", type=float, default=None, help="the whole submit's wall time")
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in sorted(args.sweep_dir.glob("cells/*/result.json"))]
    manifest = json.loads((args.sweep_dir / "manifest.json").read_text())
    header = ["cell", "status", "tokens/s/GPU", "launch (s)", "duration_s", *PHASES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for record in records:
        phases = record.get("phases") or {}
        speed = record.get("tokens_per_s_per_gpu")
        launch = manifest.get(record["cell_id"], {})
        wall = launch.get("ended_at", 0) - launch.get("submitted_at", 0)
        row = [
            record["cell_id"],
            record["status"],
            f"{speed:,.0f}" if speed else "-",
            f"{wall:.1f}",
            f"{record.get('duration_s', 0):.1f}",
            *(f"{phases[name]:.2f}" if name in phases else "-" for name in PHASES),
        ]
        print("| " + " | ".join(row) + " |")
    fixed = [
        sum(
            seconds for name, seconds in (r.get("phases") or {}).items() if name not in ("timed_window", "batch_search")
        )
        for r in records
        if r.get("phases")
    ]
    gpu_hours = sum(
        (entry.get("ended_at", 0) - entry.get("submitted_at", 0)) * r.get("world_size", 1) / 3600
        for r in records
        if (entry := manifest.get(r["cell_id"]))
    )
    print()
    if fixed:
        print(
            "fixed cost per launch (every phase but the timed window and the batch search): "
            f"median {statistics.median(fixed):.1f} s, max {max(fixed):.1f} s"
        )
    wall = f"{args.wall_s:.0f} s" if args.wall_s else "-"
    print(f"{len(records)} cells: submit's wall time {wall}, {gpu_hours:.4f} GPU-hours (launches x GPUs)")
    for record in records:
        search = record.get("batch_search")
        if search:
            probes = ", ".join(
                f"{p['batch_size']} {p['status']} ({p['wall_s']:.1f} s)" for p in search.get("probes", [])
            )
            print(
                f"{record['cell_id']}: predicted batch {search.get('predicted_batch')}, probes {probes}; "
                f"chose {search.get('chosen_batch_size')} in {search.get('wall_s', 0):.1f} s"
            )


if __name__ == "__main__":
    main()
