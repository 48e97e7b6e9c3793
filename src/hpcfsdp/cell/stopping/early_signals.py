"""Slurm's signals that reach a cell before its own handlers are in place are held by the kernel,
then given to those handlers.

A cell spends its first seconds importing torch and forming its process group. A time limit's
SIGUSR2 or a cancel's SIGTERM in that window would end it without a record (the default action,
or submitit's handler raising in the middle of an import), and the sweep would only learn that
the job failed. So the entry points block both signals from their first line (`held`): the
kernel keeps them pending. Once signals.handle_time_limit is installed the cell unblocks them
(`release`) and they arrive there: it records timeout or cancelled at stage `setup`, or is
requeued, as it would have been a minute later. Imports nothing heavy: it runs before torch.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

HELD_SIGNALS = {signal.SIGTERM, signal.SIGUSR2}


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Block SIGTERM and SIGUSR2 for the block. At its end the mask found is put back, so that
    where the cell did not release them (a refused argument, a cell an earlier run finished)
    nothing stays blocked and a signal that came meanwhile still reaches the handler in place."""
    found = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, found)


def release() -> None:
    """Unblock the held signals: one that came meanwhile reaches the handler in place now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
