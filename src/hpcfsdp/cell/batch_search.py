"""`batch_size: auto`: the largest per-device batch that fits, found inside the cell's own allocation.

The search doubles the batch from the spec's `batch_size` until a probe runs out of memory (or
reaches the cap: `max_batch_size`, and `global_batch_size`'s per-rank share where one is given),
then narrows the gap between the largest batch that fitted and the smallest that did not until
the two are neighbours. Inside the gap it tries the batch where a straight line through the peak
memory of the two largest batches that fitted meets the limit (activation memory grows linearly
with the batch), else the midpoint; a wrong guess only narrows the gap like a midpoint would, and
a right one saves the probes that halving would spend. The limit is the device memory free when
the search starts, less `batch_margin` of it; on a CPU there is none, and the midpoint is used.

A probe is a fresh model, optimizer and data iterator at that batch, run for `batch_probe_steps`
steps of the one training loop (train.py): the second step holds the optimizer states, so its peak
is the steady state's. After a probe, whether it fitted or ran out of memory, everything it
allocated is released (its objects dropped and garbage-collected, compiled graphs reset, the CUDA
cache emptied), so one probe's OOM leaves nothing behind for the next. The ranks then agree on the
probe (out of memory if any rank was, the largest peak, the slowest step) over a gloo group with
a timeout: a rank that did not run out of memory while another did is waiting in a collective,
and the search then fails with an error instead of hanging.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from ..contracts.record import BatchProbe, BatchSearchRecord
from ..contracts.spec import RunSpec
from .data import training_batches
from .measure.metrics import median, memory_reading, reset_peak_memory
from .ranks.distributed import DistEnv
from .train import train

ProbeStatus = Literal["ok", "oom", "over_margin"]
GIB = 1024**3
AGREE_TIMEOUT_S = 60  # how long a rank waits for the others' outcome of a probe
# Errors that mean a device (or host) allocation failed, beside the allocator's own OutOfMemoryError.
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "can't allocate memory")

# build(spec at the probe's batch) -> (model, optimizer, vocabulary size): run.py's own set-up.
Build = Callable[[RunSpec], tuple[nn.Module, torch.optim.Optimizer, int]]


def is_oom(exc: BaseException) -> bool:
    """Out of memory: the caching allocator's OutOfMemoryError, or cuBLAS / NCCL / the host
    allocator failing to allocate (a RuntimeError that says so)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in OOM_MARKERS)
    )


@dataclass(frozen=True)
class Probe:
    """One batch tried: figures are the maximum over ranks (the slowest step)."""

    batch_size: int
    status: ProbeStatus  # over_margin: ran, but its peak reserved memory crossed the limit
    peak_memory_gib: float  # CUDA peak allocated (up to the failed allocation for an OOM); CPU: process max RSS
    peak_reserved_gib: float | None  # CUDA only: what the margin is checked against
    tokens_per_s_per_gpu: float | None  # from the steps after the first; None for an OOM
    wall_s: float  # build, steps and release
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.status == "ok"


@dataclass
class BatchSearch:
    """The search's probes and outcome; `record()` is the record's `batch_search` object."""

    first_batch: int
    cap: int
    margin: float
    probe_steps: int
    capacity_gib: float | None = None  # device memory free when the search started
    probes: list[Probe] = field(default_factory=list)
    chosen_batch_size: int = 0  # what the cell then measured (largest fitting batch, or below it for global_batch_size)
    wall_s: float = 0.0

    @property
    def limit_gib(self) -> float | None:
        return self.capacity_gib * (1 - self.margin) if self.capacity_gib is not None else None

    @property
    def largest_fitting_batch(self) -> int:
        return max((p.batch_size for p in self.probes if p.fits), default=0)

    @property
    def smallest_failing_batch(self) -> int | None:
        return min((p.batch_size for p in self.probes if not p.fits), default=None)

    def record(self) -> BatchSearchRecord:
        return {
            "probes": [cast(BatchProbe, asdict(p)) for p in self.probes],
            "largest_fitting_batch": self.largest_fitting_batch,
            "smallest_failing_batch": self.smallest_failing_batch,
            "chosen_batch_size": self.chosen_batch_size,
            "capped": self.largest_fitting_batch == self.cap,
            "first_batch": self.first_batch,
            "cap": self.cap,
            "margin": self.margin,
            "capacity_gib": self.capacity_gib,
            "limit_gib": self.limit_gib,
            "probe_steps": self.probe_steps,
            "wall_s": self.wall_s,
        }


