"""One `submit` at a time per sweep folder: an exclusive flock on <sweep>/.submit.lock.

Two submits of one YAML at once would both see every cell unqueued, both queue it, and the
manifest would keep only one of the arrays. With the lock, the second waits until the first has
queued its cells and written the manifest, then finds them in flight and queues nothing twice.
The kernel drops the lock when its holder exits, however it ends, so a killed submit leaves
nothing to clean up. flock works across the nodes of NFSv4 and Lustre (mounted with flock)
file systems. The wait is bounded (WAIT_S): a lock held longer (a local submit running its
cells, or another user's process holding the file open) is refused in one line naming its
holder's pid and user (contracts/locks.py).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from ...contracts.errors import UserError
from ...contracts.files import LockBusy, open_lock, take_lock
from ...contracts.fs.beneath import make_folders
from ...contracts.fs.ownership import lock_holder, user_name, write_lock_note
from ..folder.guards import check_sweep_folder
from ..folder.layout import SUBMIT_LOCK_NAME as LOCK_NAME

WAIT_S = 600.0  # how long a submit or tune waits for another one of the same folder


@contextmanager
def sweep_lock(sweep_dir: Path, log: Callable[[str], None], command: Literal["submit", "tune"]) -> Iterator[None]:
    """Hold the sweep folder's submit lock for `command`; if another process holds it, say once
    which it is, and wait up to WAIT_S seconds. The folder is the user's (check_sweep_folder);
    the lock file is never a link nor a file hpcfsdp did not make (locks.open_lock)."""
    make_folders(sweep_dir)
    check_sweep_folder(sweep_dir)
    lock = sweep_dir / LOCK_NAME
    fd = open_lock(lock)
    try:
        try:
            take_lock(
                fd,
                lock,
                WAIT_S,
                lambda holder: log(
                    f"another `hpcfsdp {lock_holder(fd)[0] or 'submit or tune'}` of {sweep_dir} is running "
                    f"({lock_holder(fd)[1] or holder}); waiting for it to finish "
                    f"(up to {WAIT_S:g} s; Ctrl-C to stop waiting)"
                ),
            )
        except LockBusy as exc:
            raise UserError(f"{exc} (another submit or tune of this folder: try again when it ends)") from None
        since = time.strftime("%Y-%m-%d %H:%M:%S %z")  # with the offset: readers elsewhere see the zone
        user = user_name(os.geteuid())
        write_lock_note(fd, f"{command}: pid {os.getpid()} of {user} on {os.uname().nodename}, since {since}")
        try:
            yield
        finally:
            write_lock_note(fd, "")
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
