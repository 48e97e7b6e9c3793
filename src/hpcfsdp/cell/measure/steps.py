"""What a running cell says of its progress: the step lines rank 0 prints (five a cell), and the
progress file beside its record that `status --watch` reads (its stage, and its step while it trains)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...contracts.files import write_json
from ...contracts.record import PROGRESS_NAME
from ...contracts.spec import RunSpec
from ..ranks.distributed import DistEnv
from .metrics import TrainLog

PROGRESS_EVERY_S = 1.0  # the progress file at most this often during training


@dataclass
class ProgressFile:
    """Rank 0's stage and step in the cell folder's progress file."""

    noted_at: float = 0.0  # when rank 0 last wrote it
    step: int = 0  # the training steps done so far, of `steps`, as the file says
    steps: int = 0

    def note(self, env: DistEnv, cell_dir: Path, stage: str, step: int | None = None, steps: int = 0) -> None:
        """At each stage (with the steps trained so far), and at most once a second during training
        (a small atomic write, off the timed path's device work); a file that cannot be written is
        not the cell's failure."""
        now = time.time()
        if step is not None:
            if 0 < step < steps and now - self.noted_at < PROGRESS_EVERY_S:
                return
            self.step, self.steps = step, steps
        if not env.is_main:
            return
        self.noted_at = now
        try:
            write_json(cell_dir / PROGRESS_NAME, {"stage": stage, "step": self.step, "steps": self.steps, "at": now})
        except OSError:
            pass


def print_step(env: DistEnv, spec: RunSpec, step: int, log: TrainLog) -> None:
    """Five lines a cell, as torchtitan's: the step, its loss (where the step synced) and speed."""
    if not env.is_main or (step + 1) % max(1, spec.steps // 5):
        return
    line = f"[hpcfsdp]   step {step + 1}/{spec.steps}"
    if len(log.losses) > step:
        line += f"  loss {log.losses[step]:.4f}"
    tokens = spec.batch_size * spec.grad_accum * spec.seq_len
    per = "GPU" if env.device.type == "cuda" else "process"
    print(f"{line}  {tokens / log.step_times_s[step]:,.0f} tokens/s per {per}", flush=True)
