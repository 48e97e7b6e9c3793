"""The Slurm job of a set of probes: one task on one node holds the allocation's GPUs and runs the
probes one after another, each a torchrun of its own (probe.run_launches). Pickled by submitit on
the login side; it imports no torch (the torchruns do)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..sweep.launch.environment import without_secrets
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
        # submitit's own task variables would tell each rank it is a one-task Slurm step: torchrun's win
        env = {k: v for k, v in without_secrets(os.environ).items() if not k.startswith("SUBMITIT_")}
        run_launches(list(self.planned), env, self.limit_s, Path(self.launches_dir), "slurm", job_id)
        return "done"
