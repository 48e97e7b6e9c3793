"""The Slurm job of a set of probes: one task on one node holds the allocation's GPUs and runs the
probes one after another, each a launch of its own (probe.run_launches) under a supervisor in this
process (sweep/launch/job.launch_here), which imports the ranks' code once for all the probes and
forks each probe's ranks. Pickled by submitit on the login side, which imports no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..sweep.launch.environment import without_secrets
from ..sweep.launch.job import launch_here
from .probe import Planned, run_launches


@dataclass(frozen=True)
class ProbeJob:
    planned: tuple[Planned, ...]
    launches_dir: str
    limit_s: float

    def __call__(self) -> str:
        job_id = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID", ""))
        if task := os.environ.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{job_id}_{task}"
        # submitit's own task variables would tell each rank it is a one-task Slurm step: the supervisor's win
        env = {k: v for k, v in without_secrets(os.environ).items() if not k.startswith("SUBMITIT_")}
        launches_dir = Path(self.launches_dir)
        run_launches(list(self.planned), env, self.limit_s, launches_dir, "slurm", launch_here, job_id)
        return "done"
