"""Each rank's heartbeat in the cell's folder, and which peer a failing rank's trouble came from.

A rank that dies by a signal it cannot catch (SIGKILL: the kernel's OOM killer, kill -9) writes
nothing, and one that is stopped (SIGSTOP) runs nothing at all. Its peers see only the effect: a
collective fails ("Connection reset by peer"), their launcher's SIGTERM comes (torchrun ends the
survivors once a rank died), or a step runs past its deadline. Left to themselves they record that
effect, under their own rank: a time limit, or a hang of the rank that was still working.

So every rank keeps a file `heartbeats/rank<N>.json` in the cell's folder (its launch, pid, node,
machine and the process's start time), and the watchdog thread touches it every half second: its
mtime is the last beat. A rank that leaves by itself (its record written) says so in the file. When
a rank meets such an effect it asks `peer_trouble`, which looks at every other rank of the launch
that has not left: on this machine the process itself (gone, a zombie with its signal, stopped),
elsewhere whether its beat still moves; and a crash's signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE,
SIGILL), which faulthandler writes into `rank<N>.fault` before the process dies. The record then
names that rank, and its signal where one is known.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...contracts.files import RecordError, read_json_object, write_json
from ...contracts.fs.beneath import make_folders, matching, open_for_writing, read_file
from ...contracts.record import FailedRecord
from .processes import PeerExits, process_start, process_state

HEARTBEATS_DIR = "heartbeats"
BEAT_S = 0.5  # how often the watchdog touches the rank's file
STILL_S = 2.0  # a beat that has not moved for this long (four beats missed) means the rank stopped
KMSG_BYTES = 4 << 20  # the most of the kernel's log read for an OOM killer's line
# What a rank got, in its record, when a SIGTERM came after a peer died or stopped: no time limit.
LAUNCHERS_SIGTERM = "received SIGTERM from its launcher"
LOG_TAIL_BYTES = 256 << 10  # the end of this rank's output file read for torchrun's line
# How faulthandler ("Fatal Python error: Segmentation fault") and srun ("task 1: Killed") name a
# signal (the C library's strsignal), and the signal's name.
SIGNAL_WORDS = {
    "Killed": "SIGKILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}


@dataclass(frozen=True)
class PeerTrouble:
    """Why the cell failed, as a peer's heartbeat tells it: the rank, its status and signal."""

    rank: int
    status: str  # error (died), hang (stopped answering), host_oom (the kernel's OOM killer)
    message: str
    signal: str | None = None


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat file as read, with its mtime (the last beat)."""

    launch: str
    rank: int
    pid: int
    node: str
    machine: str
    start: str
    left: bool
    beat: float
    path: Path

    @property
    def who(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.node})"


class Heartbeat:
    """This rank's heartbeat file: written at start, touched by `beat`, marked by `left`."""

    def __init__(self, cell_dir: Path, launch: str, rank: int, node: str, world_size: int = 1, local_peers: int = 0):
        self.folder = cell_dir / HEARTBEATS_DIR
        self.launch, self.rank = launch, rank
        self.path = self.folder / f"rank{rank}.json"
        self._fields = {
            "launch_id": launch,
            "rank": rank,
            "pid": os.getpid(),
            "node": node,
            "machine": socket.gethostname(),
            "start": process_start(os.getpid()),
        }
        self._fault: IO[str] | None = None
        # The peers on this machine, watched for their exit (processes.py) once their files are read.
        self.exits = PeerExits()
        self._unread = {r for r in range(world_size) if r != rank}
        self._local_peers = local_peers
        with contextlib.suppress(OSError):  # a folder it cannot write: no heartbeat, the cell runs on
            make_folders(self.folder)
            write_json(self.path, {**self._fields, "left": False})
            # A crash's signal and stack, written by the C handler before the process dies.
            fault = open_for_writing(self.folder / f"rank{rank}.fault")  # never through a link
            self._fault = os.fdopen(fault, "w")
            faulthandler.enable(self._fault)

    def beat(self) -> None:
        """Touch this rank's file; until every peer on this machine is watched, read the files of
        the peers not yet found (a file missing, half written or of another launch: again next beat)."""
        with contextlib.suppress(OSError):
            os.utime(self.path)
        if self._local_peers:
            self._watch_new_peers()

    def _watch_new_peers(self) -> None:
        here = socket.gethostname()
        for rank in sorted(self._unread):
            beat = _read_beat(self.folder / f"rank{rank}.json")  # None where it cannot be read
            if beat is None or beat.launch != self.launch:
                continue
            self._unread.discard(rank)
            if beat.machine == here:
                self._local_peers -= 1
                self.exits.watch(beat.pid, beat.start)

    def left(self) -> None:
        """This rank leaves by itself, its record written: no peer blames it for being gone."""
        with contextlib.suppress(OSError):
            write_json(self.path, {**self._fields, "left": True})

    def peer_trouble(self, status: str) -> PeerTrouble | None:
        """The first other rank of this launch that died, crashed or stopped answering, or None.
        `status` is what a peer on another machine whose beat stopped is recorded as: from there
        a rank that died and one that stopped look alike."""
        peers = [b for b in read_beats(self.folder, self.launch) if b.rank != self.rank and not b.left]
        here = socket.gethostname()
        found = [t for b in peers if b.machine == here and (t := _local_trouble(b, self.exits)) is not None]
        if found:
            return found[0]
        elsewhere = [b for b in peers if b.machine != here]
        if not elsewhere:
            return None
        time.sleep(STILL_S)  # does each beat still move?
        for earlier in elsewhere:
            now = _read_beat(earlier.path)
            if now is not None and not now.left and now.beat == earlier.beat:
                age = time.time() - now.beat
                return PeerTrouble(
                    now.rank,
                    status,
                    f"{now.who} stopped answering: its heartbeat stopped {age:.0f} s ago (it died or was stopped)",
                )
        return None


