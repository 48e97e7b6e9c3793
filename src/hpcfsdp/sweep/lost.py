"""The record of a cell whose job left the queue without one: how Slurm ended it (sacct's states
and the logs, endings.py), what to change, and the tail of every rank's log, so that collect shows
why. Status, submit --wait, cancel and the local executor write such records through here.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..endings import ended_by, ending_fields, memory_to_ask
from ..files import RecordError, read_json_object
from ..record import RECORD_NAME, SPEC_NAME, failure_record, write_record
from .layout import cell_dir, slurm_folder
from .scheduler import FinishedJob


def lost_ending(
    sweep_dir: Path, cell_id: str, job_id: str, finished: FinishedJob | None
) -> tuple[str, str, dict[str, str]]:
    """status, error line and the record's ending fields (endings.py) of a job that left no record."""
    states = finished.states if finished else []
    logs = "\n".join(path.read_text(errors="replace") for path in cell_logs(sweep_dir, cell_id, job_id))
    known = ended_by(states, logs)
    shown = f" ({states[0]})" if states else ""
    if known is None:
        return "error", f"Slurm job {job_id} ended{shown} without a record", {}
    state, ending = known
    mem_gb = memory_to_ask(logs, 0, finished.max_rss_bytes if finished else 0) if ending.status == "host_oom" else 0
    fields = ending_fields(state, ending, mem_gb)
    return (
        ending.status,
        f"Slurm job {job_id} ended ({state}) without a record: {ending.meaning}; {fields['advice']}",
        fields,
    )


def cell_logs(sweep_dir: Path, cell_id: str, job_id: str) -> list[Path]:
    """Every rank's stderr log of the cell's job (slurm_logs), as many ranks as its spec has."""
    try:
        spec = read_json_object(cell_dir(sweep_dir, cell_id) / SPEC_NAME, kind="cell spec")["spec"]
    except (FileNotFoundError, RecordError):
        return []
    return slurm_logs(sweep_dir, job_id, spec.get("nodes", 1) * spec.get("gpus_per_node", 1))


def slurm_logs(sweep_dir: Path, job_id: str, tasks: int) -> list[Path]:
    """submitit's stderr logs of one job, one per task (rank), in rank order: those that exist."""
    from submitit.core.utils import JobPaths

    paths = (JobPaths(slurm_folder(sweep_dir), job_id=job_id, task_id=task).stderr for task in range(tasks))
    return [path for path in paths if path.exists()]


def log_tails(paths: Iterable[Path], chars: int = 2000) -> str:
    """The last `chars` of each log, under a line naming it: what a launch-failure record keeps."""
    return "\n".join(f"== {path} ==\n{path.read_text(errors='replace')[-chars:]}" for path in paths)


def record_launch_failure(directory: Path, error: str, log_tail: str, status: str = "error", **fields: str) -> None:
    """A cell that ended before it could write its record still gets one, with its log's tail."""
    meta = read_json_object(directory / SPEC_NAME, kind="cell spec")
    write_record(directory / RECORD_NAME, failure_record(status, "launch", error, log_tail, cell=meta, **fields))
