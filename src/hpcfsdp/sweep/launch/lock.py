"""One `submit` at a time per sweep folder: an exclusive flock on <sweep>/.submit.lock.

Two submits of one YAML at once would both see every cell unqueued, both queue it, and the
manifest would keep only one of the arrays. With the lock, the second waits until the first has
queued its cells and written the manifest, then finds them in flight and queues nothing twice.
The kernel drops the lock when its holder exits, however it ends, so a killed submit leaves
nothing to clean up. flock works across the nodes of NFSv4 and Lustre (mounted with flock)
file systems.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..folder.layout import SUBMIT_LOCK_NAME as LOCK_NAME


@contextmanager
def sweep_lock(sweep_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the sweep folder's submit lock; if another process holds it, say so once and wait."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            log(
                f"another `hpcfsdp submit` of {sweep_dir} is running ({holder}); waiting for it to finish "
                "(Ctrl-C to stop waiting)"
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
