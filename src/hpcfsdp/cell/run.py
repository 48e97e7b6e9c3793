"""Run one cell: build model, apply strategy, train, measure, write the record.

Called by `hpcfsdp run` (under torchrun or by hand) and by each Slurm array task (submitit).
A failing cell still leaves a record that says why. This module is the cell's sequence; Slurm's
signals are handled in signals.py, injected faults come from faults.py, and the optional
profiles and memory snapshot from profiling.py.
"""

from __future__ import annotations

import math
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import PreTrainedModel

from .. import __version__
from ..fields import SpecError
from ..record import (
    RECORD_NAME,
    SPEC_NAME,
    RecordError,
    failure_record,
    keep_as_attempt,
    read_json_object,
    read_record,
    write_record,
)
from ..sources import check_seq_len
from ..spec import RunSpec
from .batch_search import BatchSearch, is_oom, search_batch_size
from .data import open_data, training_batches
from .distributed import DistEnv, all_gather_objects, all_reduce_max, init_distributed, shutdown
from .faults import inject_fault
from .levers import check_device, float8_linear_count, install_loss
from .metrics import (
    FlopCount,
    NvmlSampler,
    device_name,
    flops_per_token,
    median,
    memory_capacity_gib,
    memory_reading,
    peak_tflops,
    percentile,
    reset_peak_memory,
)
from .models import ModelSource, build_model, materialize, resolve_model
from .profiling import memory_snapshot, profile_communication, write_trace
from .provenance import driver_version, framework_environment, git_commit
from .signals import CellCancelled, CellTimeout, handle_time_limit, restore_handlers, signal_cause
from .strategies import parallelize, param_dtype
from .summary import summary_line
from .train import Diverged, TrainLog, build_optimizer, train


def run_cell_dir(cell_dir: Path) -> str:
    meta = read_json_object(cell_dir / SPEC_NAME, kind="cell spec")
    try:
        # Validated again on the compute node: a path checked at plan time may be gone by now.
        spec = RunSpec.from_dict(meta["spec"], where=str(cell_dir / SPEC_NAME))
    except SpecError as exc:
        write_record(cell_dir / RECORD_NAME, failure_record("error", "setup", str(exc), cell=meta, **_provenance()))
        raise SystemExit(f"cell {meta['cell_id']} failed: {exc}") from None
    return run_cell(spec, cell_dir, cell_id=meta["cell_id"], sweep=meta["sweep"])


def run_cell(spec: RunSpec, cell_dir: Path, cell_id: str, sweep: str) -> str:
    """Train one cell on this process's rank and write the record; returns the status."""
    started = time.time()
    if _launch_rank() == 0:
        # Before the process group forms, so no rank has written yet: a record left by an earlier
        # run (by hand, or a command --executor print printed) is kept in attempts/, not overwritten.
        keep_as_attempt(cell_dir)
    if spec.expandable_segments:  # read when CUDA initialises, so before the process group
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    env = init_distributed(spec.device)
    progress = _Progress()
    previous_handlers = handle_time_limit()
    try:
        record = _train_cell(spec, env, cell_dir, cell_id, progress)
    except Exception as exc:  # every failure must become a record
        record = _record_exception(exc, progress.stage, env)
        if record["status"] == "oom":  # while the exception still holds the tensors of the failing step
            record.update(memory_snapshot(spec, env, cell_dir))
        print(f"[hpcfsdp] {cell_id}: rank {env.rank} failed at {progress.stage}: {record['error']}", flush=True)
    finally:
        restore_handlers(previous_handlers)
    if progress.batch_search is not None:
        record["batch_search"] = progress.batch_search.record()
        spec = progress.measured or spec  # the record holds the batch the search chose
    status = record["status"]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    hosts = all_gather_objects(node) if status == "ok" else [node]
    path = cell_dir / RECORD_NAME
    if (env.is_main or status != "ok") and not _keeps_earlier_failure(cell_dir, status):
        record.update(_context(spec, env, cell_id, sweep, hosts, started))
        write_record(path, record)
    elif env.is_main:  # another rank failed first, and its record says why
        record = _read_or(path, record)
    if env.is_main:
        print(summary_line(record, path), flush=True)
    shutdown()
    if status != "ok":
        # Leave no rank waiting in a collective: a non-zero exit makes torchrun / srun end the others.
        raise SystemExit(f"cell {cell_id} failed: {record['error']}")
    return status


