"""The table of bench/tune_vs_grid.sh: the grid's records against tune's outcome (tune.json) for
the same YAML. Spend is GPU-hours counted per launch, from the launcher's start to its end, x its
GPUs: tune's from its launch files (tune.json's spend), the grid's from each cell's manifest entry
(the local executor's submitted_at to ended_at). A cell whose entry has no ended_at (run before the
executor wrote it) counts to its record's file time, the cell's end less torchrun's exit."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hpcfsdp.contracts.files import RecordError
from hpcfsdp.contracts.record import read_record


@dataclass
class GridRecords:
    """What the grid's folders (one per stream) hold, cell by cell."""

    speeds: dict[str, float] = field(default_factory=dict)  # tokens/s per GPU of each ok cell
    statuses: dict[str, str] = field(default_factory=dict)  # every readable record's status
    sources: dict[str, int] = field(default_factory=dict)  # records per card, day and commit
    gpu_hours: float = 0.0  # the cells' launches
    estimated: int = 0  # launches counted to their record's file time (no ended_at)
    walls: dict[str, float] = field(default_factory=dict)  # launch wall time where ended_at is known


def grid_records(grids: list[Path]) -> GridRecords:
    """Reads the grid's records and manifest entries (see GridRecords)."""
    found, gpu_s = GridRecords(), 0.0
    for grid in grids:
        manifest = json.loads((grid / "manifest.json").read_text())
        for path in sorted(grid.glob("cells/*/result.json")):
            try:
                record = read_record(path)
            except RecordError:
                continue
            day = time.strftime("%Y-%m-%d", time.gmtime(float(record.get("started_at") or 0)))
            commit = str(record.get("git_commit") or "?")[:7]
            where = f"{record.get('device_name', '?')}, {day}, commit {commit}"
            found.sources[where] = found.sources.get(where, 0) + 1
            cell = path.parent.name
            found.statuses[cell] = str(record["status"])
            if record["status"] == "ok":
                found.speeds[cell] = float(record["tokens_per_s_per_gpu"])
            entry = manifest[cell]
            if entry.get("ended_at") is None:
                wall = path.stat().st_mtime - float(entry["submitted_at"])
                found.estimated += 1
            else:
                wall = float(entry["ended_at"]) - float(entry["submitted_at"])
                found.walls[cell] = wall
            spec = record["spec"]
            gpu_s += wall * int(spec["nodes"]) * int(spec["gpus_per_node"])
    found.gpu_hours = gpu_s / 3600
    return found


def estimate_check(tune: Path, jobs: Path, walls: dict[str, float]) -> str:
    """tune's estimate of each grid cell's launch (tune/gridcost.py) against the grid's own, summed
    over the cells both have that the final stage did not run (those it counts as measured)."""
    from hpcfsdp.sweep.define.matrix import load_sweep
    from hpcfsdp.tune.gridcost import launch_estimates
    from hpcfsdp.tune.state import FINAL, load_state

    state = load_state(tune)
    cells = {cell.id: cell for cell in load_sweep(jobs).cells}
    estimates = launch_estimates(cells, tune, state) or {}
    final = set(next((s.runs for s in state.stages if s.name == FINAL), {}))
    both = [c for c in walls if c in estimates and c not in final]
    if not both:
        return "tune's estimate of the grid: no cell to check it on"
    measured, estimated = sum(walls[c] for c in both), sum(estimates[c] for c in both)
    return (
        f"tune's estimate of the grid, checked on the {len(both)} grid cell(s) with a timed launch that the final "
        f"stage did not run: {estimated:,.0f} s estimated against {measured:,.0f} s measured "
        f"({estimated / measured - 1:+.1%})"
    )


