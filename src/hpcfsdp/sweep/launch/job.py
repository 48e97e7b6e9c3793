"""The job object of one array task (the spec file it reads: folder/layout.py's write_cell_spec).

Lives on the login side so that `submit` pickles it without importing torch; the task imports
the compute side (`cell/`) only when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import submitit


@dataclass(frozen=True)
class CellJob(submitit.helpers.Checkpointable):
    """What an array task needs: where the cell's spec lives and where its record goes.

    Checkpointable: at the time-limit signal submitit requeues the task with this same object, and
    the cell starts over (a benchmark keeps no training state worth resuming).
    """

    cell_dir: str

    def __call__(self) -> str:
        """The node's supervisor (one Slurm task per node), which starts the node's ranks; the
        cell's status. A failed cell fails the task, so that srun ends the other nodes' tasks."""
        from ...cell.supervise.entry import supervise_slurm_task

        status, failed = supervise_slurm_task(self.cell_dir)
        if failed:
            raise SystemExit(f"cell {Path(self.cell_dir).name}: {status}")
        return status
