"""Slurm's requeues of a cell's job (preemption, a failed node, `scontrol requeue`) as the cell sees
them: how many it has had and may have (SLURM_RESTART_COUNT against slurm.max_requeue), what Slurm
says of the job at a SIGTERM, and the name of an earlier run's ending once Slurm has restarted it.

Why an earlier run is named again: at a SIGTERM a rank asks the controller why (job_view), and on
a busy machine the answer may not come before SIGKILL; the rank then records `cancelled`. A cancel
(scancel) never requeues a job, so a run that Slurm restarts proves the earlier run was not one:
rank 0 of the requeued run names it from `sacct --duplicates` (every run of the job, each with its
own state) and, where accounting does not answer, as `preempted` (Slurm requeues a running job for
preemption; a failed node shows the reason NodeDown). That holds whatever the timing.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ...contracts.endings import ENDINGS, JOB_ENDING_STATUSES, ending_fields
from ...contracts.files import RecordError
from ...contracts.record import RECORD_NAME, read_record, write_record
from ...contracts.spec import MAX_REQUEUE_ENV

SLURM_ASK_S = 4.0  # one question to the controller at a SIGTERM (SIGKILL follows after KillWait)
# Test-only: another wait for that answer; 0 makes the controller "not answer", as a busy one may not.
ASK_ENV = "HPCFSDP_SLURM_ASK_S"


def ask_s() -> float:
    return float(os.environ.get(ASK_ENV) or SLURM_ASK_S)


def restarts() -> tuple[int, int]:
    """Requeues so far (SLURM_RESTART_COUNT, the same on every rank) and those the sweep allows."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0), int(os.environ.get(MAX_REQUEUE_ENV) or 0)


def requeues_left() -> bool:
    done, allowed = restarts()
    return done < allowed


def requeued_too_often() -> str:
    """Why this run must not train, or "": Slurm requeued the job (preemption, a failed node) more
    often than slurm.max_requeue allows. Slurm requeues a job with --requeue whenever it is
    preempted; only the cell can stop that."""
    done, allowed = restarts()
    if done > allowed:  # max_requeue 0 too: a job Slurm requeued anyway (a site default) trains once
        return f"Slurm requeued the job {done} time(s), above slurm.max_requeue {allowed}: not run again"
    return ""


def requeue_note() -> str:
    """Whether Slurm requeues the job after this run (slurm.max_requeue > 0 gives it --requeue)."""
    done, allowed = restarts()
    if not allowed:
        return "; not requeued (slurm.max_requeue 0)"
    if done < allowed:
        return f"; Slurm requeues it (requeue {done + 1} of slurm.max_requeue {allowed})"
    return f"; its slurm.max_requeue {allowed} requeue(s) are used up: the requeued run ends at once"


@dataclass(frozen=True)
class JobView:
    """What the controller says of this process's job at a SIGTERM (`scontrol show job`)."""

    reason: str = ""  # Reason: NodeDown, BeginTime, None, ...
    restarts: int = 0  # Restarts: Slurm counts a requeue before it signals the job's steps
    preempt_time: str = ""  # PreemptTime ("" when not preempted)
    unanswered: bool = False  # under Slurm, the controller did not answer within ask_s()

    def ending(self) -> tuple[str, str] | None:
        """(Slurm's state, why) for a preemption or a failed node; None for a cancel.

        A Restarts above this run's SLURM_RESTART_COUNT says Slurm requeues the job now; a scancel
        never does, and Slurm counts the requeue before it sends the SIGTERM, so that answer does
        not depend on how quickly the controller is asked."""
        own = restarts()[0]
        if "NodeDown" in self.reason:
            return "NODE_FAIL", "Slurm: NodeDown"
        if self.preempt_time:
            return "PREEMPTED", f"at {self.preempt_time}"
        if self.restarts > own:
            return "PREEMPTED", f"Slurm requeues the job (restart {self.restarts})"
        return None


