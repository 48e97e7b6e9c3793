"""What `tune` leaves out before anything runs, and the shortcuts it takes (or not), each said in
its output: cells `plan --memory` predicts will not fit even at the prediction's measured error,
and fields that cannot change the ranking."""

from __future__ import annotations

from dataclasses import dataclass

from ..sweep.define.matrix import Cell, Sweep
from ..sweep.launch.plan import capacity_of
from ..sweep.predict.memory import predict_cells, usable_gib
from .accumulation import accumulation_sources

# The memory prediction's largest error on whole cells measured on GPUs (docs/benchmarks.md,
# "within 3.3%"): a cell is left out only when it does not fit even if the prediction is this high.
PREDICTION_ERROR = 0.033


@dataclass(frozen=True)
class Pruning:
    candidates: tuple[Cell, ...]
    pruned: dict[str, str]  # cell id -> why it was left out
    computed: dict[str, str]  # cell id -> the cell whose probe its figures are computed from (accumulation.py)
    notes: tuple[str, ...]  # the margin, the shortcuts taken or skipped, and why


def prune(sweep: Sweep) -> Pruning:
    capacity = capacity_of(sweep)
    pruned: dict[str, str] = {}
    notes: list[str] = []
    if capacity is None:
        notes.append(
            "memory: no cell left out before running (GPU memory unknown: set slurm.gpu_memory_gib or "
            "slurm.gpu_name); probes that run out of memory map the OOM frontier"
        )
    else:
        usable = usable_gib(capacity)
        for row in predict_cells(sweep.cells, capacity, sweep.resources.cache_dir or None):
            if row.prediction is None or row.spec.device == "cpu":
                continue
            low = row.prediction.required_gib / (1 + PREDICTION_ERROR)
            if low > usable:
                pruned[row.cell_id] = (
                    f"predicted {row.prediction.required_gib:.1f} GiB per GPU, {low:.1f} at the prediction's "
                    f"-{PREDICTION_ERROR:.1%} error, of {usable:g} usable"
                )
        notes.append(
            f"memory: {len(pruned)} cell(s) left out, predicted not to fit in {usable:g} GiB usable of "
            f"{capacity:g} (plan --memory) even {PREDICTION_ERROR:.1%} lower (the prediction's measured "
            "error on whole cells, docs/benchmarks.md); cells within that margin are probed"
        )
    candidates = tuple(cell for cell in sweep.cells if cell.id not in pruned)
    computed = accumulation_sources(list(candidates))
    if computed:
        notes.append(
            f"grad_accum: {len(computed)} cell(s) not probed on the first stage but computed from the probe of "
            "the same setup at its smallest accumulation, from that probe's optimizer share of a step "
            "(optimizer_step_s); one that is promoted is probed at its own accumulation (tune/accumulation.py)"
        )
    return Pruning(candidates, pruned, computed, tuple(notes))
