"""A rank that cannot end itself is ended by a thread of its own: the watchdog.

Two things kept the ranks of a failed cell alive on GPUs. Python runs a signal handler only
between bytecodes of the main thread, so a rank blocked in CUDA or NCCL (waiting for a peer that
failed) never ran signals.py's handler: torchrun's, scancel's or the time limit's SIGTERM did not
end it. And a step that never ends (a peer that hangs) had nothing to end it but the time limit.

The watchdog needs nothing of the main thread. CPython's C-level handler writes every signal to
a wakeup fd the moment it arrives (signal.set_wakeup_fd), whatever the main thread is blocked in,
and the watchdog reads it; it also holds the deadline of the step in progress (StepDeadlines).
When a signal came and the main thread has not finished within GRACE_S, or a step runs past its
deadline, the watchdog writes the cell's record itself (`end`) and leaves the process: its
communicators aborted, no collective waited for, os._exit. The launcher (torchrun, or srun's
--kill-on-bad-exit) then ends the other ranks, whose own watchdogs end them in turn.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ...contracts.spec import LAUNCH_ID_ENV
from .heartbeats import BEAT_S, LAUNCHERS_SIGTERM, PeerTrouble
from .processes import PeerExits

GRACE_S = 5.0  # from a signal to the watchdog ending a rank whose main thread did not end it
PEER_DEFER_S = 3.0  # a rank waiting inside a collective lets the rank that stopped answering write first
ABORT_WAIT_S = 3.0  # how long leaving waits for the communicators' abort (it may block on a dead peer)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# hpcfsdp's own frames are those below its package's folder: not any path with "/hpcfsdp/" in it, as
# the torch of a venv in a checkout cloned as hpcfsdp (~/hpcfsdp/.venv/lib/...) has.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep

# end(status, message, stack, peer): write the cell's failure record (unless an earlier one stands);
# peer: the rank the trouble came from (heartbeats.py), when it was another.
End = Callable[[str, str, str, "PeerTrouble | None"], None]
# blame(status): the peer that died or stopped answering, if one did (Heartbeat.peer_trouble).
Blame = Callable[[str], "PeerTrouble | None"]
# on_signal(signum) -> (status, message) of the record a signal means, or None: not the watchdog's to end.
SignalOutcome = Callable[[int], "tuple[str, str] | None"]


@dataclass
class StepDeadlines:
    """How long a step may run before the rank counts as hung.

    The first step (compile, warm-up, the first collectives) may take init_timeout_s; a later one
    train_timeout_s more than the slowest step so far, so that a model whose steps take minutes
    is never called hung for being slow (torchtitan's timeouts are per collective: 300 s, then 100 s).
    """

    init_timeout_s: float
    train_timeout_s: float
    slowest_s: float = 0.0
    ended: int = 0

    def step_ended(self, seconds: float) -> None:
        self.ended += 1
        self.slowest_s = max(self.slowest_s, seconds)

    @property
    def limit_s(self) -> float:
        return self.init_timeout_s if self.ended == 0 else self.train_timeout_s + self.slowest_s


class Watchdog:
    """Started once the cell's signal handlers are in place (while the entry point still holds its
    signals: the thread inherits the blocked mask, so they keep going to the main thread).
    `arm(limit)` gives the step in progress its deadline, `disarm()` ends it, `finished()` says the
    main thread has written the record and is leaving by itself."""

    def __init__(
        self,
        rank: int,
        end: End,
        on_signal: SignalOutcome,
        grace_s: float = GRACE_S,
        beat: Callable[[], None] | None = None,
        blame: Blame | None = None,
        peers: PeerExits | None = None,
    ):
        self._rank, self._end, self._on_signal, self._grace_s = rank, end, on_signal, grace_s
        self._beat, self._blame, self._peers = beat, blame, peers
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._deadline: float | None = None
        self._limit_s = 0.0
        self._signalled: tuple[float, int] | None = None
        self._main = threading.main_thread()
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="hpcfsdp-watchdog", daemon=True)
        self._thread.start()

    def arm(self, limit_s: float) -> None:
        with self._lock:
            self._limit_s, self._deadline = limit_s, time.monotonic() + limit_s

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def finished(self) -> None:
        """The main thread has the record in hand: the watchdog ends nothing from now on."""
        with self._lock:
            self._done.set()
        signal.set_wakeup_fd(self._previous_fd)

    def _watch(self) -> None:
        try:
            self._watch_until_done()
        finally:
            if self._peers is not None:
                self._peers.close()

    def _watch_until_done(self) -> None:
        """Each BEAT_S, and at once when a signal comes or a watched peer exits (its pidfd)."""
        while not self._done.is_set():
            if self._beat is not None:
                self._beat()
            waits = select.poll()  # not select(): a rank with NCCL's sockets may hold fds past 1024
            for fd in [self._read, *(self._peers.fds() if self._peers is not None else [])]:
                waits.register(fd, select.POLLIN)
            ready = [fd for fd, _ in waits.poll(BEAT_S * 1000)]
            now = time.monotonic()
            if self._peers is not None:
                self._peers.exited([fd for fd in ready if fd != self._read])
            if self._read in ready:
                for signum in os.read(self._read, 64):
                    if self._signalled is None and self._on_signal(signum) is not None:
                        self._signalled = (now, signum)
            with self._lock:
                if self._done.is_set():
                    return
                deadline, limit_s = self._deadline, self._limit_s
            if self._signalled is not None and now - self._signalled[0] > self._grace_s:
                outcome = self._on_signal(self._signalled[1])
                if outcome is not None:
                    status, message = outcome
                    # torchrun's SIGTERM after a peer died is no time limit: the peer is named
                    peer = self._peer(status) if self._signalled[1] == signal.SIGTERM else None
                    message = message if peer is None else LAUNCHERS_SIGTERM
                    self._leave_with(
                        status, f"{message}; not ended within {self._grace_s:g} s by the rank itself", peer
                    )
            elif deadline is not None and now > deadline:
                peer = None
                if _waits_on_peers(self._main_stack()):
                    time.sleep(PEER_DEFER_S)  # the rank that stopped answering names itself first
                    peer = self._peer("hang")  # or, stopped (SIGSTOP) or dead, its heartbeat names it
                self._leave_with("hang", f"no step ended within {limit_s:.0f} s", peer)

    def _peer(self, status: str) -> PeerTrouble | None:
        return self._blame(status) if self._blame is not None else None

    def _main_stack(self) -> traceback.StackSummary:
        frame = sys._current_frames().get(self._main.ident or 0)
        return traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()

    def _leave_with(self, status: str, message: str, peer: PeerTrouble | None = None) -> None:
        """Write the record (naming where this rank's main thread is, and the peer the trouble came
        from) and end the process."""
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
        stack = self._main_stack()
        try:
            self._end(status, f"{message}: rank {self._rank} {_where(stack)}", "".join(stack.format()), peer)
        finally:
            leave(1)


def _waits_on_peers(stack: traceback.StackSummary) -> bool:
    """The main thread waits inside torch.distributed (a collective, or a wait on one), or inside
    the training step itself, where a device sync waits for the step's collectives (NCCL's run on
    the GPU): not the rank that stopped answering, which is stuck elsewhere."""
    if any("/torch/distributed/" in frame.filename for frame in stack):
        return True
    ours = next((f for f in reversed(stack) if f.filename.startswith(PACKAGE_DIR)), None)
    return ours is not None and ours.filename.endswith("train.py") and ours.name == "train"


def _where(stack: traceback.StackSummary) -> str:
    """Where the main thread is: its innermost frame, and the innermost of hpcfsdp's own."""
    if not stack:
        return "(main thread's place unknown)"
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if f.filename.startswith(PACKAGE_DIR)), None)
    text = f"waits at {os.path.basename(inner.filename)}:{inner.lineno} in {inner.name}"
    if ours is not None and ours is not inner:
        text += f" (from {os.path.basename(ours.filename)}:{ours.lineno} in {ours.name})"
    return text


def leave(code: int) -> None:
    """End this rank now, without the collectives a peer may never answer: abort the process
    group's communicators (waiting at most ABORT_WAIT_S), flush the output, os._exit. A rank that
    fails must never call destroy_process_group while a peer is inside a collective: under NCCL it
    blocks there, and the peer waits on the GPU until NCCL's own timeout."""
    if dist.is_initialized():
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            aborting = threading.Thread(target=_quietly, args=(abort,), daemon=True)
            aborting.start()
            aborting.join(ABORT_WAIT_S)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        call()


def end_with_launcher(sig: int) -> None:
    """Under the node's supervisor or torchrun: `sig` when the launcher dies (SIGKILLed, or its
    node lost), so that no rank outlives it holding the GPU. It reaches the cell's handler or the
    watchdog, which record `cancelled`. A launcher already gone means the rank leaves at once."""
    if LAUNCH_ID_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        set_parent_death_signal(sig)


def set_parent_death_signal(sig: int) -> None:
    """Linux sends `sig` to this process when its parent dies; a parent already gone (this
    process was re-parented to init) means it leaves at once."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1:
        os._exit(1)
