"""The one way the login side asks Slurm: every sbatch, squeue, sacct, sinfo, scontrol, sacctmgr and
scancel that hpcfsdp runs on the login node is run here (`ask`); the cell's reading of its own job
on the compute node (cell/stopping/requeue.py), and its `scontrol --version` for the record
(cell/measure/provenance.py), are the only others (tests/test_layout.py checks them).

`ask` gives each command
- the cluster to ask (`on_cluster`: -M, explicit, never an exported variable);
- a timeout: TRACK_TIMEOUT_S for the commands that track or cancel a sweep's jobs, ANSWER_TIMEOUT_S
  for the questions about the cluster's configuration that a plan on a laptop asks too;
- one kind of error, `SlurmError`, one line naming the command, the cluster and what failed (not
  installed, no answer within the timeout, or the command's own last line of error).

Output is read in the formats that every release from 22.05 to 25.11 prints alike: --parsable2
(sacct, sacctmgr) and '|'-separated --format fields (squeue, sinfo). `--json` is there since 21.08,
but its schema changes with each release's data_parser (v0.0.38 to v0.0.42), which the delimited
formats do not.

`Watcher` asks squeue and sacct about many jobs at once, as submitit's SlurmInfoWatcher does: one
call for every job asked about in a poll, and never again about a job that sacct says has settled
(status --watch: one squeue and at most one sacct per poll for the whole sweep).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from .contracts.errors import UserError

SlurmCommand = Literal["sbatch", "squeue", "sacct", "sinfo", "scontrol", "sacctmgr", "scancel"]
SLURM_COMMANDS: tuple[SlurmCommand, ...] = ("sbatch", "squeue", "sacct", "sinfo", "scontrol", "sacctmgr", "scancel")
TRACK_TIMEOUT_S = 60.0  # squeue, sacct and scancel of a sweep's jobs: a busy controller takes its time
ANSWER_TIMEOUT_S = 15.0  # the cluster's configuration, sbatch's options and --test-only: skipped without
IDS_PER_CALL = 500  # job ids on one command line, which has a length limit
# squeue's fields of a job: the reason last, since a job name may hold '|' and a reason spaces.
SQUEUE_FORMAT = "%i|%T|%D|%P|%k|%j|%r"
# sacct's fields of a job and its steps: sweep/track/accounting.py reads the first seven, scheduler.py MaxRSS.
SACCT_FORMAT = "JobID,State,Submit,Start,End,ElapsedRaw,ConsumedEnergyRaw,MaxRSS"
# Final states: a job sacct shows in one of them is never asked about again (Watcher). PREEMPTED
# and NODE_FAIL are not among them: Slurm may requeue such a job under the same id.
SETTLED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL")


class SlurmError(UserError, RuntimeError):
    """A Slurm command that is not installed, did not answer in time, or failed: one line naming
    the command, the cluster it asked and why; `stderr` and `returncode` (None: it never answered)
    for callers that tell one failure from another (an id that left the queue, sbatch's refusal)."""

    def __init__(self, command: str, cluster: str, why: str, stderr: str = "", returncode: int | None = None):
        where = f" on cluster {cluster}" if cluster else ""
        super().__init__(f"{command}{where}: {why}")
        self.command = command
        self.stderr = stderr
        self.returncode = returncode

    @property
    def answered(self) -> bool:
        """Whether the command ran and exited (with a refusal), rather than never answering."""
        return self.returncode is not None


def on_cluster(cluster: str) -> list[str]:
    """The -M option that points a Slurm command at `cluster`; none for "" (the default cluster).
    Every command is given it explicitly: sacct ignores SLURM_CLUSTERS, and an exported variable
    would reach the commands of every other sweep this process handles."""
    return [f"--clusters={cluster}"] if cluster else []


def installed(*commands: SlurmCommand) -> bool:
    """Whether these Slurm clients are on PATH (a laptop has none)."""
    return all(shutil.which(command) for command in commands)


def ask(
    command: SlurmCommand,
    *args: str,
    cluster: str = "",
    timeout_s: float = TRACK_TIMEOUT_S,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """stdout of `command -M cluster args...`; SlurmError when it cannot be run, does not answer
    within timeout_s or exits with an error."""
    argv = [command, *on_cluster(cluster), *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, input=stdin, env=env)
    except FileNotFoundError:
        raise SlurmError(command, cluster, "not found (no Slurm client on PATH)") from None
    except OSError as exc:
        raise SlurmError(command, cluster, f"cannot be run ({exc.strerror or exc})") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(command, cluster, f"did not answer within {timeout_s:g} s") from None
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        why = lines[-1].removeprefix(f"{command}: ") if lines else f"exit status {proc.returncode}"  # its fatal line
        raise SlurmError(command, cluster, why, proc.stderr, proc.returncode)
    return proc.stdout


@dataclass
class _Cluster:
    """What one cluster said: this poll's squeue lines and sacct rows, and the settled jobs' rows."""

    queued: dict[str, str] = field(default_factory=dict)  # job id -> its squeue line, this poll
    arrays_asked: set[str] = field(default_factory=set)  # the arrays (job ids before '_') squeue was asked of
    accounted: dict[str, list[list[str]]] = field(default_factory=dict)  # job id -> its sacct rows, this poll
    settled: dict[str, list[list[str]]] = field(default_factory=dict)  # ... of a settled job: for good


@dataclass
class Watcher:
    """squeue and sacct of many jobs, batched and cached as submitit's SlurmInfoWatcher does.

    Within one poll (until `poll()`), squeue is asked once about each array and sacct once about
    each job, however many callers ask: the first question asks for every id it names at once
    (IDS_PER_CALL a command line). A job that sacct shows settled (SETTLED_STATES) is never asked
    about again while the watcher lives; one watcher lives for one command (a status, a watch), so
    nothing is ever answered from an earlier command's look. `calls` counts the commands run.
    """

    clusters: dict[str, _Cluster] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)

    def poll(self) -> None:
        """A new look: what squeue said, and sacct of jobs not yet settled, are asked again."""
        for seen in self.clusters.values():
            seen.queued.clear()
            seen.arrays_asked.clear()
            seen.accounted.clear()

    def queue(self, job_ids: Iterable[str], cluster: str = "") -> dict[str, str]:
        """job id -> its squeue line (SQUEUE_FORMAT) for every task of these jobs' arrays still in the
        queue (pending, running, completing); SlurmError when squeue does not answer."""
        seen = self.clusters.setdefault(cluster, _Cluster())
        arrays = {job.split("_")[0] for job in job_ids}
        new = sorted(arrays - seen.arrays_asked)
        for first in range(0, len(new), IDS_PER_CALL):
            chunk = new[first : first + IDS_PER_CALL]
            args = ["--noheader", "--array", f"--format={SQUEUE_FORMAT}", f"--jobs={','.join(chunk)}"]
            self.calls["squeue"] += 1
            try:
                out = ask("squeue", *args, cluster=cluster)
            except SlurmError as exc:
                if "Invalid job id" not in exc.stderr:
                    raise
                out = ""  # every one of them has left the queue
            for line in out.splitlines():
                if line.count("|") >= SQUEUE_FORMAT.count("|"):
                    seen.queued[line.split("|", 1)[0].strip()] = line
            seen.arrays_asked.update(chunk)
        return {job: line for job, line in seen.queued.items() if job.split("_")[0] in arrays}

    def accounting(self, job_ids: Iterable[str], cluster: str = "") -> dict[str, list[list[str]]]:
        """job id -> sacct's rows (SACCT_FORMAT fields) of the job, then of its steps, for those of
        these jobs that sacct knows; SlurmError when sacct cannot tell (no slurmdbd)."""
        seen = self.clusters.setdefault(cluster, _Cluster())
        ids = set(job_ids)
        new = sorted(ids - seen.settled.keys() - seen.accounted.keys())
        for first in range(0, len(new), IDS_PER_CALL):
            chunk = new[first : first + IDS_PER_CALL]
            args = ["--noheader", "--parsable2", f"--format={SACCT_FORMAT}", f"--jobs={','.join(chunk)}"]
            self.calls["sacct"] += 1
            found: dict[str, list[list[str]]] = {job: [] for job in chunk}
            for line in ask("sacct", *args, cluster=cluster).splitlines():
                row = line.split("|")
                job = row[0].split(".")[0]  # 12_3.batch -> 12_3
                if len(row) == SACCT_FORMAT.count(",") + 1 and job in found:
                    found[job].append(row)
            for job, rows in found.items():
                settled = any(row[0] == job and row[1].split(" ")[0] in SETTLED_STATES for row in rows)
                (seen.settled if settled else seen.accounted)[job] = rows
        answers = {**seen.accounted, **seen.settled}
        return {job: answers[job] for job in sorted(ids) if answers.get(job)}

    def cancel(self, job_ids: list[str], cluster: str = "") -> None:
        """scancel these jobs (array tasks); one that ended meanwhile is no error. What squeue said
        of them this poll is forgotten."""
        self.calls["scancel"] += 1
        try:
            ask("scancel", *job_ids, cluster=cluster)
        except SlurmError as exc:
            # A job that ended between squeue and scancel is not an error: it is no longer queued either way.
            errors = [line for line in exc.stderr.splitlines() if line.strip() and "already completing" not in line]
            if not exc.answered or not all("Invalid job id" in line or "Job/step already" in line for line in errors):
                raise
        finally:
            seen = self.clusters.get(cluster)
            if seen is not None:
                seen.queued.clear()
                seen.arrays_asked.clear()
