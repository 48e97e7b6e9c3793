"""Submit a sweep: Slurm job arrays (submitit), one per resource shape, split at the cluster's
array size limit (cluster.py), after the check against the partition (preflight.py); or run the
cells locally.

Layout of a sweep folder (results/<sweep>/):
    matrix.yaml          the matrix as submitted
    manifest.json        cell id -> executor, job id, submit time
    cells/<id>/spec.json the resolved spec of the cell
    cells/<id>/result.json   written by the cell (record.py): its current record
    cells/<id>/attempts/<n>.json   the records reruns (--retry-failed, --force) replaced, oldest first
    slurm/               submitit's scripts and logs
    .submit.lock         held by the submit running now (lock.py)

A cell is in flight while its job (manifest) is in squeue: never submitted twice, whatever the flags,
and never by two submits at once (the lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..cache.hub import CACHE_ENV
from ..errors import Stopped, UserError
from ..record import (
    MISSING,
    RecordError,
    keep_as_attempt,
    restore_attempt,
    write_json,
)
from ..spec import JOB_END_ENV, MAX_REQUEUE_ENV, Resources, SpecError
from .cluster import array_size_limit, jobs_in_queue
from .interrupts import Interrupted, interrupts_deferred, interrupts_raise
from .lock import sweep_lock
from .matrix import Cell, Sweep, arrays
from .preflight import cluster_problems
from .status import (
    IN_FLIGHT,
    MANIFEST_NAME,
    STALE,
    SchedulerError,
    StatusReport,
    _log_tails,
    cell_dir,
    cell_state,
    cell_status,
    problem_lines,
    queued_states,
    read_manifest,
    record_launch_failure,
    record_lost_cells,
    slurm_folder,
    slurm_job_ids,
    sweep_status,
    watch,
)

EXECUTORS = ("slurm", "local", "print")
# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# sbatch copies the submitting environment into the job, and slurmctld keeps that copy: tokens and
# keys are taken out of the environment sbatch (and the local executor's torchrun) starts with.
HF_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
SECRET_NAME = re.compile(r"(^|_)(TOKEN|API_KEY|SECRET|SECRET_KEY|ACCESS_KEY|PASSWORD)$", re.IGNORECASE)
# Slurm's final job states that say why a job without a record ended: the status its record gets.
LOCAL_GRACE_S = 30.0  # local executor: from SIGTERM at the time limit to SIGKILL


class SubmitError(UserError, RuntimeError):
    """sbatch refused an array; the cells not queued keep the records they had."""


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


def default_executor() -> tuple[str, str]:
    """slurm when a Slurm controller answers here, else local (this machine's processes), and why."""
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return "local", "no Slurm here (sbatch is not on PATH)"
    try:
        probe = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "local", "sbatch is installed but sinfo did not answer within 15 s"
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]  # its fatal line
        return "local", f"sbatch is installed but no Slurm controller answers (sinfo: {reason}; is SLURM_CONF set?)"
    return "slurm", ""


def select_cells(
    sweep: Sweep, sweep_dir: Path, force: bool = False, retry_failed: bool = False, log=lambda message: None
) -> tuple[list[Cell], list[Cell], dict[str, str]]:
    """Cells to submit; cells a record says are done; cells still in flight (cell id -> job id).

    By default only cells without a (current) record run; --retry-failed adds oom / error / timeout / diverged /
    corrupt ones, --force every cell. A cell whose job is still queued or running is never chosen.
    """
    chosen: list[Cell] = []
    done: list[Cell] = []
    corrupt: list[str] = []
    stale = 0
    for cell in sweep.cells:
        state = cell_state(sweep_dir, cell)
        stale += state.status == STALE
        corrupt += [state.problem] if state.problem else []
        rerun = force or state.status in (MISSING, STALE) or (retry_failed and state.status != "ok")
        (chosen if rerun else done).append(cell)
    if stale and not force:
        log(f"rerunning {stale} cell(s) whose record was made with other values of their fields (a changed default)")
    for line in problem_lines(corrupt):
        log(f"corrupt record: {line}")
    if corrupt and not (force or retry_failed):
        log(f"{len(corrupt)} cell(s) with a corrupt record are left as they are (--retry-failed reruns them)")
    jobs = slurm_job_ids(sweep_dir, [c.id for c in chosen])
    queued = queued_states(jobs.values())
    flying = {cid: jid for cid, jid in jobs.items() if jid in queued}
    return [c for c in chosen if c.id not in flying], done, flying


