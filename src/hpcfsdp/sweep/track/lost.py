"""The record of a cell whose job left the queue without one: how Slurm ended it (sacct's states
and the logs, endings.py), what to change, and the tail of every rank's log, so that collect shows
why. Status, submit --wait, cancel and the local executor write such records through here.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ...contracts.endings import ended_by, ending_fields, memory_to_ask
from ...contracts.files import read_json_object, read_regular_file
from ...contracts.record import RECORD_NAME, SPEC_NAME, failure_record, write_record
from ..folder.layout import LOG_TAIL_BYTES, job_log_files, log_out_of_folder, read_log
from .scheduler import FinishedJob


def lost_ending(
    sweep_dir: Path, cell_id: str, job_id: str, finished: FinishedJob | None
) -> tuple[str, str, dict[str, str]]:
    """status, error line and the record's ending fields (endings.py) of a job that left no record."""
    states = finished.states if finished else []
    logs = _logs_text(sweep_dir, cell_logs(sweep_dir, cell_id, job_id))
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
    """Every rank's stderr log of the cell's job (slurm_logs)."""
    return slurm_logs(sweep_dir, job_id)


def slurm_logs(sweep_dir: Path, job_id: str, tasks: int | None = None) -> list[Path]:
    """submitit's stderr logs of one job, one per task (rank; the first `tasks` of them), in rank
    order: those that exist and lead nowhere out of the sweep folder (a record keeps their tails)."""
    return [
        path
        for rank, path in job_log_files(sweep_dir, job_id, "stderr")
        if (tasks is None or rank < tasks) and not log_out_of_folder(sweep_dir, path)
    ]


def log_tails(paths: Iterable[Path], chars: int = 2000) -> str:
    """The last `chars` of each log, under a line naming it: what a launch-failure record keeps
    (read as regular files only, at most their last LOG_TAIL_BYTES)."""
    return "\n".join(f"== {path} ==\n{_tail(path)[-chars:]}" for path in paths)


def _tail(path: Path) -> str:
    try:
        return read_regular_file(path, LOG_TAIL_BYTES, tail=True).decode(errors="replace")
    except OSError as exc:
        return f"(not read: {exc.strerror or exc})"


def _logs_text(sweep_dir: Path, paths: Iterable[Path]) -> str:
    return "\n".join(read_log(sweep_dir, path)[0] for path in paths)


def record_launch_failure(directory: Path, error: str, log_tail: str, status: str = "error", **fields: str) -> None:
    """A cell that ended before it could write its record still gets one, with its log's tail."""
    meta = read_json_object(directory / SPEC_NAME, kind="cell spec")
    write_record(directory / RECORD_NAME, failure_record(status, "launch", error, log_tail, cell=meta, **fields))
