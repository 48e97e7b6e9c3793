"""hpcfsdp's lr schedule against torchtitan's own, step by step, on real optimizers (CPU).

For every run length, warm-up, decay and floor below, one AdamW is stepped under torchtitan's
build_lr_schedulers (the checkout named by TORCHTITAN_DIR, on PYTHONPATH) and one under hpcfsdp's
build_optimizer, and the lr each used at every step is compared. Prints the largest difference and
exits 1 if any lr differs by more than 1e-12 of the peak.

    PYTHONPATH=$TORCHTITAN_DIR:src python bench/lr_schedule_check.py
"""

from __future__ import annotations

import itertools
import sys

import torch
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.config import LRScheduler

from hpcfsdp.cell.train import build_optimizer
from hpcfsdp.contracts.spec import RunSpec

LR = 8e-4


def used_lrs(optimizer: torch.optim.Optimizer, steps: int, step_schedule=lambda: None) -> list[float]:
    param = optimizer.param_groups[0]["params"][0]
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones_like(param)
        optimizer.step()
        step_schedule()
    return used


def main() -> int:
    worst, cases = 0.0, 0
    for steps, warmup, decay, floor in itertools.product(
        (2, 3, 12, 100), (0, 1, 2, 20), ("linear", "cosine"), (0.0, 0.1)
    ):
        if warmup > steps:
            continue
        titan_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
        config = LRScheduler(warmup_steps=warmup, decay_type=decay, min_lr_factor=floor)
        schedules = build_lr_schedulers([titan_opt], config, steps)
        titan = used_lrs(titan_opt, steps, schedules.step)
        spec = RunSpec.from_dict(
            {
                "model": "tiny",
                "device": "cpu",
                "steps": steps,
                "warmup_steps": 0,
                "lr": LR,
                "lr_warmup_steps": warmup,
                "lr_decay": decay,
                "lr_min_ratio": floor,
            }
        )
        ours = used_lrs(build_optimizer(torch.nn.Linear(2, 2), spec), steps)
        worst = max(worst, max(abs(a - b) for a, b in zip(titan, ours)))
        cases += 1
    print(f"{cases} schedules, every step: largest lr difference {worst:.3g} (peak lr {LR:g})")
    return 0 if worst <= 1e-12 * LR else 1


if __name__ == "__main__":
    sys.exit(main())