def read_beats(folder: Path, launch: str) -> list[Beat]:
    """The heartbeats of one launch in a cell's heartbeats folder, in rank order."""
    beats = [_read_beat(path) for path in matching(folder, "rank*.json")]
    return sorted((b for b in beats if b is not None and b.launch == launch), key=lambda b: b.rank)


def _read_beat(path: Path) -> Beat | None:
    try:
        fields: dict[str, Any] = read_json_object(path, kind="heartbeat")
        mtime = path.stat().st_mtime
        return Beat(
            str(fields["launch_id"]),
            int(fields["rank"]),
            int(fields["pid"]),
            str(fields["node"]),
            str(fields["machine"]),
            str(fields["start"]),
            bool(fields["left"]),
            mtime,
            path,
        )
    except (RecordError, OSError, KeyError, TypeError, ValueError):  # half written, or not ours
        return None


def _local_trouble(beat: Beat, exits: PeerExits) -> PeerTrouble | None:
    """A peer on this machine: its crash's signal, its process gone (killed: the exit code caught
    as it exited, else the launcher's word), a zombie's signal, or stopped."""
    crash = crash_signal(beat.path.with_suffix(".fault"))
    if crash:
        where = beat.path.with_suffix(".fault").name
        return PeerTrouble(beat.rank, "error", f"{beat.who} died of {crash} (its stack: {where})", crash)
    caught = exits.code(beat.pid)
    state = process_state(beat.pid, beat.start) or (None if caught is None else ("X", caught))
    if state is not None and state[0] in "Tt":
        stopped = f"{beat.who} stopped answering: its process is stopped (SIGSTOP)"
        return PeerTrouble(beat.rank, "hang", stopped, "SIGSTOP")
    if state is None or state[1] or state[0] in "ZX":  # gone, or ending (the kernel set its exit code)
        killed = signal_name(state[1] & 0x7F) if state else launcher_said(beat.pid, beat.rank)
        if killed in (None, "SIGKILL") and oom_killed(beat.pid):
            return PeerTrouble(
                beat.rank, "host_oom", f"{beat.who} was killed by the kernel's OOM killer (host memory)", "SIGKILL"
            )
        if killed:
            return PeerTrouble(beat.rank, "error", f"{beat.who} was killed by {killed}", killed)
        if state:
            return PeerTrouble(beat.rank, "error", f"{beat.who} exited with status {state[1] >> 8} without a record")
        return PeerTrouble(
            beat.rank,
            "error",
            f"{beat.who} died without a record: its process is gone, ended by a signal it cannot catch "
            "(SIGKILL: kill -9, or an OOM killer whose log this rank cannot read)",
        )
    if time.time() - beat.beat > 2 * STILL_S + BEAT_S:
        age = time.time() - beat.beat
        return PeerTrouble(beat.rank, "hang", f"{beat.who} stopped answering: its heartbeat stopped {age:.0f} s ago")
    return None


