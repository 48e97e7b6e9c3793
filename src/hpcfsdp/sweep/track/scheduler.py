"""What Slurm says of a sweep's jobs, and scancel: squeue while they are queued, sacct once they
left the queue.

Every call asks the cluster the jobs were queued on (`cluster`: the manifest's, layout.py; "" the
default one) with an explicit -M (cluster.on_cluster), so that nothing is tracked, or cancelled, on
the wrong cluster. A job asks about itself without it: slurmd gives each job the configuration of
its own cluster (SLURM_CONF).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from ...contracts.errors import UserError
from .cluster import on_cluster


class SchedulerError(UserError, RuntimeError):
    """squeue did not answer, so whether a cell is still queued cannot be known."""


@dataclass(frozen=True)
class QueuedJob:
    """A job (array task) as squeue shows it."""

    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str = ""  # why it is pending (squeue %r): Priority, Resources, PartitionNodeLimit, ...
    nodes: int = 1
    partition: str = ""
    name: str = ""  # the job's name: hpcfsdp-<sweep> for the sweep's own
    comment: str = ""  # its --comment: hpcfsdp:<sweep id> for the sweep's own (layout.sweep_comment)


def queued_states(job_ids: Iterable[str], cluster: str = "", comment: str = "") -> dict[str, QueuedJob]:
    """job id -> what squeue says of it, for those of the jobs still in the queue (pending, running,
    completing); given a comment (the sweep's, layout.sweep_comment), only the jobs that carry it:
    a job id that Slurm has since given to another job, or a job of another folder, is none of
    the sweep's."""
    arrays = sorted({jid.split("_")[0] for jid in job_ids})
    if not arrays:
        return {}
    command = [
        "squeue",
        *on_cluster(cluster),
        "--noheader",
        "--array",
        "--format=%i|%T|%D|%P|%k|%j|%r",
        f"--jobs={','.join(arrays)}",
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerError(f"squeue: {exc}") from None
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:  # every one of them has left the queue
            return {}
        raise SchedulerError(f"squeue: {proc.stderr.strip() or f'exit status {proc.returncode}'}")
    queued = dict(_queued_job(line) for line in proc.stdout.splitlines() if line.count("|") >= 6)
    return {jid: job for jid, job in queued.items() if not comment or job.comment == comment}


def _queued_job(line: str) -> tuple[str, QueuedJob]:
    """One squeue line, '%i|%T|%D|%P|%k|%j|%r' (the reason last: a job name may hold '|', a reason
    spaces; a comment holding '|' leaves part of itself in the name, which then is no sweep's)."""
    job_id, state, nodes, partition, comment, rest = line.split("|", 5)
    name, _, reason = rest.rpartition("|")
    pending = state.startswith("PENDING")
    return job_id.strip(), QueuedJob(
        state,
        reason if pending and reason != "None" else "",
        int(nodes) if nodes.isdigit() else 1,
        partition,
        name,
        "" if comment == "(null)" else comment,
    )


def scancel(job_ids: list[str], cluster: str = "") -> None:
    """scancel these jobs (array tasks); one that ended meanwhile is no error."""
    try:
        proc = subprocess.run(["scancel", *on_cluster(cluster), *job_ids], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerError(f"scancel: {exc}") from None
    # A job that ended between squeue and scancel is not an error: it is no longer queued either way.
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "already completing" not in line]
    if proc.returncode != 0 and not all("Invalid job id" in line or "Job/step already" in line for line in errors):
        raise SchedulerError(f"scancel: {' '.join(errors) or f'exit status {proc.returncode}'}")


@dataclass(frozen=True)
class FinishedJob:
    """What sacct says of a job that left the queue: its state, then its steps' (CANCELLED for
    "CANCELLED by 0"), and the most memory a step of it used on one node (MaxRSS; 0 unknown)."""

    states: list[str]
    max_rss_bytes: int = 0


def finished_jobs(job_ids: Iterable[str], cluster: str = "") -> dict[str, FinishedJob]:
    """job id -> what sacct says of it; empty where there is no accounting (sacct fails)."""
    ids = sorted(set(job_ids))
    if not ids or not shutil.which("sacct"):
        return {}
    command = [
        "sacct",
        *on_cluster(cluster),
        "--noheader",
        "--parsable2",
        "--format=JobID,State,MaxRSS",
        f"--jobs={','.join(ids)}",
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if proc.returncode != 0:
        return {}
    found: dict[str, FinishedJob] = {}
    for line in proc.stdout.splitlines():
        row = line.split("|")
        if len(row) != 3 or not row[1]:
            continue
        job = row[0].split(".")[0]  # 12_3.batch -> 12_3
        if job not in ids:
            continue
        known = found.get(job, FinishedJob([]))
        state = row[1].split()[0]
        states = [state, *known.states] if row[0] == job else [*known.states, state]
        found[job] = FinishedJob(states, max(known.max_rss_bytes, _bytes(row[2])))
    return {job: finished for job, finished in found.items() if finished.states}


def finished_states(job_ids: Iterable[str], cluster: str = "") -> dict[str, str]:
    """job id -> final Slurm state from sacct; empty where there is no accounting (sacct fails)."""
    return {job: finished.states[0] for job, finished in finished_jobs(job_ids, cluster).items()}


def _bytes(size: str) -> int:
    """sacct's MaxRSS ("269040K", "1.50G", "0") in bytes; 0 when empty."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        return int(float(size[:-1]) * units[size[-1]]) if size and size[-1] in units else int(size or 0)
    except ValueError:
        return 0
