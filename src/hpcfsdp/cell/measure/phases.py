"""Where a launch's time goes: the record's `phases` ({name: seconds}) and `launch_span_s`.

The launching side (the local executor, tune's launches, the Slurm job's script) exports its own
start time (LAUNCH_STARTED_ENV) just before it starts torchrun or srun; the rank reads its own
process's start from /proc. From there the cell marks each stage as it enters it (the stages
that `progress.stage` names), and the training loop's log splits the train stage into compile,
warm-up and timed window. What follows the record's write (tear-down: destroying the process
group, the processes' exit) only the launching side sees: it adds `teardown` to the record
afterwards (sweep/launch/local.py).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from ...contracts.record import Record
from ...contracts.spec import LAUNCH_STARTED_ENV, RunSpec
from .metrics import TrainLog

# The cell's stages (run.py's progress.stage) -> the phase they count in; the train stage is split
# by the loop's log, and what comes after training (profiles, snapshot, gathering) is measurement.
STAGE_PHASES = {
    "setup": "process_group",
    "data": "data",
    "batch_search": "batch_search",
    "model": "model_build",
    "shard": "shard",
    "train": "train",
    "comm_profile": "measurement",
    "profile": "measurement",
}


def launch_started() -> float | None:
    """When the launching side started torchrun / srun (Unix time), where it said so."""
    try:
        return float(os.environ[LAUNCH_STARTED_ENV])
    except (KeyError, ValueError):
        return None


def process_started() -> float | None:
    """When this process started (Unix time), from /proc (Linux); None elsewhere. Its start is in
    clock ticks since boot; the boot's moment is now less /proc/uptime (to the hundredth), not
    /proc/stat's btime, whole seconds, which put every start up to a second early (0.23 s on the
    CPU machine: a forked rank's `imports` read 0.24 s, its `launcher_start` 0)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after "pid (comm)"
        with open("/proc/uptime") as uptime:
            booted = time.time() - float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return booted + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class PhaseClock:
    """The moments the cell entered each phase, from run_cell's start (`started`, Unix time)."""

    started: float
    marks: list[tuple[str, float]] = field(default_factory=list)
    train_log: TrainLog | None = None  # the loop's log, once trained
    train_ended: float | None = None

    def __post_init__(self) -> None:
        self.marks.append(("process_group", self.started))

    def enter(self, stage: str) -> None:
        self.marks.append((STAGE_PHASES.get(stage, stage), time.time()))

    def trained(self, log: TrainLog) -> None:
        self.train_log, self.train_ended = log, time.time()
        self.marks.append(("measurement", self.train_ended))

    def phases(self, spec: RunSpec, written: float) -> dict[str, float]:
        """Seconds per phase up to `written` (the record's write), in the order they ran."""
        found: dict[str, float] = {}
        launcher, process = launch_started(), process_started()
        if launcher is not None and process is not None:
            found["launcher_start"] = max(0.0, process - launcher)
        if process is not None:
            found["imports"] = max(0.0, self.started - process)
        ends = [moment for _, moment in self.marks[1:]] + [written]
        for (name, moment), end in zip(self.marks, ends, strict=True):
            found[name] = found.get(name, 0.0) + max(0.0, end - moment)
        if "train" not in found or self.train_log is None:
            return found
        split = _train_split(found["train"], self.train_log, spec)  # in the train stage's place
        return {
            k: v for name, seconds in found.items() for k, v in (split if name == "train" else {name: seconds}).items()
        }


def _train_split(train_s: float, log: TrainLog, spec: RunSpec) -> dict[str, float]:
    """The train stage as compile (with `compile`: the first step's time beyond a timed step's
    median, where torch.compile traces and compiles), warm-up (the rest before the timed window,
    batches' set-up included) and the timed window."""
    timed = log.step_times_s[spec.warmup_steps :]
    compile_s = 0.0
    if spec.compile and spec.warmup_steps and timed:
        compile_s = max(0.0, log.step_times_s[0] - statistics.median(timed))
    split = {"warmup": max(0.0, train_s - log.window_s - compile_s), "timed_window": log.window_s}
    return {"compile": compile_s, **split} if spec.compile else split


def launch_span(written: float) -> float | None:
    """From the launcher's start (else this process's) to the record's write."""
    start = launch_started() or process_started()
    return max(0.0, written - start) if start is not None else None


def timing_fields(spec: RunSpec, clock: PhaseClock) -> Record:
    """The run's start, and its length up to now (the record's write): the cell's own
    (duration_s), the launch's (launch_span_s) and where it went (phases)."""
    written = time.time()
    fields: Record = {"started_at": clock.started, "duration_s": written - clock.started}
    fields["phases"] = clock.phases(spec, written)
    if (span := launch_span(written)) is not None:
        fields["launch_span_s"] = span
    return fields
