"""What a cell's processes get from the environment, by executor: the hub switched offline and the
cache folder always; under Slurm only an allowlist of the submitting shell's variables (issue 33).

sbatch copies the environment it is given into the job, and slurmctld keeps that copy with the job
in its state folder, where the cluster's administrators read it. A list of secret shapes always
misses the next one, so a Slurm job gets only the variables a cell needs (ALLOWED_NAMES and
ALLOWED_PREFIXES, listed in docs/refusals.md) and those the user names in `slurm.pass_env`; of the
allowlisted ones, any whose name or value still has a secret's shape (secret_shapes.py: an
HPCFSDP_TOKEN) is left out unless named in pass_env. Of Slurm's own SLURM_*, SRUN_* and SALLOC_*,
which its clients read as options and sbatch passes on whatever --export says, only SLURM_CONF
goes (issue 51, item 5). The batch script says so with
`#SBATCH --export=<names>`, and sbatch runs with no other variable (slurm_environment) but the
shell's SBATCH_* defaults in SBATCH_KEPT, so that no SBATCH_* variable (SBATCH_EXPORT, SBATCH_GRES,
SBATCH_PARTITION, ...) overrides the script's options. With an export list sbatch gives the job
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
from ..define.resources import NEVER_TO_SBATCH
from ..define.secret_shapes import is_secret

# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Slurm's own settings for MPI launchers (Intel MPI's and MPICH's hydra, Open MPI's and PRRTE's
# plm), which Slurm 24.11 puts in every job's environment, --export or not, so that mpirun starts
# its ranks through srun (seen with 24.11.5; 22.05 sets none of them). Not secrets.
SLURM_LAUNCHER_NAMES = (
    "HYDRA_BOOTSTRAP", "HYDRA_LAUNCHER_EXTRA_ARGS", "I_MPI_HYDRA_BOOTSTRAP", "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS",
    "OMPI_MCA_plm_slurm_args", "PRTE_MCA_plm_slurm_args",
)  # fmt: skip
# What a cell needs from the submitting shell: the shell's basics, the module system's, conda's and
# the venv's variables, Python's and the linker's paths, the hub's cache and offline switches, and
# podman's runtime folder (a rootless podman refuses another one than its images were made with),
# and Slurm's configuration file (it names the cluster sbatch asks; the job's srun asks the same).
ALLOWED_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
        "MODULEPATH", "MODULEPATH_ROOT", "MODULESHOME", "LOADEDMODULES", "_LMFILES_",
        "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_EXE", "CONDA_PYTHON_EXE", "CONDA_SHLVL", "MAMBA_EXE",
        "MAMBA_ROOT_PREFIX", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT",
        "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
        "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", *OFFLINE_ENV,
        "XDG_RUNTIME_DIR", "SLURM_CONF",
        *SLURM_LAUNCHER_NAMES,
    }
)  # fmt: skip
# Families of variables: the locale, CUDA, NCCL, gloo, torch, Triton, hpcfsdp's own, the module
# systems' (Lmod's, Environment Modules', and their exported shell functions, which `module load` in
# a setup line needs), conda's stacked prefixes, and the container runtimes' settings (slurm.container).
ALLOWED_PREFIXES = (
    "LC_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "HPCFSDP_",
    "LMOD_", "__LMOD_REF_COUNT_", "_ModuleTable", "MODULES_", "BASH_FUNC_module", "BASH_FUNC_ml",
    "BASH_FUNC__module_raw", "BASH_FUNC_switchml", "CONDA_PREFIX_",
    "CONTAINERS_", "APPTAINER_", "SINGULARITY_", "ENROOT_",
)  # fmt: skip
# The batch script's first line: srun passes the job's whole environment (the allowlist and what
# the setup lines set) to the tasks, not only the export list.
EXPORT_ALL_TO_STEPS = "export SLURM_EXPORT_ENV=ALL"
# sbatch reads SBATCH_* variables as options over the script's own #SBATCH lines (environment
# variables win): SBATCH_GRES=gpu:1 gave a 2-GPU cell one GPU, SBATCH_PARTITION moved the jobs,
# SBATCH_WAIT and SBATCH_EXCLUSIVE broke submit (issue 44, item 6). Of the 57 that sbatch 22.05
# reads, only these reach it: a site's defaults for what the YAML leaves unset (variable -> the
# sbatch option; the YAML's own setting of that option drops the variable). NEVER_TO_SBATCH
# (resources.py) would move the jobs, or widen their environment, the same way.
SBATCH_KEPT = {
    "SBATCH_ACCOUNT": "account",
    "SBATCH_QOS": "qos",
    "SBATCH_RESERVATION": "reservation",
    "SBATCH_WCKEY": "wckey",
}
# Slurm's clients read SLURM_*, SRUN_* and SALLOC_* variables as options, and sbatch passes a job
# every SLURM_* of its own environment whatever --export says: SLURM_TIMELIMIT=1 left in a login
# shell (from an salloc, or a script) reached the job's srun and ended a 10-minute cell after 78 s
# (issue 51, item 5). Slurm sets the job's own SLURM_* inside it; of the shell's, only SLURM_CONF
# (ALLOWED_NAMES) reaches sbatch, and those named in slurm.pass_env.
FROM_SLURM_CLIENTS = ("SLURM_", "SRUN_", "SALLOC_")


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
        if name in passed or (is_allowed(name) and not is_secret(name, value) and name not in NEVER_TO_SBATCH)
    )


def slurm_clients_dropped(sweep: Sweep, environ: Mapping[str, str] | None = None) -> list[str]:
    """The submitting shell's SLURM_*, SRUN_* and SALLOC_* variables that no Slurm job of the sweep
    gets (all but SLURM_CONF and those named in slurm.pass_env), by name."""
    environ = os.environ if environ is None else environ
    passed = set(sweep.resources.pass_env)
    return sorted(
        name for name in environ if name.startswith(FROM_SLURM_CLIENTS) and not is_allowed(name) and name not in passed
    )


def slurm_parameters_for_environment(sweep: Sweep) -> tuple[dict[str, str], list[str]]:
    """The sbatch option (`export`) and the first setup line of a Slurm job of the sweep."""
    return {"export": ",".join(exported_names(sweep)) or "NONE"}, [EXPORT_ALL_TO_STEPS]


def slurm_environment(sweep: Sweep, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment sbatch runs in: the exported names, and the shell's SBATCH_* settings that
    sbatch_from_shell keeps."""
    environ = os.environ if environ is None else environ
    names = set(exported_names(sweep, environ))
    kept = sbatch_from_shell(sweep, environ)
    return {name: value for name, value in environ.items() if name in names or name in kept}


