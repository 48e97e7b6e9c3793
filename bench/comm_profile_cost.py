"""What a cell's communication profile costs, side by side in one process (issue 45, item 1).

Run under torchrun on 2 GPUs (or 2 CPU processes with MODEL=tiny DEVICE=cpu). One cell is built
once (Qwen2.5-1.5B, seq 4096, batch 4, fsdp2_zero3, full checkpointing, bf16 mixed: an ok cell of
bench/launch_phases.sh), warmed up, then rounds in rotating order of:
  - `before`: the profile as it was at a3f5631: host ops and kernels (CPU + CUDA activities),
    read through `prof.events()` with the garbage collector paused;
  - `after`: `profiling.profile_communication` as it is now (kernels only, read from the
    profiler's own results);
  - `plain`: the same 1 + comm_profile_steps steps without a profiler: what the steps cost.
Each variant is timed wall to wall (device synchronized, ranks at a barrier), and after each a
window of plain steps gives tokens/s, to show whether a profile slows the steps after it. Lines of
JSON go to $OUT/comm_profile_cost.jsonl; rank 0 prints medians and both variants' figures.
  torchrun --standalone --nproc-per-node 2 bench/comm_profile_cost.py
  ROUNDS=3 MODEL=tiny DEVICE=cpu torchrun --standalone --nproc-per-node 2 bench/comm_profile_cost.py
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from hpcfsdp.cell.build import build
from hpcfsdp.cell.data import open_data, training_batches
from hpcfsdp.cell.measure.metrics import Span, communication_breakdown, quiet_profiler
from hpcfsdp.cell.profiling import profile_communication
from hpcfsdp.cell.ranks.distributed import init_distributed
from hpcfsdp.cell.train import train
from hpcfsdp.contracts.sources import resolve_sources
from hpcfsdp.contracts.spec import RunSpec

WINDOW_STEPS = 6


def profile_before(model, optimizer, batches, spec, env) -> dict[str, float]:
    """The communication profile as at a3f5631 (host ops and kernels, FunctionEvents)."""
    quiet_profiler()
    steps = spec.comm_profile_steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        log = train(model, optimizer, batches, spec, env, 1 + steps, warmup=1, on_step_end=lambda *_: prof.step())
    gc.disable()
    try:
        events = prof.events()
    finally:
        gc.enable()
    spans = [
        Span(e.name, e.time_range.start, e.time_range.end, "cuda" in str(e.device_type).lower(), e.is_user_annotation)
        for e in events
    ]
    comm = communication_breakdown(spans, steps)
    comm["comm_profile_step_time_s"] = log.window_s / steps
    comm["events"] = len(spans)
    return comm


def main() -> None:
    device = os.environ.get("DEVICE", "cuda")
    tiny = os.environ.get("MODEL", "qwen2.5-1.5b") == "tiny"
    values = {
        "model": os.environ.get("MODEL", "qwen2.5-1.5b"),
        "device": device,
        "strategy": "fsdp2_zero3",
        "gpus_per_node": int(os.environ.get("WORLD_SIZE", "2")),
        "seq_len": 64 if tiny else 4096,
        "batch_size": 4,
        "precision": "fp32" if device == "cpu" else "bf16_mixed",
        "activation_checkpointing": "none" if tiny else "full",
        "steps": 20,
        "comm_profile_steps": 2,
    }
    if device == "cuda":
        values["adamw_impl"] = "fused"
    spec, _ = RunSpec.resolved(values, "bench/comm_profile_cost.py")
    sources = resolve_sources("bench/comm_profile_cost.py", spec)
    env = init_distributed(device, 600)
    built = build(spec, sources, env, {}, lambda stage: None)
    blocks = open_data(sources.data, sources.tokenizer, spec.seq_len, spec.text_column)
    batches = training_batches(
        blocks, built.vocab_size, spec.batch_size, spec.seq_len, spec.seed, env.rank, env.world_size, env.device
    )
    model, optimizer = built.model, built.optimizer
    train(model, optimizer, batches, spec, env, 4, warmup=1)

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        dist.barrier()

    def plain() -> dict[str, float]:
        log = train(model, optimizer, batches, spec, env, 1 + spec.comm_profile_steps, warmup=1)
        return {"comm_profile_step_time_s": log.window_s / spec.comm_profile_steps}

    variants = {
        "before": lambda: profile_before(model, optimizer, batches, spec, env),
        "after": lambda: dict(profile_communication(model, optimizer, batches, spec, env)),
        "plain": plain,
    }
    names = list(variants)
    out = Path(os.environ.get("OUT", "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    tokens_per_step = spec.batch_size * spec.seq_len * env.world_size
    for round_ in range(int(os.environ.get("ROUNDS", "3"))):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            sync()
            started = time.perf_counter()
            figures = variants[name]()
            sync()
            wall = time.perf_counter() - started
            window = train(model, optimizer, batches, spec, env, 1 + WINDOW_STEPS, warmup=1)
            row = {
                "round": round_,
                "variant": name,
                "rank": env.rank,
                "wall_s": round(wall, 3),
                "tokens_per_s_per_gpu_after": round(tokens_per_step * WINDOW_STEPS / window.window_s / env.world_size),
                **{k: v for k, v in figures.items() if isinstance(v, (int, float))},
            }
            rows.append(row)
            if env.rank == 0:
                print(json.dumps(row), flush=True)
    with open(out / f"comm_profile_cost.rank{env.rank}.jsonl", "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    if env.rank == 0:
        print("variant  wall_s(median)  tokens/s/GPU after(median)  comm_s/step  exposed_s/step")
        for name in names:
            mine = [r for r in rows if r["variant"] == name]
            print(
                f"{name:8} {statistics.median(r['wall_s'] for r in mine):8.3f} "
                f"{statistics.median(r['tokens_per_s_per_gpu_after'] for r in mine):14,.0f} "
                f"{[round(r.get('comm_s_per_step', 0), 4) for r in mine]} "
                f"{[round(r.get('comm_exposed_s_per_step', 0), 4) for r in mine]}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
