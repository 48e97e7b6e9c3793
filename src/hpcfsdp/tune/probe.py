"""A probe: the grid's cell cut short. It keeps everything that decides speed and memory, runs
with the grid's warm-up, and stops once its tokens/s is stable (RunSpec.stop_when_stable, checked
in cell/train.py) within a step budget that grows by eta each rung. Each probe is a launch of its
own (its supervisor's ranks), so that a probe that fails or runs out of memory ends its processes
and the next starts clean; several run one after another in one allocation (run_launches: here for
the local executor, one supervisor process for the stage's probes, sweep/launch/local.py's
WarmSupervisor; inside one Slurm job for the slurm executor, job.py); either imports the ranks'
code once and forks each probe's ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..contracts.spec import RunSpec
from ..sweep.folder.layout import LOG_NAME
from ..sweep.track.lost import log_tails, record_launch_failure
from .state import INTERRUPTED, Launch, run_status, write_launch

# One launch of a run: its folder, processes, environment and time limit -> its supervisor's exit
# status, None at the limit (sweep/launch/local.WarmSupervisor here; job.launch_here inside a Slurm job).
Launcher = Callable[[Path, int, dict[str, str], float], "int | None"]

FIRST_RUNG_TIMED_STEPS = 6  # rung 0's budget of timed steps; a probe stops after half of them once stable


def rung_timed_steps(rung: int, eta: int) -> int:
    return FIRST_RUNG_TIMED_STEPS * eta**rung


def probe_spec(spec: RunSpec, rung: int, eta: int) -> RunSpec:
    """The grid cell's spec as a probe of this rung: the grid's warm-up, then at most
    rung_timed_steps timed steps, stopping once stable; no communication profile, trace or
    memory snapshot (they run after the timed steps and change nothing the ranking reads)."""
    steps = spec.warmup_steps + min(rung_timed_steps(rung, eta), spec.steps - spec.warmup_steps)
    return spec.replace(
        steps=steps,
        stop_when_stable=True,
        sync_each_step=True,
        comm_profile_steps=0,
        profile=False,
        memory_snapshot=False,
        lr_warmup_steps=min(spec.lr_warmup_steps, steps),
    )


def probe_rungs(spec: RunSpec, eta: int) -> int:
    """How many probe rungs there are before the final stage: those whose budget stays below the
    grid cell's own timed steps (longer, only the grid's cells themselves measure), and at least
    one, where even the first would not (a probe still stops once stable, and maps out the OOMs)."""
    timed = spec.steps - spec.warmup_steps
    return max(1, math.ceil(math.log(max(1.0, timed / FIRST_RUNG_TIMED_STEPS), eta)))


@dataclass(frozen=True)
class Planned:
    """One launch to make: the run's folder (spec.json written), its processes, which stage."""

    directory: str
    processes: int
    stage: str


def run_launches(
    planned: list[Planned],
    env: dict[str, str],
    limit_s: float,
    launches_dir: Path,
    executor: str,
    launch: Launcher,
    job_id: str = "",
    log: Callable[[str], None] = print,
) -> None:
    """Launch each planned run one after another, each under its supervisor with its own limit; record each
    launch (launcher start to end, GPUs) in launches_dir. A run whose record already stands is
    skipped (a requeued or resumed allocation). One that ended without a record gets one: timeout
    at its limit, else error, with its log's tail; an out-of-memory probe recorded oom itself."""
    for index, run in enumerate(planned, 1):
        directory = Path(run.directory)
        if run_status(directory) not in ("missing", *INTERRUPTED) and _launched(launches_dir, run):
            continue
        log(f"[{index}/{len(planned)}] {run.stage} {directory.name} ({run.processes} process(es))")
        started = time.time()
        returncode = launch(directory, run.processes, env, limit_s)
        ended = time.time()
        status = run_status(directory)
        if status == "missing":
            status = "timeout" if returncode is None else "error"
            ended_how = (
                f"was killed at its {limit_s / 60:g} min limit" if returncode is None else f"exited {returncode}"
            )
            record_launch_failure(
                directory,
                f"its supervisor {ended_how} without a record",
                log_tails([directory / LOG_NAME], chars=4000),
                status=status,
            )
        write_launch(
            launches_dir,
            Launch(directory.name, run.stage, started, ended, run.processes, returncode, executor, job_id),
        )
        log(f"    {status} ({ended - started:.1f} s)")


def _launched(launches_dir: Path, run: Planned) -> bool:
    return (Path(launches_dir) / f"{run.stage}-{Path(run.directory).name}.json").is_file()
