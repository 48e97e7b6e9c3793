"""The state of a sweep's cells: their records (record.py's one reader), the manifest of queued
jobs, and what Slurm says of those jobs on the cluster they were queued on (scheduler.py). `hpcfsdp
status`, `submit` (what to run, --wait) and `collect` (missing cells) read cells through here; a
watch (watch.py) reads them here at every look, through the slurm.Watcher it keeps.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...contracts.errors import EXIT_IN_FLIGHT, EXIT_NOT_OK, EXIT_OK
from ...contracts.files import RecordError, read_json_object
from ...contracts.record import (
    CORRUPT,
    MISSING,
    PROGRESS_NAME,
    RECORD_NAME,
    SPEC_NAME,
    CellState,
    RecordState,
)
from ...contracts.recordspec import SEARCHED_FIELDS
from ...contracts.validity import record_state
from ...progress import coloured
from ...slurm import SlurmError, Watcher, on_cluster
from ..define.matrix import Cell, column_texts, varying_columns
from ..folder.layout import (
    MANIFEST_NAME,
    SLURM_DIR,
    cell_dir,
    local_run,
    moved_from,
    planned_cell_ids,
    slurm_jobs,
    sweep_comment,
    unusable_cell_folders,
)
from .cluster import never_clears, read_partitions, waits_for_nodes
from .intent import reconcile_intent
from .lost import cell_logs, log_tails, lost_ending, record_launch_failure
from .packed import queued_seats
from .preemptions import preemption_note, preemptions
from .scheduler import QueuedJob, finished_jobs, queued_states

IN_FLIGHT = (CellState.PENDING, CellState.RUNNING)
STALE = CellState.STALE
UNKNOWN_NOTE = "; cells still queued show as missing"  # the report's note when squeue did not answer


@dataclass(frozen=True)
class CellStatus:
    cell_id: str
    strategy: str
    state: str  # pending / running (squeue), else the record's status, else missing
    job_id: str = ""
    slurm: str = ""  # the scheduler's word: squeue's state, or sacct's once the job left the queue
    reason: str = ""  # why a pending cell waits (squeue %r)
    blocked: bool = False  # pending with a reason that cannot clear as the cluster stands (cluster.never_clears)
    advice: str = ""  # what to change (endings.py): the record's, or from sacct and the logs for a lost cell
    preempted: int = 0  # its records (current and earlier attempts) that say preempted (preemptions.py)
    error: str = ""  # the first line of its record's error, for a cell that did not end ok
    resources: str = ""  # its record's resource_problems as one line (resources_line)
    spec: dict[str, Any] = field(default_factory=dict, compare=False)  # its spec.json's: what tells it apart
    progress: str = ""  # a running cell's stage or step, from rank 0's progress file ("step 3/6")


@dataclass(frozen=True)
class StatusReport:
    sweep_dir: Path
    cells: list[CellStatus]
    note: str = ""  # why the scheduler could not be asked, if it could not
    problems: list[str] = field(default_factory=list)  # one line per corrupt record or manifest
    cluster: str = ""  # the cluster its jobs were queued on (slurm.clusters); "" the default one

    def counts(self) -> Counter:
        return Counter(c.state for c in self.cells)

    @property
    def in_flight(self) -> bool:
        return any(c.state in IN_FLIGHT for c in self.cells)

    @property
    def blocked(self) -> list[CellStatus]:
        return [c for c in self.cells if c.blocked]

    @property
    def exit_status(self) -> int:
        return cells_exit_status(c.state for c in self.cells)

    @property
    def unknown(self) -> list[CellStatus]:
        """The cells queued on Slurm, without a record, whose state squeue could not tell (note)."""
        return [c for c in self.cells if self.note and c.job_id and c.state == MISSING]

    def unknown_message(self) -> str:
        """`status`'s error when squeue did not answer and cells have no record: their state is
        unknown, not "not ok" (issue 44, item 9)."""
        return f"{self.note.removesuffix(UNKNOWN_NOTE)}: the state of {len(self.unknown)} queued cell(s) is unknown"

    @property
    def stuck(self) -> bool:
        """Cells are in flight and every one of them waits on a reason that cannot clear."""
        flying = [c for c in self.cells if c.state in IN_FLIGHT]
        return bool(flying) and all(c.blocked for c in flying)


def cells_exit_status(states: Iterable[str]) -> int:
    """What `status` and `submit` exit with (errors.py): 3 when a cell is in any state but ok,
    pending or running (a record that is not ok, none, a corrupt or stale one), else 4 while a
    cell is pending or running, else 0."""
    seen = set(states)
    if seen - {CellState.OK, *IN_FLIGHT}:
        return EXIT_NOT_OK
    return EXIT_IN_FLIGHT if seen & set(IN_FLIGHT) else EXIT_OK


def cell_state(sweep_dir: Path, cell: Cell | str) -> RecordState:
    """The cell's record as status, submit and collect all read it (validity.record_state): its
    status, missing, or corrupt with the line naming the file; given a Cell, 'stale' when the
    record was made with other values of its fields (a record whose spec makes another id, as a
    changed default makes it, reads as corrupt to collect, which knows no plan)."""
    cell_id = cell if isinstance(cell, str) else cell.id
    state = record_state(cell_dir(sweep_dir, cell) / RECORD_NAME, root=sweep_dir, cell_id=cell_id)
    if (
        state.record is not None
        and isinstance(cell, Cell)
        and _made_with_other_values(state.record["spec"], cell.spec.to_dict())
    ):
        return state._replace(status=STALE, problem="")
    return state


def cell_status(sweep_dir: Path, cell: Cell | str) -> str:
    return cell_state(sweep_dir, cell).status


def _made_with_other_values(recorded: dict, spec: dict) -> bool:
    """A cell id hashes only non-default fields, so a changed default keeps the id: the record then
    holds another value of a field both know. (A field the record lacks is newer than it: its
    default is the behaviour the record was made with.)"""
    searched = SEARCHED_FIELDS if spec.get("auto_batch") else ()  # the record holds the batch found
    return any(recorded[name] != spec[name] for name in recorded.keys() & spec.keys() if name not in searched)


def problem_lines(problems: list[str], limit: int = 10) -> list[str]:
    """The first `limit` problems, then how many more there are."""
    more = [f"... and {len(problems) - limit} more"] if len(problems) > limit else []
    return problems[:limit] + more


def sweep_status(
    sweep_dir: Path, cell_ids: Iterable[str] | None = None, watcher: Watcher | None = None
) -> StatusReport:
    """Every cell of the sweep folder (or those named): its record, else what the scheduler says
    (asked through `watcher`, a watch's; else afresh)."""
    watcher = watcher or Watcher()
    sweep_dir = Path(sweep_dir)
    unnamed = unusable_cell_folders(sweep_dir) if cell_ids is None else {}
    cell_ids = list(planned_cell_ids(sweep_dir) if cell_ids is None else cell_ids)
    problems = list(unnamed.values())
    try:
        reconcile_intent(sweep_dir, problems.append)  # an array a killed submit queued: tracked from now on
    except SlurmError as exc:
        problems.append(f"an array a stopped submit may have queued is not tracked yet ({exc})")
    try:
        jobs, cluster, uid, elsewhere = slurm_jobs(sweep_dir, cell_ids)
        moved = moved_from(sweep_dir)
    except RecordError as exc:  # a broken manifest: which jobs are the sweep's cannot be known
        jobs, cluster, uid, elsewhere, moved = {}, "", "", "", ""
        problems.append(f"{exc}; queued cells show as missing")
    if moved:
        problems.append(
            f"this folder was moved from {moved} while jobs it queued there were in the queue: they are followed "
            "here, but a job that starts after the move reads and writes the old folder (its script names it); "
            "`hpcfsdp cancel` and submit again any that have not started"
        )
    if elsewhere:
        problems.append(
            f"{sweep_dir / MANIFEST_NAME} names jobs queued from {elsewhere} (this folder is a copy of it): "
            "they are that folder's, and not followed here"
        )
    note = ""
    try:
        queued = queued_states(jobs.values(), cluster, sweep_comment(uid) if uid else "", watcher)
    except SlurmError as exc:
        queued, note = {}, f"{exc}{UNKNOWN_NOTE}"
    states = {cid: _what_status_shows(cell_state(sweep_dir, cid)) for cid in cell_ids}
    states |= _locally_in_flight(sweep_dir, states)
    problems += [state.problem for state in states.values() if state.problem]
    unrecorded = [jid for cid, jid in jobs.items() if states[cid].status == MISSING and jid not in queued]
    finished = finished_jobs(unrecorded, cluster, watcher)
    blocked = _blocked_jobs(queued, cluster)
    seats = queued_seats(
        sweep_dir, cell_ids, jobs, queued, lambda m: (states.get(m) or cell_state(sweep_dir, m)).status
    )
    cells = []
    for cid in cell_ids:
        jid = jobs.get(cid, "")
        job = seats[cid] if cid in seats else queued.get(jid)  # a task of several cells: each cell's own
        spec = _cell_spec(sweep_dir, cid)
        strategy = str(spec["strategy"]) if isinstance(spec.get("strategy"), str) else "?"
        if job is None:
            ended = finished.get(jid)
            record = states[cid].record or {}
            advice = record.get("advice") or (lost_ending(sweep_dir, cid, jid, ended)[2].get("advice") if ended else "")
            cells.append(
                CellStatus(
                    cid,
                    strategy,
                    states[cid].status,
                    jid,
                    ended.states[0] if ended else "",
                    advice=advice if isinstance(advice, str) else "",
                    preempted=preemptions(cell_dir(sweep_dir, cid)),
                    error=_first_line(record.get("error")) if states[cid].status != CellState.OK else "",
                    resources=resources_line(cid, record.get("resource_problems")) or "",
                    spec=spec,
                )
            )
        else:
            cells.append(
                CellStatus(
                    cid,
                    strategy,
                    _scheduler_state(job.state),
                    jid,
                    job.state,
                    job.reason,
                    jid in blocked,
                    preempted=preemptions(cell_dir(sweep_dir, cid)),
                    spec=spec,
                    progress=cell_progress(sweep_dir, cid) if _scheduler_state(job.state) == CellState.RUNNING else "",
                )
            )
    cells += [CellStatus(name, "?", CORRUPT) for name in unnamed]
    return StatusReport(sweep_dir, cells, note, problems, cluster)


def _what_status_shows(state: RecordState) -> RecordState:
    """The state with only the record's fields status shows: a sweep's records are never held all
    at once (a record may be megabytes: issue 44, item 11)."""
    if state.record is None:
        return state
    return state._replace(
        record={
            key: state.record[key] for key in ("status", "advice", "error", "resource_problems") if key in state.record
        }
    )


def resources_line(cell_id: str, problems: Any) -> str | None:
    """The line status and collect print for a cell whose record says its resources differed from
    its spec (`resource_problems`), or None when they did not."""
    if not isinstance(problems, list) or not problems:
        return None
    return f"{cell_id} did not run on the resources it asked for ({'; '.join(map(str, problems))}): not ranked"


def _locally_in_flight(sweep_dir: Path, states: dict[str, RecordState]) -> dict[str, RecordState]:
    """The cells without a record that a local submit running now on this folder runs (running)
    or will run (pending): no scheduler knows them, and they are not missing."""
    run = local_run(sweep_dir)
    if run is None:
        return {}
    flying = {run.running: CellState.RUNNING, **dict.fromkeys(run.waiting, CellState.PENDING)}
    return {cid: RecordState(flying[cid]) for cid, state in states.items() if cid in flying and state.status == MISSING}


def cell_progress(sweep_dir: Path, cell_id: str) -> str:
    """What rank 0 of a running cell last wrote of itself (cell/run.py): 'step 3/6' while it trains,
    else its stage ('model_build'); "" before it wrote any, or where the file cannot be read."""
    try:
        note = read_json_object(cell_dir(sweep_dir, cell_id) / PROGRESS_NAME, root=sweep_dir, kind="progress file")
    except (OSError, RecordError):
        return ""
    step, steps, stage = note.get("step"), note.get("steps"), note.get("stage")
    if isinstance(step, int) and isinstance(steps, int) and steps > 0 and stage == "train":
        return f"step {step}/{steps}"
    return stage if isinstance(stage, str) else ""


CAUSE_WIDTH = 72
EXCEPTION_NAME = re.compile(r"^[\w.]+(Error|Exception|Timeout|Cancelled|Interrupt): ")


def short_cause(error: str) -> str:
    """The cause column of the status and `submit --wait` tables: a failed cell's error, its first
    line without the exception's class name (the state says oom, timeout), cut to CAUSE_WIDTH
    characters (the whole line is in `status --json` and the report)."""
    error = EXCEPTION_NAME.sub("", error, count=1)
    return error if len(error) <= CAUSE_WIDTH else error[: CAUSE_WIDTH - 3] + "..."


def _first_line(error: object) -> str:
    return error.strip().splitlines()[0] if isinstance(error, str) and error.strip() else ""


def _scheduler_state(slurm_state: str) -> str:
    return CellState.PENDING if slurm_state.startswith(("PENDING", "REQUEUE")) else CellState.RUNNING


def _blocked_jobs(queued: dict[str, QueuedJob], cluster: str) -> set[str]:
    """The pending jobs whose reason cannot clear as the cluster stands; the partitions are read
    only when a reason depends on which nodes are up."""
    waiting = {jid: job for jid, job in queued.items() if job.reason}
    partitions = read_partitions(cluster) if any(waits_for_nodes(job.reason) for job in waiting.values()) else None
    return {
        jid
        for jid, job in waiting.items()
        if never_clears(job.reason, job.nodes, (partitions or {}).get(job.partition))
    }


def _cell_spec(sweep_dir: Path, cell_id: str) -> dict[str, Any]:
    """The spec its spec.json holds; empty where there is none, or none readable."""
    try:
        spec = read_json_object(cell_dir(sweep_dir, cell_id) / SPEC_NAME, root=sweep_dir, kind="cell spec").get("spec")
    except (FileNotFoundError, RecordError):
        return {}
    return spec if isinstance(spec, dict) else {}


def print_status(report: StatusReport, summary: bool = True) -> None:
    """Counts by state, then one row per cell that is not ok (yet) with Slurm's word for it (and
    why it is pending), and where Slurm logs are; warnings on stderr."""
    if report.note:
        print(f"warning: {report.note}", file=sys.stderr)
    for line in problem_lines(report.problems):
        print(f"warning: {line}", file=sys.stderr)
    if summary:
        counts = report.counts()
        print(
            f"{report.sweep_dir}: {len(report.cells)} cell(s)"
            + (f" on cluster {report.cluster}" if report.cluster else "")
            + ": "
            + ", ".join(f"{coloured(k, k)} {v}" for k, v in sorted(counts.items()))
            + preemption_note(c.preempted for c in report.cells)
        )
    for c in report.cells:
        if c.resources:
            print(f"warning: {c.resources}", file=sys.stderr)
    shown = [i for i, c in enumerate(report.cells) if c.state != "ok" or c.preempted]
    if not shown:
        return
    rows = [report.cells[i] for i in shown]
    # After the job, the fields beyond those the cell id spells that tell cells apart (optimizer_order, ...)
    differ = varying_columns([c.spec for c in report.cells], ("strategy", "batch_size", "grad_accum"))
    extra_header, extra = column_texts({name: [values[i] for i in shown] for name, values in differ.items()}, len(rows))
    width = max(4, *(len(c.cell_id) for c in rows))
    strategy_width = max(len("strategy"), *(len(c.strategy) for c in rows))
    state_width = max(len("state"), *(len(str(c.state)) for c in rows))  # cancelled, node_fail, preempted
    causes = [short_cause(c.error) for c in rows]
    cause_width = max(len("cause"), *map(len, causes)) if any(causes) else 0
    cause_header = f" {'cause':{cause_width}}" if cause_width else ""
    print(
        f"{'cell':{width}} {'strategy':{strategy_width}} {'state':{state_width}} {'job':12}{extra_header}"
        f"{cause_header} slurm"
    )
    for c, more, cause in zip(rows, extra, causes):
        more += f" {cause or '-':{cause_width}}" if cause_width else ""
        slurm = f"{c.slurm} ({c.reason})" if c.reason else c.slurm or "-"
        slurm += f", {c.progress}" if c.progress else ""
        slurm += f": {c.advice}" if c.advice else ""
        slurm += f" [preempted {c.preempted} time(s)]" if c.preempted else ""
        state = coloured(f"{c.state:{state_width}}", c.state)
        print(f"{c.cell_id:{width}} {c.strategy:{strategy_width}} {state} {c.job_id or '-':12}{more} {slurm}")
    if any(c.job_id and c.state not in IN_FLIGHT for c in rows):
        files = report.sweep_dir / SLURM_DIR / "<job>" / "<job>_<rank>_log.err"
        print(f"logs: `hpcfsdp logs {report.sweep_dir} CELL` ({files})")


def status_document(report: StatusReport) -> dict:
    """`status --json`: the counts and every cell (the table shows only those not ok)."""
    return {
        "sweep_dir": str(report.sweep_dir),
        "cluster": report.cluster,
        "exit_status": report.exit_status,
        "counts": dict(sorted(report.counts().items())),
        "cells": [
            {
                "cell_id": c.cell_id,
                "strategy": c.strategy,
                "status": str(c.state),
                "job_id": c.job_id,
                "slurm": c.slurm,
                "reason": c.reason or c.error,  # why it waits (squeue), else why it failed (its record)
                "advice": c.advice,
                "blocked": c.blocked,
                "preempted": c.preempted,
                "resources": c.resources,
                "progress": c.progress,
            }
            for c in report.cells
        ],
        "warnings": ([report.note] if report.note else []) + report.problems,
    }


def blocked_message(cells: list[CellStatus], cluster: str = "") -> str:
    """One line for cells Slurm holds with a reason that cannot clear: which, why, how to cancel."""
    by_reason: dict[str, list[str]] = {}
    for cell in cells:
        by_reason.setdefault(cell.reason, []).append(cell.cell_id)
    why = "; ".join(
        f"{reason}: {', '.join(ids[:3])}{f' and {len(ids) - 3} more' if len(ids) > 3 else ''}"
        for reason, ids in by_reason.items()
    )
    jobs = " ".join(sorted({c.job_id.split("_")[0] for c in cells}, key=lambda j: (len(j), j)))
    return (
        f"{len(cells)} cell(s) can never start as the cluster stands; Slurm holds them pending ({why}); "
        f"their jobs stay queued: `{' '.join(['scancel', *on_cluster(cluster), jobs])}` removes them"
    )


def record_lost_cells(report: StatusReport) -> list[CellStatus]:
    """Give each cell whose Slurm job left the queue without a record a record of its own.

    Such a cell was cancelled, killed with its node, killed for host memory, preempted, past its
    deadline, or crashed before training began (a failed rendezvous, an import error); its record
    names the job, how Slurm ended it where accounting or the logs tell (endings.py: the status
    `cancelled`, `timeout`, `node_fail`, `preempted`, `host_oom`, `deadline` or `boot_fail`, with
    `slurm_state` and `advice`; else `error`), and the tail of every rank's log, so that collect
    shows why.
    """
    lost = [c for c in report.cells if c.state == MISSING and c.job_id]
    if not lost:
        return lost
    finished = finished_jobs((c.job_id for c in lost), report.cluster)
    for cell in lost:
        status, error, fields = lost_ending(report.sweep_dir, cell.cell_id, cell.job_id, finished.get(cell.job_id))
        directory = cell_dir(report.sweep_dir, cell.cell_id)
        record_launch_failure(
            directory, error, log_tails(cell_logs(report.sweep_dir, cell.cell_id, cell.job_id)), status, **fields
        )
    return lost
