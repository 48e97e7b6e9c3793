"""Process group and device mesh from torchrun's or Slurm's (via submitit) environment."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .devices import choose_device
from .ports import free_port, slurm_port


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def export_launcher_env() -> str:
    """Make RANK/WORLD_SIZE/MASTER_* available; return which launcher provided them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        os.environ.setdefault("MASTER_PORT", str(slurm_port(os.environ["SLURM_JOB_ID"])))
        # Slurm already narrows CUDA_VISIBLE_DEVICES to the allocation; we pick cuda:LOCAL_RANK inside it.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return "slurm"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    return "single"


class StartupError(RuntimeError):
    """The device or the process group could not be set up: one line, for the record."""


def init_distributed(device_kind: str, timeout_s: float) -> DistEnv:
    """The process group, whose collectives wait at most timeout_s (set_collective_timeout
    changes it once training runs). Under NCCL, errors are handled asynchronously: a collective
    past its timeout aborts the communicators and ends the process, the backstop behind
    watchdog.py, which ends a hung rank with a record before that."""
    export_launcher_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    timeout = timedelta(seconds=timeout_s)
    if use_cuda:
        if not torch.cuda.is_available():
            raise StartupError("device: cuda was asked for but torch sees no GPU on this node")
        # LOCAL_RANK's entry of the GPUs Slurm or the user made visible (devices.py, docs/clusters.md)
        device = torch.device("cuda", choose_device(os.environ).index % torch.cuda.device_count())
        try:
            torch.cuda.set_device(device)
            torch.empty(1, device=device)  # the CUDA context: a device held by another process fails here
        except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StartupError(
                f"{device} could not be set up ({first}): another process may still hold it "
                "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv lists them)"
            ) from exc
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
        backend=dist.get_backend(),
    )


@functools.cache
def build_mesh(env: DistEnv, replicate: int = 0) -> DeviceMesh:
    """1-D mesh over all ranks (replicate=0), or 2-D (replicate, shard) for hybrid sharding.

    One per shape and process: `batch_size: auto` builds the model again for every probe, and
    a 2-D mesh makes new process groups (NCCL communicators hold GPU memory) each time it is made."""
    if not replicate:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        env.device.type, (replicate, env.world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def all_reduce_max(value: float, env: DistEnv) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def all_gather_objects(value: object) -> list[object]:
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def set_collective_timeout(seconds: float) -> None:
    """Every process group's collectives now wait at most `seconds` (torchtitan shortens its
    timeout the same way once the first step has run)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
