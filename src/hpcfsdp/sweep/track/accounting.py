"""Slurm accounting of finished cells: elapsed time, queue wait and consumed energy, from sacct.

`collect` and `status` add it to a record (key `slurm_accounting`, docs/record.md) once the record's
job has ended; a record that has it is not asked about again by collect. Where there is no
accounting (no sacct, or sacct fails: a cluster without slurmdbd) one line says so and nothing else
changes. sacct is asked through the runner (slurm.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from ...contracts.endings import ENDINGS, ending_fields
from ...contracts.files import RecordError
from ...contracts.names import slurm_job_of
from ...contracts.record import ACCOUNTING_KEY, RECORD_NAME, read_record, write_record
from ...slurm import SlurmError, Watcher
from ..folder.layout import cell_dir, manifest_cluster
from .packed import all_task_mates

# The fields read here: the first seven of slurm.SACCT_FORMAT.
ACCOUNTING_FIELDS = ("JobID", "State", "Submit", "Start", "End", "ElapsedRaw", "ConsumedEnergyRaw")


def parse_sacct(text: str) -> dict[str, dict[str, Any]]:
    """`sacct --noheader --parsable2 --format=JobID,State,Submit,Start,End,ElapsedRaw,ConsumedEnergyRaw`
    output -> job id -> accounting, for the jobs that have ended (an End that is a time; a running
    job's is Unknown)."""
    return accounting_of(line.split("|") for line in text.splitlines())


def accounting_of(rows: Iterable[list[str]]) -> dict[str, dict[str, Any]]:
    """sacct rows (ACCOUNTING_FIELDS) -> job id -> accounting, for the jobs that have ended."""
    out: dict[str, dict[str, Any]] = {}
    for parts in rows:
        if len(parts) != len(ACCOUNTING_FIELDS):
            continue
        job, state, submit, start, end, elapsed, energy = parts
        try:
            submitted, started, _ = (datetime.fromisoformat(moment) for moment in (submit, start, end))
        except ValueError:
            continue
        out[job] = {
            "state": state.split()[0] if state else None,  # "CANCELLED by 1000" -> CANCELLED
            "submit": submit,
            "start": start,
            "end": end,  # the cluster's local time, as sacct prints it
            "elapsed_s": int(elapsed) if elapsed.isdigit() else None,
            "queue_wait_s": (started - submitted).total_seconds(),
            # 0 or empty: the cluster does not gather energy (AcctGatherEnergyType=none)
            "consumed_energy_j": int(energy) if energy.isdigit() and int(energy) > 0 else None,
        }
    return out


def sacct(job_ids: Iterable[str], cluster: str = "") -> dict[str, dict[str, Any]]:
    """Accounting of the jobs that have ended, by job id (each job's own row, not its steps');
    SlurmError when sacct cannot tell."""
    answers = Watcher().accounting(job_ids, cluster)
    return accounting_of(
        row[: len(ACCOUNTING_FIELDS)] for job, rows in answers.items() for row in rows if row[0] == job
    )


def add_accounting(sweep_dir: Path, jobs: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], str]:
    """Ask sacct about the jobs (cell id -> job id) and add what it says of each ended one to that
    cell's record, unless the record has it already or is from another job (a rerun).

    Returns cell id -> the accounting added, and a one-line note when sacct cannot tell ("" else)."""
    if not jobs:
        return {}, ""
    try:
        answers = sacct(jobs.values(), manifest_cluster(sweep_dir) or "")
    except SlurmError as exc:
        return {}, (
            f"no Slurm accounting ({exc}): elapsed time, queue wait and energy not added to {len(jobs)} record(s)"
        )
    added = {}
    shared = all_task_mates(sweep_dir, list(jobs))
    for cell_id, job in jobs.items():
        if job not in answers:
            continue
        path = cell_dir(sweep_dir, cell_id) / RECORD_NAME
        try:
            record = read_record(path)
        except (RecordError, OSError):  # unreadable, or gone since: collect and status name it themselves
            continue
        if ACCOUNTING_KEY in record or slurm_job_of(record.get("slurm")) != job:
            continue
        # A task of several cells (slurm.cells_per_task): its time and energy are all its cells', none one's.
        found = {**answers[job], "elapsed_s": None, "consumed_energy_j": None} if cell_id in shared else answers[job]
        record[ACCOUNTING_KEY] = found
        record.update(_ending_slurm_saw(record, found["state"]))
        write_record(path, record)
        added[cell_id] = found
    return added, ""


def note_accounting(sweep_dir: Path, jobs: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """add_accounting for `status` and `collect`: what was added; where there is no accounting, one
    `note:` line on stderr."""
    added, note = add_accounting(sweep_dir, jobs)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return added


def _ending_slurm_saw(record: dict[str, Any], state: str | None) -> dict[str, Any]:
    """A rank that got an early SIGTERM records `cancelled` when squeue did not answer it in time
    (a busy controller, a short KillWait); sacct's final state then tells a failed node or a
    preemption from a cancel: the record's status, slurm_state and advice follow it."""
    if record.get("status") != "cancelled" or state not in ("NODE_FAIL", "PREEMPTED"):
        return {}
    return {"status": ENDINGS[state].status, **ending_fields(state, ENDINGS[state])}
