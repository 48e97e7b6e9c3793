"""The table of bench/tune_vs_grid.sh: the grid's records against tune's outcome (tune.json) for
the same YAML. Spend is GPU-hours, wall time per launch x its GPUs: tune's from its launches (and
its whole command's wall time), the grid's from its whole submit (its launches one after another)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hpcfsdp.contracts.files import RecordError
from hpcfsdp.contracts.record import read_record


def grid_speeds(grid: Path) -> tuple[dict[str, float], dict[str, int]]:
    """cell id -> tokens/s per GPU of each ok cell (oom and failed cells left out); and how many
    records came from each machine and day (a grid run over several sittings)."""
    speeds, sources = {}, {}
    for path in sorted(grid.glob("cells/*/result.json")):
        try:
            record = read_record(path)
        except RecordError:
            continue
        day = time.strftime("%Y-%m-%d", time.gmtime(float(record.get("started_at") or 0)))
        where = f"{','.join(record.get('hostnames') or ['?'])} ({record.get('device_name', '?')}, {day})"
        sources[where] = sources.get(where, 0) + 1
        if record["status"] == "ok":
            speeds[path.parent.name] = float(record["tokens_per_s_per_gpu"])
    return speeds, sources


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", type=Path, required=True)
    parser.add_argument("--tune", type=Path, required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--grid-wall", type=float, default=0.0)
    parser.add_argument("--tune-wall", type=float, default=0.0)
    args = parser.parse_args()
    found = json.loads((args.tune / "tune.json").read_text())
    speeds, sources = grid_speeds(args.grid)
    ranked = sorted(speeds, key=lambda cell: -speeds[cell])
    pick = (found.get("best") or {}).get("cell_id")
    spend = found["spend"]
    grid_h = args.grid_wall * args.gpus / 3600
    lines = [
        f"# tune vs grid: {found['sweep']}",
        "",
        "| | grid | tune |",
        "|:--|--:|--:|",
        f"| cells / launches | {spend['grid_cells']} | {spend['launches']} |",
        f"| GPU-hours, whole command (wall x {args.gpus}) | {grid_h:.4f} | {args.tune_wall * args.gpus / 3600:.4f} |",
        f"| GPU-hours, sum of launches | - | {spend['tune_gpu_hours']:.4f} |",
        f"| tune / grid (whole commands) | | {args.tune_wall / args.grid_wall:.3f} |" if args.grid_wall else "",
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
