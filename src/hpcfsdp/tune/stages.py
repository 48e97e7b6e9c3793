"""The search: successive halving over the grid's cells (Jamieson & Talwalkar; Optuna's
SuccessiveHalvingPruner promotes the best 1/eta of each rung the same way). Rung k probes its
runs for at most 6 x eta^k timed steps, each stopping once stable; the best 1/eta go on to the
next rung, until `top_k` are left or the next rung would be as long as a grid cell: those run as
the grid's own cells (the final stage), and the fastest of them is the pick. Where others of the
final stage are within noise of the fastest (their p10-p90 steps overlap), those and the fastest
run once more (the repeat stage) and the pick is the best mean of the two runs. Where probing
cannot spend less than the grid (gridcost.probing_cannot_save: no more cells than the final stage
runs, or probes as long as the cells), the grid's cells run themselves, as the final stage, at once,
and no repeat follows (it would spend more than the grid).
A `batch_size: auto` cell of the final stage measures the batch its probe found: no second search.

Every stage is written to the state before it runs, and every run's launch after it ends, so
that a search stopped at any point and started again runs only what is not done."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..contracts.validity import is_trusted, within_noise
from ..progress import duration
from ..sweep.define.matrix import Cell, Sweep
from ..sweep.folder.guards import require_utf8_path
from ..sweep.folder.layout import (
    cell_dir,
    require_inside,
    slurm_jobs,
    update_manifest,
    write_cell_spec,
    write_sweep_files,
)
from ..sweep.launch.crashpoint import crash_point
from ..sweep.launch.environment import job_environment, without_secrets
from ..sweep.launch.local import WarmSupervisor
from ..sweep.launch.submit import auto_batch_predictions
from ..sweep.track.lost import record_launch_failure
from ..sweep.track.processes import end_launches_left
from .accumulation import computed_speed
from .gridcost import probing_cannot_save
from .probe import Planned, probe_rungs, probe_spec, run_launches
from .prune import prune
from .state import (
    FINAL,
    REPEAT,
    Launch,
    Stage,
    TuneState,
    is_done,
    launch_path,
    load_state,
    run_record,
    save_state,
    stage_dir,
    tune_dir,
    write_launch,
)

TRIES = 2  # Slurm: a run its job ended before it ran is queued once more, then recorded as lost


@dataclass(frozen=True)
class Settings:
    executor: str  # local or slurm
    eta: int = 3  # keep the best 1/eta of each rung
    top_k: int = 3  # how many setups the final stage runs as grid cells
    probes_per_job: int = 8  # Slurm: runs per allocation
    poll_s: float = 3.0  # Slurm: seconds between looks at squeue


def tune(sweep: Sweep, results_dir: Path, settings: Settings, log: Callable[[str], None] = print) -> dict:
    """Search (or resume the search in) the sweep's folder; write and return tune.json's content.
    Holds the folder's submit lock; an interrupt ends the running probe (local) or stops waiting
    (slurm: the jobs run on), and the next run of the same command goes on from there."""
    from ..contracts.errors import Stopped, UserError
    from ..sweep.launch.interrupts import Interrupted, interrupts_raise
    from ..sweep.launch.lock import sweep_lock
    from .output import outcome, write_outcome

    sweep_dir = Path(results_dir) / sweep.name
    require_utf8_path(sweep_dir.absolute())
    started = time.monotonic()
    untimed = log

    def timed(line: str) -> None:  # every line says how long the search has run
        untimed(f"[{duration(time.monotonic() - started)}] {line}")

    log = timed
    try:
        with interrupts_raise(), sweep_lock(sweep_dir, log, "tune"):
            require_inside(sweep_dir, tune_dir(sweep_dir))
            state = load_state(sweep_dir)
            if settings.executor == "slurm":
                _check_cluster(sweep)
            if state is None:
                state, _ = new_state(sweep, log)
                save_state(sweep_dir, state)
            elif state.grid != [cell.id for cell in sweep.cells]:
                raise UserError(
                    f"{tune_dir(sweep_dir)}: the search there was made from another matrix than {sweep.source}; "
                    "remove that folder or choose another --results-dir"
                )
            else:
                log(f"resuming the search in {tune_dir(sweep_dir)} ({len(state.stages)} stage(s) begun)")
            local = settings.executor == "local"
            if local:  # a tune killed by SIGKILL leaves its probe's ranks for a while
                end_launches_left(sweep_dir, log)
            # The local probes of every stage fork from one import; Slurm's jobs launch their own.
            with WarmSupervisor(sweep_dir) if local else contextlib.nullcontext() as launch:
                search(sweep, sweep_dir, state, settings, log, launch)
    except Interrupted as exc:
        raise Stopped(
            f"interrupted ({exc}): the running probe was stopped (Slurm: its jobs run on); "
            "run the same command again to go on",
            exc.exit_status,
        ) from None
    found = outcome(sweep, sweep_dir, state)
    write_outcome(sweep_dir, found)
    return found


def _check_cluster(sweep: Sweep) -> None:
    """The shapes the partition can never run, before anything is queued (as submit checks)."""
    from ..contracts.fields import SpecError
    from ..sweep.launch.preflight import cluster_problems

    problems = cluster_problems(sweep, list(sweep.cells))
    if problems:
        more = f" (and {len(problems) - 1} more: `hpcfsdp plan` lists them)" if len(problems) > 1 else ""
        raise SpecError(f"{problems[0]}{more}")


def new_state(sweep: Sweep, log: Callable[[str], None]) -> tuple[TuneState, tuple[str, ...]]:
    pruning = prune(sweep)
    for cell_id, why in pruning.pruned.items():
        log(f"left out {cell_id}: {why}")
    state = TuneState(sweep.name, [c.id for c in sweep.cells], dict(pruning.pruned), dict(pruning.computed))
    return state, pruning.notes


def search(
    sweep: Sweep,
    sweep_dir: Path,
    state: TuneState,
    settings: Settings,
    log: Callable[[str], None],
    launch: WarmSupervisor | None,
) -> None:
    """Run (or resume) every stage until the final one has run; `launch` starts the local executor's
    runs (None under Slurm)."""
    cells = {cell.id: cell for cell in sweep.cells}
    if not state.stages:
        candidates = [cells[c] for c in state.grid if c not in state.pruned and c not in state.computed]
        if not candidates:
            log("every cell was left out before running: nothing to probe")
            return
        grid = [cells[c] for c in state.grid if c not in state.pruned]
        if why := probing_cannot_save(candidates, grid, settings.top_k, settings.eta):
            log(f"running the grid's {len(grid)} cell(s) themselves, no probes: {why}")
            write_sweep_files(sweep, sweep_dir, grid, auto_batch_predictions(sweep, grid))
            _begin(sweep_dir, state, Stage(FINAL, {cell.id: cell.id for cell in grid}))
        else:
            _begin(sweep_dir, state, _probe_stage(sweep_dir, sweep, candidates, 0, settings.eta))
    while True:
        stage = state.stages[-1]
        run_stage(sweep, sweep_dir, state, stage, settings, log, launch)
        if stage.name == REPEAT:
            return
        if stage.final:
            if len(state.stages) == 1:  # the grid ran itself: a repeat would cost more than the grid
                return
            close = noisy_top(sweep_dir, stage)
            if len(close) < 2:
                return
            log(f"final: {', '.join(close)} are within noise of each other: each runs once more (repeat stage)")
            _begin(sweep_dir, state, _repeat_stage(sweep_dir, sweep, [cells[grid_id] for grid_id in close]))
            continue
        ranked = [grid_id for grid_id, _ in ranking(sweep_dir, stage, state, cells)]
        rung = int(stage.name.removeprefix("stage"))
        keep = math.ceil(len(ranked) / settings.eta)
        rungs = max(probe_rungs(cells[state.stages[0].runs[r]].spec, settings.eta) for r in state.stages[0].runs)
        if not ranked:
            log(f"{stage.name}: no run finished ok: nothing to promote")
            return
        if rung + 1 < rungs and keep > settings.top_k:
            promoted = [cells[grid_id] for grid_id in ranked[:keep]]
            log(f"{stage.name}: {len(ranked)} ok; the best {keep} go on to stage{rung + 1}")
            _begin(sweep_dir, state, _probe_stage(sweep_dir, sweep, promoted, rung + 1, settings.eta))
        else:
            final = [cells[grid_id] for grid_id in ranked[: settings.top_k]]
            log(f"{stage.name}: {len(ranked)} ok; the best {len(final)} run as the grid's cells (final stage)")
            write_sweep_files(sweep, sweep_dir, final, _found_batches(sweep_dir, stage, final))
            _begin(sweep_dir, state, Stage(FINAL, {cell.id: cell.id for cell in final}))


def _begin(sweep_dir: Path, state: TuneState, stage: Stage) -> None:
    """Add the stage to the state and save it, before any of its runs starts: a search stopped
    from here on resumes at this stage."""
    state.stages.append(stage)
    save_state(sweep_dir, state)
    crash_point(f"tune_begun_{stage.name}")


def _probe_stage(sweep_dir: Path, sweep: Sweep, cells: list[Cell], rung: int, eta: int) -> Stage:
    name = f"stage{rung}"
    require_inside(sweep_dir, stage_dir(sweep_dir, name))  # a planted tune/stage<k> link: no spec.json out there
    runs = {}
    hints = auto_batch_predictions(sweep, cells)  # the probe's search starts at the predicted batch
    for cell in cells:
        probe = Cell.of(probe_spec(cell.spec, rung, eta), cell.sources)
        folder = cell_dir(stage_dir(sweep_dir, name), probe.id)
        write_cell_spec(folder, probe.spec, probe.id, sweep.name, probe.sources, hints.get(cell.id))
        runs[probe.id] = cell.id
    return Stage(name, runs)


def _repeat_stage(sweep_dir: Path, sweep: Sweep, cells: list[Cell]) -> Stage:
    """The final stage's cells within noise of its fastest, as the grid's cells once more."""
    for cell in cells:
        write_cell_spec(cell_dir(stage_dir(sweep_dir, REPEAT), cell.id), cell.spec, cell.id, sweep.name, cell.sources)
    return Stage(REPEAT, {cell.id: cell.id for cell in cells})


def noisy_top(sweep_dir: Path, stage: Stage) -> list[str]:
    """The stage's fastest trusted run and those within noise of it (grid cell ids, fastest
    first); only the fastest where none is."""
    records = {grid_id: run_record(sweep_dir, stage.name, run) for run, grid_id in stage.runs.items()}
    trusted = {grid_id: record for grid_id, record in records.items() if record and is_trusted(record)}
    ranked = sorted(trusted, key=lambda grid_id: -float(trusted[grid_id]["tokens_per_s_per_gpu"]))
    if not ranked:
        return []
    top = trusted[ranked[0]].get("tokens_per_s_spread")
    return [ranked[0], *(g for g in ranked[1:] if within_noise(top, trusted[g].get("tokens_per_s_spread")))]


def _found_batches(sweep_dir: Path, stage: Stage, final: list[Cell]) -> dict[str, dict]:
    """The spec.json hint of each `batch_size: auto` cell of the final stage: the batch search its
    probe in `stage` (the last rung) ran, whose chosen batch the cell measures without a search."""
    from ..contracts.record import BATCH_FOUND_KEY

    probe_of = {grid_id: run for run, grid_id in stage.runs.items()}
    hints = {}
    for cell in final:
        record = run_record(sweep_dir, stage.name, probe_of.get(cell.id, "")) if cell.spec.auto_batch else None
        search = record.get("batch_search") if record and record["status"] == "ok" else None
        if isinstance(search, dict) and search.get("chosen_batch_size"):
            reused = {**search, "reused_from": f"{stage.name}/{probe_of[cell.id]}"}
            hints[cell.id] = {BATCH_FOUND_KEY: reused}
    return hints


def ranking(sweep_dir: Path, stage: Stage, state: TuneState, cells: dict[str, Cell]) -> list[tuple[str, float]]:
    """The stage's setups that finished ok with figures that can be trusted, fastest first: (grid
    cell id, tokens/s per GPU); on the first stage with the setups computed from a probe at another
    accumulation among them."""
    speeds = {}
    for run, grid_id in stage.runs.items():
        record = run_record(sweep_dir, stage.name, run)
        if record and is_trusted(record):
            speeds[grid_id] = float(record["tokens_per_s_per_gpu"])
    if stage.name == "stage0":
        probe_of = {grid_id: run for run, grid_id in stage.runs.items()}
        for grid_id, source in state.computed.items():
            record = run_record(sweep_dir, stage.name, probe_of.get(source, ""))
            speed = computed_speed(record, cells[grid_id].spec.grad_accum) if record else None
            if record and is_trusted(record) and speed is not None:
                speeds[grid_id] = speed
    return sorted(speeds.items(), key=lambda pair: -pair[1])


def run_stage(
    sweep: Sweep,
    sweep_dir: Path,
    state: TuneState,
    stage: Stage,
    settings: Settings,
    log: Callable[[str], None],
    launch: WarmSupervisor | None,
) -> None:
    directory = stage_dir(sweep_dir, stage.name)
    launches = tune_dir(sweep_dir) / "launches"
    cells = {cell.id: cell for cell in sweep.cells}

    def todo() -> list[tuple[Cell, Planned]]:
        out = []
        for run, grid_id in stage.runs.items():
            require_inside(sweep_dir, cell_dir(directory, run))  # never a run trained out of the sweep folder
            if is_done(sweep_dir, stage.name, run):
                continue
            cell = cells[grid_id] if stage.as_grid else _cell_of(sweep_dir, directory, run)
            out.append((cell, Planned(str(cell_dir(directory, run).absolute()), cell.spec.world_size, stage.name)))
        return out

    pending = todo()
    done = len(stage.runs) - len(pending)
    log(f"{stage.name}: {len(stage.runs)} run(s)" + (f", {done} done before (not repeated)" if done else ""))
    if launch is not None:  # the local executor
        env = without_secrets(os.environ) | job_environment(sweep)
        update_manifest(
            directory,
            {cell.id: {"executor": "local", "job_id": None, "submitted_at": time.time()} for cell, _ in pending},
        )
        run_launches([p for _, p in pending], env, sweep.resources.time_min * 60, launches, "local", launch, log=log)
        return
    from .slurm import submit_stage_jobs, wait_for_jobs

    cluster = sweep.resources.clusters
    # A resumed search: its jobs still queued, those the state names and those the manifest names
    # (a search stopped after sbatch queued a stage's array and before the state said so).
    queued_before = set(stage.jobs) | set(slurm_jobs(directory, stage.runs).ids.values())

    def probes_done() -> str:
        done = sum(is_done(sweep_dir, stage.name, run) for run in stage.runs)
        return f"{stage.name}: {done} of {len(stage.runs)} probe(s) done"

    wait_for_jobs(sorted(queued_before), cluster, settings.poll_s, log, probes_done)
    for _ in range(TRIES):
        pending = todo()
        if not pending:
            break
        submit_stage_jobs(sweep, directory, stage, pending, settings.probes_per_job, launches, log)
        save_state(sweep_dir, state)
        wait_for_jobs(list(stage.jobs), cluster, settings.poll_s, log, probes_done)
        _count_array_launches(sweep_dir, stage, cells)
    for cell, planned in todo():  # their jobs ended before they ran, TRIES times
        jobs = [job for job, runs in stage.jobs.items() if cell.id in runs]
        record_launch_failure(
            Path(planned.directory),
            f"its Slurm job(s) {', '.join(jobs)} ended before it ran to its end",
            "",
        )
        write_launch(launches, Launch(cell.id, stage.name, 0.0, 0.0, planned.processes, None, "slurm", jobs[-1]))


def _cell_of(sweep_dir: Path, directory: Path, run: str) -> Cell:
    """A probe run as its spec.json says: its spec, and its sources as resolved at load time."""
    from ..contracts.files import RecordError, read_json_object
    from ..contracts.jsontypes import shown
    from ..contracts.record import SPEC_NAME
    from ..contracts.sources import Sources
    from ..contracts.spec import RunSpec

    where = str(cell_dir(directory, run) / SPEC_NAME)
    meta = read_json_object(cell_dir(directory, run) / SPEC_NAME, root=sweep_dir, kind="cell spec")
    if not isinstance(meta.get("spec"), dict):
        raise RecordError(
            f"{where}: spec: expected an object, got {shown(meta.get('spec'))}; remove tune/ to start again"
        )
    spec, sources = RunSpec.resolved(meta["spec"], where, Sources.of_cell_spec(meta, where))
    return Cell(spec, run, sources)


def _count_array_launches(sweep_dir: Path, stage: Stage, cells: dict[str, Cell]) -> None:
    """Runs of several nodes ran as array tasks (no launcher of ours around them): their launch
    is the record's own span, started_at to started_at + duration_s (start-up before the cell
    began is not in it)."""
    from ..contracts.files import RecordError
    from ..contracts.record import RECORD_NAME, read_record

    for job_id, runs in stage.jobs.items():
        for run in runs:
            if cells[stage.runs[run]].spec.nodes == 1 or launch_path(sweep_dir, stage.name, run).is_file():
                continue
            try:
                record = read_record(cell_dir(stage_dir(sweep_dir, stage.name), run) / RECORD_NAME)
            except (RecordError, FileNotFoundError):
                continue
            started = float(record.get("started_at") or 0.0)
            ended = started + float(record.get("duration_s") or 0.0)
            gpus = int(record.get("world_size") or 1)
            launches = tune_dir(sweep_dir) / "launches"
            write_launch(launches, Launch(run, stage.name, started, ended, gpus, None, "slurm-array", job_id))
