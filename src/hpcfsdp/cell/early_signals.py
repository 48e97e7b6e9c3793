"""Slurm's signals that reach a cell before its own handlers are in place are held, then given to
those handlers.

A cell spends its first seconds importing torch and forming its process group. A time limit's
SIGUSR2 or a cancel's SIGTERM in that window would end it without a record (the default action,
or submitit's handler raising in the middle of an import), and the sweep would only learn that
the job failed. So the entry points hold both signals from their first line (`held`), and once
signals.handle_time_limit is installed the cell delivers what was held (`release`, then
`signal.raise_signal`): it records timeout or cancelled at stage `setup`, or is requeued, as it
would have been a minute later. Imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

HELD_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
_found: dict[int, Any] = {}  # the handlers hold() replaced: submitit's, which handle_time_limit chains to
_held: list[int] = []


def hold() -> None:
    """From now on, keep SIGTERM and SIGUSR2 for `release` instead of acting on them."""
    if _found:  # already holding (a submitit task passes through two entry points)
        return
    for sig in HELD_SIGNALS:
        _found[sig] = signal.getsignal(sig)
        signal.signal(sig, lambda signum, frame: _held.append(signum))


def release() -> list[int]:
    """Put back the handlers `hold` found and return the signals held meanwhile, each once, in
    the order they came (none if nothing was held)."""
    for sig, handler in _found.items():
        signal.signal(sig, handler)
    _found.clear()
    held = list(dict.fromkeys(_held))
    _held.clear()
    return held


@contextlib.contextmanager
def held() -> Iterator[None]:
    """`hold` for the block. Where the block ends before the cell released them (a bad argument, a
    cell an earlier run finished), the handlers found are put back and what was held goes to them:
    nothing stays held in the process, and a signal that came meanwhile still acts."""
    hold()
    try:
        yield
    finally:
        for sig in release():
            signal.raise_signal(sig)
