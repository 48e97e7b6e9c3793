"""The table of bench/versus_torchtitan.sh: per case, the median over its repeats of tokens/s per
GPU, the peak reserved memory, and the ratios to torchtitan at the same batch and to torchtitan's
best case.

    python3 bench/versus_torchtitan_table.py WORK WARMUP SUITE_FIELDS CASE...

torchtitan's figure for one run is the median of its per-step `tps` log lines after WARMUP steps
(log_freq 1: each line covers one step, and the loss it logs has synchronised the device); its
memory the largest `memory: X GiB` (max reserved, reset at every log line). hpcfsdp's figure is
the record's tokens_per_s_per_gpu (the window after warm-up, between two device syncs) and its
memory the record's peak reserved memory. Where a run's `logs/NAME-rN.gpu.csv` exists (nvidia-smi
samples of utilization, SM clock and power), the table gives the median SM clock and power over
the samples with the GPU at least 90% busy: identical kernels take longer at a lower clock.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def titan_run(log: Path, warmup: int) -> dict | None:
    steps = [STEP.search(ANSI.sub("", line)) for line in log.read_text(errors="replace").splitlines()]
    found = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in steps if m]
    timed = [tps for step, _, tps in found if step > warmup]
    if not timed:
        return None
    return {"tps": statistics.median(timed), "reserved": max(mem for _, mem, _ in found)}


def suite_run(folder: Path) -> dict | None:
    for path in sorted(folder.glob("cells/*/result.json")):
        record = json.loads(path.read_text())
        if record.get("status") == "ok":
            end = record.get("memory", {}).get("end", {})
            return {
                "tps": record["tokens_per_s_per_gpu"],
                "reserved": end.get("peak_reserved_gib", record["peak_memory_gib"]),
                "retries": int(end.get("alloc_retries", 0)),
            }
        return {"error": f"{record.get('status')}: {str(record.get('error', ''))[:60]}"}
    return None


def gpu_clock(log: Path) -> tuple[float, float] | None:
    """(median SM MHz, median W) while the GPU was at least 90% busy, from the run's samples."""
    samples = log.with_suffix(".gpu.csv")
    if not samples.exists():
        return None
    busy = []
    for line in samples.read_text(errors="replace").splitlines():
        try:
            utilization, mhz, watts = (float(v) for v in line.split(","))
        except ValueError:
            continue
        if utilization >= 90:
            busy.append((mhz, watts))
    if not busy:
        return None
    return statistics.median(m for m, _ in busy), statistics.median(w for _, w in busy)


def main() -> None:
    work, warmup, suite_fields, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    rows, medians = [], {}
    for case in cases:
        name, side, batch, *fields = case.split()
        runs, errors = [], []
        for log in sorted((work / "logs").glob(f"{name}-r*.log")):
            repeat = log.stem.removeprefix(f"{name}-r")
            if not repeat.isdigit():  # another case whose name starts with this one's (suite-b4-rbf16)
                continue
            run = titan_run(log, warmup) if side == "titan" else suite_run(work / "suite" / f"{name}-r{repeat}")
            if run and "tps" in run:
                run["clock"] = gpu_clock(log)
            if run and "tps" in run:
                runs.append(run)
            else:
                oom = "out of memory" in log.read_text(errors="replace").lower()
                errors.append("out of memory" if oom else (run or {}).get("error", "no figure (see its log)"))
        tps = [r["tps"] for r in runs]
        median = statistics.median(tps) if tps else None
        medians[name] = (side, int(batch), median)
        rows.append((name, side, batch, " ".join(fields), median, tps, runs, errors))
    titan = {b: m for s, b, m in medians.values() if s == "titan" and m}
    best_titan = max(titan.values(), default=None)
    header = [
        "case",
        "side",
        "batch",
        "fields",
        "tok/s/GPU, median (runs)",
        "peak reserved GiB",
        "vs torchtitan, same batch",
        "vs torchtitan's best",
        "SM MHz, W while busy",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, side, batch, fields, median, tps, runs, errors in rows:
        figure = f"{median:,.0f} ({', '.join(f'{v:,.0f}' for v in tps)})" if median else "-"
        if errors:
            figure += f"; {len(errors)} failed: {'; '.join(sorted(set(errors)))}"
        reserved = f"{max(r['reserved'] for r in runs):.1f}" if runs else "-"
        retries = max((r.get("retries", 0) for r in runs), default=0)
        if retries:
            reserved += f" ({retries} allocator retries)"
        same = titan.get(int(batch))
        ratio = f"{median / same:.3f}" if side == "suite" and median and same else "-"
        best = f"{median / best_titan:.3f}" if side == "suite" and median and best_titan else "-"
        clocks = [r["clock"] for r in runs if r.get("clock")]
        clock = "-"
        if clocks:
            clock = f"{statistics.median(c[0] for c in clocks):,.0f}, {statistics.median(c[1] for c in clocks):.0f}"
        print(f"| {name} | {side} | {batch} | {fields or '-'} | {figure} | {reserved} | {ratio} | {best} | {clock} |")
    print()
    print(
        f"hpcfsdp: `hpcfsdp run {suite_fields}` + the case's fields, seq_len and batch_size. torchtitan: "
        "bench/torchtitan_random.py (its trainer, qwen3 1.7B, random tokens), compile, float8 converter."
    )
    for name in ("skipped.txt", "failed.txt"):
        if (work / name).exists():
            print(f"{name[:-4]}: " + "; ".join((work / name).read_text().split("\n")).strip("; "))


if __name__ == "__main__":
    main()
