"""The job object of one array task (the spec files it reads: folder/layout.py's write_cell_spec).

Lives on the login side so that `submit` pickles it without importing torch; the task imports
the compute side (`cell/`) only when it runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import submitit

from ...contracts.fs.beneath import open_for_writing
from ...contracts.record import RECORD_NAME
from ..folder.layout import LOG_NAME
from .local import add_teardown, launch_limits


@dataclass(frozen=True)
class CellJob(submitit.helpers.Checkpointable):
    """What an array task needs: where its cells' specs live and where their records go; one cell,
    or several one-node cells of one shape (slurm.cells_per_task) run one after another.

    Checkpointable: at the time-limit signal submitit requeues the task with this same object; the
    requeued run skips the cells an earlier run of the job recorded, and the cell it was running
    starts over (a benchmark keeps no training state worth resuming).
    """

    cell_dirs: tuple[str, ...]

    def __call__(self) -> str:
        """The node's supervisor (one Slurm task per node), which starts the node's ranks, for each
        cell in turn; the cells' statuses. A failed cell fails the task once its cells are done,
        so that srun ends the other nodes' tasks (a cell of several nodes is a task of its own)."""
        from ...cell.supervise.entry import supervise_slurm_cells

        statuses, failed = supervise_slurm_cells(self.cell_dirs)
        if failed:
            raise SystemExit(f"cell {'; cell '.join(failed)}")
        return "; ".join(statuses)


def launch_here(directory: Path, processes: int, env: dict[str, str], limit_s: float) -> int | None:
    """local.WarmSupervisor's launch, in this process rather than a supervisor process of its own: what
    tune's probes run inside their Slurm job, so that the allocation imports the ranks' code once and
    forks each probe's ranks (cell/supervise/start.py). The same log, limits and tear-down; the exit
    status, None when it reached limit_s."""
    from ...cell.supervise.entry import supervise_launch

    with os.fdopen(open_for_writing(directory / LOG_NAME), "w") as out:  # never through a link
        launched = time.time()
        env = env | launch_limits(directory, launched, limit_s)
        returncode = supervise_launch(directory, processes, env, out.fileno(), launched + limit_s)
    add_teardown(directory / RECORD_NAME, launched, time.time())
    return returncode
