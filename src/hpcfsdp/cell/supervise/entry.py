"""The two ways a supervisor starts: on this machine for all of a cell's ranks (the local executor,
tune's probes), or as the one Slurm task of its node (the array task's CellJob), for each of the
task's cells in turn."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ...contracts.endings import JOB_ENDING_STATUSES
from ...contracts.files import read_json_object
from ...contracts.record import SPEC_NAME
from ...contracts.spec import LAUNCH_STARTED_ENV
from ..measure.provenance import launch_id
from ..ranks.ports import free_port
from ..stopping.requeue import settled_before
from .ending import launch_record
from .layout import local_layout, slurm_layout
from .supervisor import Supervisor, exit_code, hang_seconds


def supervise_here(cell_dir: str, processes: int) -> int:
    """Every rank of the cell on this machine; the exit status: 0 when the cell recorded ok."""
    directory = Path(cell_dir).absolute()
    spec = read_json_object(directory / SPEC_NAME, kind="cell spec")["spec"]
    layout = local_layout(processes, free_port("127.0.0.1"), os.environ)
    launch = f"supervisor-{os.getpid()}-{os.environ.get(LAUNCH_STARTED_ENV, '')}"
    return exit_code(Supervisor(directory, layout, launch, hang_seconds(spec)).run())


def supervise_slurm_task(cell_dir: str) -> tuple[str, bool]:
    """This node's ranks of the cell, in the node's one task of a Slurm job step: the cell's status,
    and whether this run failed it (a run that did not train, requeued too often, keeps the earlier
    run's record and fails nothing)."""
    directory = Path(cell_dir)
    spec = read_json_object(directory / SPEC_NAME, kind="cell spec")["spec"]
    layout = slurm_layout(int(spec.get("gpus_per_node", 1)), os.environ)
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
