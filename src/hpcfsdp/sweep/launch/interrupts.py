"""Ctrl-C, SIGTERM and SIGHUP while `submit` runs: end what it started, keep what it recorded.

By default SIGTERM and SIGHUP end a Python process at once, without unwinding: the local
executor's torchrun (in a session of its own, so that the terminal's Ctrl-C reaches only submit)
would run on, orphaned, with no time limit, and a record set aside for a rerun would stay aside.
Inside `interrupts_raise` the three signals raise `Interrupted` instead, a KeyboardInterrupt, so
that the code that started something ends it on the way out. `interrupts_deferred` holds them
over a step that must finish or not start: sbatch queueing an array and the manifest naming it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """One of SIGNALS arrived; `exit_status` is the shell's 128 + signal number. `running_cell`:
    the cell the local executor was running when it arrived ("" when none was)."""

    running_cell = ""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _raise(signum, frame) -> None:
    raise Interrupted(signum)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted inside the block (main thread only)."""
    previous = {sig: signal.signal(sig, _raise) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGNALS until the block has ended, then raise Interrupted for the first that came
    (also when the block failed: the interrupt is what the user asked for)."""
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if arrived:
            raise Interrupted(arrived[0])
