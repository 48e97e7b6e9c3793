"""FLOPs per token, MFU, and memory readings. docs/metrics.md gives the formulas."""

from __future__ import annotations

import math
import resource
import statistics
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ...contracts.gpus import gpu_named
from ...contracts.record import OkRecord, Spread
from ...contracts.spec import RunSpec
from ..ranks.distributed import DistEnv, all_gather_objects, all_reduce_max


@dataclass
class TrainLog:
    """Per-step measurements on this rank. Losses are averaged over ranks and micro-batches."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    data_times_s: list[float] = field(default_factory=list)
    window_s: float = 0.0  # wall time of the steps after warm-up, between two device syncs
    # stop_when_stable (tune's probes): each step's clipping and optimizer step, between two device
    # syncs, so that other gradient accumulations can be computed from one (tune/accumulation.py)
    optimizer_times_s: list[float] = field(default_factory=list)

    def timed(self, warmup: int) -> tuple[list[float], list[float]]:
        return self.step_times_s[warmup:], self.data_times_s[warmup:]


@dataclass(frozen=True)
class FlopCount:
    flops_per_token: float
    non_embedding_params: int
    tied_lm_head: bool


def flops_per_token(model: nn.Module, seq_len: int) -> FlopCount:
    """6 x non-embedding params + 12 x layers x hidden x seq (attention scores and values), plus
    6 x vocab x hidden when the LM head is tied to the input embedding: its matmul is real work
    but its weight is not among the non-embedding parameters."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    tied = bool(getattr(config, "tie_word_embeddings", False))
    non_embedding = total - embedding
    hidden, layers = config.hidden_size, config.num_hidden_layers
    flops = 6 * non_embedding + 12 * layers * hidden * seq_len + (6 * embedding if tied else 0)
    return FlopCount(float(flops), int(non_embedding), tied)