def crash_signal(fault_file: Path) -> str | None:
    """The signal faulthandler wrote of a crash ("Fatal Python error: Segmentation fault"), or None."""
    try:
        text = read_file(fault_file, 1 << 20).decode(errors="replace")[:4096]
    except OSError:
        return None
    found = re.search(r"Fatal Python error: ([A-Za-z -]+)", text)
    return SIGNAL_WORDS.get(found.group(1).strip()) if found else None


def signal_name(number: int) -> str | None:
    if not number:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launcher_said(pid: int, rank: int) -> str | None:
    """The signal the launcher says ended a rank that is gone, where this rank's output goes to the
    file the launcher writes to: torchrun's "failed (exitcode: -9) local_rank: 1 (pid: 4242)" (a
    cell's log.txt; written as it reaps the rank, before it sends the others SIGTERM), or srun's
    "srun: error: n2: task 1: Killed" (the first task's stderr under submitit; srun writes it once
    the rank's node reports, so it is waited for up to STILL_S). None where neither says."""
    torchrun = re.compile(rf"failed \(exitcode: -(\d+)\) local_rank: \d+ \(pid: {pid}\)")
    srun = re.compile(rf"srun: error: \S+: task {rank}: ({'|'.join(SIGNAL_WORDS)})")
    deadline = time.monotonic() + (STILL_S if "SLURM_JOB_ID" in os.environ else 0)
    while True:
        text = own_output_tail()
        if found := torchrun.search(text):
            return signal_name(int(found.group(1)))
        if found := srun.search(text):
            return SIGNAL_WORDS[found.group(1)]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def own_output_tail() -> str:
    """The end of the files this process's stderr and stdout go to ("" for a pipe or terminal)."""
    tails = []
    for fd in (2, 1):
        try:
            # The file this process writes to, reopened as /proc names it: no name in a folder.
            with open(f"/proc/self/fd/{fd}", "rb") as log:
                info = os.fstat(log.fileno())
                if not stat.S_ISREG(info.st_mode):
                    continue
                log.seek(max(0, info.st_size - LOG_TAIL_BYTES))
                tails.append(log.read().decode(errors="replace"))
        except (OSError, ValueError):  # no /proc, a file gone
            continue
    return "\n".join(tails)


def oom_killed(pid: int) -> bool:
    """The kernel's log says its OOM killer killed pid ("Killed process PID", "oom-kill:...pid=PID");
    False where the log cannot be read (kernel.dmesg_restrict, a container)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    pattern = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    read = 0
    try:
        while read < KMSG_BYTES:
            try:
                entry = os.read(fd, 8192)
            except BlockingIOError:  # the end of the log
                return False
            except OSError:  # EPIPE: an entry overwritten while reading; read on
                continue
            if not entry:
                return False
            read += len(entry)
            if pattern.search(entry.decode(errors="replace")):
                return True
        return False
    finally:
        os.close(fd)


def blamed(record: FailedRecord, peer: PeerTrouble) -> FailedRecord:
    """A failure record of this rank made the peer's: the peer's status, rank and signal, its
    story first and what this rank met after it."""
    record["error"] = f"{peer.message}; then, on rank {record.get('failed_rank')}: {record.get('error')}"
    record["status"], record["failed_rank"] = peer.status, peer.rank
    if peer.signal:
        record["failed_signal"] = peer.signal
    return record
