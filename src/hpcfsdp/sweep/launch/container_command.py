"""The command lines that start a cell inside slurm.container's image (the value: sweep/define/container.py;
docs/containers.md).

submitit starts every task of a job as `srun ... <python> -u -m <module> <folder> ...` (hpcfsdp's
module: sweep/launch/digested.py, which checks the job pickle's digest before submitit runs it),
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
`podman kill` as well (the cell ignores the second of each: cell/stopping/signals.py).
Records are written into the sweep folder, bound at its own path, so they land on the host.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ...cache.hub import CACHE_ENV
from ..define.container import Container, parse_mount
from ..define.matrix import Sweep
from .environment import job_environment

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
    folders = [sweep_dir.absolute()]
    cache = job_environment(sweep).get(CACHE_ENV)
    if cache:
        folders.append(Path(cache).absolute())
    for cell in sweep.cells:
        sources = (cell.sources.model, cell.sources.tokenizer, cell.sources.data)
        folders += [Path(source.path) for source in sources if source and source.kind == "local"]
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


# A container of `podman run --rm` is removed by its `podman run`, or by its conmon (podman's exit
# command) where the client was killed first (checked on podman 4.3). But at scancel under load,
# Slurm's SIGKILL after KillWait can end a `podman run` in the middle of that removal, which then
# never finishes: an Exited container is left (seen twice, 2026-11-26). Such a container is
# garbage, whichever job left it, so the batch shell, as it exits, removes every Exited hpcfsdp
# container on its node, and its own job's Created ones (another job's may be starting). Running
# ones are left to their own removal: forcing it (stop, wait, remove) races theirs.
PODMAN_CLEANUP = (
    "trap 'podman rm --ignore $(podman ps --all --quiet --filter name=^hpcfsdp- --filter status=exited) "
    "$(podman ps --all --quiet --filter name=^hpcfsdp-$SLURM_JOB_ID- --filter status=created) >/dev/null 2>&1' EXIT"
)


def env_lines(sweep: Sweep) -> list[str]:
    """Batch script lines: pyxis's variables (the other runtimes take them as --env flags); for
    podman, the removal of the job's containers when the batch script ends."""
    container = sweep.resources.container
    if container is None:
        return []
    if container.runtime == "podman":
        return [PODMAN_CLEANUP]
    if container.runtime != "pyxis":
        return []
    return [f"export {name}={shlex.quote(value)}" for name, value in container.env.items()]
