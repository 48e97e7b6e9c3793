"""Progress of work that can take a while (collect reading 10,000 records), on stderr: a bar
redrawn in place on a terminal, plain lines where stderr is a file (a Slurm log, CI), never escape
codes there. Silent for small work (a count below `min_count`, so that what a small sweep's
collect prints does not depend on how busy the machine is) and for work that ends soon (nothing
before `quiet_s`). Also the one way a cell's state is coloured on a terminal (`coloured`), and a
span of time as people read it (`duration`). And the one way what the CLI prints reaches the
terminal (`escaped_output`): with every control character escaped, whatever file it came from.
"""

from __future__ import annotations

import io
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

from .contracts.names import printable_text

# A cell state's colour on a terminal (SGR codes): ok green, in flight yellow / cyan, never run or
# unreadable magenta, every other ending (oom, error, hang, timeout, ...) red.
STATE_COLOURS = {"ok": "32", "running": "36", "pending": "33", "missing": "35", "corrupt": "35", "stale": "35"}
FAILED_COLOUR = "31"

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


def colour_on(stream: TextIO) -> bool:
    """Whether to colour what goes to `stream`: a terminal, and NO_COLOR unset or empty (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def coloured(text: str, state: str, stream: TextIO | None = None) -> str:
    """`text` (a cell state, perhaps padded to its column) in the state's colour where `stream`
    (stdout by default) is a terminal; as it is in a file, a pipe or with NO_COLOR."""
    if not colour_on(stream or sys.stdout):
        return text
    return f"\033[{STATE_COLOURS.get(state, FAILED_COLOUR)}m{text}\033[0m"


def error_lines(text: str, stream: TextIO) -> str:
    """Lines for stderr with each leading `error:` in red where `stream` is a terminal and NO_COLOR
    is unset; as they are in a file, a pipe or with NO_COLOR."""
    if not colour_on(stream):
        return text
    return "\n".join(
        f"\033[{FAILED_COLOUR};1merror:\033[0m{line[6:]}" if line.startswith("error:") else line
        for line in text.split("\n")
    )


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a span of time as a person reads it."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


# The terminal codes hpcfsdp writes itself, passed as they are on a terminal (and only there): a
# state's colour and its end (coloured), error_lines' bold red, the bar's return and line erase
# (Progress). A file's text can at most colour itself with them; every other code it holds is escaped.
_SGR = "|".join(sorted({*STATE_COLOURS.values(), FAILED_COLOUR, f"{FAILED_COLOUR};1", "0"}, key=len, reverse=True))
OWN_CODES = re.compile(f"(\033\\[(?:{_SGR})m|\r\033\\[K)")


class EscapedStream:
    """A text stream whose writes go through names.printable_text: no control character that a
    file held (a record's `advice`, a spec's strategy, a cell folder's name) reaches the terminal as
    a command. On a terminal, OWN_CODES pass as they are."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        try:
            self.keeps_own_codes = stream.isatty()
        except (AttributeError, ValueError):  # a closed or a bare stream
            self.keeps_own_codes = False

    def write(self, text: str) -> int:
        if self.keeps_own_codes:
            parts = OWN_CODES.split(text)  # the codes at odd places
            text = "".join(part if index % 2 else printable_text(part) for index, part in enumerate(parts))
        else:
            text = printable_text(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def escaped_output() -> Iterator[None]:
    """sys.stdout and sys.stderr are EscapedStreams while the block runs (a command of the CLI),
    and line-buffered as on a terminal: into a pipe or a file too each line goes out as it is
    printed, so that a command killed outright (SIGKILL, the OOM killer) has left every line it
    printed, and `| tee` shows a long tune or submit --wait as it goes (Python block-buffers them
    there unless PYTHONUNBUFFERED is set)."""
    saved = sys.stdout, sys.stderr
    buffered = [s for s in saved if isinstance(s, io.TextIOWrapper) and not s.line_buffering]
    for stream in buffered:
        stream.reconfigure(line_buffering=True)
    sys.stdout, sys.stderr = (s if isinstance(s, EscapedStream) else EscapedStream(s) for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for stream in buffered:
            with suppress(ValueError):  # closed meanwhile
                stream.reconfigure(line_buffering=False)