@dataclass
class _Progress:
    stage: str = "setup"
    batch_search: BatchSearch | None = None  # batch_size: auto: its probes so far
    measured: RunSpec | None = None  # batch_size: auto: the spec at the batch it chose


def _train_cell(spec: RunSpec, env: DistEnv, cell_dir: Path, cell_id: str, progress: _Progress) -> dict[str, Any]:
    """The whole cell on this rank, stage by stage (set-up, data, batch search, model, shard, train,
    then the optional profiles): the ok record's fields. Memory is read after each stage (max over
    ranks later); `progress` says which stage a failure happened at."""

    def enter(stage: str) -> None:
        progress.stage = stage
        inject_fault(stage, env)

    enter("setup")
    if env.world_size != spec.world_size:
        raise RuntimeError(
            f"world size {env.world_size} does not match the spec's nodes x gpus_per_node = "
            f"{spec.nodes} x {spec.gpus_per_node}; launch {spec.world_size} processes"
        )
    check_device(spec, env.device)
    enter("data")
    blocks = open_data(spec.data, spec.text_tokenizer, spec.seq_len, spec.text_column)
    if spec.auto_batch:
        enter("batch_search")

        def say(line: str) -> None:
            if env.is_main:
                print(f"[hpcfsdp] {cell_id}: batch search: {line}", flush=True)

        progress.batch_search = BatchSearch(spec.batch_size, spec.batch_cap, spec.batch_margin, spec.batch_probe_steps)
        spec = progress.measured = search_batch_size(
            progress.batch_search,
            spec,
            env,
            blocks,
            lambda probe: _build_probe(probe, env),
            on_first_step=lambda batch: inject_fault("train_step", env, batch),
            log=say,
        )
    if spec.memory_snapshot and env.device.type == "cuda":  # after a search: the measured batch's history
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    memory: dict[str, dict[str, float]] = {}
    built = _build(spec, env, memory, enter)
    model, optimizer, flops = built.model, built.optimizer, built.flops
    enter("train")
    reset_peak_memory(env.device)
    batches = training_batches(
        blocks, built.vocab_size, spec.batch_size, spec.seq_len, spec.seed, env.rank, env.world_size, env.device
    )
    if env.is_main:
        print(f"[hpcfsdp] {cell_id}: training {spec.steps} steps on {env.world_size} x {env.device.type}", flush=True)

    sampler = NvmlSampler(env.device) if spec.nvml else None

    def on_step_end(step: int) -> None:
        if step == 0:
            inject_fault("train_step", env, spec.batch_size)
        if step == spec.warmup_steps - 1:
            memory["after_warmup"] = memory_reading(env.device)
            if sampler is not None:
                sampler.start()  # utilisation of the timed steps only
        _print_progress(env, spec, step)

    if sampler is not None and spec.warmup_steps == 0:
        sampler.start()
    try:
        log = train(model, optimizer, batches, spec, env, spec.steps, spec.warmup_steps, on_step_end)
    finally:
        if sampler is not None:
            sampler.stop()
    memory["end"] = memory_reading(env.device)
    record = _ok_record(spec, env, log, flops.flops_per_token, memory)
    record.update(
        flops_tied_lm_head=flops.tied_lm_head,
        non_embedding_params=flops.non_embedding_params,
        optimizer_tracks_model=built.optimizer_tracks_model,
        model_source=built.source.provenance,
        data_source=blocks.provenance if blocks else {"kind": "synthetic"},
    )
    if spec.float8 != "none":
        record["float8_linears"] = float8_linear_count(model)
    if sampler is not None:
        record.update(_gpu_utilisation(sampler.summary(), env))
    record.update(_energy(record.get("energy_per_rank_j"), record))
    if spec.comm_profile_steps:
        enter("comm_profile")
        record.update(profile_communication(model, optimizer, batches, spec, env))
    if spec.profile:
        enter("profile")
        record["profile_trace_dir"] = write_trace(model, optimizer, batches, spec, env, cell_dir)
    record.update(memory_snapshot(spec, env, cell_dir))
    if spec.record_param_norm:
        record["final_param_norm"] = full_param_norm(model)
    return record


