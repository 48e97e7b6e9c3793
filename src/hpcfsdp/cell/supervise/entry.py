"""The ways a supervisor starts: on this machine for all of a cell's ranks (`python -m
hpcfsdp.cell.supervise --cell-dir`), the same inside a process that runs several launches one after
another (the local executor's kept supervisor, serve.py, and tune's probes in their Slurm job:
supervise_launch), or as the one Slurm task of its node
(the array task's CellJob), for each of the task's cells in turn. Each may be called again in the
same process for the next cell: the ranks' code, imported by the first, is not imported again
(start.py)."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ...contracts.endings import JOB_ENDING_STATUSES
from ...contracts.files import read_json_object
from ...contracts.record import SPEC_NAME
from ...contracts.spec import LAUNCH_STARTED_ENV
from ..measure.provenance import launch_id
from ..ranks.ports import free_port, slurm_port
from ..stopping.requeue import settled_before
from .ending import launch_record
from .layout import local_layout, slurm_layout
from .supervisor import Supervisor, exit_code, hang_seconds

_SLURM_CELLS = itertools.count()  # the cells this process ran as its node's Slurm task, for their ports


def supervise_here(cell_dir: str, processes: int) -> int:
    """Every rank of the cell on this machine; the exit status: 0 when the cell recorded ok."""
    return exit_code(_local_supervisor(Path(cell_dir), processes, None).run())


def supervise_launch(
    cell_dir: Path, processes: int, environ: Mapping[str, str], output: int, deadline: float
) -> int | None:
    """One launch of the cell on this machine in this process, as if it were the local executor's
    supervisor process: `environ` its environment, `output` (a file descriptor) its stdout and
    stderr, ended as the local executor ends one at `deadline` (SIGTERM to the ranks, which record
    `timeout`). The exit status, None when the deadline came first."""
    with _as_process(environ, output):
        supervisor = _local_supervisor(cell_dir, processes, deadline)
        status = supervisor.run()
    return None if supervisor.timed_out else exit_code(status)


def _local_supervisor(directory: Path, processes: int, deadline: float | None) -> Supervisor:
    directory = directory.absolute()
    spec = read_json_object(directory / SPEC_NAME, kind="cell spec")["spec"]
    layout = local_layout(processes, free_port("127.0.0.1"), os.environ)  # a fresh port each launch
    launch = f"supervisor-{os.getpid()}-{os.environ.get(LAUNCH_STARTED_ENV) or time.time()!r}"
    return Supervisor(directory, layout, launch, hang_seconds(spec), may_requeue=False, deadline=deadline)


@contextlib.contextmanager
def _as_process(environ: Mapping[str, str], output: int) -> Iterator[None]:
    """os.environ and file descriptors 1 and 2 as a process of its own would have them; this
    process's own back afterwards."""
    saved_environ = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.environ.clear()
        os.environ.update(environ)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, kept in zip((1, 2), saved, strict=True):
            os.dup2(kept, fd)
            os.close(kept)
        os.environ.clear()
        os.environ.update(saved_environ)


def supervise_slurm_task(cell_dir: str) -> tuple[str, bool]:
    """This node's ranks of the cell, in the node's one task of a Slurm job step: the cell's status,
    and whether this run failed it (a run that did not train, requeued too often, keeps the earlier
    run's record and fails nothing)."""
    directory = Path(cell_dir)
    spec = read_json_object(directory / SPEC_NAME, kind="cell spec")["spec"]
    port = slurm_port(os.environ["SLURM_JOB_ID"], next(_SLURM_CELLS))  # each cell of the task its own
    layout = slurm_layout(int(spec.get("gpus_per_node", 1)), os.environ, port)
    launch = launch_id()
    status = Supervisor(directory, layout, launch, hang_seconds(spec)).run()
    return status, status != "ok" and (status == "missing" or launch_record(directory, launch) is not None)


def supervise_slurm_cells(cell_dirs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The array task's cells one after another (slurm.cells_per_task), each its own launch and
    record: "<cell>: <status>" of each, and of those this run failed. A failed cell does not stop
    the later ones; the job's own ending (a cancel, the time limit, a preemption) does. A requeued
    run skips the cells an earlier run of the job recorded (requeue.settled_before)."""
    statuses: list[str] = []
    failed: list[str] = []
    for position, cell_dir in enumerate(cell_dirs, 1):
        name = Path(cell_dir).name
        if len(cell_dirs) > 1:  # where each cell's part of the task's shared log begins (`hpcfsdp logs`)
            print(f"[hpcfsdp] cell {name} ({position} of {len(cell_dirs)} in this task)", flush=True)
            if settled_before(Path(cell_dir)):
                print(f"[hpcfsdp] {name}: recorded by an earlier run of this job: not run again", flush=True)
                statuses.append(f"{name}: recorded before")
                continue
        status, cell_failed = supervise_slurm_task(cell_dir)
        statuses.append(f"{name}: {status}")
        failed += [statuses[-1]] if cell_failed else []
        if status in JOB_ENDING_STATUSES and position < len(cell_dirs):
            print(f"[hpcfsdp] {name}: {status}: the task starts none of its later cells", file=sys.stderr, flush=True)
            break
    return statuses, failed
