"""Run one cell: build model, apply strategy, train, measure, write the record.

Called by `hpcfsdp run` (under torchrun or by hand) and by each Slurm array task (submitit).
A failing cell still leaves a record that says why.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from . import __version__
from .data import synthetic_batches
from .distributed import DistEnv, all_gather_objects, all_reduce_max, init_distributed, shutdown
from .metrics import device_name, flops_per_token, median, memory_reading, peak_tflops, percentile, reset_peak_memory
from .models import build_model
from .record import RECORD_NAME, write_record
from .spec import RunSpec
from .strategies import param_dtype, parallelize
from .train import TrainLog, build_optimizer, train

SPEC_NAME = "spec.json"


@dataclass(frozen=True)
class CellJob:
    """What an array task needs: where the cell's spec lives and where its record goes."""

    cell_dir: str

    def __call__(self) -> str:
        return run_cell_dir(Path(self.cell_dir))


def write_cell_spec(cell_dir: Path, spec: RunSpec, cell_id: str, sweep: str) -> Path:
    cell_dir.mkdir(parents=True, exist_ok=True)
    path = cell_dir / SPEC_NAME
    path.write_text(json.dumps({"cell_id": cell_id, "sweep": sweep, "spec": spec.to_dict()}, indent=2))
    return path


def run_cell_dir(cell_dir: Path) -> str:
    meta = json.loads((cell_dir / SPEC_NAME).read_text())
    spec = RunSpec.from_dict(meta["spec"], where=str(cell_dir / SPEC_NAME))
    return run_cell(spec, cell_dir, cell_id=meta["cell_id"], sweep=meta["sweep"])


def run_cell(spec: RunSpec, cell_dir: Path, cell_id: str, sweep: str) -> str:
    """Train one cell on this process's rank and write the record; returns the status."""
    started = time.time()
    env = init_distributed(spec.device)
    stage = "setup"
    try:
        if env.world_size != spec.world_size:
            raise RuntimeError(
                f"world size {env.world_size} does not match the spec's nodes x gpus_per_node = "
                f"{spec.nodes} x {spec.gpus_per_node}; launch {spec.world_size} processes"
            )
        stage = "model"
        model = build_model(spec.model, param_dtype(spec), env.device, spec.seed)
        flops = flops_per_token(model, spec.seq_len)
        vocab_size = model.config.vocab_size
        memory = {"after_model": memory_reading(env.device)}
        stage = "shard"
        model, optimizer, optimizer_tracks_model = _parallelize_with_optimizer(model, spec, env)
        memory["after_shard_and_optimizer"] = memory_reading(env.device)
        stage = "train"
        reset_peak_memory(env.device)
        batches = synthetic_batches(vocab_size, spec.batch_size, spec.seq_len, spec.seed, env.rank, env.device)
        if env.is_main:
            print(f"[hpcfsdp] {cell_id}: training {spec.steps} steps on {env.world_size} x {env.device.type}", flush=True)
        log = train(model, optimizer, batches, spec, env, on_step_end=lambda s: _progress(env, spec, s))
        memory["end"] = memory_reading(env.device)
        record = _ok_record(spec, env, log, flops.flops_per_token, memory)
        record.update(flops_tied_lm_head=flops.tied_lm_head, non_embedding_params=flops.non_embedding_params,
                      optimizer_tracks_model=optimizer_tracks_model)
        if spec.record_param_norm:
            record["final_param_norm"] = full_param_norm(model)
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure must become a record
        status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "error"
        record = {"status": status, "stage": stage, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(), "failed_rank": env.rank}
        print(f"[hpcfsdp] {cell_id}: rank {env.rank} failed at {stage}: {type(exc).__name__}: {exc}", flush=True)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    hosts = all_gather_objects(node) if status == "ok" else [node]
    if env.is_main or status != "ok":
        record.update(_context(spec, env, cell_id, sweep, hosts, started))
        write_record(cell_dir / RECORD_NAME, record)
    shutdown()
    if status != "ok":
        # Leave no rank waiting in a collective: a non-zero exit makes torchrun / srun end the others.
        raise SystemExit(f"cell {cell_id} failed: {record['error']}")
    return status


def _parallelize_with_optimizer(model, spec: RunSpec, env: DistEnv):
    """Build the optimizer after sharding (right), before it (the known broken way), or before it
    with its parameter references remapped to the sharded parameters (the fix)."""
    if spec.optimizer_order == "after_shard":
        model = parallelize(model, spec, env)
        optimizer = build_optimizer(model, spec)
    else:
        optimizer = build_optimizer(model, spec)
        unsharded = list(model.parameters())
        model = parallelize(model, spec, env)
        if spec.optimizer_order == "before_shard_fixed":
            remap = dict(zip(map(id, unsharded), model.parameters()))
            for group in optimizer.param_groups:
                group["params"] = [remap[id(p)] for p in group["params"]]
    model_params = {id(p) for p in model.parameters()}
    tracked = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return model, optimizer, model_params == tracked


def full_param_norm(model) -> float:
    """L2 norm over the full (unsharded) parameters: equal across strategies when training is equal."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return float(sum(t.double().pow(2).sum() for t in state.values()) ** 0.5)


def _progress(env: DistEnv, spec: RunSpec, step: int) -> None:
    if env.is_main and (step + 1) % max(1, spec.steps // 5) == 0:
        print(f"[hpcfsdp]   step {step + 1}/{spec.steps}", flush=True)


def _ok_record(spec: RunSpec, env: DistEnv, log: TrainLog, flops: float, memory: dict) -> dict[str, Any]:
    step_times, data_times = log.timed(spec.warmup_steps)
    slowest = [all_reduce_max(t, env) for t in step_times]  # a step ends when its slowest rank ends
    step_time = median(slowest)
    tokens_per_step = spec.batch_size * spec.seq_len * spec.grad_accum * env.world_size
    tokens_per_s = tokens_per_step / step_time
    name = device_name(env.device)
    peak = peak_tflops(name) if env.device.type == "cuda" else 0.0
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
        "warmup_steps": spec.warmup_steps,
        "timed_steps": len(slowest),
        "data_time_fraction": sum(data_times) / sum(step_times) if step_times else float("nan"),
        "flops_per_token": flops,
        "tflops_per_gpu": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "memory": memory_max,
        "peak_memory_gib": memory_max["end"].get("peak_allocated_gib", memory_max["end"]["cpu_max_rss_gib"]),
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
        "backend": env.backend,
        "hostnames": sorted(set(hosts)),
        "slurm": {k: os.environ.get(f"SLURM_{k.upper()}") for k in ("job_id", "array_job_id", "array_task_id", "job_nodelist")},
        "versions": {
            "hpcfsdp": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        },
        "git_commit": _git_commit(),
        "started_at": started,
        "duration_s": time.time() - started,
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
