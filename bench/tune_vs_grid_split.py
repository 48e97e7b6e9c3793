"""bench/tune_vs_grid.sh's two streams: share the grid's cells that have no record yet between
them, balanced by a rough cost (start-up, plus micro-batches x batch, more with checkpointing),
stream 0 starting behind by what tune is expected to take. Writes PREFIX<k>.yaml for each stream
that gets cells: the same YAML with every other cell excluded, so that each cell keeps the id the
whole grid gives it (checked here)."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import yaml

from hpcfsdp.sweep.define.matrix import Cell, load_sweep

START_S = 22.0  # torchrun, imports and the model's build before the first step (H200, Qwen2.5-1.5B)
PER_SAMPLE_S = 3.5  # per micro-batch sample over the cell's steps, from the first slices' records


def rough_cost(cell: Cell) -> float:
    spec = cell.spec
    samples = spec.batch_size * spec.grad_accum * (1.3 if spec.activation_checkpointing != "none" else 1.0)
    return START_S + PER_SAMPLE_S * samples


def has_record(cell: Cell, grids: list[Path]) -> bool:
    return any((grid / "cells" / cell.id / "result.json").is_file() for grid in grids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", type=Path)
    parser.add_argument("prefix", help="writes PREFIX0.yaml, PREFIX1.yaml, ...")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--head-start-s", type=float, default=0.0, help="stream 0's work before its cells (tune)")
    parser.add_argument("--grid", type=Path, nargs="*", default=[], help="sweep folders whose records count as done")
    args = parser.parse_args()
    sweep = load_sweep(args.jobs)
    axes = list(sweep.raw["matrix"])
    todo = [cell for cell in sweep.cells if not has_record(cell, args.grid)]
    load = [args.head_start_s] + [0.0] * (args.streams - 1)
    share: list[list[Cell]] = [[] for _ in range(args.streams)]
    for cell in sorted(todo, key=rough_cost, reverse=True):
        k = min(range(args.streams), key=lambda i: load[i])
        share[k].append(cell)
        load[k] += rough_cost(cell)
    for k, cells in enumerate(share):
        path = Path(f"{args.prefix}{k}.yaml")
        path.unlink(missing_ok=True)
        if not cells:
            print(f"stream {k}: no cell")
            continue
        mine = {cell.id for cell in cells}
        doc = copy.deepcopy(sweep.raw)
        doc["exclude"] = list(doc.get("exclude") or []) + [
            {axis: getattr(cell.spec, axis) for axis in axes} for cell in sweep.cells if cell.id not in mine
        ]
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        ids = {cell.id for cell in load_sweep(path).cells}
        assert ids == mine, f"{path}: the excludes left {sorted(ids ^ mine)}"
        print(f"stream {k}: {len(cells)} cell(s), about {load[k]:.0f} s with its head start -> {path}")


if __name__ == "__main__":
    main()
