"""What each rank ran on, gathered once after the process group forms, and how that differs from
the cell's spec: the record's `ranks` and `resource_problems` (docs/record.md).

A cell that ran on fewer GPUs than it asked for (an `SBATCH_GRES` in the submitting shell, a
node's gres misconfigured), with two ranks on one GPU, or on fewer hosts than its `nodes`, still
measures something, only not the setup its row names. Its status stays what the run gave; its
`resource_problems` say what differed, and the readers keep it out of every ranking
(contracts/validity.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...contracts.record import RankResources
from .devices import choose_device
from .distributed import DistEnv, all_gather_objects


@dataclass(frozen=True)
class Seen:
    """One rank's resources as gathered: the record's entry, and what its environment listed."""

    ranks: RankResources
    visible_ids: tuple[str, ...]  # the GPUs its environment gives its node's tasks, as named there
    gpu: str | None  # its own GPU: UUID on a GPU, else as its environment names it


def node_name() -> str:
    """The node a rank runs on: Slurm's name for it, else the host's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def this_rank(env: DistEnv) -> Seen:
    """What this rank runs on: host, pid, device, its GPU's UUID, PCI bus id, name and memory
    (null on CPU), and the CPUs it may run on."""
    choice = choose_device(os.environ)
    entry: RankResources = {
        "rank": env.rank,
        "host": node_name(),
        "pid": os.getpid(),
        "device": str(env.device),
        "gpu_uuid": None,
        "gpu_bus_id": None,
        "gpu_name": None,
        "gpu_memory_gib": None,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    if env.device.type == "cuda":
        entry.update(gpu_identity(env.device))
    elif "SLURM_JOB_ID" not in os.environ:  # a CPU cell's GPUs are checked where Slurm gave them
        return Seen(entry, (), None)
    return Seen(entry, choice.visible_ids, entry["gpu_uuid"] or choice.gpu)


def gpu_identity(device: torch.device) -> RankResources:
    """The GPU's UUID ("GPU-..." as nvidia-smi writes it), PCI bus id, name and memory in GiB, from
    torch where its version has them, the bus id from NVML by UUID where torch lacks it."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    text = f"GPU-{uuid}" if uuid is not None and not str(uuid).startswith("GPU-") else (uuid and str(uuid))
    bus = None
    domain, number, slot = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    if isinstance(domain, int) and isinstance(number, int) and isinstance(slot, int):
        bus = f"{domain:08X}:{number:02X}:{slot:02X}.0"  # as nvidia-smi writes it
    elif text:
        bus = _nvml_bus_id(text)
    return {
        "gpu_uuid": text,
        "gpu_bus_id": bus,
        "gpu_name": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 2),
    }


def _nvml_bus_id(uuid: str) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).busId
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, driver or permission: the record says null
        return None
    return bus.decode() if isinstance(bus, bytes) else str(bus)


def gather(env: DistEnv) -> list[Seen]:
    """Every rank's resources, in rank order (one all_gather_object: every rank calls it)."""
    mine = this_rank(env)
    if env.world_size == 1:
        return [mine]
    return [seen for seen in all_gather_objects(mine) if isinstance(seen, Seen)]


def resource_problems(seen: list[Seen], nodes: int, gpus_per_node: int, device_type: str) -> list[str]:
    """Each way the ranks' resources differ from the spec, one sentence each; [] when as asked.
    GPUs are checked where the ranks ran on GPUs or their environment listed GPUs (Slurm's gres,
    also for a CPU cell on a cluster that gives them)."""
    problems = []
    hosts = sorted({s.ranks["host"] for s in seen})
    if len(hosts) < nodes:
        problems.append(f"{nodes} nodes asked, the ranks ran on {len(hosts)} ({', '.join(hosts)})")
    gpus_known = device_type == "cuda" or any(s.visible_ids for s in seen)
    if not gpus_known:
        return problems
    for host in hosts:
        on_host = [s for s in seen if s.ranks["host"] == host]
        visible = {gpu for s in on_host for gpu in s.visible_ids} or {s.gpu for s in on_host if s.gpu}
        if len(visible) < gpus_per_node:
            problems.append(f"{gpus_per_node} GPUs per node asked, {len(visible)} visible on {host}")
        problems += _shared(on_host, host)
    return problems


def _shared(on_host: list[Seen], host: str) -> list[str]:
    """A sentence for each GPU that several ranks on one host used."""
    by_gpu: dict[str, list[Seen]] = {}
    for s in on_host:
        if s.gpu:
            by_gpu.setdefault(s.gpu, []).append(s)
    found = []
    for gpu, sharing in by_gpu.items():
        if len(sharing) > 1:
            ranks = " and ".join(", ".join(str(s.ranks["rank"]) for s in sharing).rsplit(", ", 1))
            bus = sharing[0].ranks.get("gpu_bus_id")
            found.append(f"ranks {ranks} share GPU {gpu}{f' (bus {bus})' if bus else ''} on {host}")
    return found


def ranks_fields(seen: list[Seen], nodes: int, gpus_per_node: int, device_type: str) -> Mapping[str, Any]:
    """The record's `ranks` and `resource_problems`."""
    return {
        "ranks": [s.ranks for s in seen],
        "resource_problems": resource_problems(seen, nodes, gpus_per_node, device_type),
    }
