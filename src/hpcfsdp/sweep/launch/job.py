"""The job object of one array task (the spec files it reads: folder/layout.py's write_cell_spec).

Lives on the login side so that `submit` pickles it without importing torch; the task imports
the compute side (`cell/`) only when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import submitit


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
