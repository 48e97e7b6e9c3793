"""What /proc says of a process on this machine (its start time, its state, its exit code), and
the exit codes of the peer ranks on this machine, caught the moment they exit.

A rank that a signal it cannot catch ended (SIGKILL) says nothing itself; its exit code is in
/proc/PID/stat only while it is a zombie, until its launcher reaps it. torchrun reaps within its
0.1 s poll, sends the survivors SIGTERM, and (torch 2.13) logs "failed (exitcode: -9)" only once
they have ended: a survivor that asks after the reaping learns nothing, and on a loaded machine
(two ranks on two cores) it asks late often enough. So the watchdog thread holds a pidfd of each
peer on this machine (Linux 5.3: readable once the process exits, for any process of the user,
not only a child), wakes on it, and reads the exit code while the process is still a zombie.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat), which tells it from a
    later process that reuses its pid; "" where it cannot be read."""
    fields = _stat(pid)
    return fields[19] if fields else ""


def process_state(pid: int, start: str) -> tuple[str, int] | None:
    """(state letter, exit code as waitpid reports it) of the process that started at `start`;
    None when it is gone (reaped, or its pid reused). The kernel sets the exit code as the process
    begins to exit, before it closes its sockets: a peer that sees the connection drop reads the
    signal here even while the process is still ending, not yet a zombie."""
    fields = _stat(pid)
    if fields is None or (start and fields[19] != start):
        return None
    exit_code = int(fields[49]) if len(fields) > 49 and fields[49].isdigit() else 0
    return fields[0], exit_code


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name: state is [0], starttime [19], exit_code [49]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class PeerExits:
    """pidfds of peer processes on this machine, and the exit code of each that exited while
    watched. `watch`, `fds` and `exited` are the watchdog thread's; `code` may be asked from any."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[int, str]] = {}  # pidfd -> (pid, process start)
        self._codes: dict[int, int] = {}  # pid -> exit code as waitpid reports it

    def watch(self, pid: int, start: str) -> None:
        """Watch the process that started at `start`; nothing where it is gone already or the
        kernel has no pidfds (before 5.3)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if process_start(pid) != start:  # its pid taken by a later process
            os.close(fd)
            return
        self._watched[fd] = (pid, start)

    def fds(self) -> list[int]:
        return list(self._watched)

    def exited(self, ready: list[int]) -> None:
        """Read the exit code of each watched process whose pidfd is readable, and stop watching it."""
        for fd in ready:
            pid, start = self._watched.pop(fd)
            state = process_state(pid, start)
            if state is not None:
                self._codes[pid] = state[1]
            os.close(fd)

    def code(self, pid: int) -> int | None:
        """The exit code caught for pid, or None."""
        return self._codes.get(pid)

    def close(self) -> None:
        for fd in self._watched:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watched.clear()
