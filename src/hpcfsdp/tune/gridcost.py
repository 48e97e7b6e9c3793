"""What the whole grid would have spent, estimated cell by cell from what the search measured,
so that `tune` can say what it saved without running the grid.

A grid cell's launch is its start-up (torchrun, imports, the model's build) and its steps. Each
probe's launch measured both: its wall time less its steps (warm-up and timed, at its step time)
is the start-up. So a cell is estimated as

    its probe's start-up + (steps + comm_profile_steps) x its step time

where the step time is the probe's, or computed from the probe at the smallest accumulation
(accumulation.py), plus what a grid cell does beyond its steps that a probe does not (the
communication profile): the median difference between the final stage's launches, which are grid
cells, and their own estimates. A cell the final stage ran counts as measured. A cell whose probe failed (out
of memory, mostly at its first steps) counts as its probe's launch: the grid cell would fail the
same way. A cell never launched (left out before running) counts as the median probe start-up: a
launch that fails at its first step. A search that ran no probe (probing_cannot_save) estimates
from the grid's cells it ran: each measured, the cells it left out at the median start-up.
bench/tune_vs_grid.sh checks the estimate against the grid.

Before anything runs, the same estimate says whether probing can save at all: probes of the
candidates plus the final stage's cells against the candidates as grid cells, in steps (each
launch's start-up, paid by a probe as by a cell, left out: the case most favourable to probing).
Where even that spends no less, the search runs the grid's cells themselves."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..sweep.define.matrix import Cell
from .accumulation import computed_step_time, mean_step_s
from .probe import probe_spec
from .state import FINAL, Launch, TuneState, read_launches, run_record

BASIS = "estimated cell by cell from the probes' launches and step times (tune/gridcost.py)"


def probing_cannot_save(probed: list[Cell], grid: list[Cell], top_k: int, eta: int) -> str:
    """Why probing `probed` and then running the best top_k as grid cells cannot cost less than
    running the `grid` cells (those probed, and those computed from them), each as a grid cell;
    "" where it can. In steps: a probe's first rung (warm-up and its whole budget of timed steps)
    against a cell's steps and communication profile."""
    if len(grid) <= top_k:
        return f"{len(grid)} cell(s) to run, no more than the final stage's {top_k}: probes could only add"
    cell_steps = sorted((cell.spec.steps + cell.spec.comm_profile_steps for cell in grid), reverse=True)
    probing = sum(probe_spec(cell.spec, 0, eta).steps for cell in probed) + sum(cell_steps[:top_k])
    if probing < sum(cell_steps):
        return ""
    return (
        f"probes as long as the cells: {probing} steps for the probes and the final stage's {top_k} cell(s) "
        f"against {sum(cell_steps)} for the grid's {len(grid)}, start-up left out"
    )


def grid_estimate(cells: dict[str, Cell], sweep_dir: Path, state: TuneState) -> float | None:
    """GPU-hours the grid's cells would take, or None before any probe has been launched."""
    walls = launch_estimates(cells, sweep_dir, state)
    if walls is None:
        return None
    return sum(wall * cells[grid_id].spec.world_size for grid_id, wall in walls.items()) / 3600


def launch_estimates(cells: dict[str, Cell], sweep_dir: Path, state: TuneState) -> dict[str, float] | None:
    """Grid cell id -> the wall time its launch would take (measured, for the final stage's cells),
    or None before any probe has been launched."""
    launches = read_launches(sweep_dir)
    launched = {(launch.stage, launch.run): launch for launch in launches if launch.ended > launch.started}
    probes: dict[str, tuple[Launch, dict]] = {}  # grid id -> its deepest probe's launch and record
    for stage in state.stages:
        if stage.as_grid:
            continue
        for run, grid_id in stage.runs.items():
            record = run_record(sweep_dir, stage.name, run)
            if (stage.name, run) in launched and record:
                probes[grid_id] = (launched[stage.name, run], record)
    finals = {grid_id: launched[FINAL, grid_id] for grid_id in cells if (FINAL, grid_id) in launched}
    if not probes:
        return _grid_ran(cells, sweep_dir, state, finals) if finals else None
    start_ups = {grid_id: _start_up(launch, record) for grid_id, (launch, record) in probes.items()}

    def from_probe(grid_id: str, cell: Cell) -> tuple[float, bool] | None:
        """The cell's launch from its probe's, and whether that probe finished ok; None without a
        probe of its setup."""
        source = grid_id if grid_id in probes else state.computed.get(grid_id)
        if source not in probes:
            return None
        launch, record = probes[source]
        ok = record["status"] == "ok"
        step = computed_step_time(record, cell.spec.grad_accum) if ok else None
        if step is None:
            return launch.ended - launch.started, ok
        return start_ups[source] + (cell.spec.steps + cell.spec.comm_profile_steps) * step, ok

    estimates = {grid_id: from_probe(grid_id, cell) for grid_id, cell in cells.items()}
    # What a grid cell does that its probe does not (the communication profile's set-up and
    # analysis, the record's extras): measured where a final-stage cell has a probe to compare with.
    extras = [
        (launch.ended - launch.started) - estimate[0]
        for grid_id, launch in finals.items()
        if (estimate := estimates[grid_id]) is not None
    ]
    extra = max(0.0, statistics.median(extras)) if extras else 0.0
    typical = statistics.median(start_ups.values())
    walls = {}
    for grid_id, estimate in estimates.items():
        if grid_id in finals:
            walls[grid_id] = finals[grid_id].ended - finals[grid_id].started
        elif estimate is None:
            walls[grid_id] = typical
        else:
            wall, ok = estimate
            walls[grid_id] = wall + extra if ok else wall
    return walls


def _grid_ran(cells: dict[str, Cell], sweep_dir: Path, state: TuneState, finals: dict[str, Launch]) -> dict[str, float]:
    """A search that ran the grid's cells themselves: those measured, the others (left out before
    running) at the median start-up of those."""
    start_ups = [_start_up(launch, run_record(sweep_dir, FINAL, grid_id) or {}) for grid_id, launch in finals.items()]
    typical = statistics.median(start_ups)
    return {
        grid_id: finals[grid_id].ended - finals[grid_id].started if grid_id in finals else typical for grid_id in cells
    }


def _start_up(launch: Launch, record: dict) -> float:
    """The launch's wall time less its steps (all of it for a probe that did not finish ok)."""
    wall = launch.ended - launch.started
    step = mean_step_s(record) if record.get("status") == "ok" else None
    if not step:
        return wall
    steps = int(record.get("warmup_steps") or 0) + int(record.get("timed_steps") or 0)
    return max(0.0, wall - steps * float(step))
