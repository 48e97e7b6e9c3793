"""What a record says it was made with: the git commit of hpcfsdp's own checkout (if it runs from
one), the NVIDIA driver, the Slurm release of its job, and the communication and PyTorch settings
of the environment."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from ...contracts.record import Record, SlurmJob
from ...contracts.spec import LAUNCH_ID_ENV

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # .../hpcfsdp
UNKNOWN = "unknown"
# The settings that steer the communication library and PyTorch, recorded with their values.
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_")
# The threading variables, recorded with their values: what each rank ran with (the supervisor sets
# OMP_NUM_THREADS from the CPUs its node was given).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# A variable whose name has one of these is left out whatever its prefix: a record is shared.
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")


def git_commit(package_dir: Path = PACKAGE_DIR) -> str:
    """HEAD of the git checkout the package runs from, else "unknown".

    Asked of the package's own folder, never of the working directory, and only believed when that
    folder is `src/<package>` of the work tree git finds: a copy installed into site-packages
    inside some other project's checkout is in that project's work tree too, and must not be
    credited with its commit.
    """
    package_dir = package_dir.resolve()
    try:
        out = subprocess.run(
            ["git", "-C", str(package_dir), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != 2:
        return UNKNOWN
    top, commit = lines
    if Path(top).resolve() / "src" / package_dir.name != package_dir:
        return UNKNOWN
    return commit if len(commit) in (40, 64) else UNKNOWN  # SHA-1 or SHA-256 repositories


def framework_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_*, TORCH_* and PYTORCH_* variables, except any whose name suggests a secret, and
    the threading variables."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name in THREAD_VARIABLES
        or (name.startswith(ENV_PREFIXES) and not any(marker in name.upper() for marker in SECRET_MARKERS))
    }


def driver_version() -> str | None:
    """The NVIDIA driver's version, from NVML; None where NVML cannot answer."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, driver or permission: the record says null
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def slurm_release() -> str | None:
    """The release of the Slurm that runs this process's job ("24.11.5", from `scontrol --version`
    on its node, which asks no daemon); None outside a Slurm job or where scontrol cannot answer.
    Releases differ in what a job gets (24.11's srun inherits --cpus-per-task, 22.05's does not)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    try:
        out = subprocess.run(["scontrol", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\b(\d+\.\d+(?:\.\d+)?)", out)
    return match.group(1) if match else None


def launch_rank() -> int:
    """This process's global rank as its launcher set it, before the process group exists."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def launch_id() -> str:
    """Identifies one launch of the cell across its ranks (the supervisor's, torchrun's run id, or
    the Slurm job)."""
    if supervised := os.environ.get(LAUNCH_ID_ENV):
        return supervised
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm-{slurm}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"


SLURM_FIELDS = tuple(SlurmJob.__annotations__)  # each from its SLURM_* variable


def provenance() -> Record:
    """What every record carries about where and with what it ran, whatever stage it ended in.
    (torch and transformers are imported here: the helpers above stay light.)"""
    import torch
    import transformers

    from ... import __version__

    gpu = torch.cuda.is_available()
    return {
        "slurm": cast(SlurmJob, {k: os.environ.get(f"SLURM_{k.upper()}") for k in SLURM_FIELDS}),
        "versions": {
            "hpcfsdp": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "driver": driver_version() if gpu else None,
            "slurm": slurm_release(),
        },
        "environment": framework_environment(os.environ),
        "git_commit": git_commit(),
        "launch_id": launch_id(),
    }
