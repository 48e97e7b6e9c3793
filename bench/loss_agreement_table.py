"""The table of bench/loss_agreement.sh: does each lever train like the baseline, beyond seed noise?

    python3 bench/loss_agreement_table.py WORK LAST RUN...     (RUN: GROUP_sSEED; the baseline's first)

Prints the Markdown table on stdout and every step's loss per run as CSV on stderr.

Per run: the mean loss over its last LAST steps. Per group: the mean of that over its seeds. The
baseline's spread is [min, max] over its seeds. A lever agrees when its mean lies inside that
spread: a seed alone moves the loss that much. The paired difference compares each lever seed
with the baseline run of the same seed (same initialisation, same batches), the mean over seeds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def tail_mean(values: list[float], last: int) -> float:
    return sum(values[-last:]) / len(values[-last:])


def main() -> None:
    work, last, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    records: dict[str, dict | None] = {}
    for run in runs:
        found = sorted((work / "suite" / run / "cells").glob("*/result.json"))
        records[run] = json.loads(found[-1].read_text()) if found else None
    losses = {run: r["losses"] for run, r in records.items() if r and r.get("status") == "ok"}
    steps = max((len(v) for v in losses.values()), default=0)
    print("step," + ",".join(losses), file=sys.stderr)
    for step in range(steps):
        cells = [f"{v[step]:.6f}" if step < len(v) else "" for v in losses.values()]
        print(f"{step + 1}," + ",".join(cells), file=sys.stderr)

    groups: dict[str, dict[int, str]] = {}
    for run in runs:
        group, seed = run.rsplit("_s", 1)
        groups.setdefault(group, {})[int(seed)] = run
    baseline = next(iter(groups))
    base = {seed: tail_mean(losses[run], last) for seed, run in groups[baseline].items() if run in losses}
    low, high = (min(base.values()), max(base.values())) if base else (None, None)
    base_mean = statistics.mean(base.values()) if base else None

    header = [
        "variant",
        "float8",
        "loss",
        "seeds run",
        f"mean loss, last {last} steps (per seed)",
        f"vs {baseline} mean",
        f"paired vs {baseline} (same seed)",
        f"inside {baseline}'s seed spread",
        "peak GiB",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for group, seeds in groups.items():
        done = {seed: run for seed, run in seeds.items() if run in losses}
        failed = [
            f"s{seed}: {(records[run] or {}).get('error', 'not run')}"[:70]
            for seed, run in seeds.items()
            if run not in losses
        ]
        first = records[next(iter(done.values()))] if done else None
        if not done or first is None:
            print(f"| {group} | | | 0 of {len(seeds)} | | | | no ({'; '.join(failed)}) | |")
            continue
        means = {seed: tail_mean(losses[run], last) for seed, run in done.items()}
        mean = statistics.mean(means.values())
        spec = first["spec"]
        row = [
            group,
            spec["float8"],
            spec["loss"],
            f"{len(done)} of {len(seeds)}",
            f"{mean:.4f} ({', '.join(f's{s} {m:.4f}' for s, m in sorted(means.items()))})",
        ]
        if group == baseline:
            spread = f"spread {low:.4f} .. {high:.4f} ({(high - low) / base_mean:.2%} of the mean)" if base else "-"
            row += ["reference", "-", spread]
        elif base_mean is not None and low is not None and high is not None:
            paired = [means[s] / base[s] - 1 for s in means if s in base]
            row += [
                f"{mean / base_mean - 1:+.3%}",
                f"{statistics.mean(paired):+.3%} ({len(paired)} pair(s))" if paired else "-",
                "yes" if low <= mean <= high else f"NO ({'below' if mean < low else 'above'})",
            ]
        else:
            row += ["-", "-", "no baseline"]
        row.append(f"{max(records[r]['peak_memory_gib'] for r in done.values()):.1f}")  # type: ignore[index]
        if failed:
            row[-2] += f"; failed {'; '.join(failed)}"
        print("| " + " | ".join(row) + " |")
    print()
    first = next((r for r in records.values() if r), None) or {}
    spec, source = first.get("spec", {}), first.get("data_source", {})
    print(
        f"{spec.get('model', '?')}, {spec.get('precision', '?')}, seq {spec.get('seq_len', '?')}, batch "
        f"{spec.get('batch_size', '?')} x {first.get('world_size', '?')} rank(s), {steps} steps, lr "
        f"{spec.get('lr', '?')}; text: {source.get('documents', '?')} documents, {source.get('tokens', '?')} "
        f"tokens (bench/make_text_data.py). Runs shared GPUs: no speeds."
    )
    if (work / "failed.txt").exists():
        print("failed: " + "; ".join((work / "failed.txt").read_text().split("\n")).strip("; "))


if __name__ == "__main__":
    main()
