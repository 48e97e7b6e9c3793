"""slurm.container: the image each cell runs in, validated once, and the command lines that start
the cell inside it (docs/containers.md).

submitit starts every task of a job as `srun ... <python> -u -m submitit.core._submit <folder>`,
and SlurmExecutor's `python` argument is that `<python>`: for Apptainer, Singularity and podman
it becomes `<runtime> exec|run <flags> <image> <python inside>`, so srun starts one container per
task, with the task's environment. pyxis is an srun plugin instead: `srun --container-image
--container-mounts ...` starts the tasks inside the image, and the Python command stays as it is.

Signals: srun passes Slurm's signals (the time limit's SIGUSR2, scancel's SIGTERM) to the task,
which is the runtime's own process: Apptainer's starter passes them to the contained Python,
podman run proxies them to the container (--sig-proxy, its default), and under pyxis the task is
the contained process itself. podman's proxy alone loses Slurm's signals: Slurm sends SIGCONT
and then the signal (scancel's SIGTERM, the time limit's SIGUSR2) to every process of the step,
the signal kills the `runc kill` that forwards the SIGCONT, and podman then stops proxying and
dies of the signal itself, leaving the container running (its parent, conmon, is outside the
step). So a small shell (PODMAN_TASK) names the container and sends it SIGTERM and SIGUSR2 with
`podman kill` as well (the cell ignores the second of each: cell/signals.py).
Records are written into the sweep folder, bound at its own path, so they land on the host.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..cache.hub import CACHE_ENV
from ..fields import SpecError, coerce_fields, documented, require_choices, require_no_control_characters, shown
from ..sources import data_kind, model_kind
from .secret_shapes import require_no_secret

if TYPE_CHECKING:
    from .matrix import Sweep

ContainerRuntime = Literal["apptainer", "singularity", "podman", "pyxis"]


@dataclass(frozen=True)
class Container:
    """slurm.container: each cell runs inside this image. The sweep folder (records, submitit's
    folder), the cache folder and the cells' local model / data / tokenizer paths are bound at
    their own paths; `mounts` adds more."""

    runtime: ContainerRuntime = documented("apptainer", "`apptainer`, `singularity`, `pyxis` or `podman`")
    image: str = documented(
        "",
        "a `.sif` file or `docker://` reference (Apptainer/Singularity), an image name (podman), a `.sqsh` file "
        "or `registry#image` (pyxis)",
        default_means="required",
    )
    mounts: tuple[str, ...] = documented(
        (),
        "more folders to bind: `SRC`, `SRC:DST` or `SRC:DST:OPTIONS` (`ro`, `rw`, ...); absolute paths (`~` is "
        "your home folder where you submit; `$VARS` are not expanded), no `,`",
    )
    env: dict[str, str] = documented({}, "variables set inside the container, over what the job passes in")
    python: str = documented(
        "", "the Python that runs the cell inside the image", default_means="the Python you submit with"
    )
    gpus: bool = documented(
        True,
        "pass the node's GPUs in: `--nv` (Apptainer/Singularity), `--device=nvidia.com/gpu=all` (podman, "
        "through CDI); pyxis passes the job's GPUs itself",
    )
    options: tuple[str, ...] = documented((), "more flags of `apptainer exec` / `podman run`, or of `srun` (pyxis)")

    @classmethod
    def from_dict(cls, values: Any, where: str) -> Container:
        """Errors name `container.<key>` (the YAML loader finds the line of slurm.container.<key>)."""
        if not isinstance(values, Mapping):
            raise SpecError(
                where, "container", f"expected a mapping (runtime, image, mounts, ...), got {shown(values)}"
            )
        try:
            typed = coerce_fields(cls, values, where)
        except SpecError as exc:
            raise SpecError(exc.where, f"container.{exc.key}", exc.what) from None
        for key in ("mounts", "options"):
            items = typed.get(key, ())
            if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
                raise SpecError(where, f"container.{key}", f"expected a list of strings, got {shown(items)}")
            typed[key] = tuple(items)
        typed["env"] = _env(where, typed.get("env", {}))
        container = cls(**typed)
        try:
            require_choices(where, container)
        except SpecError as exc:
            raise SpecError(exc.where, f"container.{exc.key}", exc.what) from None
        if not container.image:
            raise SpecError(where, "container.image", f"expected the image to run the cells in ({container.runtime})")
        texts = [("image", container.image), ("python", container.python)]
        texts += [("mounts", mount) for mount in container.mounts] + [("options", o) for o in container.options]
        texts += [(f"env.{name}", value) for name, value in container.env.items()]
        for key, text in texts:
            require_no_control_characters(where, f"container.{key}", text)
            variable = key.removeprefix("env.") if key.startswith("env.") else ""
            require_no_secret(where, f"container.{key}", text, variable)
        for mount in container.mounts:
            try:
                parse_mount(mount)
            except ValueError as exc:
                raise SpecError(where, "container.mounts", f"{exc}, got {shown(mount)}") from None
        return container


# A variable name of the shell; an option of a mount (ro, rw, z, ...).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MOUNT_OPTIONS = re.compile(r"[A-Za-z0-9=+_-]+")


def _env(where: str, env: Mapping[Any, Any]) -> dict[str, str]:
    """container.env as NAME -> text (a number is written as YAML read it)."""
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise SpecError(where, "container.env", f"expected variable names (A-Z, 0-9, _), got {shown(name)}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise SpecError(where, f"container.env.{name}", f"expected a string or a number, got {shown(value)}")
        out[name] = str(value)
    return out


def parse_mount(text: str) -> tuple[str, str, str]:
    """A mount "SRC[:DST[:OPTIONS]]" as (absolute source, absolute destination, options);
    ValueError says what is wrong. `~` is your home folder where you submit. The runtimes separate
    mounts with ',' (pyxis) and their parts with ':', so neither may be in a path."""
    parts = text.split(":")
    if len(parts) > 3 or "," in text:
        raise ValueError("expected SRC, SRC:DST or SRC:DST:OPTIONS without ','")
    source = str(Path(parts[0]).expanduser())
    target = parts[1] if len(parts) > 1 else source
    options = parts[2] if len(parts) > 2 else ""
    if not (source.startswith("/") and target.startswith("/")):
        raise ValueError("expected absolute paths (the job's working folder is not the container's)")
    if len(parts) > 2 and not MOUNT_OPTIONS.fullmatch(options):
        raise ValueError("expected options such as ro or rw")
    return source, target, options


# ---------------------------------------------------------------------------------------------
# Command lines

# What podman needs beside the binds: the host's network (the rendezvous across nodes), IPC
# (NCCL's shared memory) and PIDs (the contained Python is no PID 1, which would ignore the signals
# it has no handler for), the job's environment (SLURM_*, the setup lines' exports), removal on exit.
PODMAN_RUN_FLAGS = ("--rm", "--network=host", "--ipc=host", "--pid=host", "--uts=host", "--env-host")
# The task of a podman container: `sh -c PODMAN_TASK hpcfsdp-podman <podman run's arguments>`. The
# container is named per job, run and rank; a SIGTERM or SIGUSR2 to the shell (scancel's, the time
# limit's) is passed on with `podman kill`, which starts after Slurm's signals went out, and the
# shell waits for podman run (the trap interrupts `wait`) and ends with its status.
PODMAN_TASK = (
    "n=hpcfsdp-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}-$SLURM_PROCID; "
    'for s in TERM USR2; do trap "podman kill --signal=$s $n >/dev/null 2>&1" $s; done; '
    'podman run --name=$n "$@" & p=$!; '
    "while wait $p; r=$?; kill -0 $p 2>/dev/null; do :; done; exit $r"
)
GPU_FLAGS: dict[str, tuple[str, ...]] = {
    "apptainer": ("--nv",),
    "singularity": ("--nv",),
    "podman": ("--device=nvidia.com/gpu=all",),  # CDI (nvidia-ctk cdi generate)
    "pyxis": (),  # enroot's hooks pass the job's GPUs in
}


def binds(sweep: Sweep, sweep_dir: Path) -> list[tuple[str, str, str]]:
    """(source, destination, options) of every mount: the sweep folder (records and submitit's
    folder), the cache folder, the cells' local model / data / tokenizer paths, then `mounts`
    (which win for the same destination)."""
    from .environment import job_environment  # environment -> matrix -> resources -> here

    folders = [sweep_dir.absolute()]
    cache = job_environment(sweep).get(CACHE_ENV)
    if cache:
        folders.append(Path(cache).absolute())
    for cell in sweep.cells:
        spec = cell.spec
        paths = [path for path in (spec.model, spec.tokenizer) if path and model_kind(path) == "local"]
        paths += [spec.data] if data_kind(spec.data) == "local" else []
        folders += [Path(path).expanduser().absolute() for path in paths]
    found = {str(folder): (str(folder), str(folder), "") for folder in folders}
    container = sweep.resources.container
    for mount in container.mounts if container else ():
        source, target, options = parse_mount(mount)
        found[target] = (source, target, options)
    return list(found.values())


def job_python(sweep: Sweep, sweep_dir: Path) -> str:
    """The shell command submitit starts each task's Python with (SlurmExecutor's `python`)."""
    container = sweep.resources.container
    python = (container.python if container else "") or sys.executable
    if container is None or container.runtime == "pyxis":
        return shlex.quote(python)
    return shlex.join([*runtime_command(container, binds(sweep, sweep_dir)), container.image, python])


def runtime_command(container: Container, mounts: list[tuple[str, str, str]]) -> list[str]:
    """`apptainer exec` / `singularity exec` / `podman run` (in PODMAN_TASK's shell) with its flags,
    up to the image."""
    if container.runtime == "podman":
        command = ["sh", "-c", PODMAN_TASK, "hpcfsdp-podman", *PODMAN_RUN_FLAGS, f"--workdir={os.getcwd()}"]
        command += [f"--volume={mount_text(*mount, short=False)}" for mount in mounts]  # -v /x alone: a volume
    else:
        command = [container.runtime, "exec"]
        command += [f"--bind={mount_text(*mount)}" for mount in mounts]
    command += [f"--env={name}={value}" for name, value in container.env.items()]
    command += GPU_FLAGS[container.runtime] if container.gpus else ()
    return [*command, *container.options]


def mount_text(source: str, target: str, options: str, short: bool = True) -> str:
    """SRC:DST[:OPTIONS], or SRC alone (short: Apptainer's --bind) for a folder bound at its own path."""
    if short and source == target and not options:
        return source
    return ":".join([source, target, *([options] if options else [])])


def srun_args(sweep: Sweep, sweep_dir: Path) -> list[str]:
    """pyxis's srun flags (none for the other runtimes). Its variables are exported by the batch
    script (env_lines) and named in --container-env, so they win over the image's own."""
    container = sweep.resources.container
    if container is None or container.runtime != "pyxis":
        return []
    args = [
        f"--container-image={container.image}",
        f"--container-mounts={','.join(mount_text(*mount, short=False) for mount in binds(sweep, sweep_dir))}",
        f"--container-workdir={os.getcwd()}",
    ]
    if container.env:
        args.append(f"--container-env={','.join(container.env)}")
    return [*args, *container.options]


def env_lines(sweep: Sweep) -> list[str]:
    """Batch script lines for pyxis's variables (the other runtimes take them as --env flags)."""
    container = sweep.resources.container
    if container is None or container.runtime != "pyxis":
        return []
    return [f"export {name}={shlex.quote(value)}" for name, value in container.env.items()]