@dataclass(frozen=True)
class _Built:
    model: Any
    optimizer: torch.optim.Optimizer
    optimizer_tracks_model: bool
    flops: FlopCount
    source: ModelSource
    vocab_size: int


def _build(spec: RunSpec, env: DistEnv, memory: dict, enter: Callable[[str], None]) -> _Built:
    """Model, strategy and optimizer for `spec`; memory is read after each stage."""
    enter("model")
    pretrained = spec.init == "pretrained"
    source = resolve_model(spec.model, weights=pretrained)
    model = build_model(source, param_dtype(spec), env.device, spec.seed, spec.kernels, pretrained, meta=spec.meta_init)
    if spec.meta_init and spec.family != "fsdp2":
        materialize(
            cast(PreTrainedModel, model), env.device, spec.seed
        )  # DDP holds a full replica: nothing to shard first
    check_seq_len(f"model {spec.model}", spec.seq_len, model.config.to_dict())  # hub models: unknown at plan time
    install_loss(model, spec, env.device)
    flops = flops_per_token(model, spec.seq_len)
    vocab_size = cast(int, model.config.vocab_size)
    memory["after_model"] = memory_reading(env.device)
    enter("shard")
    model, optimizer, tracks = _parallelize_with_optimizer(model, spec, env, memory)
    memory["after_optimizer"] = memory_reading(env.device)
    return _Built(model, optimizer, tracks, flops, source, vocab_size)


def _build_probe(spec: RunSpec, env: DistEnv):
    """What a batch-search probe trains: the cell's own set-up at the probe's batch."""
    built = _build(spec, env, {}, enter=lambda stage: None)
    return built.model, built.optimizer, built.vocab_size


def _gpu_utilisation(summary: dict[str, float | None], env: DistEnv) -> dict[str, Any]:
    """Per-GPU NVML summaries from every rank, and their mean / min over the job."""
    gathered: list[dict[str, Any]] = all_gather_objects(summary)  # type: ignore[assignment]
    per_gpu = [s for s in gathered if s.get("nvml_samples")]
    energy = [s.get("energy_j") for s in gathered]
    out: dict[str, Any] = {"energy_per_rank_j": energy if all(e is not None for e in energy) else None}
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


def _energy(per_rank_j: list[float] | None, record: dict[str, Any]) -> dict[str, Any]:
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


def _record_exception(exc: BaseException, stage: str, env: DistEnv) -> dict[str, Any]:
    exc = signal_cause(exc)
    if isinstance(exc, CellTimeout):
        status = "timeout"
    elif isinstance(exc, CellCancelled):
        status = exc.status
    elif is_oom(exc):
        status = "oom"
    elif isinstance(exc, Diverged):
        status = "diverged"
    else:
        status = "error"
    record = failure_record(
        status,
        stage,
        f"{type(exc).__name__}: {exc}",
        traceback.format_exc(),
        failed_rank=env.rank,
        memory_at_failure=memory_reading(env.device),
    )
    if isinstance(exc, Diverged):
        record.update(diverged_step=exc.step, losses=exc.losses)
    return record


def _read_or(path: Path, fallback: dict[str, Any]) -> dict[str, Any]:
    try:
        return read_record(path)
    except RecordError:
        return fallback


