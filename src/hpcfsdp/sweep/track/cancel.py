"""`hpcfsdp cancel SWEEP`: scancel exactly this sweep's queued jobs (array tasks), and record them.

Which jobs are the sweep's comes from its manifest (cell id -> the job id of its latest submit,
the sweep id and the folder that queued it), and every one is checked against squeue's job name
(`hpcfsdp-<sweep>`) and comment (`hpcfsdp:<sweep id>`, made at the folder's first submit) before
scancel sees it: a job id that Slurm has since given to another job, the user's or anyone's, or
a job of another folder of the same sweep name, is never cancelled. A copy of the folder made
while its jobs run holds the original's manifest: those jobs were queued from the original folder
(layout.slurm_jobs), so the copy neither cancels them nor records them.
scancel gets task ids (`4242_3`), never a whole array, so the tasks of other cells of the same
array run on. A task of several cells (slurm.cells_per_task) is cancelled whole: naming one of its
cells takes along those it has not run yet (`taken_along`); those it recorded keep their records.

A pending cell never starts, so its record (`cancelled`) is written here. A running cell gets
Slurm's SIGTERM and records `cancelled` itself (cell/stopping/signals.py); if its job leaves the queue
without a record (killed before it could write one), cancel writes it after waiting for that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ...contracts.record import MISSING, SPEC_NAME
from ...contracts.spec import SpecError
from ..folder.layout import cell_dir, planned_cell_ids, read_manifest, slurm_jobs, sweep_comment
from .intent import reconcile_intent
from .lost import log_tails, record_launch_failure, slurm_logs
from .packed import NOT_RUN, all_task_mates
from .scheduler import QueuedJob, queued_states, scancel
from .status import cell_status

LEAVE_QUEUE_S = 120.0  # how long cancel waits for its running jobs to leave the queue
POLL_S = 1.0


@dataclass
class Cancelled:
    """What `cancel_sweep` did, cell id -> job id."""

    pending: dict[str, str] = field(default_factory=dict)  # cancelled before they started
    running: dict[str, str] = field(default_factory=dict)  # cancelled while running
    left_running: dict[str, str] = field(default_factory=dict)  # running, kept (--pending-only)
    not_queued: list[str] = field(default_factory=list)  # chosen cells with no job in the queue
    still_queued: dict[str, str] = field(default_factory=dict)  # cancelled, not out of the queue in time
    taken_along: list[str] = field(default_factory=list)  # not named, but in the task of a cell named


def job_name(sweep_dir: Path) -> str:
    """The name submit gives the sweep's jobs (sweep/launch/submit.py: slurm_parameters)."""
    return f"hpcfsdp-{Path(sweep_dir).resolve().name}"


def cancel_sweep(
    sweep_dir: Path,
    cell_ids: Iterable[str] = (),
    pending_only: bool = False,
    leave_queue_s: float = LEAVE_QUEUE_S,
) -> Cancelled:
    """scancel the sweep's queued cells (those named, else all), running ones too unless
    pending_only; each cancelled cell ends with a `cancelled` record (or the one it wrote itself)."""
    sweep_dir = Path(sweep_dir)
    reconcile_intent(sweep_dir, lambda line: None)  # an array a killed submit queued is the sweep's to cancel
    chosen = _chosen_cells(sweep_dir, list(cell_ids))
    mates = all_task_mates(sweep_dir, chosen)
    along = [m for cid in chosen for m in mates.get(cid, []) if m not in chosen]
    chosen += list(dict.fromkeys(along))
    jobs, cluster, uid, _ = slurm_jobs(sweep_dir, chosen)  # asked and cancelled on the cluster they were queued on
    queued = _named(queued_states(jobs.values(), cluster, sweep_comment(uid) if uid else ""), job_name(sweep_dir))
    done = Cancelled(not_queued=[cid for cid in chosen if jobs.get(cid) not in queued and cid not in along])
    for cid, jid in jobs.items():
        if jid not in queued or ((cid in mates or cid in along) and cell_status(sweep_dir, cid) not in NOT_RUN):
            continue  # a cell its task has run keeps its record
        if cid in along:
            done.taken_along.append(cid)
        pending = queued[jid].state.startswith("PENDING")
        target = done.pending if pending else done.left_running if pending_only else done.running
        target[cid] = jid
    to_cancel = {**done.pending, **done.running}
    if not to_cancel:
        return done
    scancel(sorted(to_cancel.values()), cluster)
    for cid, jid in done.pending.items():
        if cell_status(sweep_dir, cid) == MISSING:
            _record_cancelled(sweep_dir, cid, jid, "while pending")
    done.still_queued = _wait_until_gone(done.running, cluster, leave_queue_s)
    for cid, jid in done.running.items():
        if cid not in done.still_queued and cell_status(sweep_dir, cid) == MISSING:
            _record_cancelled(sweep_dir, cid, jid, "while running; it left no record of its own")
    return done


def _chosen_cells(sweep_dir: Path, cell_ids: list[str]) -> list[str]:
    """The cells named (each must be a cell of the sweep folder), else every cell of the folder: those
    planned (a spec.json) and those of the manifest. A planned cell the manifest lacks (never
    queued, or queued by a submit killed before it wrote the manifest) has no queued job, and
    cancel counts it so."""
    if not cell_ids:
        return sorted(set(read_manifest(sweep_dir)) | set(planned_cell_ids(sweep_dir)))
    unknown = [cid for cid in cell_ids if not (cell_dir(sweep_dir, cid) / SPEC_NAME).is_file()]
    if unknown:
        raise SpecError(
            f"cancel: --cells: {', '.join(unknown)}: no such cell in {sweep_dir} (`hpcfsdp status` lists them)"
        )
    return list(dict.fromkeys(cell_ids))


def _named(queued: dict[str, QueuedJob], name: str) -> dict[str, QueuedJob]:
    """Of these queued jobs, those whose Slurm job name is `name`: a job id that Slurm has since
    given to someone else's job is never the sweep's."""
    return {jid: job for jid, job in queued.items() if job.name == name}


def _wait_until_gone(jobs: dict[str, str], cluster: str, timeout_s: float) -> dict[str, str]:
    """Wait for these jobs to leave the queue; those still in it after timeout_s."""
    deadline = time.monotonic() + timeout_s
    left = dict(jobs)
    while left:
        queued = queued_states(left.values(), cluster)
        left = {cid: jid for cid, jid in left.items() if jid in queued}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    return left


def _record_cancelled(sweep_dir: Path, cell_id: str, job_id: str, when: str) -> None:
    directory = cell_dir(sweep_dir, cell_id)
    logs = slurm_logs(sweep_dir, job_id)  # listed from the job's folder: no count taken from spec.json
    record_launch_failure(
        directory, f"Slurm job {job_id} cancelled by `hpcfsdp cancel` {when}", log_tails(logs), "cancelled"
    )
