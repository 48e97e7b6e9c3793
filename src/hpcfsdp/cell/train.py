"""The one training loop: warm-up, gradient accumulation, per-step timing. Strategy-agnostic."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..contracts.spec import RunSpec
from .levers import add_float8_scale_hook, attention_backend
from .measure.metrics import TrainLog
from .ranks.distributed import DistEnv
from .strategies import autocast, clip_gradients, gradient_sync

# stop_when_stable: a run stops once its last timed steps, half of those it may take and at least
# STABLE_MIN_STEPS, lie within this fraction of their median ((max - min) / median).
STABLE_SPREAD = 0.05
STABLE_MIN_STEPS = 3


class Diverged(RuntimeError):
    """A loss that is not finite: the run diverged, and its speed would be no measurement at all."""

    def __init__(self, step: int, losses: list[float]):
        super().__init__(f"loss is {losses[step - 1]} at step {step}")
        self.step = step  # counted from 1, as in the progress lines
        self.losses = losses


def build_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer:
    impl: dict[str, dict[str, Any]] = {
        "plain": {"foreach": False, "fused": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, **impl[spec.adamw_impl]
    )
    add_float8_scale_hook(optimizer, model, spec)
    add_lr_schedule(optimizer, spec)
    return optimizer


def add_lr_schedule(optimizer: torch.optim.Optimizer, spec: RunSpec) -> None:
    """Set the lr of every optimizer step by lr_factor: a LambdaLR stepped by a post-step hook
    on the optimizer, as the float8 scales are, so the training loop is unchanged."""
    if not spec.lr_warmup_steps and spec.lr_decay == "none":
        return
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(spec, step, spec.steps))
    optimizer.register_step_post_hook(lambda *_: schedule.step())


def lr_factor(spec: RunSpec, step: int, total: int) -> float:
    """The lr of optimizer step `step` (from 0) of `total`, as a fraction of spec.lr: torchtitan's
    warm-up, stable, decay schedule with decay_ratio unset (torchtitan/components/lr_scheduler.py
    at v0.2.2): a linear warm-up to 1 over lr_warmup_steps, then lr_decay over the rest, towards
    lr_min_ratio at a virtual step after the last, so that the last step's lr is not the minimum."""
    warmup = min(spec.lr_warmup_steps, total)  # a batch-search probe runs fewer steps than the cell
    if step < warmup:
        return (step + 1) / warmup
    if spec.lr_decay == "none":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    shape = 1 - progress if spec.lr_decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return spec.lr_min_ratio + (1 - spec.lr_min_ratio) * shape


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[torch.Tensor],
    spec: RunSpec,
    env: DistEnv,
    steps: int,
    warmup: int = 0,
    on_step_end: Callable[[int, TrainLog], None] = lambda step, log: None,
) -> TrainLog:
    """Run `steps` optimizer steps. With `spec.sync_each_step` every step is timed between device
    syncs; without, the device is synced only around the window after `warmup` steps.

    A loss that is not finite raises Diverged: at once with `sync_each_step` (the loss is on the
    host anyway), else after the last step, naming the first such step (a check per step would
    sync the device, which that mode leaves out). Losses are all-reduced, so every rank stops at
    the same step."""
    log = TrainLog()
    slowest: list[float] = []  # stop_when_stable: each timed step's time on its slowest rank
    pending_losses: list[torch.Tensor] = []
    model.train()
    window_start = 0.0
    for step in range(steps):
        if step == warmup or spec.sync_each_step:
            _synchronize(env.device)
        started = time.perf_counter()
        if step == warmup:
            window_start = started
        loss_sum = torch.zeros((), device=env.device)
        data_time = 0.0
        for micro in range(spec.grad_accum):
            fetch_started = time.perf_counter()
            tokens = next(batches)
            data_time += time.perf_counter() - fetch_started
            with (
                gradient_sync(model, spec, enabled=micro == spec.grad_accum - 1),
                autocast(spec, env.device),
                attention_backend(spec),
            ):
                loss = model(input_ids=tokens, labels=tokens).loss / spec.grad_accum
                loss.backward()
            loss_sum += loss.detach().float()
        timing_optimizer = spec.stop_when_stable and spec.sync_each_step
        if timing_optimizer:
            _synchronize(env.device)
            optimizer_started = time.perf_counter()
        clip_gradients(model, spec)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if timing_optimizer:
            _synchronize(env.device)
            log.optimizer_times_s.append(time.perf_counter() - optimizer_started)
        dist.all_reduce(loss_sum)
        if spec.sync_each_step:
            log.losses.append(loss_sum.item() / env.world_size)  # .item() waits for the device
            _stop_if_diverged(log.losses, len(log.losses) - 1)
        else:
            pending_losses.append(loss_sum)
        log.step_times_s.append(time.perf_counter() - started)
        log.data_times_s.append(data_time)
        on_step_end(step, log)
        if spec.stop_when_stable and spec.sync_each_step and _stable(log, slowest, steps, warmup, env):
            break
    _synchronize(env.device)
    log.window_s = time.perf_counter() - window_start
    log.losses += [t.item() / env.world_size for t in pending_losses]
    _stop_if_diverged(log.losses, len(log.losses) - len(pending_losses))
    return log


def _stable(log: TrainLog, slowest: list[float], steps: int, warmup: int, env: DistEnv) -> bool:
    """stop_when_stable: whether the last half of the timed steps the run may take (at least
    STABLE_MIN_STEPS) are all in, and lie within STABLE_SPREAD of their median. Judged on each
    step's slowest rank (an all-reduce after the step's timing), so that every rank stops at the
    same step."""
    if len(log.step_times_s) <= warmup:
        return False
    tensor = torch.tensor([log.step_times_s[-1]], dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    slowest.append(float(tensor.item()))
    window = max(STABLE_MIN_STEPS, (steps - warmup) // 2)
    if len(slowest) < window:
        return False
    last = sorted(slowest[-window:])
    return (last[-1] - last[0]) / last[len(last) // 2] <= STABLE_SPREAD


def _stop_if_diverged(losses: list[float], start: int) -> None:
    """Raise Diverged at the first loss from `start` on that is not finite."""
    for index in range(start, len(losses)):
        if not math.isfinite(losses[index]):
            raise Diverged(index + 1, losses)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
