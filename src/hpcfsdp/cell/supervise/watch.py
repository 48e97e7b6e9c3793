"""What the supervisor sees of one rank's process from outside it: its exit status, the signal that
ended it, a stop (/proc/PID/stat state T), a heartbeat that no longer moves, and whether the kernel's
OOM killer ended it. An `Ending` says what the cell's record says when the rank cannot."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...contracts.files import RecordError, read_json_object
from ..stopping.heartbeats import BEAT_S, HEARTBEATS_DIR, oom_killed, signal_name
from ..stopping.processes import process_state
from .cgroup import oom_kills


@dataclass(frozen=True)
class Ending:
    """Why the cell ends, as its supervisor saw it of one rank: the record's status, error and
    failed_* fields."""

    status: str  # error, hang or host_oom
    rank: int
    pid: int
    node: str
    message: str  # after "rank R (pid P on NODE) "
    signal: str | None = None

    @property
    def error(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.node}) {self.message}"


@dataclass
class RankProcess:
    """One rank the supervisor started (a child of its process, forked or spawned: start.py; in a
    session of its own: its process group is its own and its children's) and what has been seen of it."""

    rank: int
    pid: int
    node: str
    started: float = field(default_factory=time.time)
    stopped_since: float | None = None
    ended_by_supervisor: bool = False
    returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit as subprocess.Popen.poll says it (-N: ended by signal N); None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): Popen's answer
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def signal_group(self, signum: int) -> None:
        """The rank and every process it started (compile workers, data loaders)."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def heartbeat_age(self, cell_dir: Path) -> float | None:
        """Seconds since the rank's watchdog last touched its heartbeat (written once its process
        group formed, touched every BEAT_S); None before it exists or once the rank left."""
        path = cell_dir / HEARTBEATS_DIR / f"rank{self.rank}.json"
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return None
        age = time.time() - mtime
        if mtime < self.started or (age > BEAT_S * 4 and _left(path)):  # an earlier launch's, or done
            return None
        return age


def _left(path: Path) -> bool:
    try:
        return bool(read_json_object(path, kind="heartbeat").get("left"))
    except (RecordError, OSError):
        return False


def exit_ending(rank: RankProcess, code: int, oom_before: int | None) -> Ending | None:
    """What a rank's exit says: its signal (the OOM killer's SIGKILL told apart), a non-zero status;
    None for exit 0 (whether its record was written is asked once every rank has left)."""
    if code == 0:
        return None
    if code > 0:
        return Ending("error", rank.rank, rank.pid, rank.node, f"exited with status {code}")
    name = signal_name(-code) or f"signal {-code}"
    if -code == signal.SIGKILL and _oom_killed(rank.pid, oom_before):
        return Ending(
            "host_oom", rank.rank, rank.pid, rank.node, "was killed by the kernel's OOM killer (host memory)", name
        )
    return Ending("error", rank.rank, rank.pid, rank.node, f"was killed by {name}", name)


def _oom_killed(pid: int, oom_before: int | None) -> bool:
    now = oom_kills()
    return (now is not None and oom_before is not None and now > oom_before) or oom_killed(pid)


def live_ending(rank: RankProcess, cell_dir: Path, hang_s: float, now: float) -> Ending | None:
    """A rank still running that counts as hung: stopped (SIGSTOP, or Slurm's suspend of this rank
    alone) for hang_s, or its heartbeat still for hang_s (its whole process frozen: the watchdog
    thread that would end a hung step does not run either)."""
    state = process_state(rank.pid, "")
    if state is not None and state[0] in "Tt":
        rank.stopped_since = rank.stopped_since or now
        if now - rank.stopped_since >= hang_s:
            stopped = f"stopped answering: its process is stopped (SIGSTOP) for {now - rank.stopped_since:.0f} s"
            return Ending("hang", rank.rank, rank.pid, rank.node, stopped, "SIGSTOP")
        return None
    rank.stopped_since = None
    age = rank.heartbeat_age(cell_dir)
    if age is not None and age >= max(hang_s, 4 * BEAT_S):
        return Ending(
            "hang", rank.rank, rank.pid, rank.node, f"stopped answering: its heartbeat stopped {age:.0f} s ago"
        )
    return None