def job_view() -> JobView:
    """The controller's word on this process's job; an empty view outside Slurm or when it does
    not answer within ask_s()."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return JobView()
    try:
        out = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job], capture_output=True, text=True, timeout=ask_s()
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return JobView(unanswered=True)
    fields = dict(re.findall(r"\b(Reason|Restarts|PreemptTime)=(\S*)", out))
    preempt_time = fields.get("PreemptTime", "")
    return JobView(
        fields.get("Reason", ""),
        int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else 0,
        "" if preempt_time in ("", "None", "Unknown", "N/A") else preempt_time,
        "JobState=" not in out,
    )


def _earlier_run(cell_dir: Path) -> dict[str, Any] | None:
    """The cell's record when an earlier run of this Slurm job wrote it (this run is a requeue)."""
    job, now = os.environ.get("SLURM_JOB_ID"), restarts()[0]
    try:
        record = read_record(cell_dir / RECORD_NAME)
    except (RecordError, OSError):
        return None
    found = re.fullmatch(rf"slurm-{re.escape(job or '')}-(\d+)", str(record.get("launch_id")))
    return record if job and found and int(found.group(1)) < now else None


def done_before(cell_dir: Path) -> bool:
    """An earlier run of this job trained the cell to the end (`ok`), and Slurm requeued the job as it
    ended (a preemption while it finished): the requeued run need not train it again."""
    earlier = _earlier_run(cell_dir)
    return earlier is not None and earlier.get("status") == "ok"


def settled_before(cell_dir: Path) -> bool:
    """An earlier run of this job recorded the cell with an ending of the cell's own (ok, oom, error,
    ...), not one of the allocation's (a cancel, the time limit, a preemption): the requeued run of a
    task of several cells (slurm.cells_per_task) does not run it again."""
    earlier = _earlier_run(cell_dir)
    return earlier is not None and earlier.get("status") not in JOB_ENDING_STATUSES


def name_requeued_run(cell_dir: Path) -> str:
    """Rank 0 of a requeued run, before anything else: an earlier run of this job whose record says
    `cancelled` was requeued by Slurm, so it was no cancel; its record is rewritten with the ending
    sacct gives that run (PREEMPTED, NODE_FAIL), else as preempted. Returns a line saying so, or ""."""
    record = _earlier_run(cell_dir)
    if record is None or record.get("status") != "cancelled":
        return ""
    state = _run_state(os.environ["SLURM_JOB_ID"], record.get("started_at"))
    if state == "REQUEUED":  # `scontrol requeue` by hand: a person's doing, as a cancel is
        return ""
    state, why = (state, f"sacct: {state}") if state in ("PREEMPTED", "NODE_FAIL") else ("PREEMPTED", "sacct: -")
    ending, recorded = ENDINGS[state], record.get("error")
    record.update(
        status=ending.status,
        error=f"received SIGTERM: {ending.meaning} (Slurm requeued the job; {why})",
        **ending_fields(state, ending),
    )
    write_record(cell_dir / RECORD_NAME, record)
    return f"the run before this one recorded `cancelled` ({recorded}); Slurm restarted the job: {record['error']}"


def _run_state(job: str, started_at: Any) -> str:
    """sacct's state of the run of the job that started last before `started_at` (epoch seconds;
    the record's start): `--duplicates` lists every run of a requeued job. "" when sacct does not
    answer or does not know it."""
    command = ["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2", "--format=State,Start"]
    try:
        out = subprocess.run([*command, f"--jobs={job}"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    runs = []
    for line in out.splitlines():
        state, _, start = line.partition("|")
        try:
            runs.append((datetime.fromisoformat(start).timestamp(), state.split()[0] if state else ""))
        except ValueError:  # Unknown: a run that has not started
            continue
    before = [run for run in runs if isinstance(started_at, (int, float)) and run[0] <= started_at + 1]
    return max(before)[1] if before else ""