def agreement(ranking: list[dict], speeds: dict[str, float]) -> list[str]:
    """tune's figures against the grid's for the same cell, by how tune got them (a probe, computed
    from a probe at another accumulation, a final-stage run) and by batch: the accumulation
    shortcut is checked against the probes' own spread, not against zero."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in ranking:
        if row["status"] != "ok" or row["cell_id"] not in speeds or not row.get("tokens_per_s_per_gpu"):
            continue
        how = "final-stage run" if row["stage"] == "final" else "computed" if row.get("computed_from") else "probe"
        batches = "batch 1-2" if int(row["setup"]["batch_size"]) <= 2 else "batch 4 and up"
        groups.setdefault((how, batches), []).append(float(row["tokens_per_s_per_gpu"]) / speeds[row["cell_id"]] - 1)
    lines = ["", "tune's tokens/s per GPU against the grid's, cell by cell (tune / grid - 1):", ""]
    lines += ["| how tune got it | batch | cells | median | range |", "|:--|:--|--:|--:|:--|"]
    for (how, batches), ratios in sorted(groups.items()):
        lines.append(
            f"| {how} | {batches} | {len(ratios)} | {statistics.median(ratios):+.1%} "
            f"| {min(ratios):+.1%} to {max(ratios):+.1%} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", type=Path, action="append", required=True, help="a sweep folder of the grid")
    parser.add_argument("--tune", type=Path, required=True)
    parser.add_argument("--jobs", type=Path, help="the YAML: check tune's estimate of the grid cell by cell")
    args = parser.parse_args()
    found = json.loads((args.tune / "tune.json").read_text())
    grid = grid_records(args.grid)
    speeds, sources, grid_h = grid.speeds, grid.sources, grid.gpu_hours
    ranked = sorted(speeds, key=lambda cell: -speeds[cell])
    pick = (found.get("best") or {}).get("cell_id")
    spend = found["spend"]
    tune_h = spend["tune_gpu_hours"]
    lines = [
        f"# tune vs grid: {found['sweep']}",
        "",
        "| | grid | tune |",
        "|:--|--:|--:|",
        f"| cells with a record / launches | {sum(sources.values())} of {spend['grid_cells']} | {spend['launches']} |",
        f"| GPU-hours, sum of launches | {grid_h:.4f} | {tune_h:.4f} |",
        f"| GPU-hours of the whole grid, tune's estimate | {spend['grid_estimate_gpu_hours'] or 0:.4f} | |",
        f"| tune / grid | | {tune_h / grid_h:.3f} |" if grid_h else "",
        f"| pick | {ranked[0] if ranked else '-'} | {pick or '-'} |",
    ]
    if ranked:
        lines.append(
            f"| pick's tokens/s per GPU in the grid | {speeds[ranked[0]]:,.1f} | {speeds.get(pick or '', 0.0):,.1f} |"
        )
        place = ranked.index(pick) + 1 if pick in ranked else None
        lines.append(f"| pick's place in the grid | 1 | {place or 'not ok in the grid'} of {len(ranked)} ok |")
        if pick in speeds:
            lines.append(f"| pick / grid's best | 1.000 | {speeds[pick] / speeds[ranked[0]]:.3f} |")
    lines = [line for line in lines if line]
    lines += ["", "The grid's top three (tokens/s per GPU): " + ", ".join(f"{c} {speeds[c]:,.1f}" for c in ranked[:3])]
    lines += ["", "The grid's records came from: " + "; ".join(f"{n} from {where}" for where, n in sources.items())]
    if grid.estimated:
        lines += [
            f"{grid.estimated} grid cell(s) ran before the manifest had ended_at: counted to their record's file time"
        ]
    if args.jobs:
        lines += ["", estimate_check(args.tune, args.jobs, grid.walls)]
    lines += agreement(found["ranking"], speeds)
    lines += ["", "tune's ranking (its furthest stage):"]
    lines += [
        f"- {row['cell_id']} {row['stage']} {row['status']}"
        + (f" {row['tokens_per_s_per_gpu']:,.1f}" if row.get("tokens_per_s_per_gpu") else "")
        + (f" computed from {row['computed_from']}" if row.get("computed_from") else "")
        + (f" (grid {speeds[row['cell_id']]:,.1f})" if row["cell_id"] in speeds else "")
        for row in found["ranking"]
    ]
    lines += ["", *(f"note: {note}" for note in found["notes"])]
    lines += [
        f"left out before running: {cell}: {why} (grid: {grid.statuses.get(cell, 'no record')})"
        for cell, why in found["pruned"].items()
    ]
    ran = Counter(grid.statuses[cell] for cell in found["pruned"] if cell in grid.statuses)
    if found["pruned"]:
        lines.append(
            f"of the {len(found['pruned'])} cell(s) left out, the grid ran {ran.total()}: "
            + ", ".join(f"{n} {status}" for status, n in sorted(ran.items()))
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