def peak_tflops(device_name: str, override: float = 0.0) -> float:
    """Dense bf16 peak of the device, 0.0 when unknown (then MFU is not reported)."""
    if override:
        return override
    gpu = gpu_named(device_name)
    return gpu.peak_bf16_tflops if gpu else 0.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_capacity_gib(device: torch.device) -> float | None:
    """The GPU's total memory as torch sees it (GiB); None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 1024**3


def memory_reading(device: torch.device) -> dict[str, float]:
    """Memory in GiB: CUDA allocator figures on a GPU, process peak RSS everywhere."""
    gib = 1024**3
    reading = {"cpu_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        reading.update(
            allocated_gib=stats.get("allocated_bytes.all.current", 0) / gib,
            peak_allocated_gib=stats.get("allocated_bytes.all.peak", 0) / gib,
            reserved_gib=stats.get("reserved_bytes.all.current", 0) / gib,
            peak_reserved_gib=stats.get("reserved_bytes.all.peak", 0) / gib,
            alloc_retries=float(stats.get("num_alloc_retries", 0)),
            ooms=float(stats.get("num_ooms", 0)),
        )
    return reading


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class NvmlSampler:
    """Samples GPU utilisation, SM clock and power of one GPU in a background thread, and reads
    its total-energy counter (nvmlDeviceGetTotalEnergyConsumption, mJ since the driver loaded) at
    start and stop.

    `start()` when the timed steps begin (after warm-up and compilation), `stop()` after them;
    does nothing when NVML is absent, so a record simply has no GPU-utilisation fields then, and
    no energy where the GPU has no energy counter (before Volta) either.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.1) -> None:
        self.device = device
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (util %, SM clock MHz, power W)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self._energy_mj: list[int | None] = []  # the counter at start and at stop

    def start(self) -> None:
        if self.device.type != "cuda" or self._thread is not None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(_cuda_uuid(self.device))
        except Exception:
            return
        self._energy_mj.append(self._energy_counter())
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _energy_counter(self) -> int | None:
        import pynvml

        try:
            return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except pynvml.NVMLError:  # not supported on this GPU
            return None

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(self.interval_s):
            util = pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            clock = pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
            power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000
            self.samples.append((float(util), float(clock), float(power)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._energy_mj.append(self._energy_counter())

    @property
    def energy_j(self) -> float | None:
        """Joules between start() and stop(); None without both counter readings."""
        start, stop = (self._energy_mj + [None, None])[:2]
        if start is None or stop is None or len(self._energy_mj) != 2:
            return None
        return (stop - start) / 1000

    def summary(self) -> dict[str, float | None]:
        if not self.samples:
            return {"energy_j": self.energy_j}
        util, clock, power = zip(*self.samples)
        return {
            "gpu_util_mean": statistics.fmean(util),
            "gpu_util_min": min(util),
            "sm_clock_mhz_mean": statistics.fmean(clock),
            "power_w_mean": statistics.fmean(power),
            "nvml_samples": float(len(self.samples)),
            "energy_j": self.energy_j,
        }


def _cuda_uuid(device: torch.device) -> str:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


COMM_MARKERS = ("nccl", "gloo:")


def quiet_profiler() -> None:
    """Silence torch.profiler's warning that a schedule's cycles drop earlier events: each profile
    here is one cycle, and torch 2.11 warns even then, on every rank, into the user's terminal."""
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")


class Span(NamedTuple):
    """One event of a communication profile as the breakdown reads it: its name, its start and end
    (microseconds), whether it ran on the device's timeline, and whether it is an annotation (a
    `record_function` range, not work)."""

    name: str
    start_us: float
    end_us: float
    on_device: bool
    annotation: bool


def communication_breakdown(events: Iterable[Span], steps: int) -> dict[str, float]:
    """Seconds per step in collectives, and the part not hidden behind compute.

    On a GPU: collective kernels (NCCL) against all other kernels on the device timeline; the
    exposed part is the time covered by collectives and by no compute kernel. On CPU (gloo) the
    collectives run on helper threads and there is no device timeline: all of it counts as exposed.

    On a GPU the profiler may also project annotations onto the device timeline (`gpu_user_annotation`:
    "ProfilerStep#N", FSDP's record_function ranges). They are spans, not kernels: one of them
    covers the whole step, and counted as compute it hid every collective (exposed 0.000 s).
    """
    events = list(events)
    comm, compute = [], []
    on_device = any(event.on_device for event in events)
    for event in events:
        if on_device and (not event.on_device or event.annotation):
            continue
        span = (event.start_us, event.end_us)
        if any(marker in event.name.lower() for marker in COMM_MARKERS):
            comm.append(span)
        elif on_device:
            compute.append(span)
    comm_us = _union_length(comm)
    exposed_us = _union_length(comm) - _overlap(_merge(comm), _merge(compute)) if on_device else comm_us
    return {"comm_s_per_step": comm_us / 1e6 / steps, "comm_exposed_s_per_step": exposed_us / 1e6 / steps}


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _union_length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _merge(spans))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, merged span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _steps_timed_alone(spec: RunSpec, env: DistEnv) -> bool:
    """Whether each step's time is its own: a device sync ends every step (`sync_each_step`), or
    the device is the CPU, whose work is done when the host's call returns. Without, a GPU step's
    host time is the time to queue its kernels, not to run them."""
    return spec.sync_each_step or env.device.type == "cpu"


def tokens_spread(slowest: list[float], tokens_per_gpu_step: float, timed_alone: bool) -> Spread | None:
    """tokens/s per GPU at the 10th and 90th percentile of the window's steps (each on its slowest
    rank): p10 is the slow end. None where the steps were not timed one by one, or none was."""
    rates = [tokens_per_gpu_step / t for t in slowest if t > 0]
    if not timed_alone or not rates:
        return None
    return {"p10": percentile(rates, 0.1), "p90": percentile(rates, 0.9)}


def figures_so_far(spec: RunSpec, env: DistEnv, log: TrainLog) -> dict[str, Any]:
    """A cell stopped at its time limit mid-training: the figures of the steps it finished, on this
    rank (no collective: its peers are ending too), and the words the record's error adds for them."""
    done = len(log.step_times_s)
    timed = log.step_times_s[spec.warmup_steps : done]
    figures: dict[str, Any] = {"finished_steps": done, "losses": log.losses[:done]}
    said = [f"after {done} of {spec.steps} steps"]
    if timed:
        step_time = median(timed)
        tokens_per_s = spec.batch_size * spec.seq_len * spec.grad_accum * env.world_size / step_time
        figures |= {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "timed_steps": len(timed)}
        said.append(f"{tokens_per_s:,.0f} tokens/s")
    if figures["losses"]:
        figures["final_loss"] = figures["losses"][-1]
        said.append(f"loss {figures['final_loss']:.4g}")
    return figures | {"said": f"{said[0]}" + (f" ({', '.join(said[1:])})" if said[1:] else "")}


def ok_record(spec: RunSpec, env: DistEnv, log: TrainLog, flops: float, memory: dict) -> OkRecord:
    step_times, data_times = log.timed(spec.warmup_steps)
    slowest = [all_reduce_max(t, env) for t in step_times]  # a step ends when its slowest rank ends
    window_step_time = all_reduce_max(log.window_s, env) / len(step_times)
    step_time = median(slowest) if spec.sync_each_step else window_step_time
    tokens_per_step = spec.batch_size * spec.seq_len * spec.grad_accum * env.world_size
    tokens_per_s = tokens_per_step / window_step_time  # the window's mean, in every kind of run
    name = device_name(env.device)
    peak = peak_tflops(name, spec.peak_tflops) if env.device.type == "cuda" else spec.peak_tflops
    tflops = tokens_per_s / env.world_size * flops / 1e12
    memory_max = {stage: {k: all_reduce_max(v, env) for k, v in reading.items()} for stage, reading in memory.items()}
    record: OkRecord = {}
    if log.optimizer_times_s:  # stop_when_stable: the optimizer's share of a step, on its slowest rank
        record["optimizer_step_s"] = median(
            [all_reduce_max(t, env) for t in log.optimizer_times_s[spec.warmup_steps :]]
        )
    return record | {
        "status": "ok",
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / env.world_size,
        "tokens_per_s_spread": tokens_spread(slowest, tokens_per_step / env.world_size, _steps_timed_alone(spec, env)),
        "samples_per_s": tokens_per_s / spec.seq_len,
        "step_time_s": step_time,
        "step_time_p90_s": percentile(slowest, 0.9),
        "step_times_s": slowest,
        "window_step_time_s": window_step_time,
        "warmup_steps": spec.warmup_steps,
        "timed_steps": len(slowest),
        "data_time_fraction": sum(data_times) / sum(step_times) if step_times else float("nan"),
        "flops_per_token": flops,
        "tflops_per_gpu": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "memory": memory_max,
        "peak_memory_gib": memory_max["end"].get("peak_allocated_gib", memory_max["end"]["cpu_max_rss_gib"]),
        "peak_memory_kind": "cuda_peak_allocated" if env.device.type == "cuda" else "cpu_max_rss",
        "memory_capacity_gib": memory_capacity_gib(env.device),
        "losses": log.losses,
        "final_loss": log.losses[-1],
    }


def gpu_utilisation(summary: dict[str, float | None], env: DistEnv) -> OkRecord:
    """The record's fields of the per-GPU NVML summaries from every rank: energy per rank, and their
    mean / min over the job."""
    gathered: list[dict[str, Any]] = all_gather_objects(summary)  # type: ignore[assignment]
    per_gpu = [s for s in gathered if s.get("nvml_samples")]
    energy = [s["energy_j"] for s in gathered if s.get("energy_j") is not None]
    out: OkRecord = {"energy_per_rank_j": energy if len(energy) == len(gathered) else None}
    if not per_gpu:
        return out
    return {
        **out,
        "gpu_util_mean": sum(s["gpu_util_mean"] for s in per_gpu) / len(per_gpu),
        "gpu_util_min": min(s["gpu_util_min"] for s in per_gpu),
        "sm_clock_mhz_mean": sum(s["sm_clock_mhz_mean"] for s in per_gpu) / len(per_gpu),
        "power_w_mean": sum(s["power_w_mean"] for s in per_gpu) / len(per_gpu),
        "gpu_utilisation_per_rank": per_gpu,
    }


def energy(per_rank_j: list[float] | None, record: OkRecord) -> OkRecord:
    """Energy of the timed steps (NVML's counter, summed over ranks) and what a token costs.

    GPU-hours per billion tokens = 1e9 / (3600 x tokens/s per GPU): devices x hours, for every
    record with a throughput, a CPU run's included (then device-hours of its processes)."""
    tokens = record["tokens_per_step"] * record["timed_steps"]
    energy = sum(per_rank_j) if per_rank_j else None
    return {
        "energy_j": energy,
        "joules_per_token": energy / tokens if energy is not None and tokens else None,
        "gpu_hours_per_billion_tokens": 1e9 / (3600 * record["tokens_per_s_per_gpu"]),
    }


def full_param_norm(model) -> float:
    """L2 norm over the full (unsharded) parameters: equal across strategies when training is equal."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return math.fsum(float(t.double().pow(2).sum()) for t in state.values()) ** 0.5


def parameter_sums(model: nn.Module) -> list[float]:
    """Each parameter's local shard summed in float64, one tensor at a time: a fingerprint that an
    optimizer step moves (seed 003's optimizer built before sharding leaves every one as it was)."""
    with torch.no_grad():
        return [float(torch.sum(_local_tensor(p), dtype=torch.float64)) for p in model.parameters()]


def parameters_changed(model: nn.Module, before: list[float], env: DistEnv) -> tuple[int, int]:
    """(how many of the model's parameters changed on any rank since `before`, how many there are):
    the evidence that the model trained, or that it did not."""
    after = parameter_sums(model)
    moved = torch.tensor([a != b for a, b in zip(after, before, strict=True)], dtype=torch.int32, device=env.device)
    if torch.distributed.is_initialized() and len(moved):  # a shard may be empty on one rank
        torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.MAX)
    return int(moved.sum()), len(after)


def _local_tensor(parameter: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), or the tensor itself."""
    to_local = getattr(parameter, "to_local", None)
    return to_local() if callable(to_local) else parameter
