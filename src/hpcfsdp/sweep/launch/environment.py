"""What a cell's processes get from the environment, by executor: the hub switched offline and the
cache folder always; under Slurm only an allowlist of the submitting shell's variables (issue 33).

sbatch copies the environment it is given into the job, and slurmctld keeps that copy with the job
in its state folder, where the cluster's administrators read it. A list of secret shapes always
misses the next one, so a Slurm job gets only the variables a cell needs (ALLOWED_NAMES and
ALLOWED_PREFIXES, listed in docs/refusals.md) and those the user names in `slurm.pass_env`; of the
allowlisted ones, any whose name or value still has a secret's shape (secret_shapes.py: an
HPCFSDP_TOKEN, a SLURM_JWT) is left out unless named in pass_env. The batch script says so with
`#SBATCH --export=<names>`, and sbatch runs with no other variable (slurm_environment), so that an
SBATCH_EXPORT of the shell cannot widen it. With an export list sbatch gives the job
SLURM_EXPORT_ENV=<the list>, and srun inside it would pass the tasks that list alone, without what
the script's setup lines set: the script exports SLURM_EXPORT_ENV=ALL first (EXPORT_ALL_TO_STEPS).

The local executor's torchrun and the print executor's command run on the user's own machine and
keep the shell's environment, less the variables of a secret's shape.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ...cache.hub import CACHE_ENV
from ..define.matrix import Sweep
from ..define.secret_shapes import is_secret

# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# What a cell needs from the submitting shell: the shell's basics, the module system's, conda's and
# the venv's variables, Python's and the linker's paths, the hub's cache and offline switches, and
# podman's runtime folder (a rootless podman refuses another one than its images were made with).
ALLOWED_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
        "MODULEPATH", "MODULEPATH_ROOT", "MODULESHOME", "LOADEDMODULES", "_LMFILES_",
        "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE", "CONDA_PYTHON_EXE", "CONDA_SHLVL", "MAMBA_EXE",
        "MAMBA_ROOT_PREFIX", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT",
        "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
        "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", *OFFLINE_ENV,
        "XDG_RUNTIME_DIR",
    }
)  # fmt: skip
# Families of variables: the locale, CUDA, NCCL, gloo, torch, Triton, hpcfsdp's own, Slurm's own
# (sbatch passes SLURM_* on whatever it is told), the module systems' (Lmod's, Environment
# Modules', and their exported shell functions, which `module load` in a setup line needs),
# conda's stacked prefixes, and the container runtimes' settings (slurm.container).
ALLOWED_PREFIXES = (
    "LC_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "HPCFSDP_", "SLURM_",
    "LMOD_", "__LMOD_REF_COUNT_", "_ModuleTable", "MODULES_", "BASH_FUNC_module", "BASH_FUNC_ml",
    "BASH_FUNC__module_raw", "BASH_FUNC_switchml", "CONDA_PREFIX_",
    "CONTAINERS_", "APPTAINER_", "SINGULARITY_", "ENROOT_",
)  # fmt: skip
# The batch script's first line: srun passes the job's whole environment (the allowlist and what
# the setup lines set) to the tasks, not only the export list.
EXPORT_ALL_TO_STEPS = "export SLURM_EXPORT_ENV=ALL"
# sbatch reads these as options over the script's own #SBATCH lines (environment variables win):
# those of options hpcfsdp always sets, and the cluster, which the manifest must name.
SBATCH_OVERRIDES = frozenset(
    {
        "SBATCH_EXPORT", "SBATCH_GET_USER_ENV", "SBATCH_ARRAY_INX", "SBATCH_JOB_NAME", "SBATCH_REQUEUE",
        "SBATCH_NO_REQUEUE", "SBATCH_OPEN_MODE", "SBATCH_SIGNAL", "SBATCH_TIMELIMIT", "SBATCH_OUTPUT",
        "SBATCH_ERROR", "SBATCH_CLUSTERS", "SLURM_CLUSTERS", "SLURM_EXPORT_ENV",
    }
)  # fmt: skip


def job_environment(sweep: Sweep) -> dict[str, str]:
    """What every cell's processes get, whatever the executor: hub offline, and the cache folder."""
    env = dict(OFFLINE_ENV)
    cache = sweep.resources.cache_dir or os.environ.get(CACHE_ENV, "")
    if cache:
        env[CACHE_ENV] = os.path.expanduser(cache)
    return env


# A name that can go into the `#SBATCH --export=` line: a shell variable's, or an exported function's.
EXPORTABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|BASH_FUNC_[A-Za-z_][A-Za-z0-9_]*%%")


def is_allowed(name: str) -> bool:
    """A variable a Slurm job gets from the submitting shell without being named in pass_env."""
    return (name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)) and bool(EXPORTABLE.fullmatch(name))


def exported_names(sweep: Sweep, environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables of the submitting shell that a Slurm job of the sweep gets (--export): the
    allowlisted ones without a secret's shape, and those named in slurm.pass_env, if set."""
    environ = os.environ if environ is None else environ
    passed = set(sweep.resources.pass_env)
    return sorted(
        name
        for name, value in environ.items()
        if name in passed or (is_allowed(name) and not is_secret(name, value) and name not in SBATCH_OVERRIDES)
    )


def slurm_parameters_for_environment(sweep: Sweep) -> tuple[dict[str, str], list[str]]:
    """The sbatch option (`export`) and the first setup line of a Slurm job of the sweep."""
    return {"export": ",".join(exported_names(sweep)) or "NONE"}, [EXPORT_ALL_TO_STEPS]


def slurm_environment(sweep: Sweep, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment sbatch runs in: the exported names, and sbatch's own SBATCH_* settings
    (an account, a reservation) but those that would override what the script sets."""
    environ = os.environ if environ is None else environ
    names = set(exported_names(sweep, environ))
    return {
        name: value
        for name, value in environ.items()
        if name in names or (name.startswith("SBATCH_") and name not in SBATCH_OVERRIDES and not is_secret(name, value))
    }


@contextmanager
def slurm_environment_only(sweep: Sweep) -> Iterator[None]:
    """os.environ is slurm_environment while the block runs: submitit starts sbatch with this
    process's environment. Everything is put back at the end."""
    saved = dict(os.environ)
    kept = slurm_environment(sweep, saved)
    for name in [name for name in os.environ if name not in kept]:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# Always unset in a printed command and an sbatch script from `plan --sbatch`, set here or not.
HF_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def secret_names(environ: Mapping[str, str]) -> list[str]:
    return sorted(name for name, value in environ.items() if is_secret(name, value))


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if not is_secret(name, value)}