def sbatch_from_shell(sweep: Sweep, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The submitting shell's SBATCH_* variables that reach sbatch (SBATCH_KEPT, where the YAML
    leaves the option unset), by name."""
    environ = os.environ if environ is None else environ
    res = sweep.resources
    set_here = {"account": res.account, "qos": res.qos, **{key: True for key in res.extra_sbatch}}
    return {
        name: environ[name]
        for name, option in SBATCH_KEPT.items()
        if name in environ and not set_here.get(option) and not is_secret(name, environ[name])
    }


def sbatch_note(sweep: Sweep, environ: Mapping[str, str] | None = None) -> str:
    """What plan and submit say, in one line, of the shell's variables that Slurm's clients read
    ("" when it has none): the SBATCH_* that reach sbatch (and, sbatch reading them over the
    script, may move or refuse the jobs), the SBATCH_* left out, and the SLURM_*, SRUN_* and
    SALLOC_* that the jobs do not get."""
    environ = os.environ if environ is None else environ
    kept = sbatch_from_shell(sweep, environ)
    dropped = sorted(name for name in environ if name.startswith("SBATCH_") and name not in kept)
    parts = []
    if kept:
        parts.append(f"{', '.join(f'{name}={value}' for name, value in kept.items())} from your shell reach sbatch")
    if dropped:
        parts.append(f"{', '.join(dropped)} from your shell do not (the YAML sets the jobs' options)")
    if clients := slurm_clients_dropped(sweep, environ):
        parts.append(
            f"{', '.join(clients)} from your shell do not reach the jobs (srun would read them as options; "
            "name one in slurm.pass_env to pass it)"
        )
    return f"note: {'; '.join(parts)}" if parts else ""


# The tests' fault hook (cell/stopping/faults.py's FAULT_ENV): set, every cell fails where it says.
FAULT_HOOK = "HPCFSDP_FAULT"
# pytest sets this in its process's environment while a test runs: the one place the hook is meant.
UNDER_PYTEST = "PYTEST_CURRENT_TEST"


def fault_hook_warning(environ: Mapping[str, str] | None = None) -> str:
    """A warning line where the shell has the tests' fault hook set outside a test ("" otherwise):
    every cell of the sweep would fail, or hang, where the hook says (issue 51, item 5)."""
    environ = os.environ if environ is None else environ
    if not environ.get(FAULT_HOOK) or environ.get(UNDER_PYTEST):
        return ""
    return (
        f"warning: {FAULT_HOOK}={environ[FAULT_HOOK]} is set in your shell: it is the tests' fault hook, and "
        f"every cell would fail where it says; `unset {FAULT_HOOK}`"
    )


def shell_part_in(refusal: str, sweep: Sweep) -> str:
    """' (from your shell: SBATCH_ACCOUNT=x)' where sbatch's refusal names an option a kept SBATCH_*
    variable set; "" otherwise: a refusal the shell caused is never blamed on the YAML alone."""
    kept = sbatch_from_shell(sweep)
    named = [f"{name}={value}" for name, value in kept.items() if SBATCH_KEPT[name] in refusal.lower()]
    return f" (from your shell: {', '.join(named)})" if named else ""


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