def submit(
    sweep: Sweep,
    results_dir: Path,
    executor: str | None = None,
    force: bool = False,
    retry_failed: bool = False,
    log=print,
    room_poll_s: float | None = None,
) -> Submission:
    """Run or queue the cells that need it. room_poll_s (submit --wait): when slurm.max_jobs_in_queue
    leaves no room, look again this often until all are queued; None: queue what fits and say so.

    What stops it is a UserError that says what was and was not queued: squeue not answering, sbatch
    refusing an array, an unreadable manifest, or an interrupt (Stopped)."""
    executor = executor or default_executor()[0]
    if executor not in EXECUTORS:
        raise ValueError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    sweep_dir = Path(results_dir) / sweep.name
    # The lock: from reading which cells are queued to the manifest naming what this submit
    # queued (for the local executor, to its last cell). Signals end what it started (interrupts.py).
    try:
        with interrupts_raise(), sweep_lock(sweep_dir, log):
            return _submit_locked(sweep, sweep_dir, executor, force, retry_failed, log, room_poll_s)
    except SchedulerError as exc:
        raise UserError(f"cannot tell which cells are still queued ({exc}); nothing submitted") from None
    except SubmitError as exc:
        raise UserError(
            f"{exc}; the cells of that array and any after it were not queued "
            f"(arrays queued before it are in {sweep_dir / MANIFEST_NAME})"
        ) from None
    except RecordError as exc:  # the manifest: which jobs are the sweep's
        raise UserError(
            f"{exc}; it names the sweep's queued jobs: repair or remove it (`squeue --name "
            f"hpcfsdp-{sweep.name}` lists them); nothing submitted"
        ) from None
    except Interrupted as exc:
        done = (
            "the running cell was stopped and its earlier record is current again"
            if executor == "local"
            else "arrays queued before it are in manifest.json; the cells not queued keep their records"
        )
        raise Stopped(f"interrupted ({exc}): {done}; run the same command again to go on", exc.exit_status) from None


def _submit_locked(
    sweep: Sweep, sweep_dir: Path, executor: str, force: bool, retry_failed: bool, log, room_poll_s: float | None
) -> Submission:
    cells, done, flying = select_cells(sweep, sweep_dir, force, retry_failed, log)
    problems = cluster_problems(sweep, cells) if executor == "slurm" and cells else []
    if problems:  # before anything is written or queued
        more = f" (and {len(problems) - 1} more: `hpcfsdp plan` lists them)" if len(problems) > 1 else ""
        raise SpecError(f"{problems[0]}{more}")
    sub = Submission(sweep_dir=sweep_dir, executor=executor, submitted=cells, in_flight=flying)
    if done:
        log(f"skipping {len(done)} cell(s) that already have a record (--retry-failed or --force to rerun)")
    if flying:
        log(f"skipping {len(flying)} cell(s) still queued or running:")
        for cid, jid in flying.items():
            log(f"    {cid} (job {jid})")
    if not cells:
        log("nothing to submit")
        return sub
    _write_sweep_files(sweep, sweep_dir, cells)
    # The records of rerun cells are kept as attempts just before each array is queued or each
    # local cell starts (the print executor runs nothing: records stay where they are).
    if executor == "slurm":
        _submit_slurm(sweep, sub, log, room_poll_s)
    elif executor == "local":
        _run_local(sweep, sub, log)
    else:
        for cell in cells:
            print(print_command(sweep, sweep_dir, cell))
    return sub


def _write_sweep_files(sweep: Sweep, sweep_dir: Path, cells: Iterable[Cell]) -> None:
    from .job import write_cell_spec

    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "matrix.yaml").write_text(yaml.safe_dump(sweep.raw, sort_keys=False))
    for cell in cells:
        write_cell_spec(cell_dir(sweep_dir, cell), cell.spec, cell.id, sweep.name)


@contextmanager
def records_set_aside(sweep_dir: Path, cells: Iterable[Cell]) -> Iterator[None]:
    """Keep the cells' current records as attempts (record.keep_as_attempt) for a rerun: status
    then reads the new run's state. If the block fails or is interrupted (sbatch refused, Ctrl-C,
    a local run cut short), each earlier record is current again, and whatever the cut-short run
    recorded is kept as an attempt too."""
    kept = {cell.id: path for cell in cells if (path := keep_as_attempt(cell_dir(sweep_dir, cell)))}
    try:
        yield
    except BaseException:
        for cell_id, path in kept.items():
            restore_attempt(cell_dir(sweep_dir, cell_id), path)
        raise


