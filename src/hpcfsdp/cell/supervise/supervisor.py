"""The node's supervisor: starts the node's ranks, watches them, and ends them all when one ends the
cell; it writes the cell's record where no rank of this launch could (ending.py).

Signals: Slurm's and the local executor's (SIGTERM, the time limit's SIGUSR2; SIGINT by hand) are
passed on to the ranks, which record `timeout` or `cancelled` themselves; what a signal left without
a record gets the signal's record here. Under Slurm, while the sweep allows another requeue, the time
limit's SIGUSR2 ends the ranks without a record and goes to submitit's handler, which requeues the
task (the requeued run writes the record).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from ...contracts.spec import RunSpec
from ..ranks.forking import fork_refusal
from ..stopping.heartbeats import own_output_tail
from ..stopping.requeue import requeued_too_often
from ..stopping.signals import SUPERVISOR_REQUEUES_ENV, signal_outcome, submitit_requeues
from .bytecode import use_bytecode_cache
from .cgroup import oom_kills
from .ending import cell_status, launch_record, node_here, write_ending, write_rank_ending
from .layout import NodeLayout
from .start import start_rank, warm_imports
from .watch import Ending, RankProcess, exit_ending, live_ending

POLL_S = 0.2  # how often each rank's process is looked at
END_GRACE_S = 10.0  # from SIGTERM to the ranks (whose watchdogs end a blocked rank in 5 s) to SIGKILL
PEER_DEFER_S = 3.0  # with several ranks, how long a rank's death waits for a peer's record (as the watchdog does)
FORWARDED = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
LOG_TAIL_CHARS = 4000


def hang_seconds(spec: dict) -> float:
    """How long a rank may be stopped, or its heartbeat still, before it counts as hung: the spec's
    train_timeout_s (its default where the spec leaves it out)."""
    value = spec.get("train_timeout_s", RunSpec.__dataclass_fields__["train_timeout_s"].default)
    return float(value)


@dataclass
class Supervisor:
    """One node's supervisor of one launch of a cell."""

    cell_dir: Path
    layout: NodeLayout
    launch: str
    hang_s: float
    say: Callable[[str], None] = print
    may_requeue: bool = True  # a Slurm task's: submitit may requeue it at the time limit
    deadline: float | None = None  # a launch's time limit in this process (tune's probes): then as SIGTERM
    ranks: list[RankProcess] = field(default_factory=list)
    signalled: int | None = None  # the first ending signal passed on to the ranks
    requeuing: bool = False  # the time limit's SIGUSR2 requeues the task: no record, the next run writes it
    timed_out: bool = False  # the deadline came first
    launched: float = field(default_factory=time.time)

    def run(self) -> str:
        """Start the ranks, watch them to their end; the cell's status as its record says it. The
        signal handlers found are back in place at the end, for the next cell of this process."""
        previous = {sig: signal.getsignal(sig) for sig in FORWARDED}
        requeue = self.may_requeue and submitit_requeues({signal.SIGUSR2: previous[signal.SIGUSR2]})
        try:
            for sig in FORWARDED:
                signal.signal(sig, self._handler(previous[signal.SIGUSR2] if requeue else None))
            oom_before = oom_kills()
            self._start_ranks(requeue)
            try:
                self._watch(oom_before)
            finally:
                for rank in self.ranks:  # what a rank left behind in its group (compile workers, loaders)
                    rank.signal_group(signal.SIGKILL)
                self._reap()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        return cell_status(self.cell_dir)

    def _reap(self) -> None:
        """Wait (END_GRACE_S at most) for the killed ranks' exits: no zombie stays beside the next
        cell's ranks in this process."""
        deadline = time.monotonic() + END_GRACE_S
        while any(rank.poll() is None for rank in self.ranks) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _start_ranks(self, requeue: bool) -> None:
        """Fork the node's ranks once this process has imported their code (start.py); by exec where
        it may not fork, saying why."""
        started = time.time()
        if bytecode := use_bytecode_cache(os.environ):
            self.say(bytecode)
        refused = fork_refusal(os.environ, "the supervisor's process")
        if not refused:
            try:
                warm_imports(self.cell_dir)
            except Exception as exc:  # a broken install: each rank meets it, and its exit is recorded
                refused = f"the ranks' imports failed here: {type(exc).__name__}: {exc}"
            else:
                refused = fork_refusal(os.environ, "the supervisor's process")  # the imports started a thread, or CUDA
        if self.signalled is not None or self.requeuing:  # it came while importing: no rank to start
            return
        node = node_here()
        for local_rank in range(self.layout.per_node):
            env = self.layout.rank_environment(local_rank, self.launch, os.environ)
            if requeue:
                env[SUPERVISOR_REQUEUES_ENV] = "1"
            pid = start_rank("exec" if refused else "fork", self.cell_dir, env)
            self.ranks.append(RankProcess(self.layout.global_rank(local_rank), pid, node))
        pids = ", ".join(str(rank.pid) for rank in self.ranks)
        how = f"started by exec ({refused})" if refused else f"forked after {time.time() - started:.1f} s of imports"
        self.say(f"[hpcfsdp] supervisor (pid {os.getpid()}): rank(s) {how}: pid {pids}")

    def _handler(self, requeue_with: Callable | object | None) -> Callable[[int, FrameType | None], None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            if self.requeuing and signum == signal.SIGTERM:  # the requeue ends this run: no record
                raise SystemExit("requeued")
            if self.requeuing or self.signalled is not None:
                return
            if signum == signal.SIGUSR2 and callable(requeue_with):
                self.requeuing = True
                self._end_ranks(signal.SIGKILL)
                try:
                    requeue_with(signum, frame)  # the first node's task requeues the job, then exits
                except Exception as exc:  # submitit declined to requeue: the time limit's record
                    write_ending(
                        self.cell_dir,
                        self.launch,
                        "timeout",
                        f"received SIGUSR2 (time limit); not requeued: {exc}",
                        self._log_tail(),
                        self.launched,
                    )
                    self.requeuing = False
                    self.signalled = signum
                return
            self._pass_on(signum)

        return handler

    def _pass_on(self, signum: int) -> None:
        self.signalled = signum
        passed = signal.SIGTERM if signum == signal.SIGINT else signum
        for rank in self.ranks:
            if rank.poll() is None:
                rank.signal_group(passed)

    def _watch(self, oom_before: int | None) -> None:
        """Until the ranks have ended. With several ranks, an ending found waits PEER_DEFER_S for a
        peer rank to record it first: its record has the cell's whole context (every rank's
        resources), the supervisor's only what it saw."""
        signalled_at: float | None = None
        pending: tuple[float, Ending] | None = None
        while True:
            time.sleep(POLL_S)
            now = time.time()
            if self.requeuing:
                continue  # the requeue's SIGTERM (or submitit's exit) ends this process
            if self.deadline is not None and now >= self.deadline and self.signalled is None:
                self.timed_out = True  # as the local executor ends a launch at its limit: SIGTERM
                self._pass_on(signal.SIGTERM)
            running = [rank for rank in self.ranks if rank.poll() is None]
            if self.signalled is not None:
                signalled_at = signalled_at or now
                if running and now - signalled_at < END_GRACE_S:
                    continue
                self._end_ranks(signal.SIGKILL)
                self._record_signal(self.signalled)
                return
            found = pending[1] if pending else self._ending(running, oom_before, now)
            if found is not None:
                pending = pending or (now + (PEER_DEFER_S if self.layout.world_size > 1 else 0.0), found)
                if now >= pending[0] or _failure_recorded(self.cell_dir, self.launch):
                    self._end_with(found)
                    return
                continue
            if not running:
                if launch_record(self.cell_dir, self.launch) is None and cell_status(self.cell_dir) != "ok":
                    first = self.ranks[0]
                    self._end_with(Ending("error", first.rank, first.pid, first.node, "exited 0 without a record"))
                return

    def _ending(self, running: list[RankProcess], oom_before: int | None, now: float) -> Ending | None:
        for rank in self.ranks:
            code = rank.poll()
            ending = live_ending(rank, self.cell_dir, self._stop_limit_s(), now) if code is None else None
            if code is not None and not rank.ended_by_supervisor:
                ending = exit_ending(rank, code, oom_before)
            if ending is not None:
                return ending
        return None

    def _stop_limit_s(self) -> float:
        """How long a rank may be stopped (or its heartbeat still) before this supervisor records
        it: train_timeout_s for a lone rank; with peers, their watchdogs name it first (a step past
        its deadline: train_timeout_s past the slowest step), so the supervisor is their backstop."""
        return self.hang_s if self.layout.world_size == 1 else 2 * self.hang_s + END_GRACE_S

    def _end_with(self, ending: Ending) -> None:
        """Record the ending (unless a rank of this launch recorded its failure first), then end the
        node's other ranks: SIGTERM, SIGKILL after END_GRACE_S (a stopped rank at once)."""
        if requeued_too_often():  # the ranks did not train: the earlier run's record stays the cell's
            return
        if write_rank_ending(self.cell_dir, self.launch, ending, self._log_tail(), self.launched):
            self.say(f"[hpcfsdp] supervisor: {ending.error}: recorded {ending.status}")
        for rank in self.ranks:
            if rank.poll() is None and rank.rank == ending.rank and ending.signal == "SIGSTOP":
                rank.ended_by_supervisor = True
                rank.signal_group(signal.SIGKILL)
        self._end_ranks(signal.SIGTERM)
        deadline = time.monotonic() + END_GRACE_S
        while any(rank.poll() is None for rank in self.ranks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self._end_ranks(signal.SIGKILL)

    def _end_ranks(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                rank.ended_by_supervisor = True
                rank.signal_group(signum)
                if signum == signal.SIGTERM:
                    rank.signal_group(signal.SIGCONT)

    def _record_signal(self, signum: int) -> None:
        """The ranks a signal ended without a record (before their handlers were in place, or
        killed after the grace): the record the signal means, as a rank's handler would write it."""
        outcome = signal_outcome(signal.SIGTERM if signum == signal.SIGINT else signum, False)
        status, message = outcome or ("cancelled", f"received {signal.Signals(signum).name}")
        if write_ending(
            self.cell_dir,
            self.launch,
            status,
            f"{message} (before a rank recorded it)",
            self._log_tail(),
            self.launched,
        ):
            self.say(f"[hpcfsdp] supervisor: {message}: recorded {status}")

    def _log_tail(self) -> str:
        return own_output_tail()[-LOG_TAIL_CHARS:]


def _failure_recorded(cell_dir: Path, launch: str) -> bool:
    record = launch_record(cell_dir, launch)
    return record is not None and record.get("status") != "ok"


def exit_code(status: str) -> int:
    return 0 if status == "ok" else 1
