"""What Slurm says of a sweep's jobs, and scancel: squeue while they are queued, sacct once they
left the queue, read from the runner's answers (slurm.py: the command lines, timeouts, errors,
and the Watcher that asks about many jobs at once).

Every call asks the cluster the jobs were queued on (`cluster`: the manifest's, layout.py; "" the
default one) with an explicit -M (slurm.on_cluster), so that nothing is tracked, or cancelled, on
the wrong cluster. A job asks about itself without it: slurmd gives each job the configuration of
its own cluster (SLURM_CONF). A caller that looks again and again (status --watch) passes one
Watcher and calls its poll() before each look; without one, each call asks Slurm afresh.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...slurm import SQUEUE_FORMAT, SlurmError, Watcher, ask


@dataclass(frozen=True)
class QueuedJob:
    """A job (array task) as squeue shows it."""

    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str = ""  # why it is pending (squeue %r): Priority, Resources, PartitionNodeLimit, ...
    nodes: int = 1
    partition: str = ""
    name: str = ""  # the job's name: hpcfsdp-<sweep> for the sweep's own
    comment: str = ""  # its --comment: hpcfsdp:<sweep id> for the sweep's own (layout.sweep_comment)


def queued_states(
    job_ids: Iterable[str], cluster: str = "", comment: str = "", watcher: Watcher | None = None
) -> dict[str, QueuedJob]:
    """job id -> what squeue says of it, for those of the jobs still in the queue (pending, running,
    completing); given a comment (the sweep's, layout.sweep_comment), only the jobs that carry it:
    a job id that Slurm has since given to another job, or a job of another folder, is none of
    the sweep's. SlurmError when squeue does not answer."""
    lines = (watcher or Watcher()).queue(job_ids, cluster)
    queued = dict(_queued_job(line) for line in lines.values())
    return {jid: job for jid, job in queued.items() if not comment or of_sweep(job.comment, comment)}


def of_sweep(comment: str, sweep_comment: str) -> bool:
    """Whether a job's comment is the sweep's: its own (`hpcfsdp:<sweep id>`), or that with the
    token of the submit intent it was queued under (`hpcfsdp:<sweep id>:<token>`, track/intent.py)."""
    return comment == sweep_comment or comment.startswith(f"{sweep_comment}:")


def my_jobs_named(name: str, cluster: str = "") -> dict[str, QueuedJob]:
    """job id (array task) -> what squeue says of it, for every job of this user with that job
    name still in the queue. SlurmError when squeue does not answer."""
    args = ["--noheader", "--array", "--me", f"--name={name}", f"--format={SQUEUE_FORMAT}"]
    lines = ask("squeue", *args, cluster=cluster).splitlines()
    return dict(_queued_job(line) for line in lines if line.count("|") >= SQUEUE_FORMAT.count("|"))


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
    Watcher().cancel(job_ids, cluster)


@dataclass(frozen=True)
class FinishedJob:
    """What sacct says of a job that left the queue: its state, then its steps' (CANCELLED for
    "CANCELLED by 0"), and the most memory a step of it used on one node (MaxRSS; 0 unknown)."""

    states: list[str]
    max_rss_bytes: int = 0


def finished_jobs(job_ids: Iterable[str], cluster: str = "", watcher: Watcher | None = None) -> dict[str, FinishedJob]:
    """job id -> what sacct says of it; empty where there is no accounting (sacct fails)."""
    try:
        answers = (watcher or Watcher()).accounting(job_ids, cluster)
    except SlurmError:
        return {}
    found = {}
    for job, rows in answers.items():
        states: list[str] = []
        max_rss = 0
        for row in rows:  # slurm.SACCT_FORMAT: JobID, State, ..., MaxRSS
            if not row[1]:
                continue
            state = row[1].split()[0]
            states = [state, *states] if row[0] == job else [*states, state]
            max_rss = max(max_rss, _bytes(row[-1]))
        if states:
            found[job] = FinishedJob(states, max_rss)
    return found


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