def _update_manifest(sweep_dir: Path, entries: dict[str, dict]) -> None:
    manifest = read_manifest(sweep_dir)
    manifest.update(entries)
    write_json(sweep_dir / MANIFEST_NAME, manifest, sort_keys=True)


def wait_for(sub: Submission, interval_s: float, log=print) -> StatusReport:
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
            f"{cell_status(sub.sweep_dir, cell.cell_id)} (logs: {sub.sweep_dir / 'slurm' / cell.job_id})"
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


def job_environment(sweep: Sweep) -> dict[str, str]:
    """What every cell's processes get, whatever the executor: hub offline, and the cache folder."""
    env = dict(OFFLINE_ENV)
    cache = sweep.resources.cache_dir or os.environ.get(CACHE_ENV, "")
    if cache:
        env[CACHE_ENV] = os.path.expanduser(cache)
    return env


# The job's end time as Slurm scheduled it, asked once per job (not per rank): a rank that gets
# SIGTERM well before it was cancelled (scancel) or lost a node, not timed out (cell/run.py).
JOB_END_SETUP = f'export {JOB_END_ENV}="$(timeout 30 squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e 2>/dev/null)"'


def slurm_parameters(sweep: Sweep, nodes: int, gpus_per_node: int) -> dict:
    """submitit SlurmExecutor parameters for one array: resources, setup lines, offline switches."""
    res: Resources = sweep.resources
    env = {**job_environment(sweep), MAX_REQUEUE_ENV: str(res.max_requeue)}
    additional = dict(res.extra_sbatch)
    if res.max_requeue:
        additional["requeue"] = True  # clusters with JobRequeue=0 refuse `scontrol requeue` otherwise
    params: dict = dict(
        job_name=f"hpcfsdp-{sweep.name}",
        partition=res.partition or None,
        time=res.time_min,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        cpus_per_task=res.cpus_per_task,
        array_parallelism=res.array_parallelism,
        signal_delay_s=res.signal_delay_s,
        # The unset is for a script submitted by hand (plan --sbatch): submit's sbatch never has them.
        setup=[
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            f"unset {' '.join(HF_TOKEN_ENV)}",
            JOB_END_SETUP,
            *sweep.setup,
        ],
        # One failed rank must end the whole step, never leave the others hanging in a collective.
        srun_args=["--kill-on-bad-exit=1"],
        additional_parameters=additional,
    )
    if res.gpu_request == "gres":
        params["gres"] = f"gpu:{gpus_per_node}"
    elif res.gpu_request == "gpus_per_node":
        params["gpus_per_node"] = gpus_per_node
    for key in ("account", "qos", "constraint"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    if res.mem_gb:
        params["mem"] = f"{res.mem_gb}G"
    if res.exclusive:
        params["exclusive"] = True
    return params


def sbatch_script(sweep: Sweep, sweep_dir: Path, nodes: int, gpus_per_node: int, count: int) -> str:
    """The sbatch script submit writes for an array of `count` cells of one shape (a plain job for one)."""
    # submitit has no public call for the script text; SlurmExecutor builds it with this helper,
    # from the same parameters and its _submitit_command_str, which the command below repeats.
    from submitit.slurm.slurm import _make_sbatch_string

    folder = slurm_folder(sweep_dir)
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(
        command=command,
        folder=folder,
        map_count=count if count > 1 else None,
        **slurm_parameters(sweep, nodes, gpus_per_node),
    )


def _submit_slurm(sweep: Sweep, sub: Submission, log, room_poll_s: float | None) -> None:
    """One array per shape, split at the most cells an array may hold (cluster.array_size_limit).
    Under slurm.max_jobs_in_queue only as many cells go out as there is room for: the rest wait for
    room (room_poll_s seconds between looks) or, without room_poll_s, stay out (sub.not_queued)."""
    cap = sweep.resources.max_jobs_in_queue
    todo = arrays(sub.submitted, array_size_limit(sweep.resources.max_array_size))
    total = len(sub.submitted)
    last_note = ""
    while todo:
        (nodes, gpus), cells = todo[0]
        room = _queue_room(cap)
        if room is not None and room < 1:
            if room_poll_s is None:
                break
            note = (
                f"waiting for room in the queue (slurm.max_jobs_in_queue {cap}, {cap - room} of your jobs queued): "
                f"{sum(len(c) for _, c in todo)} of {total} cell(s) still to submit"
            )
            if note != last_note:
                log(note)
                last_note = note
            time.sleep(room_poll_s)
            continue
        take = len(cells) if room is None else min(room, len(cells))
        todo[0:1] = [((nodes, gpus), cells[take:])] if take < len(cells) else []
        _submit_array(sweep, sub, nodes, gpus, cells[:take], log)
    sub.not_queued = [cell for _, cells in todo for cell in cells]
    sub.submitted = [cell for cell in sub.submitted if cell.id in sub.job_ids]
    if sub.not_queued:
        log(
            f"queued {len(sub.submitted)} of {total} cell(s): the queue is full (slurm.max_jobs_in_queue {cap}); "
            f"submit the same YAML again once jobs have finished to queue the other {len(sub.not_queued)} "
            "(it skips cells with a record or in flight), or add --wait to wait for room"
        )


def _queue_room(cap: int) -> int | None:
    """How many more cells slurm.max_jobs_in_queue lets into the queue now; None: no cap."""
    if not cap:
        return None
    queued = jobs_in_queue()
    if queued is None:
        raise SubmitError(
            f"squeue did not answer, so your queued jobs cannot be counted against slurm.max_jobs_in_queue {cap}"
        )
    return cap - queued


def _submit_array(sweep: Sweep, sub: Submission, nodes: int, gpus: int, cells: list[Cell], log) -> None:
    import submitit
    from submitit.core.utils import FailedJobError

    from .job import CellJob

    executor = submitit.SlurmExecutor(folder=slurm_folder(sub.sweep_dir), max_num_timeout=sweep.resources.max_requeue)
    executor.update_parameters(**slurm_parameters(sweep, nodes, gpus))
    # The CellJob itself is the submitted function, so that submitit finds its checkpoint().
    # sbatch queues the array and the manifest names it, or neither happens: signals wait until
    # then (outermost, so that a signal during a queueing that worked restores no record). A refusal
    # is reported once, by SubmitError, with sbatch's message: submitit's own echo of it is dropped.
    with interrupts_deferred(), records_set_aside(sub.sweep_dir, cells), secrets_removed():
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.submit_array([CellJob(str(cell_dir(sub.sweep_dir, c))) for c in cells])
        except FailedJobError as exc:
            reason = " ".join(str(exc).split()) or "no message"
            raise SubmitError(
                f"sbatch refused the array of {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s): {reason}"
            ) from None
        entries = {}
        for cell, job in zip(cells, jobs):
            sub.job_ids[cell.id] = job.job_id
            entries[cell.id] = {"executor": "slurm", "job_id": job.job_id, "submitted_at": time.time()}
        _update_manifest(sub.sweep_dir, entries)
    log(f"submitted array {jobs[0].job_id.split('_')[0]}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s)")


def is_secret(name: str) -> bool:
    """An environment variable that holds a token, key or password (HF_TOKEN, WANDB_API_KEY,
    AWS_SECRET_ACCESS_KEY, ...): it never goes with a cell."""
    return name in HF_TOKEN_ENV or bool(SECRET_NAME.search(name))


@contextmanager
def secrets_removed() -> Iterator[None]:
    """Take tokens out of os.environ while sbatch runs: submitit starts it with this process's
    environment, and sbatch hands that to the job and to slurmctld's saved copy of it."""
    removed = {name: os.environ.pop(name) for name in list(os.environ) if is_secret(name)}
    try:
        yield
    finally:
        os.environ.update(removed)


def torchrun_command(directory: Path, nprocs: int, nnodes: int = 1) -> list[str]:
    """torchrun for one cell: --standalone on one machine; on several, run the same command on each
    node with MASTER_ADDR set to the first one (c10d rendezvous)."""
    if nnodes == 1:
        launch = ["--standalone"]
    else:
        launch = [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=${MASTER_ADDR:?}:29500",
            f"--rdzv-id={directory.name}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        f"--nproc-per-node={nprocs}",
        "-m",
        "hpcfsdp",
        "run",
        "--cell-dir",
        str(directory),
    ]


def print_command(sweep: Sweep, sweep_dir: Path, cell: Cell) -> str:
    """One runnable shell line for the cell: `env` without the tokens of the shell it runs in
    (the Hugging Face ones always, and any other set here), the cell's environment, then torchrun."""
    unset = dict.fromkeys([*HF_TOKEN_ENV, *sorted(name for name in os.environ if is_secret(name))])
    env = [f"{k}={shlex.quote(v)}" for k, v in job_environment(sweep).items()]
    args = torchrun_command(cell_dir(sweep_dir, cell).absolute(), cell.spec.gpus_per_node, cell.spec.nodes)
    return " ".join(
        [
            "env",
            *(f"-u {shlex.quote(name)}" for name in unset),
            *env,
            *(f'"{a}"' if "${" in a else shlex.quote(a) for a in args),
        ]
    )


def _run_local(sweep: Sweep, sub: Submission, log) -> None:
    """One cell at a time on this machine, each as a torchrun with the cell's world size, within
    the sweep's time limit as under Slurm. Interrupted (Ctrl-C, SIGTERM, SIGHUP): the running
    cell's processes are ended, and its earlier record is current again."""
    env = {k: v for k, v in os.environ.items() if not is_secret(k)} | job_environment(sweep)
    limit_s = sweep.resources.time_min * 60
    for index, cell in enumerate(sub.submitted, 1):
        directory = cell_dir(sub.sweep_dir, cell)
        if cell.spec.nodes > 1:
            log(
                f"note: {cell.id} asks for {cell.spec.nodes} nodes; the local executor runs its "
                f"{cell.spec.world_size} ranks on this machine"
            )
        log(f"[{index}/{len(sub.submitted)}] {cell.id} ({cell.spec.world_size} process(es))")
        _update_manifest(sub.sweep_dir, {cell.id: {"executor": "local", "job_id": None, "submitted_at": time.time()}})
        with records_set_aside(sub.sweep_dir, [cell]), open(directory / "log.txt", "w") as out:
            # The end of its time limit, as Slurm's jobs are told it: SIGTERM before it is a cancel.
            limits = {JOB_END_ENV: f"{time.time() + limit_s:.0f}"}
            proc = subprocess.Popen(
                torchrun_command(directory, cell.spec.world_size),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env | limits,
                start_new_session=True,
                preexec_fn=_end_with_parent(os.getpid()),
            )
            returncode = _wait_within(proc, limit_s)
        status = cell_status(sub.sweep_dir, cell)
        sub.outcomes[cell.id] = status
        if status == MISSING:
            timed_out = returncode is None
            ended = (
                f"was killed at the {sweep.resources.time_min} min time limit" if timed_out else f"exited {returncode}"
            )
            status = sub.outcomes[cell.id] = "timeout" if timed_out else "error"
            record_launch_failure(
                directory,
                f"torchrun {ended} without a record",
                _log_tails([directory / "log.txt"], chars=4000),
                status=status,
            )
            status += f" ({ended} without a record; see {directory / 'log.txt'})"
        log(f"    {status}")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int):
    """For torchrun's process, between fork and exec: ask Linux for SIGTERM when submit dies, so
    that a submit killed by SIGKILL (which runs none of its handlers) leaves no cell training.
    torchrun passes the SIGTERM to its ranks, which record `cancelled`; the earlier record stays
    in attempts/. A parent that died before the request was made means exit at once."""

    def request() -> None:
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return request


