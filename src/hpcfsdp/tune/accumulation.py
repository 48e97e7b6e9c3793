"""The accumulation shortcut: gradient accumulation changes a step's tokens/s per GPU only by the
share of the step the optimizer takes (clipping and the optimizer step run once per step, the
micro-batches a times). So each setup is probed at its smallest accumulation a0, and the others
are computed from that probe: with its mean step time T (mean_step_s) and optimizer time O (the record's
optimizer_step_s, timed only in probes), one micro-batch takes m = (T - O) / a0, and

    tokens/s per GPU at a = a x batch x seq_len / (a x m + O)

A computed setup that is promoted is probed at its own accumulation on the next stage, so the
shortcut only decides who goes on. It does not see memory: FSDP2 keeps gradients unsharded
between the micro-batches of a step, so a larger accumulation may need more; a computed setup that
does not fit is found when promoted. Where the probe at a0 ran out of memory, the larger
accumulations are taken as out of memory too (they need at least as much)."""

from __future__ import annotations

from typing import Any

from ..sweep.define.matrix import Cell


def accumulation_sources(cells: list[Cell]) -> dict[str, str]:
    """grid cell id -> the cell id of the probe its figures are computed from: the cell of the
    same setup at the smallest accumulation. Cells that are their own source are left out; so are
    batch_size: auto cells (their batch is found in the run) and global_batch_size cells (their
    accumulation follows from the batch)."""
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        if cell.spec.auto_batch or cell.spec.global_batch_size:
            continue
        key = repr(sorted(cell.spec.replace(grad_accum=1).to_dict().items()))
        groups.setdefault(key, []).append(cell)
    sources = {}
    for group in groups.values():
        source = min(group, key=lambda cell: cell.spec.grad_accum)
        sources.update({cell.id: source.id for cell in group if cell.id != source.id})
    return sources


def mean_step_s(record: dict[str, Any]) -> float | None:
    """An ok record's step: the timed window's mean, as its tokens/s is (a record from before
    issue 43 that lacks it: its step_time_s, then the figure its tokens/s came from)."""
    return record.get("window_step_time_s") or record.get("step_time_s")


def computed_step_time(record: dict[str, Any], grad_accum: int) -> float | None:
    """A step's seconds at grad_accum from a probe's ok record; None without its optimizer time."""
    optimizer = record.get("optimizer_step_s")
    step = mean_step_s(record)
    if optimizer is None or not step:
        return None
    micro = max(0.0, step - optimizer) / record["spec"]["grad_accum"]
    return grad_accum * micro + optimizer


def computed_speed(record: dict[str, Any], grad_accum: int) -> float | None:
    """tokens/s per GPU at grad_accum from a probe's ok record; None without its optimizer time."""
    step = computed_step_time(record, grad_accum)
    if not step:
        return None
    spec = record["spec"]
    return grad_accum * spec["batch_size"] * spec["seq_len"] / step
