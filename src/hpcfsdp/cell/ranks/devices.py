"""Which GPU a rank uses, from its launcher's variables alone (no torch: a pure function, tested so).

Under Slurm with GPU gres, Slurm sets CUDA_VISIBLE_DEVICES for each task to the GPUs of its step on
its node (all of them, or one per task with --gpus-per-task / --gpu-bind), and torch numbers the
visible GPUs from 0. A rank picks the entry its node-local rank (LOCAL_RANK, which submitit's
environment and torchrun set; else SLURM_LOCALID) points at, wrapping when there are fewer
entries than ranks on the node: then two ranks share a GPU, which the cell's resource check
(resources.py) reports. Where CUDA_VISIBLE_DEVICES is unset but Slurm names the GPUs
(SLURM_STEP_GPUS, SLURM_JOB_GPUS: the node's own numbers), torch sees every GPU of the node, and
the rank takes the GPU of that number. With neither, the rank takes cuda:LOCAL_RANK.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# What Slurm puts in CUDA_VISIBLE_DEVICES for a task that was given no GPU.
NO_GPUS = ("", "NoDevFiles")


@dataclass(frozen=True)
class DeviceChoice:
    """A rank's GPU: torch's index, and what its environment says it was given."""

    index: int  # the N of cuda:N, in torch's numbering of the GPUs it sees
    visible: int | None  # GPUs this rank's environment lists; None: not said (every GPU of the node)
    gpu: str | None  # the chosen GPU as the environment names it (a number or a UUID); None: not said
    visible_ids: tuple[str, ...] = ()  # every GPU the environment lists, as it names them
    source: str = ""  # the variable that said so


def local_rank(environ: Mapping[str, str]) -> int:
    """The rank's place on its node: LOCAL_RANK (torchrun, submitit), else SLURM_LOCALID, else 0."""
    return int(environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID") or 0)


def choose_device(environ: Mapping[str, str]) -> DeviceChoice:
    """The GPU this rank uses, and the GPUs its environment gives it (module docstring)."""
    local = local_rank(environ)
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = () if listed.strip() in NO_GPUS else _ids(listed)
        if not ids:
            return DeviceChoice(0, 0, None, (), "CUDA_VISIBLE_DEVICES")
        index = local % len(ids)
        return DeviceChoice(index, len(ids), ids[index], ids, "CUDA_VISIBLE_DEVICES")
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = _ids(environ.get(name, ""))
        if ids:
            gpu = ids[local % len(ids)]
            return DeviceChoice(int(gpu) if gpu.isdigit() else local, len(ids), gpu, ids, name)
    return DeviceChoice(local, None, None, (), "LOCAL_RANK")


def _ids(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())
