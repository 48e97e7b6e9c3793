"""The processes of local launches, seen through /proc (Linux): those under a process, those a
launch marked with its folder (LAUNCH_DIR_ENV), and ending them; for the local executor and tune's
local probes, whose supervisor and ranks must never outlive the command that started them."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

LAUNCH_DIR_ENV = "HPCFSDP_LAUNCH_DIR"  # the folder of a launch, in each of its processes' environment
LOCAL_GRACE_S = 30.0  # local executor: from SIGTERM at the time limit to SIGKILL


def launched_in(folder: Path) -> dict[int, str]:
    """The live processes (pid -> start time) of launches made in `folder` (a cell folder or one
    above it) by the local executor, found by the LAUNCH_DIR_ENV it gave them: a supervisor and its ranks
    outlive a `tune` or `submit` killed by SIGKILL for a while (they end on the SIGTERM Linux
    sends, after recording `cancelled`), and no later launch must start beside them."""
    root = Path(os.path.realpath(folder))
    found = {}
    for pid, (_, started, state) in _proc_table().items():
        if pid == os.getpid() or state == "Z":
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        marks = [
            entry[len(LAUNCH_DIR_ENV) + 1 :] for entry in environ if entry.startswith(LAUNCH_DIR_ENV.encode() + b"=")
        ]
        if marks and Path(os.path.realpath(os.fsdecode(marks[0]))).is_relative_to(root):
            found[pid] = started
    return found


def end_launches_left(folder: Path, log: Callable[[str], None], grace_s: float = LOCAL_GRACE_S) -> None:
    """Wait for the processes a killed command's launch left in `folder` (launched_in) to end, up
    to grace_s (they got SIGTERM when it died), then end them with SIGKILL; say so in one line."""
    left = launched_in(folder)
    if not left:
        return
    pids = ", ".join(map(str, sorted(left)))
    log(
        f"waiting for {len(left)} process(es) of a launch a killed run left in {folder} (pids {pids}) to end "
        f"(SIGKILL after {grace_s:g} s) before launching anything there"
    )
    deadline = time.monotonic() + grace_s
    while _alive(left) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_survivors(left)
    while _alive(left):
        time.sleep(0.1)


def _alive(processes: dict[int, str]) -> bool:
    table = _proc_table()
    return any(pid in table and table[pid][1] == started and table[pid][2] != "Z" for pid, started in processes.items())


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, state: Z for a zombie, ended) of every process, from /proc (Linux)."""
    table = {}
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
            fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        table[int(pid)] = (int(fields[1]), fields[19], fields[0])
    return table


def processes_under(pid: int) -> dict[int, str]:
    """The processes under pid (children, theirs, ...): pid -> start time, which tells a process
    from a later one that reuses its pid."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, (parent, *_) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def kill_survivors(processes: dict[int, str]) -> None:
    table = _proc_table()
    for pid, started in processes.items():
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
