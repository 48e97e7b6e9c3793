"""Slurm's signals to a running cell: the time limit (SIGUSR2, or SIGTERM near the job's end)
becomes CellTimeout, or a requeue through submitit's handler while requeues are left; an early
SIGTERM becomes CellCancelled (scancel, a failed node, or preemption).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import datetime

from ...contracts.endings import ENDINGS
from ...contracts.record import FailedRecord
from ...contracts.spec import JOB_END_ENV
from .heartbeats import LAUNCHERS_SIGTERM, PeerTrouble
from .requeue import ask_s, job_view, requeue_note, requeues_left


class SignalEnding(BaseException):
    """An ending a signal handler raises wherever the main thread happens to be. A BaseException,
    as KeyboardInterrupt is, so that no `except Exception` on the way swallows it: Slurm sends
    SIGCONT just before a cancel's SIGTERM, submitit logs the SIGCONT, and a SIGTERM that landed in
    that log line's write was swallowed by logging's own `except Exception` (2 of 31 scancels of a
    CPU cell, 2026-11-27): the rank trained on until Slurm's SIGKILL, and the cell had no record.
    Catch it only where a record is written."""


class CellTimeout(SignalEnding):
    """The scheduler's time limit (SIGTERM, or submitit's SIGUSR2 warning) arrived mid-run."""


class CellCancelled(SignalEnding):
    """SIGTERM well before the job's time limit: scancel, an interrupted local submit (`cancelled`),
    Slurm ending the job because one of its nodes went down (`node_fail`), or preempting it for a
    job of a higher priority (`preempted`). `fields`: the record's slurm_state and advice, for one
    of Slurm's endings."""

    def __init__(self, message: str, status: str, slurm_state: str | None = None, advice: str = ""):
        super().__init__(message)
        self.status = status
        self.fields: FailedRecord = {} if slurm_state is None else {"slurm_state": slurm_state, "advice": advice}


class PeerFailed(SignalEnding):
    """This rank got its launcher's SIGTERM because a peer died or stopped (torchrun ends the
    survivors of a rank that died): the peer's failure, not a time limit."""

    def __init__(self, peer: PeerTrouble, seen: str):
        super().__init__(seen)  # blamed() puts the peer's story first
        self.peer = peer


# Linux's parent-death signal of a rank under torchrun (watchdog.end_with_launcher): not SIGTERM, which
# would read as a cancel or the time limit, while this says the launcher died (SIGKILLed, its node lost).
LAUNCHER_GONE = signal.SIGHUP


def launcher_gone_text() -> str:
    """What a rank whose launcher died records: torchrun's (its workers carry TORCHELASTIC_RUN_ID),
    else the node's supervisor (hpcfsdp's executors)."""
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "the node's supervisor"
    return f"received SIGHUP: the rank's launcher ({launcher}) is gone"


# Set by the node's supervisor in its ranks' environment while it requeues the task at the time
# limit's SIGUSR2 (cell/supervise/supervisor.py): the rank leaves that signal to it.
SUPERVISOR_REQUEUES_ENV = "HPCFSDP_SUPERVISOR_REQUEUES"
# A rank recording a failure ignores further signals (torchrun's SIGTERM to the survivors of a rank
# that died may come while it writes): its record is the cell's, and it leaves once it is written.
_recording_failure = False
# Slurm sends the time limit's SIGTERM at the limit or up to 30 s after it (it checks periodically),
# never before it; a SIGTERM more than this before the job's end is something else.
EARLY_SIGTERM_S = 30.0


