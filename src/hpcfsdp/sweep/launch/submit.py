"""Submit a sweep: choose the cells that need a run, hand them to an executor, and (submit --wait)
watch them until they ended. The executors, as submitit keeps its own apart: Slurm job arrays
(sbatch.py), this machine one cell at a time (local.py), or a shell line per cell (print). What a
cell's processes get from the environment is environment.py's; the sweep folder is layout.py's.

A cell is in flight while its job (manifest) is in squeue: never submitted twice, whatever the flags,
and never by two submits at once (the lock).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...contracts.errors import Stopped, UserError
from ...contracts.fields import SpecError
from ...contracts.files import LockError, RecordError
from ...contracts.names import sbatch_word_problem
from ...contracts.record import MISSING
from ...slurm import ANSWER_TIMEOUT_S, SlurmError, ask, installed
from ..define.matrix import Cell, Sweep
from ..folder.guards import require_utf8_path
from ..folder.layout import (
    MANIFEST_NAME,
    SLURM_DIR,
    end_local_run,
    manifest_cluster,
    slurm_jobs,
    sweep_comment,
    write_sweep_files,
)
from ..track.intent import reconcile_intent
from ..track.scheduler import queued_states
from ..track.status import (
    IN_FLIGHT,
    STALE,
    StatusReport,
    cell_state,
    cell_status,
    problem_lines,
    record_lost_cells,
    sweep_status,
)
from ..track.watch import watch
from .environment import sbatch_note
from .interrupts import Interrupted, interrupts_raise
from .local import print_command, run_local
from .lock import sweep_lock
from .preflight import cluster_problems, place
from .sbatch import SubmitError, submit_arrays

EXECUTORS = ("slurm", "local", "print")


@dataclass
class Submission:
    """What `submit` did: the cells it ran or queued, and those it left alone as still in flight."""

    sweep_dir: Path
    executor: str
    submitted: list[Cell] = field(default_factory=list)
    in_flight: dict[str, str] = field(default_factory=dict)  # cell id -> job id, still queued or running
    job_ids: dict[str, str] = field(default_factory=dict)  # cell id -> Slurm job id, of the cells queued now
    outcomes: dict[str, str] = field(default_factory=dict)  # local executor: cell id -> the status it recorded
    not_queued: list[Cell] = field(default_factory=list)  # left out: no room under slurm.max_jobs_in_queue


class NoController(UserError):
    """sbatch is installed but no Slurm controller answers: a login node whose controller is down
    or unreachable, where training the cells here instead is the worst thing to do."""


def default_executor(cluster: str = "") -> tuple[str, str]:
    """slurm when a Slurm controller answers here (that of `cluster`, slurm.clusters), local where
    Slurm is not installed (a laptop, a workstation), and why; NoController where sbatch is
    installed but no controller answers (`--executor local` is then the user's explicit choice,
    never a fallback)."""
    if not installed("sbatch", "sinfo"):
        return "local", "no Slurm here (sbatch is not on PATH)"
    try:
        ask("sinfo", "--noheader", "--format=%P", cluster=cluster, timeout_s=ANSWER_TIMEOUT_S)
    except SlurmError as exc:  # no answer in time, or its fatal line (Unable to contact slurm controller)
        raise NoController(
            _no_controller(f"sbatch is installed but no Slurm controller answers ({exc}; is SLURM_CONF set?)")
        ) from None
    return "slurm", ""


def _check_same_cluster(sweep: Sweep, sweep_dir: Path) -> None:
    """One sweep folder's jobs stay on one cluster: status, cancel and collect ask the one its
    manifest names. SpecError when slurm.clusters names another than earlier cells went to."""
    queued_on = manifest_cluster(sweep_dir)
    wanted = sweep.resources.clusters
    if queued_on is None or queued_on == wanted:
        return
    shown = {queued_on: f"cluster {queued_on!r}" if queued_on else "the default cluster"}
    raise SpecError(
        f"{place(sweep, 'slurm.clusters')}: {sweep_dir}'s cells were queued on {shown[queued_on]}, "
        f"not {f'cluster {wanted!r}' if wanted else 'the default cluster'}: "
        f"{f'set slurm.clusters: {queued_on}' if queued_on else 'remove slurm.clusters'}, "
        "or submit to another --results-dir"
    )


def _no_controller(why: str) -> str:
    return (
        f"{why}; nothing submitted and nothing run on this login node "
        "(submit again once the controller answers, or choose --executor local)"
    )


def select_cells(
    sweep: Sweep,
    sweep_dir: Path,
    force: bool = False,
    retry_failed: bool = False,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[list[Cell], list[Cell], dict[str, str]]:
    """Cells to submit; cells a record says are done; cells still in flight (cell id -> job id).

    By default only cells without a (current) record run; --retry-failed adds oom / error / timeout / diverged /
    corrupt ones, --force every cell. A cell whose job is still queued or running is never chosen.
    """
    chosen: list[Cell] = []
    done: list[Cell] = []
    corrupt: list[str] = []
    stale = 0
    kept: Counter[str] = Counter()  # the statuses of the cells kept
    for cell in sweep.cells:
        state = cell_state(sweep_dir, cell)
        stale += state.status == STALE
        corrupt += [state.problem] if state.problem else []
        rerun = force or state.status in (MISSING, STALE) or (retry_failed and state.status != "ok")
        (chosen if rerun else done).append(cell)
        kept[state.status] += not rerun
    if done:
        log(kept_line(kept))
    if stale and not force:
        log(f"rerunning {stale} cell(s) whose record was made with other values of their fields (a changed default)")
    for line in problem_lines(corrupt):
        log(f"corrupt record: {line}")
    if corrupt and not (force or retry_failed):
        log(f"{len(corrupt)} cell(s) with a corrupt record are left as they are (--retry-failed reruns them)")
    jobs, cluster, uid, _ = slurm_jobs(sweep_dir, [c.id for c in chosen])
    queued = queued_states(jobs.values(), cluster, sweep_comment(uid) if uid else "")
    flying = {cid: jid for cid, jid in jobs.items() if jid in queued}
    return [c for c in chosen if c.id not in flying], done, flying


def kept_line(kept: Counter[str]) -> str:
    """What a submit leaves as it is, by status, and what --retry-failed would rerun of it (after
    `cancel --pending-only`, the cancelled cells: a plain submit reruns none of them)."""
    total = sum(kept.values())
    counts = ", ".join(f"{status} {n}" for status, n in sorted(kept.items()) if n)
    failed = total - kept["ok"]
    retry = f"--retry-failed reruns the {failed} not ok" if failed else "--retry-failed reruns none"
    return f"skipping {total} cell(s) that already have a record ({counts}): {retry}, --force all {total}"


def submit(
    sweep: Sweep,
    results_dir: Path,
    executor: str | None = None,
    force: bool = False,
    retry_failed: bool = False,
    log: Callable[[str], None] = print,
    room_poll_s: float | None = None,
) -> Submission:
    """Run or queue the cells that need it. room_poll_s (submit --wait): when slurm.max_jobs_in_queue
    leaves no room, look again this often until all are queued; None: queue what fits and say so.

    What stops it is a UserError that says what was and was not queued: squeue not answering, sbatch
    refusing an array, an unreadable manifest, or an interrupt (Stopped)."""
    executor = executor or default_executor(sweep.resources.clusters)[0]
    if executor not in EXECUTORS:
        raise ValueError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    sweep_dir = Path(results_dir) / sweep.name
    require_utf8_path(sweep_dir.absolute())  # its records are collected beside the history
    if executor == "slurm":  # the folder's path goes into the #SBATCH lines of the log files
        folder = str(sweep_dir.absolute())
        problem = (
            "holds '%', which sbatch expands in log file names"
            if "%" in folder
            else "holds '\\', which sbatch drops from #SBATCH lines (the logs would go to another folder)"
            if "\\" in folder
            else sbatch_word_problem(folder)
        )
        if problem:
            raise SpecError(folder, "", f"the sweep folder's path {problem}; choose another --results-dir")
    # The lock: from reading which cells are queued to the manifest naming what this submit
    # queued (for the local executor, to its last cell). Signals end what it started (interrupts.py).
    try:
        with interrupts_raise(), sweep_lock(sweep_dir, log, "submit"):
            return _submit_locked(sweep, sweep_dir, executor, force, retry_failed, log, room_poll_s)
    except SlurmError as exc:
        raise UserError(f"cannot tell which cells are still queued ({exc}); nothing submitted") from None
    except SubmitError as exc:
        raise UserError(
            f"{exc}; the cells of that array and any after it were not queued "
            f"(arrays queued before it are in {sweep_dir / MANIFEST_NAME})"
        ) from None
    except LockError as exc:  # the lock itself: nothing was read, nothing queued
        raise UserError(f"{exc}; nothing submitted") from None
    except RecordError as exc:  # the manifest: which jobs are the sweep's
        raise UserError(
            f"{exc}; it names the sweep's queued jobs: repair or remove it (`squeue --name "
            f"hpcfsdp-{sweep.name}` lists them); nothing submitted"
        ) from None
    except Interrupted as exc:
        done = (
            "the running cell was stopped, its record kept in attempts/ and its earlier one (if any) current again"
            if executor == "local" and exc.running_cell
            else "no cell had started"
            if executor == "local"
            else "arrays queued before it are in manifest.json; the cells not queued keep their records"
        )
        raise Stopped(f"interrupted ({exc}): {done}; run the same command again to go on", exc.exit_status) from None


def _submit_locked(
    sweep: Sweep,
    sweep_dir: Path,
    executor: str,
    force: bool,
    retry_failed: bool,
    log: Callable[[str], None],
    room_poll_s: float | None,
) -> Submission:
    reconcile_intent(sweep_dir, log, locked=True)  # an array a killed submit queued: into the manifest first
    cells, _, flying = select_cells(sweep, sweep_dir, force, retry_failed, log)
    if executor == "slurm" and cells:
        _check_same_cluster(sweep, sweep_dir)
    problems = cluster_problems(sweep, cells) if executor == "slurm" and cells else []
    if problems:  # before anything is written or queued
        more = f" (and {len(problems) - 1} more: `hpcfsdp plan` lists them)" if len(problems) > 1 else ""
        raise SpecError(f"{problems[0]}{more}")
    sub = Submission(sweep_dir=sweep_dir, executor=executor, submitted=cells, in_flight=flying)
    if flying:
        log(f"skipping {len(flying)} cell(s) still queued or running:")
        for cid, jid in flying.items():
            log(f"    {cid} (job {jid})")
    if not cells:
        log("nothing to submit")
        return sub
    write_sweep_files(sweep, sweep_dir, cells, auto_batch_predictions(sweep, cells))
    # The records of rerun cells are kept as attempts just before each array is queued or each
    # local cell starts (the print executor runs nothing: records stay where they are).
    if executor == "slurm":
        if note := sbatch_note(sweep):
            log(note)
        sub.job_ids, sub.not_queued = submit_arrays(sweep, sweep_dir, cells, log, room_poll_s)
        sub.submitted = [cell for cell in cells if cell.id in sub.job_ids]
    elif executor == "local":
        try:
            sub.outcomes = run_local(sweep, sweep_dir, cells, log)
        finally:
            end_local_run(sweep_dir)
    else:
        for cell in cells:
            print(print_command(sweep, sweep_dir, cell))
    return sub


def wait_for(sub: Submission, interval_s: float, log: Callable[[str], None] = print) -> StatusReport:
    """submit --wait: watch the cells queued now and those already in flight until none is pending
    or running, then give each whose job left the queue without a record a record of its own.
    Ctrl-C, SIGTERM or SIGHUP raise interrupts.Interrupted (the jobs keep running)."""
    waited = waited_cells(sub)
    if not waited:
        return sweep_status(sub.sweep_dir, [])
    with interrupts_raise():
        report = watch(sub.sweep_dir, interval_s, waited)
    if report.note:  # the scheduler stopped answering: which cells are lost cannot be known
        return report
    for cell in record_lost_cells(report):
        log(
            f"{cell.cell_id}: Slurm job {cell.job_id} left the queue without a record; recorded as "
            f"{cell_status(sub.sweep_dir, cell.cell_id)} (logs: {sub.sweep_dir / SLURM_DIR / cell.job_id})"
        )
    return sweep_status(sub.sweep_dir, waited)


def waited_cells(sub: Submission) -> list[str]:
    """The cells submit --wait waits for: those it queued and those it found in flight."""
    return [c.id for c in sub.submitted] + list(sub.in_flight)


def still_queued(sub: Submission) -> int | None:
    """How many of the cells submit --wait waited for are still pending or running (None: squeue
    did not answer)."""
    report = sweep_status(sub.sweep_dir, waited_cells(sub))
    return None if report.note else sum(c.state in IN_FLIGHT for c in report.cells)


def auto_batch_predictions(sweep: Sweep, cells: list[Cell]) -> dict[str, dict]:
    """The spec.json hint of each `batch_size: auto` cell: the predicted memory its search starts
    from (predict/memory.py), by cell id."""
    if not any(cell.spec.auto_batch for cell in cells):
        return {}
    from ...contracts.record import BATCH_PREDICTION_KEY
    from ..predict.memory import batch_predictions, capacity_gib

    res = sweep.resources
    found = batch_predictions(cells, capacity_gib(res.gpu_memory_gib, res.gpu_name), res.cache_dir or None)
    return {cell_id: {BATCH_PREDICTION_KEY: prediction} for cell_id, prediction in found.items()}
