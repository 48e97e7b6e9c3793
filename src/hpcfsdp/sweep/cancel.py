"""`hpcfsdp cancel SWEEP`: scancel exactly this sweep's queued jobs (array tasks), and record them.

Which jobs are the sweep's comes from its manifest (cell id -> the job id of its latest submit),
and every one is checked against squeue's job name (`hpcfsdp-<sweep>`) before scancel sees it: a
job id that Slurm has since given to another job, the user's or anyone's, is never cancelled.
scancel gets task ids (`4242_3`), never a whole array, so the tasks of other cells of the same
array run on.

A pending cell never starts, so its record (`cancelled`) is written here. A running cell gets
Slurm's SIGTERM and records `cancelled` itself (cell/signals.py); if its job leaves the queue
without a record (killed before it could write one), cancel writes it after waiting for that.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..record import MISSING, SPEC_NAME, read_json_object
from ..spec import SpecError
from .layout import cell_dir, read_manifest
from .status import (
    SchedulerError,
    cell_status,
    log_tails,
    queued_states,
    record_launch_failure,
    slurm_job_ids,
    slurm_logs,
)

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


def job_name(sweep_dir: Path) -> str:
    """The name submit gives the sweep's jobs (sweep/submit.py: slurm_parameters)."""
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
    chosen = _chosen_cells(sweep_dir, list(cell_ids))
    jobs = slurm_job_ids(sweep_dir, chosen)
    queued = queued_states(jobs.values())
    ours = _jobs_named(queued, job_name(sweep_dir))
    done = Cancelled(not_queued=[cid for cid in chosen if jobs.get(cid) not in ours])
    for cid, jid in jobs.items():
        if jid not in ours:
            continue
        pending = queued[jid].state.startswith("PENDING")
        target = done.pending if pending else done.left_running if pending_only else done.running
        target[cid] = jid
    to_cancel = {**done.pending, **done.running}
    if not to_cancel:
        return done
    _scancel(sorted(to_cancel.values()))
    for cid, jid in done.pending.items():
        if cell_status(sweep_dir, cid) == MISSING:
            _record_cancelled(sweep_dir, cid, jid, "while pending")
    done.still_queued = _wait_until_gone(done.running, leave_queue_s)
    for cid, jid in done.running.items():
        if cid not in done.still_queued and cell_status(sweep_dir, cid) == MISSING:
            _record_cancelled(sweep_dir, cid, jid, "while running; it left no record of its own")
    return done


def _chosen_cells(sweep_dir: Path, cell_ids: list[str]) -> list[str]:
    """The cells named (each must be a cell of the sweep folder), else every cell of the manifest."""
    manifest = read_manifest(sweep_dir)
    if not cell_ids:
        return sorted(manifest)
    unknown = [cid for cid in cell_ids if not (cell_dir(sweep_dir, cid) / SPEC_NAME).is_file()]
    if unknown:
        raise SpecError(
            f"cancel: --cells: {', '.join(unknown)}: no such cell in {sweep_dir} (`hpcfsdp status` lists them)"
        )
    return list(dict.fromkeys(cell_ids))


def _jobs_named(queued: dict, name: str) -> set[str]:
    """Of these queued job ids, those whose Slurm job name is `name`."""
    if not queued:
        return set()
    arrays = sorted({jid.split("_")[0] for jid in queued})
    command = ["squeue", "--noheader", "--array", "--format=%i|%j", f"--jobs={','.join(arrays)}"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerError(f"squeue: {exc}") from None
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        raise SchedulerError(f"squeue: {proc.stderr.strip() or f'exit status {proc.returncode}'}")
    names = dict(line.split("|", 1) for line in proc.stdout.splitlines() if "|" in line)
    return {jid for jid in queued if names.get(jid) == name}


def _scancel(job_ids: list[str]) -> None:
    try:
        proc = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerError(f"scancel: {exc}") from None
    # A job that ended between squeue and scancel is not an error: it is no longer queued either way.
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "already completing" not in line]
    if proc.returncode != 0 and not all("Invalid job id" in line or "Job/step already" in line for line in errors):
        raise SchedulerError(f"scancel: {' '.join(errors) or f'exit status {proc.returncode}'}")


def _wait_until_gone(jobs: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Wait for these jobs to leave the queue; those still in it after timeout_s."""
    deadline = time.monotonic() + timeout_s
    left = dict(jobs)
    while left:
        queued = queued_states(left.values())
        left = {cid: jid for cid, jid in left.items() if jid in queued}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    return left


def _record_cancelled(sweep_dir: Path, cell_id: str, job_id: str, when: str) -> None:
    directory = cell_dir(sweep_dir, cell_id)
    spec = read_json_object(directory / SPEC_NAME, kind="cell spec")["spec"]
    logs = slurm_logs(sweep_dir, job_id, spec["nodes"] * spec["gpus_per_node"])
    record_launch_failure(
        directory, f"Slurm job {job_id} cancelled by `hpcfsdp cancel` {when}", log_tails(logs), "cancelled"
    )