def signal_cause(exc: BaseException) -> BaseException:
    """The time-limit, cancel or peer's-failure exception behind exc, if there is one: a signal handler raises
    wherever the rank is, and a library that catches every exception may re-raise what it raised as
    another, chained to it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SignalEnding):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def recording_failure() -> None:
    """From now on this rank's handler lets signals pass: it is writing its failure's record."""
    global _recording_failure
    _recording_failure = True


def handle_time_limit(blame: Callable[[str], PeerTrouble | None] | None = None) -> dict:
    """Turn Slurm's end-of-time signals into CellTimeout, so the cell records `timeout`.

    Except while the sweep allows another requeue (HPCFSDP_MAX_REQUEUE > SLURM_RESTART_COUNT, the
    same count on every rank): then SIGUSR2 goes to submitit's handler, which on rank 0 calls
    CellJob.checkpoint and requeues the task, while the other ranks train on; the SIGTERM of the
    requeue then ends every rank without a record, and the requeued run writes it.
    """
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2, LAUNCHER_GONE)}
    submitit_handler = previous[signal.SIGUSR2] if callable(previous[signal.SIGUSR2]) else None
    requeue = submitit_requeues(previous)
    requeued = ended = False

    def handler(signum, frame):
        nonlocal requeued, ended
        name = signal.Signals(signum).name
        if requeued:
            if signum == signal.SIGUSR2:  # the same signal again (podman passes it on twice): requeued once
                return
            raise SystemExit(f"requeued after {name}")
        if ended or _recording_failure:  # Slurm may signal twice (preemption does): a record is being written
            return
        if signum == signal.SIGUSR2 and requeue and submitit_handler is None:
            return  # the node's supervisor requeues the task, and ends this rank without a record
        if signum == signal.SIGUSR2 and requeue and submitit_handler is not None:
            requeued = True
            try:
                submitit_handler(signum, frame)  # rank 0: requeue, then SystemExit; other ranks: returns
            except Exception as exc:  # submitit declined to requeue: a plain timeout
                raise CellTimeout(f"received {name} (time limit); not requeued: {exc}") from None
            return
        ended = True
        if signum == LAUNCHER_GONE:
            raise CellCancelled(launcher_gone_text(), "cancelled")
        if signum == signal.SIGTERM:
            if blame is not None and (peer := blame("error")) is not None:
                raise PeerFailed(peer, LAUNCHERS_SIGTERM)
            _raise_if_not_time_limit()
        raise CellTimeout(f"received {name} (time limit)")

    for sig in previous:
        signal.signal(sig, handler)
    return previous


def submitit_requeues(previous: dict) -> bool:
    """Whether the time limit's SIGUSR2 goes to submitit's handler (found in `previous`), which
    requeues the task while the sweep allows another requeue; in a rank the node's supervisor
    started (SUPERVISOR_REQUEUES_ENV), the supervisor's, which ends the rank without a record."""
    found = callable(previous[signal.SIGUSR2]) or os.environ.get(SUPERVISOR_REQUEUES_ENV) == "1"
    return found and requeues_left()


def signal_outcome(signum: int, requeue: bool) -> tuple[str, str] | None:
    """The status and error a signal gives the record, as the handler would raise them, for a rank
    whose main thread cannot run the handler (blocked in CUDA or NCCL: watchdog.py). None for the
    time limit's SIGUSR2 while submitit requeues the task (the requeued run writes the record), and
    for a signal that ends nothing (srun sends SIGCONT first when it ends a step whose task died; on
    2 x H100 under Slurm that SIGCONT was recorded as the time limit)."""
    if signum == signal.SIGUSR2 and requeue:
        return None
    if signum not in (signal.SIGTERM, signal.SIGUSR2, LAUNCHER_GONE):
        return None  # not an ending: srun's SIGCONT before the SIGTERM that ends a step whose task died
    name = signal.Signals(signum).name
    if signum == LAUNCHER_GONE:
        return "cancelled", launcher_gone_text()
    if signum == signal.SIGTERM:
        try:
            _raise_if_not_time_limit()
        except CellCancelled as exc:
            return exc.status, str(exc)
    return "timeout", f"received {name} (time limit)"


def _raise_if_not_time_limit() -> None:
    """CellCancelled when SIGTERM came well before the job's end (JOB_END_ENV, set by the batch
    script from squeue, or by the local executor); then Slurm's word on the job (requeue.job_view)
    tells preemption and a failed node from a cancel. Without a known end time, SIGTERM counts as
    the time limit."""
    left = _seconds_to_job_end()
    if left is None or left <= EARLY_SIGTERM_S:
        return
    view = job_view()
    found = view.ending()
    if found is None:
        unsure = f"; Slurm's controller did not answer within {ask_s():g} s" if view.unanswered else ""
        raise CellCancelled(
            f"received SIGTERM {left:.0f} s before the time limit (scancel, or an interrupted local submit){unsure}",
            "cancelled",
        )
    state, why = found
    ending = ENDINGS[state]
    raise CellCancelled(
        f"received SIGTERM: {ending.meaning} ({why}){requeue_note()}",
        ending.status,
        slurm_state=state,
        advice=ending.advice,
    )


def _seconds_to_job_end() -> float | None:
    value = os.environ.get(JOB_END_ENV, "").strip()
    try:
        end = float(value)
    except ValueError:
        try:
            end = datetime.fromisoformat(value).timestamp()  # squeue's %e, in this node's time zone
        except ValueError:  # unset, or squeue did not answer when the job started
            return None
    return end - time.time()


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
