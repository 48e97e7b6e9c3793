"""`status --watch` and `submit --wait`: the progress bar redrawn until no cell is in flight (or
every one in flight is stuck), with the elapsed time and an ETA. Each look reads the cells through
status.py with one slurm.Watcher: squeue and sacct once per look for the whole sweep, and never
sacct again about a job it saw settled.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ...contracts.files import RecordError
from ...contracts.record import CellState
from ...progress import coloured, duration
from ...slurm import Watcher
from ..folder.layout import read_manifest
from .status import IN_FLIGHT, StatusReport, sweep_status

RUNNING_SHOWN = 3  # the running cells whose step a watch's line shows
SCHEDULER_PATIENCE_S = 300.0  # how long watch keeps asking a scheduler that does not answer


def progress_line(report: StatusReport, width: int = 30, timing: str = "", stream: TextIO | None = None) -> str:
    """The bar, the counts by state (coloured where `stream` is a terminal), `timing` (elapsed, ETA),
    then what each running cell's rank 0 last said of itself (its step)."""
    counts = report.counts()
    total = len(report.cells)
    finished = total - sum(counts[s] for s in IN_FLIGHT)
    filled = width * finished // max(1, total)
    states = ", ".join(f"{coloured(state, state, stream)} {n}" for state, n in sorted(counts.items()))
    line = f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{total} finished ({states})"
    line += f", {timing}" if timing else ""
    running = [f"{c.cell_id} {c.progress}" for c in report.cells if c.state == CellState.RUNNING and c.progress]
    more = f" and {len(running) - RUNNING_SHOWN} more" if len(running) > RUNNING_SHOWN else ""
    return line + (f"; {', '.join(running[:RUNNING_SHOWN])}{more}" if running else "")


@dataclass
class _Clock:
    """A watch's elapsed time and ETA: from when the cells in flight at its first look were queued
    (the manifest's submitted_at), the ETA from how fast those of them that finished did."""

    start: float
    batch: set[str]

    @classmethod
    def first_look(cls, report: StatusReport) -> _Clock:
        batch = {c.cell_id for c in report.cells if c.state in IN_FLIGHT}
        try:
            manifest = read_manifest(report.sweep_dir)
        except RecordError:
            manifest = {}
        queued = [manifest.get(cid, {}).get("submitted_at") for cid in batch]
        now = time.time()
        return cls(min([t for t in queued if isinstance(t, (int, float)) and t <= now], default=now), batch)

    def timing(self, report: StatusReport) -> str:
        elapsed = time.time() - self.start
        done = sum(c.cell_id in self.batch and c.state not in IN_FLIGHT for c in report.cells)
        left = sum(c.state in IN_FLIGHT for c in report.cells)
        eta = f", ETA {duration(elapsed * left / done)}" if done and left else ""
        return f"{duration(elapsed)} elapsed{eta}"


def watch(
    sweep_dir: Path,
    interval_s: float,
    cell_ids: Iterable[str] | None = None,
    stream: TextIO | None = None,
    patience_s: float = SCHEDULER_PATIENCE_S,
) -> StatusReport:
    """Redraw a progress bar (on stderr) every interval_s until no cell is pending or running, or
    until every one still in flight waits on a reason that cannot clear (report.stuck), two looks
    in a row (a reason seen once may be the scheduler's passing word).

    A busy slurmctld can time out one squeue ("Socket timed out on send/recv"); taking that for
    "nothing queued" would end a wait while cells still run. So an unanswered squeue is asked again,
    with a warning, and watch gives up (the report then carries the note) only after patience_s.

    One slurm.Watcher asks Slurm for every look: one squeue and at most one sacct per look for the
    whole sweep, and sacct never again about a job it saw settled.
    """
    cell_ids = None if cell_ids is None else list(cell_ids)
    stream = stream or sys.stderr
    tty = stream.isatty()
    last = ""
    unanswered_since: float | None = None
    stuck_before = False
    watcher = Watcher()
    clock: _Clock | None = None
    while True:
        watcher.poll()
        report = sweep_status(sweep_dir, cell_ids, watcher)
        if report.note:
            if unanswered_since is None:
                unanswered_since = time.monotonic()
            if time.monotonic() - unanswered_since >= patience_s:
                return report
            clear = "\r\033[K" if tty else ""
            stream.write(f"{clear}warning: {report.note} (asking again in {interval_s:g} s)\n")
            stream.flush()
            last = ""
            time.sleep(interval_s)
            continue
        unanswered_since = None
        clock = clock or _Clock.first_look(report)
        timing = clock.timing(report)
        if tty:
            stream.write(f"\r\033[K{progress_line(report, timing=timing, stream=stream)}")
        elif (line := progress_line(report)) != last:  # in a log, a line when a cell moved on, with the time then
            stream.write(f"{progress_line(report, timing=timing)}\n")
            last = line
        stream.flush()
        if not report.in_flight or (report.stuck and stuck_before):
            if tty:
                stream.write("\n")
            return report
        stuck_before = report.stuck
        time.sleep(interval_s)
