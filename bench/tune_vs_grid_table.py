"""The table of bench/tune_vs_grid.sh: the grid's records against tune's outcome (tune.json) for
the same YAML. Spend is GPU-hours counted per launch, from the launcher's start to its end, x its
GPUs: tune's from its launch files (tune.json's spend), the grid's from each cell's manifest entry
(the local executor's submitted_at to ended_at). A cell whose entry has no ended_at (run before the
executor wrote it) counts to its record's file time, the cell's end less torchrun's exit."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hpcfsdp.contracts.files import RecordError
from hpcfsdp.contracts.record import read_record


def grid_records(grids: list[Path]) -> tuple[dict[str, float], dict[str, int], float, int, dict[str, float]]:
    """From the grid's folders (one per stream): cell id -> tokens/s per GPU of each ok cell (oom
    and failed cells left out); how many records came from each card, day and commit; the GPU-hours
    of the cells' launches; how many of those were counted to their record's file time; and cell
    id -> launch wall time, for the cells whose manifest entry has ended_at."""
    speeds, sources, gpu_s, estimated, walls = {}, {}, 0.0, 0, {}
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
            sources[where] = sources.get(where, 0) + 1
            if record["status"] == "ok":
                speeds[path.parent.name] = float(record["tokens_per_s_per_gpu"])
            entry = manifest[path.parent.name]
            ended = entry.get("ended_at")
            if ended is None:
                ended, estimated = path.stat().st_mtime, estimated + 1
            else:
                walls[path.parent.name] = float(ended) - float(entry["submitted_at"])
            spec = record["spec"]
            gpu_s += (float(ended) - float(entry["submitted_at"])) * int(spec["nodes"]) * int(spec["gpus_per_node"])
    return speeds, sources, gpu_s / 3600, estimated, walls


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", type=Path, action="append", required=True, help="a sweep folder of the grid")
    parser.add_argument("--tune", type=Path, required=True)
    parser.add_argument("--jobs", type=Path, help="the YAML: check tune's estimate of the grid cell by cell")
    args = parser.parse_args()
    found = json.loads((args.tune / "tune.json").read_text())
    speeds, sources, grid_h, estimated, walls = grid_records(args.grid)
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
            f"| pick's tokens/s per GPU in the grid | {speeds[ranked[0]]:,.1f} | {speeds.get(pick, 0.0):,.1f} |"
        )
        place = ranked.index(pick) + 1 if pick in ranked else None
        lines.append(f"| pick's place in the grid | 1 | {place or 'not ok in the grid'} of {len(ranked)} ok |")
        if pick in speeds:
            lines.append(f"| pick / grid's best | 1.000 | {speeds[pick] / speeds[ranked[0]]:.3f} |")
    lines = [line for line in lines if line]
    lines += ["", "The grid's top three (tokens/s per GPU): " + ", ".join(f"{c} {speeds[c]:,.1f}" for c in ranked[:3])]
    lines += ["", "The grid's records came from: " + "; ".join(f"{n} from {where}" for where, n in sources.items())]
    if estimated:
        lines += [f"{estimated} grid cell(s) ran before the manifest had ended_at: counted to their record's file time"]
    if args.jobs:
        lines += ["", estimate_check(args.tune, args.jobs, walls)]
    lines += ["", "tune's ranking (its furthest stage):"]
    lines += [
        f"- {row['cell_id']} {row['stage']} {row['status']}"
        + (f" {row['tokens_per_s_per_gpu']:,.1f}" if row.get("tokens_per_s_per_gpu") else "")
        + (f" computed from {row['computed_from']}" if row.get("computed_from") else "")
        + (f" (grid {speeds[row['cell_id']]:,.1f})" if row["cell_id"] in speeds else "")
        for row in found["ranking"]
    ]
    lines += ["", *(f"note: {note}" for note in found["notes"])]
    lines += [f"left out before running: {cell}: {why}" for cell, why in found["pruned"].items()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
