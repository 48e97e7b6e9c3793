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
from typing import Literal

from ...contracts.files import lock_holder, open_lock, write_lock_note
from ..folder.layout import SUBMIT_LOCK_NAME as LOCK_NAME


@contextmanager
def sweep_lock(sweep_dir: Path, log: Callable[[str], None], command: Literal["submit", "tune"]) -> Iterator[None]:
    """Hold the sweep folder's submit lock for `command`; if another process holds it, say once
    which command it is, and wait. The lock file is never a link nor a file hpcfsdp did not make
    (files.open_lock)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd = open_lock(sweep_dir / LOCK_NAME)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, note = lock_holder(fd)
            log(
                f"another `hpcfsdp {holder or 'submit or tune'}` of {sweep_dir} is running ({note or 'no note'}); "
                "waiting for it to finish (Ctrl-C to stop waiting)"
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        since = time.strftime("%Y-%m-%d %H:%M:%S %z")  # with the offset: readers elsewhere see the zone
        write_lock_note(fd, f"{command}: pid {os.getpid()} on {os.uname().nodename}, since {since}")
        try:
            yield
        finally:
            write_lock_note(fd, "")
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
