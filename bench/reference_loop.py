"""The plain FSDP2 training loop that tutorials write: the reference bench/versus_reference.sh
measures the suite against. It does not import hpcfsdp.

Per-layer `fully_shard`, per-layer `torch.compile`, fused AdamW, bf16 compute through
MixedPrecisionPolicy, the model's own loss (full logits), random tokens. Each step is timed
between two device synchronisations; the warm-up steps (compilation) are left out. Prints one line:

    REFERENCE_RESULT {"tokens_per_s_per_gpu": ..., "step_time_s": ..., ...}

    torchrun --standalone --nproc-per-node 2 bench/reference_loop.py --seq-len 8192 --batch-size 2
    torchrun --standalone --nproc-per-node 2 bench/reference_loop.py --device cpu --model tiny --seq-len 64  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

PRESETS = Path(__file__).resolve().parents[1] / "src" / "hpcfsdp" / "presets"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="plain per-layer FSDP2 loop, timed")
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a preset name from src/hpcfsdp/presets/")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2, help="per GPU")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="timed steps after the warm-up")
    parser.add_argument(
        "--precision",
        choices=("bf16", "bf16_mixed"),
        default="bf16",
        help="bf16: parameters stored in bf16; bf16_mixed: fp32 parameters, bf16 compute, fp32 gradient reduction",
    )
    parser.add_argument("--zero3", action="store_true", help="reshard after forward (default: ZeRO-2, keep gathered)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (world,))

    config = AutoConfig.for_model(**json.loads((PRESETS / f"{args.model}.json").read_text()))
    config.use_cache = False
    torch.manual_seed(args.seed)
    param_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=param_dtype)

    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if args.precision == "bf16_mixed" else torch.bfloat16
    )
    layers = model.model.layers
    for index, layer in enumerate(layers):
        if not args.no_compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=args.zero3 and index < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=args.zero3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    generator = torch.Generator().manual_seed(args.seed * 100_003 + rank)
    step_times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=generator).to(device)
        synchronize(device)
        started = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:
            step_times.append(time.perf_counter() - started)
        losses.append(loss.item())

    slowest = torch.tensor(step_times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    step_time = statistics.median(slowest.tolist())
    on_gpu = device.type == "cuda"
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {
            "tokens_per_s_per_gpu": args.batch_size * args.seq_len / step_time,
            "step_time_s": step_time,
            "step_times_s": slowest.tolist(),
            "model": args.model,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "world_size": world,
            "precision": args.precision,
            "zero3": args.zero3,
            "compile": not args.no_compile,
            "warmup": args.warmup,
            "timed_steps": args.steps,
            "peak_memory_gib": peak.item(),
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        }
        print("REFERENCE_RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
