"""A submit's intent: which cells the array it is about to queue holds, written (atomically) before
sbatch and removed once the manifest names the array (issue 51, item 8).

A submit killed between the two (SIGKILL, a lost login session: no handler runs) leaves the array
queued and the manifest without it: status would show its cells missing, cancel would not find
them, and the next submit would queue them a second time. Its array carries a token of its cells
in its --comment (`hpcfsdp:<sweep id>:<token>`: layout.array_comment), so the next `submit`, `status` or `cancel` of the
folder finds it in squeue (the user's jobs of the sweep's job name with that comment) and writes
the manifest entries the killed submit did not: every cell of the array, as its task. An intent
whose array is not in the queue (sbatch never ran, or every task already left) is removed: its
cells then read as they are (a record, or missing, which the next submit queues).

Only the holder of the folder's submit lock reconciles: a submit running now (it holds the lock)
has an intent of its own that its manifest will settle.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ...contracts.files import RecordError, open_lock, read_json_object, write_json
from ...contracts.fs.beneath import remove
from ..define.matrix import is_cell_id
from ..folder.layout import SUBMIT_LOCK_NAME, array_comment, owned_entry, read_manifest, update_manifest
from .packed import task_entry
from .scheduler import my_jobs_named

INTENT_NAME = ".submit_intent.json"


@dataclass(frozen=True)
class Intent:
    """An array about to be queued: the sweep id, the cluster and job name it goes to, and its
    cells in task order (which make its comment's token: layout.array_comment), cells_per_task
    of them to a task (slurm.cells_per_task)."""

    uid: str
    cluster: str
    name: str
    cells: list[str]
    written_at: float
    cells_per_task: int = 1

    @property
    def comment(self) -> str:
        return array_comment(self.uid, self.cells)


def new_intent(uid: str, cluster: str, name: str, cells: list[str], cells_per_task: int = 1) -> Intent:
    return Intent(uid, cluster, name, list(cells), time.time(), cells_per_task)


def write_intent(sweep_dir: Path, intent: Intent) -> None:
    write_json(Path(sweep_dir) / INTENT_NAME, asdict(intent))


def clear_intent(sweep_dir: Path) -> None:
    remove(Path(sweep_dir) / INTENT_NAME, root=sweep_dir)


def reconcile_intent(sweep_dir: Path, log: Callable[[str], None], locked: bool = False) -> None:
    """Settle the intent a killed submit left (see the module's doc): its array's tasks into the
    manifest, then the intent removed. `locked`: the caller holds the submit lock (submit); else
    it is taken here without waiting, and nothing is done while another holds it. SlurmError when
    squeue does not answer (the intent stays, for the next look)."""
    path = Path(sweep_dir) / INTENT_NAME
    if not path.exists():
        return
    if locked:
        _reconcile(sweep_dir, log)
        return
    try:
        fd = open_lock(Path(sweep_dir) / SUBMIT_LOCK_NAME)
    except (OSError, RecordError):  # a folder this user cannot write: nothing of its own to settle
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a submit runs now: its intent is its own
        os.close(fd)
        return
    try:
        _reconcile(sweep_dir, log)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _reconcile(sweep_dir: Path, log: Callable[[str], None]) -> None:
    path = Path(sweep_dir) / INTENT_NAME
    try:
        intent = _read_intent(path, sweep_dir)
    except FileNotFoundError:
        return
    except (RecordError, TypeError, ValueError) as exc:
        log(f"warning: {path}: not an intent a submit wrote ({exc}); removed")
        clear_intent(sweep_dir)
        return
    queued = my_jobs_named(intent.name, intent.cluster)
    tracked = {str(entry.get("job_id", "")).split("_")[0] for entry in read_manifest(sweep_dir).values()}
    arrays = {job_id.split("_")[0] for job_id, job in queued.items() if job.comment == intent.comment} - tracked
    if arrays:
        array = max(arrays, key=int)  # the latest: an earlier one of the same cells would be tracked
        per = intent.cells_per_task
        groups = [intent.cells[start : start + per] for start in range(0, len(intent.cells), per)]
        tasks = {f"{array}_{index}": group for index, group in enumerate(groups)}
        if len(groups) == 1 and array in queued:  # one task: a plain job, not an array
            tasks = {array: groups[0]}
        entry = {"executor": "slurm", "cluster": intent.cluster, "submitted_at": intent.written_at}
        owned = owned_entry(sweep_dir, intent.uid)
        update_manifest(
            sweep_dir,
            {
                cid: {**entry, "job_id": jid, **owned, **task_entry(group)}
                for jid, group in tasks.items()
                for cid in group
            },
        )
        log(
            f"array {array} of {len(intent.cells)} cell(s) was queued by a submit stopped before it wrote "
            f"manifest.json: tracked now"
        )
    clear_intent(sweep_dir)


def _read_intent(path: Path, sweep_dir: Path) -> Intent:
    data = read_json_object(path, root=sweep_dir, kind="submit intent")
    intent = Intent(**data)
    texts = (intent.uid, intent.cluster, intent.name)
    if not (
        all(isinstance(text, str) for text in texts)
        and intent.uid.isalnum()
        and intent.name.startswith("hpcfsdp-")
        and isinstance(intent.cells, list)
        and intent.cells
        and all(is_cell_id(cid) for cid in intent.cells)
        and type(intent.written_at) in (int, float)
        and type(intent.cells_per_task) is int
        and intent.cells_per_task >= 1
    ):
        raise ValueError("a value of another type or shape")
    return intent
