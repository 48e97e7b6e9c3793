"""The two ways a supervisor starts: on this machine for all of a cell's ranks (the local executor,
tune's probes), or as the one Slurm task of its node (the array task's CellJob)."""

from __future__ import annotations

import os
from pathlib import Path

from ...contracts.files import read_json_object
from ...contracts.record import SPEC_NAME
from ...contracts.spec import LAUNCH_STARTED_ENV
from ..measure.provenance import launch_id
from ..ranks.ports import free_port
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
