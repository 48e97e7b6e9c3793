"""Progress of work that can take a while (collect reading 10,000 records), on stderr: a bar
redrawn in place on a terminal, plain lines where stderr is a file (a Slurm log, CI), never escape
codes there. Silent for small work (a count below `min_count`, so that what a small sweep's
collect prints does not depend on how busy the machine is) and for work that ends soon (nothing
before `quiet_s`).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REDRAW_S = 0.2  # a terminal's bar at most this often
LINE_EVERY_S = 5.0  # in a log, a line at most this often
QUIET_S = 1.0


class Progress:
    """`what` done `n` of `total` times; `stage()` names a step that has no count."""

    def __init__(
        self, what: str, min_count: int = 0, stream: TextIO | None = None, quiet_s: float | None = None
    ) -> None:
        self.what, self.total, self.n = what, 0, 0
        self.min_count = min_count
        self.silent = False
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.shown_at: float | None = None  # when a line or bar was last drawn
        self.bar_open = False

    def count(self, total: int) -> None:
        """The work is `total` steps: below min_count, nothing is shown of it, nor of what follows."""
        self.total = total
        self.silent = total < self.min_count

    def advance(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.silent or now - self.started < self.quiet_s:
            return
        every = REDRAW_S if self.tty else LINE_EVERY_S
        if self.shown_at is None or now - self.shown_at >= every or self.n == self.total:
            self._draw(now)

    def stage(self, what: str) -> None:
        """A step without a count: one line, once the work has taken longer than quiet_s."""
        self._end_bar()
        self.what, self.total, self.n = what, 0, 0
        if not self.silent and time.monotonic() - self.started >= self.quiet_s:
            self._write(f"{what} ...\n")

    def done(self, label: str = "") -> None:
        """The end: the bar's line is ended, and what was long says how long it all took."""
        self._end_bar()
        elapsed = time.monotonic() - self.started
        if not self.silent and (self.shown_at is not None or elapsed >= self.quiet_s):
            self._write(f"{label or self.what}: done in {elapsed:.1f} s\n")

    def _draw(self, now: float) -> None:
        count = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        if self.tty:
            filled = BAR_WIDTH * self.n // max(1, self.total) if self.total else 0
            self._write(f"\r\033[K{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {count}")
            self.bar_open = True
        else:
            self._write(f"{self.what}: {count}\n")
        self.shown_at = now

    def _end_bar(self) -> None:
        if self.bar_open:
            self._write("\n")
            self.bar_open = False

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
