"""How often Slurm preempted each cell, for `status`: the cell's record and the records of its
earlier runs (attempts/, where a requeued or rerun cell keeps them) that say `preempted`. A cell
that Slurm requeued after a preemption and that then ended `ok` still shows that it was preempted.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ...contracts.files import RecordError, read_json_object
from ...contracts.fs.beneath import matching
from ...contracts.record import ATTEMPTS_DIR, MAX_RECORD_BYTES, RECORD_NAME

PREEMPTED = "preempted"


def preemptions(cell_dir: Path) -> int:
    """The cell's records (current and earlier) whose status is `preempted`."""
    count = 0
    for path in [cell_dir / RECORD_NAME, *matching(cell_dir / ATTEMPTS_DIR, "*.json")]:
        try:
            count += read_json_object(path, root=cell_dir, limit=MAX_RECORD_BYTES).get("status") == PREEMPTED
        except (FileNotFoundError, RecordError):  # none yet, or a corrupt one status names itself
            continue
    return count


def preemption_note(counts: Iterable[int]) -> str:
    """'; preempted 3 time(s) in 2 cell(s)' for the summary line, or "" when none was preempted."""
    preempted = [n for n in counts if n]
    return f"; preempted {sum(preempted)} time(s) in {len(preempted)} cell(s)" if preempted else ""
