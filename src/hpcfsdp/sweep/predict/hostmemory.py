"""Predicted host memory (RAM) per node of a cell, before anything is queued (`plan --memory`, and
the preflight's check against what Slurm will give the job: sweep/launch/preflight.py).

Like memory.py (the GPU side, whose prediction it reuses for cells that train on the CPU) it reads
the model's config.json and the cell's RunSpec and imports no torch. Units are GiB. Per rank:

  runtime   the process itself: Python, torch, transformers and gloo, measured as the peak RSS
            of a rank of the tiny model; a GPU rank's includes the CUDA context and the code the
            CUDA libraries load into host memory
  model     what the rank holds of the model in host memory: on the CPU the whole training peak
            (memory.py's prediction); on a GPU the pretrained weights, which are loaded whole on
            the host before they move to the GPU: the checkpoint's pages (mapped, bf16) and the
            copy in the storage dtype (a random init is built on the GPU)
  offload   cpu_offload: the rank's shard of the parameters, gradients and AdamW's two states in
            pinned host memory, half a shard more of gradients on their way to it, and the
            optimizer step's temporary (foreach AdamW's, as on the GPU: memory.py)

and once per node the supervisor (cell/supervise/), which imports the ranks' code and forks them
from there and stays beside them: Slurm's memory accounting without cgroups (jobacct_gather/linux,
OverMemoryKill) sums the RSS of the step's processes, so it counts the supervisor, and again in each
rank the pages of the imports that rank touched (the prediction is for a rank of its own, which
covers them). Once per job, on the first node: record_param_norm gathers the full model into rank 0's host
memory at the end. No DataLoader workers: the data is tokenised before the cell runs and each
rank reads its batches in the training process (the packed tokens of a real data set are not
counted: their size is known only once tokenised). A node holds gpus_per_node ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import metadata

from ...contracts.sources import Source
from ...contracts.spec import RunSpec
from ..define.matrix import Sweep
from .memory import GIB, optimizer_temporary, precision_bytes, predict, shard_degree
from .modelshape import ModelConfigError, Shape, load_shape

# Peak RSS of one rank of the tiny model (whose own memory is negligible), as the record's
# memory.end.cpu_max_rss_gib reports it: on the CPU (torch 2.13 CPU, transformers 5, gloo, this
# project's CI machine), and on a GPU (torch 2.11 CUDA 13, H100, 2026-11-23).
CPU_RUNTIME_GIB = 0.42
GPU_RUNTIME_GIB = 1.9
# A CPU rank with torch's CUDA build (PyPI's default on Linux, the one Python 3.13 gets in
# bench/debian13_suite.sh's root): its CUDA libraries' code is loaded though no GPU is used. Peak RSS
# of a tiny-model rank, torch 2.13.0 cu130, Python 3.13, 2026-11-29 (importing torch and
# transformers alone: 0.52 GiB against the CPU build's 0.23).
CPU_RUNTIME_CUDA_BUILD_GIB = 0.71
# The node's supervisor after the ranks' imports (cell.run and the model class: RSS, 2026-11-29):
# 0.41 GiB with torch's CPU build (this project's CI machine, Python 3.11), 0.67 GiB with the CUDA
# build (the Debian 13 root, Python 3.13, on the CPU). A GPU node's takes the CUDA build's: the
# supervisor initialises no CUDA (it may not fork after that: cell/ranks/forking.py). Without it a
# one-rank CPU cell of the CUDA build was predicted 0.71 GiB and used 1.10 (slurmstepd's kill line
# under the local cluster's DefMemPerNode=1000 then, Slurm 24.11 in that root).
SUPERVISOR_GIB = 0.41
SUPERVISOR_CUDA_BUILD_GIB = 0.67
CHECKPOINT_BYTES = 2  # per parameter of a pretrained checkpoint (bf16, as hub checkpoints mostly are)
# Gradients on their way to the pinned CPU copy under cpu_offload, in parameter shards: measured on
# Qwen2.5-1.5B, FSDP2 ZeRO-3, 1 x H100 (27.8 GiB peak RSS with fused AdamW: 4.5 shards + runtime).
OFFLOAD_STAGING_SHARDS = 0.5
# slurm.mem_gb: auto asks for the prediction plus this share of it (the allocator's free lists,
# the page cache of the files the rank reads, what the prediction leaves out), in whole GiB.
AUTO_MEM_MARGIN = 0.25


@dataclass(frozen=True)
class HostPrediction:
    """Host memory of one cell, GiB: per rank, and per node (the first node's, which is the largest)."""

    runtime_gib: float
    model_gib: float
    offload_gib: float
    rank0_gib: float  # on the first node only: record_param_norm's full model
    ranks_per_node: int
    supervisor_gib: float  # once per node

    @property
    def rank_gib(self) -> float:
        return self.runtime_gib + self.model_gib + self.offload_gib

    @property
    def node_gib(self) -> float:
        return self.supervisor_gib + self.ranks_per_node * self.rank_gib + self.rank0_gib


@functools.cache
def torch_cuda_build() -> bool:
    """Whether the torch installed here is a CUDA build (one that requires nvidia-* wheels), which
    loads the CUDA libraries on the CPU too. Read from torch's metadata: torch is not imported."""
    try:
        return any(name.startswith("nvidia-") for name in metadata.requires("torch") or ())
    except metadata.PackageNotFoundError:
        return False


def cpu_runtime_gib() -> float:
    """A CPU rank's runtime with the torch installed here."""
    return CPU_RUNTIME_CUDA_BUILD_GIB if torch_cuda_build() else CPU_RUNTIME_GIB


def supervisor_gib(on_cpu: bool) -> float:
    """The node's supervisor: the CUDA build's on a GPU node, else the torch installed here decides."""
    return SUPERVISOR_CUDA_BUILD_GIB if not on_cpu or torch_cuda_build() else SUPERVISOR_GIB


def predict_host(spec: RunSpec, shape: Shape) -> HostPrediction:
    storage = precision_bytes(spec)[0]
    params = shape.params * storage / GIB
    on_cpu = spec.device == "cpu"
    if on_cpu:
        model = predict(spec, shape).required_gib
    elif spec.init == "pretrained":
        model = shape.params * (storage + CHECKPOINT_BYTES) / GIB
    else:
        model = 0.0
    offload = 0.0
    if spec.cpu_offload and not on_cpu:
        shard = params / shard_degree(spec)
        step = optimizer_temporary(spec.replace(cpu_offload=False), shape, shard * GIB) / GIB
        offload = (4 + OFFLOAD_STAGING_SHARDS) * shard + step
    return HostPrediction(
        runtime_gib=cpu_runtime_gib() if on_cpu else GPU_RUNTIME_GIB,
        model_gib=model,
        offload_gib=offload,
        rank0_gib=params if spec.record_param_norm else 0.0,
        ranks_per_node=spec.gpus_per_node,
        supervisor_gib=supervisor_gib(on_cpu),
    )


def auto_mem_gb(node_gib: float) -> int:
    """What slurm.mem_gb: auto asks for a node predicted to need `node_gib`: whole GiB, with the margin."""
    return max(1, math.ceil(node_gib * (1 + AUTO_MEM_MARGIN)))


def predict_host_cells(cells, cache_dir: str | None = None) -> dict[str, HostPrediction | None]:
    """Cell id -> its host prediction (cells: anything with .id, .spec and .sources); None where the
    model's config is not at hand (a hub model not in the cache)."""
    shapes: dict[Source, Shape | None] = {}
    out: dict[str, HostPrediction | None] = {}
    for cell in cells:
        model = cell.sources.model
        if model not in shapes:
            try:
                shapes[model] = load_shape(model, cache_dir)
            except ModelConfigError:
                shapes[model] = None
        shape = shapes[model]
        out[cell.id] = predict_host(cell.spec, shape) if shape else None
    return out


def requested_mem_gb(sweep: Sweep, nodes: int, gpus: int) -> int:
    """--mem in GiB of the arrays of one shape: slurm.mem_gb, or with mem_gb: auto the largest
    predicted host memory per node of the sweep's cells of that shape plus the margin (the same
    for every array of the shape); 0: no --mem."""
    res = sweep.resources
    if not res.mem_auto:
        return res.mem_gb
    shaped = [cell for cell in sweep.cells if cell.shape == (nodes, gpus)]
    needs = [p.node_gib for p in predict_host_cells(shaped, res.cache_dir or None).values() if p]
    return auto_mem_gb(max(needs)) if needs else 0
