"""The record a supervisor writes for its cell when a rank could not: one that died by a signal,
exited without a record, stopped or froze, or ranks that a signal ended before they wrote theirs.
The first ending of a launch stands (as between ranks: cell/run.py's _keeps_earlier_failure): a
record of this launch that says the cell failed is never overwritten, by a rank or a supervisor."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from ...contracts.files import RecordError, read_json_object
from ...contracts.record import PROGRESS_NAME, RECORD_NAME, SPEC_NAME, failure_record, read_record, write_record
from ..measure.provenance import SLURM_FIELDS, framework_environment
from .watch import Ending


def launch_record(cell_dir: Path, launch: str) -> dict[str, Any] | None:
    """The cell's record if this launch wrote it, else None."""
    try:
        record = read_record(cell_dir / RECORD_NAME)
    except (RecordError, FileNotFoundError):
        return None
    return record if record.get("launch_id") == launch else None


def cell_status(cell_dir: Path) -> str:
    """The status the cell's record says (of any launch: an earlier run's that this one kept), or missing."""
    try:
        return str(read_record(cell_dir / RECORD_NAME)["status"])
    except (RecordError, FileNotFoundError):
        return "missing"


def write_ending(
    cell_dir: Path, launch: str, status: str, error: str, log_tail: str, launched: float, **fields: Any
) -> bool:
    """Write the cell's failure record unless this launch already recorded a failure; whether written."""
    earlier = launch_record(cell_dir, launch)
    if earlier is not None and earlier.get("status") != "ok":
        return False
    meta = read_json_object(cell_dir / SPEC_NAME, kind="cell spec")
    record = failure_record(
        status,
        _stage(cell_dir, launched),
        error,
        log_tail,
        cell=meta,
        launch_id=launch,
        started_at=launched,
        slurm={key: os.environ.get(f"SLURM_{key.upper()}") for key in SLURM_FIELDS},
        environment=framework_environment(os.environ),
        recorded_by=f"supervisor (pid {os.getpid()} on {node_here()})",
        **fields,
    )
    write_record(cell_dir / RECORD_NAME, record)
    return True


def write_rank_ending(cell_dir: Path, launch: str, ending: Ending, log_tail: str, launched: float) -> bool:
    """The record of a rank's ending as its supervisor saw it: the cause, the rank, its pid and node."""
    fields: dict[str, Any] = {
        "failed_rank": ending.rank,
        "failed_pid": ending.pid,
        "failed_node": ending.node,
        "hostnames": [ending.node],
    }
    if ending.signal:
        fields["failed_signal"] = ending.signal
    return write_ending(cell_dir, launch, ending.status, ending.error, log_tail, launched, **fields)


def node_here() -> str:
    """This node as Slurm names it, else the host's name (ranks/resources.py's node_name, without torch)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _stage(cell_dir: Path, launched: float) -> str:
    """The stage rank 0 last noted in the progress file during this launch, else `launch`."""
    try:
        progress = read_json_object(cell_dir / PROGRESS_NAME, kind="progress file")
    except (RecordError, OSError):
        return "launch"
    at, stage = progress.get("at"), progress.get("stage")
    return stage if isinstance(stage, str) and isinstance(at, (int, float)) and at >= launched else "launch"
