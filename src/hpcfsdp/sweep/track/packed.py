"""Array tasks of several cells (slurm.cells_per_task): the manifest names, with each cell of such
a task, the task's cells in the order it runs them (`task_cells`). From it status tells the cell a
running task runs now from those it has run (their records) and those still to come (pending),
cancel names the cells a task's scancel takes along, and logs which cells share the task's log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

from ...contracts.endings import JOB_ENDING_STATUSES
from ...contracts.record import CellState
from ..folder.layout import read_manifest
from .scheduler import QueuedJob

TASK_CELLS_KEY = "task_cells"
NOT_RUN = {CellState.MISSING, CellState.CORRUPT, CellState.STALE, *JOB_ENDING_STATUSES}


def task_entry(cell_ids: list[str]) -> dict[str, list[str]]:
    """The manifest field of each cell of a task (none for a task of one cell)."""
    return {TASK_CELLS_KEY: list(cell_ids)} if len(cell_ids) > 1 else {}


def task_mates(manifest: Mapping[str, dict], cell_id: str) -> list[str]:
    """The cells of the cell's latest task, in the order the task runs them (the cell among them);
    [] for a task of one cell. A cell listed whose latest job is another (resubmitted since) is not."""
    entry = manifest.get(cell_id, {})
    listed, job = entry.get(TASK_CELLS_KEY), entry.get("job_id")
    if not isinstance(listed, list) or cell_id not in listed or not job:
        return []
    return [
        m
        for m in listed
        if isinstance(m, str) and isinstance(manifest.get(m), dict) and manifest[m].get("job_id") == job
    ]


def all_task_mates(sweep_dir: Path, cell_ids: list[str]) -> dict[str, list[str]]:
    """task_mates of each of these cells that shares its task with others (the manifest is not read
    for none: status reports a broken one itself, and a sweep with nothing queued needs none)."""
    if not cell_ids:
        return {}
    manifest = read_manifest(sweep_dir)
    return {cid: mates for cid in cell_ids if len(mates := task_mates(manifest, cid)) > 1}


def queued_seats(
    sweep_dir: Path,
    cell_ids: list[str],
    jobs: Mapping[str, str],
    queued: Mapping[str, QueuedJob],
    status_of: Callable[[str], str],
) -> dict[str, QueuedJob | None]:
    """For each of these cells whose task of several cells is in the queue: None where its record
    is the task's run of it (status shows the record), else the job as the cell sees it. In a
    running task, the first cell without such a record is running and the later ones pending,
    "after <cell>" (a requeued run trains again a cell recorded with the job's own ending).
    status_of: a cell's record status (status.py's)."""
    seats: dict[str, QueuedJob | None] = {}
    for cid, mates in all_task_mates(sweep_dir, [c for c in cell_ids if jobs.get(c) in queued]).items():
        job = queued[jobs[cid]]
        ran = {m: status_of(m) not in NOT_RUN for m in mates}
        if ran[cid]:
            seats[cid] = None
            continue
        now = next(m for m in mates if not ran[m])
        if job.state.startswith("RUNNING") and now != cid:
            job = dataclasses.replace(job, state="PENDING", reason=f"after {now} in its task {jobs[cid]}")
        seats[cid] = job
    return seats
