"""FLOPs per token, MFU, and memory readings. docs/metrics.md gives the formulas."""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass

import torch
from torch import nn

# Dense bf16 tensor-core peak per GPU, TFLOP/s (no sparsity), matched against the device name.
PEAK_BF16_TFLOPS = (
    ("H200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.5),
    ("GH200", 989.5),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.05),
    ("A10", 125.0),
    ("V100", 125.0),
)


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
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return 0.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