def next_batch(probes: list[Probe], first: int, cap: int, limit_gib: float | None = None) -> int | None:
    """The next batch to try, or None when the frontier is known (or the cap fits)."""
    if not probes:
        return first
    fitted = [p for p in probes if p.fits]
    low = max((p.batch_size for p in fitted), default=0)
    high = min((p.batch_size for p in probes if not p.fits), default=None)
    if high is None:
        return min(2 * low, cap) if low < cap else None
    if high - low <= 1:
        return None
    guess = _where_memory_meets(fitted, limit_gib)
    return min(max(guess if guess is not None else (low + high) // 2, low + 1), high - 1)


def _where_memory_meets(fitted: list[Probe], limit_gib: float | None) -> int | None:
    """The largest batch whose peak reserved memory, on the line through the two largest fitting
    batches, stays within the limit; None without a limit or two such points."""
    points = sorted((p.batch_size, p.peak_reserved_gib) for p in fitted if p.peak_reserved_gib is not None)
    if limit_gib is None or len(points) < 2:
        return None
    (b1, m1), (b2, m2) = points[-2:]
    slope = (m2 - m1) / (b2 - b1)
    if slope <= 0:
        return None
    return b2 + math.floor((limit_gib - m2) / slope)


def largest_batch_for(spec: RunSpec, fitting: int) -> int:
    """The batch to measure: the largest that fits and, with global_batch_size, divides its per-rank share."""
    if not spec.global_batch_size:
        return fitting
    share = spec.global_batch_size // spec.world_size
    return max(b for b in range(1, fitting + 1) if share % b == 0)


def search_batch_size(
    search: BatchSearch,
    spec: RunSpec,
    env: DistEnv,
    blocks,
    build: Build,
    on_first_step: Callable[[int], None],
    log: Callable[[str], None],
) -> RunSpec:
    """Probe batches into `search` (the caller keeps it, so a failure record still has the probes);
    return the spec to measure. Raises torch.OutOfMemoryError when not even the smallest batch fits."""
    started = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_TIMEOUT_S))
    search.capacity_gib = _free_device_memory(env.device)
    while (batch := next_batch(search.probes, search.first_batch, search.cap, search.limit_gib)) is not None:
        probe = _probe(spec, env, blocks, build, on_first_step, batch, search.limit_gib, group)
        search.probes.append(probe)
        speed = f", {probe.tokens_per_s_per_gpu:,.0f} tokens/s/gpu" if probe.tokens_per_s_per_gpu else ""
        log(f"batch {batch}: {probe.status} (peak {probe.peak_memory_gib:.2f} GiB{speed}, {probe.wall_s:.1f} s)")
    search.wall_s = time.perf_counter() - started
    dist.destroy_process_group(group)
    fitting = search.largest_fitting_batch
    if not fitting:
        raise torch.OutOfMemoryError(
            f"batch_size: auto: no batch fits; batch {search.smallest_failing_batch} "
            f"was {search.probes[-1].status} ({search.probes[-1].error or 'over the margin'})"
        )
    search.chosen_batch_size = largest_batch_for(spec, fitting)
    return spec.with_batch_size(search.chosen_batch_size)


def _probe(
    spec: RunSpec,
    env: DistEnv,
    blocks,
    build: Build,
    on_first_step: Callable[[int], None],
    batch: int,
    limit_gib: float | None,
    group,
) -> Probe:
    started = time.perf_counter()
    oom, error, step_time = 0.0, "", 0.0
    try:
        reading, step_time = _train_probe(spec, env, blocks, build, on_first_step, batch)
    except Exception as exc:
        if not is_oom(exc):
            raise
        oom, error = 1.0, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        reading = memory_reading(env.device)  # the peak up to the allocation that failed
    peak = reading.get("peak_allocated_gib", reading["cpu_max_rss_gib"])
    reserved = reading.get("peak_reserved_gib", -1.0)
    # Agree before releasing: a rank stuck in a collective its peer left by an OOM would also
    # block the release's device synchronisation, and then this times out instead.
    agreed = torch.tensor([oom, peak, reserved, step_time], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    oom, peak, reserved, step_time = agreed.tolist()
    _release(spec, env.device)
    if oom:
        status: ProbeStatus = "oom"
        error = error or "another rank ran out of memory"
    elif limit_gib is not None and reserved > limit_gib:
        status = "over_margin"
    else:
        status = "ok"
    return Probe(
        batch_size=batch,
        status=status,
        peak_memory_gib=peak,
        peak_reserved_gib=reserved if reserved >= 0 else None,
        tokens_per_s_per_gpu=batch * spec.seq_len / step_time if status != "oom" and step_time > 0 else None,
        wall_s=time.perf_counter() - started,
        error=error,
    )


def _train_probe(
    spec: RunSpec, env: DistEnv, blocks, build: Build, on_first_step: Callable[[int], None], batch: int
) -> tuple[dict[str, float], float]:
    """Build at `batch` and train the probe's steps; returns the memory reading and the median
    time of the steps after the first."""
    probe = spec.replace(batch_size=batch, grad_accum=1, steps=spec.batch_probe_steps, warmup_steps=1)
    reset_peak_memory(env.device)
    model, optimizer, vocab_size = build(probe)
    reset_peak_memory(env.device)  # like a measured cell: the peak of training, not of building
    batches = training_batches(blocks, vocab_size, batch, spec.seq_len, spec.seed, env.rank, env.world_size, env.device)

    def on_step_end(step: int, _log: object) -> None:
        if step == 0:
            on_first_step(batch)

    log = train(model, optimizer, batches, probe, env, probe.steps, warmup=1, on_step_end=on_step_end)
    step_times, _ = log.timed(1)
    return memory_reading(env.device), median(step_times)


def _release(spec: RunSpec, device: torch.device) -> None:
    """Free what a probe left: its objects are unreachable once its frames are gone (an OOM's
    traceback too, after the except block), but FSDP's and DDP's modules hold reference cycles."""
    if spec.compile:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    reset_peak_memory(device)


def _free_device_memory(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / GIB
