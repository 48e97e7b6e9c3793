"""What a sweep's array tasks ask Slurm for (the `slurm:` section of a jobs YAML), validated once,
and the rules for the sbatch options passed through (extra_sbatch)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from ...contracts.fields import (
    SpecError,
    coerce_fields,
    documented,
    require_choices,
    require_no_control_characters,
    shown,
    text_fields,
)
from ...contracts.gpus import gpu_memory_gib, known_memory_sizes
from ...contracts.names import name_problem, slurm_name_problem
from ...contracts.sources import path_exists
from .container import ENV_NAME, Container
from .sbatch_options import resolve_option
from .secret_shapes import require_no_secret

GpuRequest = Literal["gres", "gpus_per_node", "none"]


@dataclass(frozen=True)
class Resources:
    """What every array task of a sweep asks Slurm for, beside nodes and GPUs per node (in RunSpec)."""

    AUTO_FIELD: ClassVar[tuple[str, str]] = ("mem_gb", "mem_auto")  # `mem_gb: auto` sets mem_auto

    partition: str = documented("gpu", "`--partition`")
    # The one cluster every command of the sweep asks (slurm.on_cluster).
    clusters: str = documented(
        "",
        "`--clusters` (`-M`): one cluster name; status, cancel, collect and the preflight ask the same "
        "cluster (`docs/clusters.md`)",
        default_means="this login node's cluster",
    )
    time_min: int = documented(30, "`--time` (minutes, per cell)")
    cells_per_task: int = documented(
        1,
        "one-node cells of one shape per array task, run one after another in its one allocation, each "
        "with its own record; the task's `--time` is this x `time_min`; cells of several nodes go one per task",
    )
    cpus_per_task: int = documented(
        1, "CPUs per GPU: each node's one task (its supervisor) asks `--cpus-per-task` = `gpus_per_node` x this"
    )
    mem_gb: int = documented(
        0,
        "`--mem=<N>G`; `auto`: the predicted host memory per node plus 25% (`docs/preflight.md`)",
        default_means="the partition's default",
    )
    mem_auto: bool = documented(False, "set by `mem_gb: auto` (sweep/predict/hostmemory.py)")
    account: str = documented("", "`--account`")
    qos: str = documented("", "`--qos`")
    constraint: str = documented("", "`--constraint`")
    exclusive: bool = documented(False, "`--exclusive`")
    array_parallelism: int = documented(64, "`--array=0-<N-1>%<parallelism>`")
    max_array_size: int = documented(  # the cluster's: MaxArraySize (scontrol show config)
        0,
        "cells per array at most: a shape with more cells goes out as several arrays",
        default_means="the cluster's",
    )
    max_jobs_in_queue: int = documented(
        0,
        "your jobs (array tasks) pending or running at once at most: set it to your `MaxSubmitJobs`",
        default_means="no cap",
    )
    gpu_request: GpuRequest = documented(
        "gres", "`gres`: `--gres=gpu:<gpus_per_node>`; `gpus_per_node`: `--gpus-per-node`; `none`: no GPU flag"
    )
    max_requeue: int = documented(
        0,
        "requeues after the time-limit signal, a preemption or a failed node (the cell then starts over); "
        "`> 0` adds `--requeue`",
    )
    signal_delay_s: int = documented(  # Slurm may send it up to 60 s early
        90, "`--signal=USR2@<s>`: SIGUSR2 this long before the time limit; must be below it"
    )
    cache_dir: str = documented(
        "", "exported to the tasks as `HPCFSDP_CACHE`", default_means="`$HPCFSDP_CACHE` where you submit"
    )
    gpu_name: str = documented(
        "",
        "no sbatch flag: the partition's GPU model (`H200`, `H100`, `A100 80GB`, ...), whose memory "
        "`plan --memory` looks up",
    )
    gpu_memory_gib: float = documented(
        0.0,
        "no sbatch flag: GPU memory for `plan --memory` and `submit --skip-predicted-oom`",
        default_means="from `gpu_name`",
    )
    extra_sbatch: dict[str, Any] = documented(
        {},
        "passed through: `{reservation: maint, hold: true}` -> `--reservation=maint --hold`; a key is read "
        "as sbatch reads it (`reserv` is `--reservation`); options that change what sbatch prints, when it "
        "returns or the task layout (`parsable`, `wait`, `ntasks`, ...) are refused",
    )
    # The allowlist is environment.py's.
    pass_env: tuple[str, ...] = documented(
        (),
        "names of variables the jobs get beside the allowlist, as set where you submit (`--export`); "
        "slurmctld saves their values",
    )
    # The collect job of `submit --then-collect` (sweep/launch/collect_job.py): where it runs, whom it mails.
    collect_partition: str = documented(
        "", "the collect job of `submit --then-collect` runs here (`--partition`)", default_means="`partition`"
    )
    mail_user: str = documented("", "the collect job's `--mail-user` (a user name or one e-mail address)")
    mail_type: str = documented("", "the collect job's `--mail-type` (`END`, `FAIL`, `ALL`, ..., comma-separated)")
    container: Container | None = documented(
        None,
        "run each cell inside an image: `runtime` (apptainer, singularity, pyxis, podman), `image`, `mounts`, "
        "`env`, ... (`docs/containers.md`, sweep/define/container.py)",
    )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "slurm") -> Resources:
        values = dict(values)
        container = values.pop("container", None)
        res = cls(**coerce_fields(cls, values, where))
        if container is not None:
            res = dataclasses.replace(res, container=Container.from_dict(container, where))
        require_choices(where, res)
        for name in ("time_min", "cells_per_task", "cpus_per_task", "array_parallelism", "signal_delay_s"):
            if getattr(res, name) < 1:
                raise SpecError(where, name, f"expected a positive integer, got {getattr(res, name)}")
        for name in ("mem_gb", "max_requeue", "max_array_size", "max_jobs_in_queue"):
            if getattr(res, name) < 0:
                raise SpecError(where, name, f"expected an integer >= 0, got {getattr(res, name)}")
        if res.gpu_memory_gib < 0:
            raise SpecError(where, "gpu_memory_gib", f"expected a number >= 0, got {res.gpu_memory_gib}")
        if res.gpu_name and not res.gpu_memory_gib and gpu_memory_gib(res.gpu_name) is None:
            known = ", ".join(known_memory_sizes())
            raise SpecError(
                where, "gpu_name", f"memory size of {res.gpu_name!r} unknown (known: {known}); set gpu_memory_gib"
            )
        if res.signal_delay_s >= res.time_min * 60:
            raise SpecError(
                where,
                "signal_delay_s",
                f"{res.signal_delay_s} s is not below the time limit (time_min {res.time_min} = {res.time_min * 60} s)",
            )
        for name, value in text_fields(res):
            require_no_control_characters(where, name, value)
        _check_names(where, res)
        res = dataclasses.replace(res, extra_sbatch=_checked_extra_sbatch(where, res))
        res = dataclasses.replace(res, pass_env=_checked_pass_env(where, res.pass_env))
        _check_mail_user(where, res.mail_user)
        unknown = [kind for kind in res.mail_type.split(",") if kind and kind.strip().upper() not in MAIL_TYPES]
        if unknown:
            raise SpecError(where, "mail_type", f"{unknown[0]!r}: expected one or more of {', '.join(MAIL_TYPES)}")
        return res

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_names(where: str, res: Resources) -> None:
    """The sbatch arguments that name something (names.py), and a cache_dir that can be a folder."""
    for name in ("clusters", "partition", "account", "qos", "constraint", "collect_partition"):
        problem = slurm_name_problem(getattr(res, name))
        if problem:
            raise SpecError(where, name, f"{problem}: {shown(getattr(res, name))}")
    if "," in res.clusters or res.clusters.lower() == "all":
        # sbatch -M a,b (or -M all) queues a job on whichever cluster starts it first; the sweep's
        # jobs would then have to be looked for on each, and scancel -M all removes a job of the
        # same id on every cluster.
        raise SpecError(where, "clusters", f"expected one cluster name, got {shown(res.clusters)}")
    if res.cache_dir:
        problem = name_problem(res.cache_dir)
        path = Path(res.cache_dir).expanduser()
        if not problem and path_exists(path, where, "cache_dir") and not path.is_dir():
            problem = "a file, not a folder (the pre-download cache is a folder)"
        if problem:
            raise SpecError(where, "cache_dir", f"{problem}: {shown(res.cache_dir)}")


# sbatch options that hpcfsdp sets itself -> what to set instead ("": submitit's own); extra_sbatch
# must not repeat them.
SBATCH_SET_BY = {
    "partition": "slurm.partition",
    "clusters": "slurm.clusters",
    "time": "slurm.time_min",
    "cpus-per-task": "slurm.cpus_per_task",
    "mem": "slurm.mem_gb",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "exclusive": "slurm.exclusive",
    "array": "slurm.array_parallelism",
    "signal": "slurm.signal_delay_s",
    "requeue": "slurm.max_requeue",
    "no-requeue": "slurm.max_requeue",
    "gres": "slurm.gpu_request",
    "gpus-per-node": "slurm.gpu_request",
    "nodes": "the cells' nodes",
    "ntasks-per-node": "the cells' gpus_per_node",
    "export": "slurm.pass_env",
    "export-file": "slurm.pass_env",
    "job-name": "",
    "comment": "",  # the sweep's id (layout.sweep_uid), which cancel and status check
    "output": "",
    "error": "",
    "open-mode": "",
}


# sbatch's words for a cell's shape, written under `slurm:` (issue 54, item 5): one pointer to where the
# shape is set, not the list of every slurm key.
_SHAPE_WORDS = {
    **dict.fromkeys(("gpus", "gpus-per-node", "gpus-per-task", "gres", "ntasks", "ntasks-per-node"), "gpus_per_node"),
    **dict.fromkeys(("nodes", "N"), "nodes"),
}


def sbatch_word_hint(key: object) -> str:
    """Where an sbatch word written as a `slurm:` key belongs; "" for a key that is no such word."""
    option = str(key).replace("_", "-")
    if option in _SHAPE_WORDS:
        field = _SHAPE_WORDS[option]
        return (
            f"unknown key; the cells' {field.replace('_', ' ')} is `base.{field}` (or a matrix axis), "
            "from which hpcfsdp writes sbatch's task layout"
        )
    if SBATCH_SET_BY.get(option, "").startswith("slurm."):
        return f"unknown key; sbatch's --{option} is set by `{SBATCH_SET_BY[option]}`"
    return ""


# sbatch options that change what sbatch prints (the job id submit reads), when it returns, where
# the job starts, what it runs or its task layout (hpcfsdp's, from nodes and gpus_per_node), or
# that pass the login environment past the allowlist: refused in extra_sbatch (issue 44, item 5).
# --hold stays allowed: the array waits, held, until `scontrol release`, and status shows why.
PRINTS_OTHERWISE = "changes what sbatch prints, from which submit reads the job id"
QUEUES_NOTHING = "makes sbatch print something and queue nothing"
TASK_LAYOUT = "changes the task layout, which hpcfsdp sets: one task per node (its supervisor starts the ranks)"
SBATCH_REFUSED = {
    "parsable": PRINTS_OTHERWISE,
    "quiet": PRINTS_OTHERWISE,
    "test-only": "queues nothing (plan asks sbatch --test-only of each shape itself)",
    "help": QUEUES_NOTHING,
    "usage": QUEUES_NOTHING,
    "version": QUEUES_NOTHING,
    "autocomplete": QUEUES_NOTHING,
    "wait": "makes sbatch return only when the job ends (submit --wait waits for the cells)",
    "wrap": "replaces the batch script hpcfsdp writes",
    "chdir": "moves the folder the job starts in, from which its paths are read",
    "ntasks": TASK_LAYOUT,
    "ntasks-per-core": TASK_LAYOUT,
    "ntasks-per-socket": TASK_LAYOUT,
    "ntasks-per-gpu": TASK_LAYOUT,
    "ntasks-per-tres": TASK_LAYOUT,
    "get-user-env": "gives the job the login environment, past the allowlist (name variables in slurm.pass_env)",
}


# An sbatch option name; anything else in a key (a newline, a space, '=', '#') would let the key
# end its `#SBATCH --key=value` line and start a line of shell in the batch script.
SBATCH_OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def _checked_extra_sbatch(where: str, res: Resources) -> dict[str, Any]:
    """extra_sbatch with each key as the sbatch option it is read as (sbatch takes a unique prefix
    of a long option: sbatch_options.py), refused where hpcfsdp sets that option itself."""
    resolved: dict[str, Any] = {}
    for key, value in res.extra_sbatch.items():
        if not isinstance(key, str) or not SBATCH_OPTION_NAME.fullmatch(key):
            raise SpecError(
                where,
                f"extra_sbatch.{key!r}",
                "expected an sbatch option name (letters, digits, '-' and '_', e.g. reservation)",
            )
        written = key.replace("_", "-")
        flag, problem = resolve_option(written)
        if problem:
            raise SpecError(where, f"extra_sbatch.{key}", problem)
        read_as = f"--{flag}" if flag == written else f"--{written} (sbatch reads it as --{flag})"
        if flag in SBATCH_SET_BY:
            hint = f"; set {SBATCH_SET_BY[flag]} instead" if SBATCH_SET_BY[flag] else ""
            raise SpecError(where, f"extra_sbatch.{key}", f"{read_as} is set by hpcfsdp{hint}")
        if flag in SBATCH_REFUSED:
            raise SpecError(where, f"extra_sbatch.{key}", f"{read_as} {SBATCH_REFUSED[flag]}; not passed through")
        if flag in resolved:
            raise SpecError(where, f"extra_sbatch.{key}", f"{read_as} is given twice")
        resolved[flag] = value
        if not isinstance(value, (str, int, float, bool)) or value is False:
            raise SpecError(where, f"extra_sbatch.{key}", f"expected a string, a number or true, got {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(where, f"extra_sbatch.{key}", f"expected a finite number, got {value}")
        if isinstance(value, str):
            require_no_control_characters(where, f"extra_sbatch.{key}", value)
            require_no_secret(where, f"extra_sbatch.{key}", value)
        # Options sbatch refuses beside one that hpcfsdp sets:
        if flag in ("mem-per-cpu", "mem-per-gpu") and (res.mem_gb or res.mem_auto):
            raise SpecError(
                where,
                f"extra_sbatch.{key}",
                f"sbatch takes only one of --{flag} and --mem "
                f"(slurm.mem_gb: {'auto' if res.mem_auto else res.mem_gb}); set mem_gb: 0",
            )
        if flag in ("gpus", "gpus-per-task", "gpus-per-socket") and res.gpu_request != "none":
            raise SpecError(
                where,
                f"extra_sbatch.{key}",
                f"GPUs are already asked for (slurm.gpu_request: "
                f"{res.gpu_request}); set gpu_request: none to ask with --{flag}",
            )
    return resolved


# Of Slurm's variables, these would move the jobs (SLURM_CLUSTERS: the manifest names the cluster) or
# widen their environment (SLURM_EXPORT_ENV): never given to sbatch, nor named in pass_env.
NEVER_TO_SBATCH = frozenset({"SLURM_CLUSTERS", "SLURM_EXPORT_ENV"})


def _checked_pass_env(where: str, names: Any) -> tuple[str, ...]:
    """slurm.pass_env: names of variables (the user's choice, secrets too: plan says so)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and ENV_NAME.fullmatch(n) for n in names):
        raise SpecError(where, "pass_env", f"expected a list of variable names (A-Z, 0-9, _), got {shown(names)}")
    # SBATCH_EXPORT would override the script's --export list; other SLURM_*, SRUN_* and SALLOC_* may be named.
    slurms = [name for name in names if name.upper().startswith("SBATCH_") or name.upper() in NEVER_TO_SBATCH]
    if slurms:
        raise SpecError(where, "pass_env", f"{slurms[0]}: sbatch would read it as an option; not passed by name")
    return tuple(dict.fromkeys(names))


# sbatch --mail-user: a user name or one e-mail address (a space, a comma or a quote would make it
# another argument, or another address, in the collect job's #SBATCH line).
MAIL_USER = re.compile(r"[A-Za-z0-9._+-]+(@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*)?")


def _check_mail_user(where: str, value: str) -> None:
    if value and not MAIL_USER.fullmatch(value):
        raise SpecError(where, "mail_user", f"expected a user name or one e-mail address, got {shown(value)}")


# sbatch --mail-type values (Slurm 22.05 and later).
MAIL_TYPES = (
    "NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT", "TIME_LIMIT_90",
    "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS",
)  # fmt: skip
