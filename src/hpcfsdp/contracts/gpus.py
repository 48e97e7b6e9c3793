"""The one table of GPUs: memory (what `plan --memory`, slurm.gpu_name and the report's GPU sizes
use) and dense bf16 peak (what MFU divides by), matched by a fragment of the CUDA device name.

And the words for a rank (`rank_words`: GPU, or process on the CPU) that every command prints.

Standard library only: the login side (spec, sweep, results) and the compute side (cell/metrics)
both read it.
"""

from __future__ import annotations

from collections.abc import Iterable
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


@dataclass(frozen=True)
class RankWords:
    """What a rank is called wherever a count, a rate or a cost of ranks is printed: a GPU, or a
    process where the cells ran (or will run) on the CPU. One rule for every command and table:
    `rank_words`."""

    one: str  # "GPU" | "process"

    @property
    def count(self) -> str:
        """After a number: "2 GPU(s)", "2 process(es)"."""
        return f"{self.one}(s)" if self.one == "GPU" else f"{self.one}(es)"

    @property
    def per(self) -> str:
        return f"per {self.one}"

    @property
    def rate(self) -> str:
        """A table's header for tokens/s per rank."""
        return f"tokens/s/{self.one.lower()}"

    @property
    def hours(self) -> str:
        return f"{self.one}-hours"


GPU_WORDS = RankWords("GPU")
PROCESS_WORDS = RankWords("process")


def rank_words(devices: Iterable[object]) -> RankWords:
    """Process words where every known device is the CPU (a spec's `device: cpu`, a record's
    device_type `cpu`) and at least one is known; GPU words otherwise (`auto` on a login node
    means the cluster's GPUs)."""
    known = [str(device) for device in devices if device is not None and device == device]  # NaN != NaN
    return PROCESS_WORDS if known and all(device == "cpu" for device in known) else GPU_WORDS


def rank_words_named(one: object) -> RankWords:
    """The words a file saved by their name (tune.json's `rank`): process words for "process",
    GPU words for anything else (a file of an earlier hpcfsdp has none)."""
    return PROCESS_WORDS if one == PROCESS_WORDS.one else GPU_WORDS