def _launch_rank() -> int:
    """This process's global rank as its launcher set it, before the process group exists."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def _launch_id() -> str:
    """Identifies one launch of the cell across its ranks (torchrun's run id, or the Slurm job)."""
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm-{slurm}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"


def _keeps_earlier_failure(cell_dir: Path, status: str) -> bool:
    """The first failing rank's record says why the cell failed; ranks that fail after it (a peer
    closed the connection, the launcher sent SIGTERM) must not overwrite it."""
    if status == "ok":
        return False
    try:
        earlier = read_record(cell_dir / RECORD_NAME)
    except (RecordError, FileNotFoundError):
        return False
    return earlier["status"] != "ok" and earlier.get("launch_id") == _launch_id()


def _parallelize_with_optimizer(model, spec: RunSpec, env: DistEnv, memory: dict):
    """Build the optimizer after sharding (right), before it (the known broken way), or before it
    with its parameter references remapped to the sharded parameters (the fix)."""
    if spec.optimizer_order == "after_shard":
        model = parallelize(model, spec, env)
        if spec.meta_init and spec.family == "fsdp2":
            materialize(model, env.device, spec.seed, offload_params=spec.cpu_offload)  # this rank's shards only
        memory["after_shard"] = memory_reading(env.device)
        optimizer = build_optimizer(model, spec)
    else:
        optimizer = build_optimizer(model, spec)
        unsharded = list(model.parameters())
        model = parallelize(model, spec, env)
        memory["after_shard"] = memory_reading(env.device)
        if spec.optimizer_order == "before_shard_fixed":
            remap = dict(zip(map(id, unsharded), model.parameters(), strict=False))
            for group in optimizer.param_groups:
                group["params"] = [remap[id(p)] for p in group["params"]]
    model_params = {id(p) for p in model.parameters()}
    tracked = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return model, optimizer, model_params == tracked


def full_param_norm(model) -> float:
    """L2 norm over the full (unsharded) parameters: equal across strategies when training is equal."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return math.fsum(float(t.double().pow(2).sum()) for t in state.values()) ** 0.5


def _print_progress(env: DistEnv, spec: RunSpec, step: int) -> None:
    if env.is_main and (step + 1) % max(1, spec.steps // 5) == 0:
        print(f"[hpcfsdp]   step {step + 1}/{spec.steps}", flush=True)


def _ok_record(spec: RunSpec, env: DistEnv, log: TrainLog, flops: float, memory: dict) -> dict[str, Any]:
    step_times, data_times = log.timed(spec.warmup_steps)
    slowest = [all_reduce_max(t, env) for t in step_times]  # a step ends when its slowest rank ends
    window_step_time = all_reduce_max(log.window_s, env) / len(step_times)
    step_time = median(slowest) if spec.sync_each_step else window_step_time
    tokens_per_step = spec.batch_size * spec.seq_len * spec.grad_accum * env.world_size
    tokens_per_s = tokens_per_step / step_time
    name = device_name(env.device)
    peak = peak_tflops(name, spec.peak_tflops) if env.device.type == "cuda" else spec.peak_tflops
    tflops = tokens_per_s / env.world_size * flops / 1e12
    memory_max = {stage: {k: all_reduce_max(v, env) for k, v in reading.items()} for stage, reading in memory.items()}
    return {
        "status": "ok",
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / env.world_size,
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


def _context(spec: RunSpec, env: DistEnv, cell_id: str, sweep: str, hosts: list, started: float) -> dict[str, Any]:
    return {
        "cell_id": cell_id,
        "sweep": sweep,
        "spec": spec.to_dict(),
        "world_size": env.world_size,
        "nodes": spec.nodes,
        "device_type": env.device.type,
        "device_name": device_name(env.device),
        "gpu_count": torch.cuda.device_count() if env.device.type == "cuda" else 0,
        "backend": env.backend,
        "hostnames": sorted(set(hosts)),
        **_provenance(),
        "started_at": started,
        "duration_s": time.time() - started,
    }


SLURM_FIELDS = ("job_id", "array_job_id", "array_task_id", "job_nodelist", "cluster_name", "job_partition")


def _provenance() -> dict[str, Any]:
    """What every record carries about where and with what it ran, whatever stage it ended in."""
    gpu = torch.cuda.is_available()
    return {
        "slurm": {k: os.environ.get(f"SLURM_{k.upper()}") for k in SLURM_FIELDS},
        "versions": {
            "hpcfsdp": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "driver": driver_version() if gpu else None,
        },
        "environment": framework_environment(os.environ),
        "git_commit": git_commit(),
        "launch_id": _launch_id(),
    }
