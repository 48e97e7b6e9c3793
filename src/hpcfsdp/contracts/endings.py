"""How Slurm ends a job, as a record says it: one registry from Slurm's final job state to the
record's status and to what the user changes so that the cell runs next time.

Shared by both sides: a rank that gets Slurm's SIGTERM names its ending (cell/stopping/signals.py), and
`status` / `collect` name it from sacct and the job's logs for a cell that could not write a
record (sweep/track/status.py). Imports neither torch nor the sweep code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Ending:
    status: str  # the record's status
    meaning: str  # what Slurm did, in a few words
    advice: str  # what to change; {mem_gb} is filled in for host memory


# Slurm's final job states (sacct's State, squeue's %T) that say why a job ended early.
ENDINGS = {
    "CANCELLED": Ending(
        "cancelled", "the job was cancelled (scancel)", "rerun it with `hpcfsdp submit --retry-failed`"
    ),
    "TIMEOUT": Ending("timeout", "the job reached its time limit", "raise slurm.time_min, or lower steps"),
    "NODE_FAIL": Ending(
        "node_fail",
        "a node of the job failed",
        "rerun it with `hpcfsdp submit --retry-failed`, or set slurm.max_requeue so that Slurm requeues it",
    ),
    "PREEMPTED": Ending(
        "preempted",
        "the job was preempted for a job of a higher-priority partition or QOS",
        "raise slurm.max_requeue (Slurm then requeues it), rerun it with `hpcfsdp submit --retry-failed`, or "
        "submit to a partition or QOS that is not preempted",
    ),
    "OUT_OF_MEMORY": Ending(
        "host_oom",
        "the job used more host memory than it asked for and was killed",
        "raise slurm.mem_gb to at least {mem_gb}",
    ),
    "DEADLINE": Ending(
        "deadline",
        "the job could not end before its deadline (sbatch --deadline)",
        "set a later slurm.extra_sbatch.deadline, or a shorter slurm.time_min",
    ),
    "BOOT_FAIL": Ending(
        "boot_fail",
        "a node of the job failed to boot",
        "rerun it with `hpcfsdp submit --retry-failed`; if it recurs, tell the cluster's administrators",
    ),
}
STATUSES = tuple(ending.status for ending in ENDINGS.values())
# The endings of a job's allocation, not of one cell's run (host memory is the cell's): a task of
# several cells (slurm.cells_per_task) starts none of its later cells after one, and its requeued
# run trains again a cell an earlier run recorded with one (sweep/launch/job.py, sweep/track/packed.py).
JOB_ENDING_STATUSES = frozenset(
    ENDINGS[state].status for state in ("CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL")
)

# slurmstepd's words when it kills a step over its memory: jobacct_gather's OverMemoryKill
# ("StepId=12.0 exceeded memory limit (275496960 > 209715200), being killed") and the cgroup
# plugin ("Detected 1 oom-kill event(s) in StepId=12.0").
OVER_MEMORY = re.compile(r"exceeded memory limit \((\d+) > (\d+)\)|Exceeded job memory limit|oom-kill event")
GIB = 1024**3


def ended_by(states: list[str], log_text: str = "") -> tuple[str, Ending] | None:
    """The ending of a job without a record, from its sacct states (the job's first, then its
    steps') and its logs: slurmstepd's memory kill (OverMemoryKill leaves the job COMPLETED or
    FAILED and the killed step CANCELLED) is host memory. None for an ending the registry does
    not name (FAILED: the record says `error`)."""
    job = states[0] if states else ""
    if job in ENDINGS and job != "CANCELLED":
        return job, ENDINGS[job]
    if OVER_MEMORY.search(log_text) or "OUT_OF_MEMORY" in states:
        return "OUT_OF_MEMORY", ENDINGS["OUT_OF_MEMORY"]
    if job == "CANCELLED":
        return job, ENDINGS[job]
    return None


def memory_to_ask(log_text: str, mem_gb: int, max_rss_bytes: int = 0) -> int:
    """The slurm.mem_gb to ask for after a memory kill: above both the limit the job had and the
    most it was seen to use (slurmstepd's kill line, or sacct's MaxRSS), in whole GiB."""
    used = max([max_rss_bytes, *(int(m.group(1)) for m in OVER_MEMORY.finditer(log_text) if m.group(1))])
    limit = max([mem_gb * GIB, *(int(m.group(2)) for m in OVER_MEMORY.finditer(log_text) if m.group(2))])
    return max(math.ceil(used / GIB), math.floor(limit / GIB) + 1)


def ending_fields(state: str, ending: Ending, mem_gb: int = 0) -> dict[str, str]:
    """The record's words for an ending: `slurm_state` (what Slurm said) and `advice`."""
    return {"slurm_state": state, "advice": ending.advice.format(mem_gb=mem_gb)}