def _wait_within(proc: subprocess.Popen, limit_s: float, grace_s: float = LOCAL_GRACE_S) -> int | None:
    """The cell's exit status; None when it reached its time limit. Then, as Slurm does, the cell
    gets SIGTERM (torchrun passes it to each rank, which records `timeout`: the time limit's end
    has come), and SIGKILL after grace_s. An interrupt of submit (Ctrl-C, SIGTERM, SIGHUP: its
    own session no longer gets the terminal's signals) ends the cell the same way, before its end
    time, so that each rank records `cancelled`."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _end_session(proc, grace_s)
        return None
    except KeyboardInterrupt:
        _end_session(proc, grace_s)
        raise


def _end_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to torchrun's session, which passes it on to the ranks; SIGKILL after grace_s, or
    at once on a second interrupt, to torchrun and to every process that was under it (the ranks
    run in sessions of their own, and outlive a killed torchrun)."""
    under = processes_under(proc.pid)  # now: once torchrun has ended, its ranks are no longer under it
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        under |= processes_under(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_survivors(under)
        if isinstance(exc, KeyboardInterrupt):
            raise
    _kill_survivors(under)


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc (Linux)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[19])
    return table


def processes_under(pid: int) -> dict[int, str]:
    """The processes under pid (children, theirs, ...): pid -> start time, which tells a process
    from a later one that reuses its pid."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def _kill_survivors(processes: dict[int, str]) -> None:
    table = _proc_table()
    for pid, started in processes.items():
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
