"""The one table of GPUs: memory (what `plan --memory`, slurm.gpu_name and the report's GPU sizes
use) and dense bf16 peak (what MFU divides by), matched by a fragment of the CUDA device name.

Standard library only: the login side (spec, sweep, results) and the compute side (cell/metrics)
both read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    fragment: str  # matched, case-insensitively, inside the CUDA device name
    memory_gib: float | None  # device memory as nvidia-smi reports it; None: it varies (GH200: 96 or 144 GB)
    peak_bf16_tflops: float  # dense bf16 tensor-core peak, TFLOP/s, no sparsity


# The first match wins, so specific names come first ("GH200" before "H200", "A100 80GB" before
# "A100" before "A10").
GPUS = (
    Gpu("GH200", None, 989.5),
    Gpu("H200", 140.4, 989.5),
    Gpu("H100 NVL", 93.6, 835.0),
    Gpu("H100 PCIe", 79.6, 756.0),
    Gpu("H100", 79.6, 989.5),
    Gpu("B200", 179.1, 2250.0),
    Gpu("A100-SXM4-80GB", 80.0, 312.0),
    Gpu("A100 80GB", 80.0, 312.0),
    Gpu("A100", 40.0, 312.0),
    Gpu("A800", None, 312.0),
    Gpu("L40S", 44.4, 362.05),
    Gpu("A10", 22.5, 125.0),
    Gpu("V100", 32.0, 125.0),
)


def gpu_named(device_name: str) -> Gpu | None:
    """The table's row for a device name, e.g. "NVIDIA H200"; None if unknown."""
    return next((gpu for gpu in GPUS if gpu.fragment.lower() in device_name.lower()), None)


def gpu_memory_gib(device_name: str) -> float | None:
    """A GPU's memory by (a fragment of) its name, e.g. "NVIDIA H200" -> 140.4; None if unknown."""
    gpu = gpu_named(device_name)
    return gpu.memory_gib if gpu else None


def known_memory_sizes() -> list[str]:
    """The names whose memory is known, as an error message lists them."""
    return [gpu.fragment for gpu in GPUS if gpu.memory_gib]
