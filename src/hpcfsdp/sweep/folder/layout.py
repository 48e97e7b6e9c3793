"""The layout of a sweep folder (results/<sweep>/), in one place:

    matrix.yaml                    the matrix as submitted
    manifest.json                  cell id -> executor, job id, cluster, submit time, sweep id and folder
    cells/<id>/spec.json           the cell's spec and its resolved sources (write_cell_spec)
    cells/<id>/result.json         written by the cell (record.py): its current record
    cells/<id>/attempts/<n>.json   the records reruns (--retry-failed, --force) replaced, oldest first
    cells/<id>/log.txt             the local executor's log of the cell
    slurm/<job>/                   submitit's scripts and logs
    .submit.lock                   held by the submit running now (lock.py)
    tune.json, tune/               what `hpcfsdp tune` found, and its search's state (tune/state.py)

Submit writes it; status, collect, export and the accounting read it. No torch, no pandas.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from ...contracts.attempts import keep_as_attempt, restore_attempt
from ...contracts.fields import SpecError
from ...contracts.files import (
    RecordError,
    read_json_object,
    read_regular_file,
    write_json,
    write_text,
)
from ...contracts.fs.beneath import entries, folder, make_folders, open_file, remove
from ...contracts.fs.ownership import user_name
from ...contracts.names import has_surrogate, is_job_id, readable, slurm_name_problem
from ...contracts.record import BATCH_HINT_KEYS, SPEC_NAME

if TYPE_CHECKING:
    from ...contracts.sources import Sources
    from ...contracts.spec import RunSpec
    from ..define.matrix import Cell, Sweep

CELLS_DIR = "cells"
MANIFEST_NAME = "manifest.json"
MATRIX_NAME = "matrix.yaml"
SLURM_DIR = "slurm"
LOG_NAME = "log.txt"  # a cell's output under the local executor, in its cell folder
TUNE_NAME = "tune.json"
LOG_TAIL_BYTES = 8 << 20  # what is read of one log at most: its end, where a failure shows


def cell_dir(sweep_dir: Path, cell: Cell | str) -> Path:
    """cells/<id> of the cell (a Cell or its id)."""
    return Path(sweep_dir) / CELLS_DIR / (cell if isinstance(cell, str) else cell.id)


def cell_files(sweep_dir: Path, name: str) -> list[Path]:
    """The file `name` (result.json, spec.json) of every cell that has one, by cell id; a folder
    whose name is not UTF-8, or a link, is no cell's (unusable_cell_folders lists it)."""
    cells = Path(sweep_dir) / CELLS_DIR
    return [Path(cells, cell_id, name) for cell_id in cell_ids_with(sweep_dir, name)]


def cell_ids_with(sweep_dir: Path, name: str) -> list[str]:
    """The ids (folder names) of the cells of cell_files(sweep_dir, name), sorted, without making a
    Path of each: the folders of cells/ that hold an entry `name`, by one scandir. No link is
    followed (the file layer's rule, docs/security.md): cells/ is reached through none, a
    cells/<id> that is a link is no cell's folder, and `name` is looked at, not what it leads to
    (its reader refuses a link in one line)."""
    try:
        with folder(Path(sweep_dir, CELLS_DIR), sweep_dir) as cells:
            folders = sorted(
                entry.name
                for entry in entries(cells)
                if entry.is_dir(follow_symlinks=False) and not _no_cell_id(entry.name)
            )
            return [cell_id for cell_id in folders if _has_entry(cells, f"{cell_id}/{name}")]
    except OSError:
        return []


def _has_entry(fd: int, relative: str) -> bool:
    """Whether anything (a link too, not followed) is at the relative path below the open folder fd."""
    try:
        os.stat(relative, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _no_cell_id(name: str) -> bool:
    """A folder name no cell id is: not UTF-8 text (a lone surrogate, as Python reads such a name),
    or holding a control character (a newline would split the lines that name it). A printable
    name has neither (str.isprintable is False for every Cc and Cs character): most names, in C."""
    if name.isprintable():
        return False
    return has_surrogate(name) or any(unicodedata.category(char) == "Cc" for char in name)


def unusable_cell_folders(sweep_dir: Path) -> dict[str, str]:
    """The entries of cells/ that cell_ids_with passes over: a folder whose name is no cell id
    (_no_cell_id), which cannot be written to a report, a CSV file or strict JSON (issue 44, item
    4), and a symbolic link, which is never followed (the file layer's rule). Their names shown
    escaped (as ascii() writes them) -> the line that names each: status shows each as a corrupt
    cell, collect lists it as unreadable."""
    cells = readable(str(Path(sweep_dir) / CELLS_DIR))
    try:
        with folder(Path(sweep_dir, CELLS_DIR), sweep_dir) as fd:
            found = sorted((entry.name, entry.is_symlink()) for entry in entries(fd))
    except OSError:
        return {}
    lines = {}
    for name, link in found:
        if _no_cell_id(name):
            why = "a cell folder whose name is no cell id (not UTF-8 text, or a control character)"
        elif link:
            why = "a symbolic link where a cell folder belongs (hpcfsdp follows none)"
        else:
            continue
        escaped = ascii(name)[1:-1]
        lines[escaped] = f"{cells}/{escaped}: {why}; not read"
    return lines


def planned_cell_ids(sweep_dir: Path) -> list[str]:
    """The cells of the folder: those with a spec.json, sorted."""
    return cell_ids_with(sweep_dir, SPEC_NAME)


LOG_SUFFIXES = {"stdout": "_log.out", "stderr": "_log.err"}  # submitit's names: slurm/<job>/<job>_<rank>_log.out


def job_log_files(sweep_dir: Path, job_id: str, stream: str) -> list[tuple[int, Path]]:
    """(rank, path) of each log file of one job (stream: stdout or stderr) in rank order: the files
    in the job's folder, not a count of ranks from a spec.json (a hand-edited one may say
    nodes: 10**12). A job id that is none (from a file) names no folder. Links are listed as they
    are: read them through read_log."""
    if not is_job_id(job_id):
        return []
    job_folder = Path(str(slurm_folder(sweep_dir)).replace("%j", job_id))
    name = re.compile(re.escape(job_id) + r"_([0-9]{1,9})" + re.escape(LOG_SUFFIXES[stream]))
    try:
        found = entries(job_folder) if job_folder.is_dir() else []
    except OSError:
        return []
    return sorted((int(m.group(1)), Path(e.path)) for e in found if (m := name.fullmatch(e.name)))


def log_out_of_folder(sweep_dir: Path, path: Path) -> str:
    """Why a log is not read ("" where it may be): a link that leads out of the sweep folder."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(sweep_dir)):
        return f"not shown: a link to {real}, out of the sweep folder"
    return ""


def read_log(sweep_dir: Path, path: Path, limit: int = LOG_TAIL_BYTES) -> tuple[str, str]:
    """(the log's text, "") or ("", why it is not read): a link out of the sweep folder (to
    /etc/shadow, say) or anything but a regular file (a FIFO, /dev/zero) is not read, and of a
    long log only its last `limit` bytes, from the first whole line."""
    why = log_out_of_folder(sweep_dir, path)
    if why:
        return "", why
    try:
        data = read_regular_file(path, limit, tail=True)
    except OSError as exc:
        return "", f"not shown: {exc.strerror or exc}"
    text = data.decode(errors="replace")
    if len(data) == limit and os.path.getsize(path) > limit:
        text = f"[... only its last {limit:,} bytes]\n" + text.split("\n", 1)[-1]
    return text, ""


def require_inside(sweep_dir: Path, path: Path) -> None:
    """SpecError when path (a folder hpcfsdp writes or runs in: report/, tune/, a run's folder) is,
    or is reached through, a link that leads out of the sweep folder: nothing out of it is written
    or trained, whatever a shared folder holds."""
    real = os.path.realpath(path)
    if os.path.lexists(path) and not Path(real).is_relative_to(os.path.realpath(sweep_dir)):
        raise SpecError(
            str(path), "", f"a link to {real}, out of the sweep folder; remove it (hpcfsdp writes {path.name}/ itself)"
        )


def slurm_folder(sweep_dir: Path) -> Path:
    """submitit's folder for scripts, pickles and logs; absolute, as SlurmExecutor makes it."""
    return (Path(sweep_dir) / SLURM_DIR / "%j").expanduser().absolute()


def read_manifest(sweep_dir: Path) -> dict[str, dict]:
    """cell id -> {executor, job_id, cluster, submitted_at} (the local executor adds ended_at once
    its launch ends); {} before the first submit; RecordError (one line) when the file cannot be read."""
    path = Path(sweep_dir) / MANIFEST_NAME
    try:
        manifest = read_json_object(path, root=sweep_dir, kind="manifest")
    except FileNotFoundError:
        return {}
    for cell_id, entry in manifest.items():
        if cell_id in ("", ".", "..") or "/" in cell_id or "\\" in cell_id or "\0" in cell_id:
            # A cell id becomes the folder cells/<id>/ that status and submit write records into.
            raise RecordError(f"{path}: {cell_id!r}: not a cell folder name; not followed")
        if not isinstance(entry, dict):
            raise RecordError(
                f"{path}: {cell_id}: expected an object (executor, job_id, submitted_at), got {type(entry).__name__}"
            )
    return manifest


class SlurmJobs(NamedTuple):
    """A sweep's Slurm jobs, from one read of its manifest."""

    ids: dict[str, str]  # cell id -> its latest job id (ARRAY_TASK, or JOB for a one-cell array)
    cluster: str  # the cluster they were queued on (slurm.clusters); "" the default one
    uid: str = ""  # the folder's sweep id, each job's --comment (sweep_comment); "" before issue 33
    elsewhere: str = ""  # the folder another manifest's jobs were queued from (this one is a copy)


# Each Slurm entry of the manifest names the sweep id its jobs carry in --comment and the folder
# that queued them (resolved): a copy of the folder, made while its jobs run, holds the same
# manifest, and must never take the original's jobs for its own (cancel them, record them lost).
UID_KEY = "sweep_uid"
FOLDER_KEY = "folder"


def sweep_comment(uid: str) -> str:
    """The --comment of a sweep's jobs: squeue shows it (%k), and cancel and status check it."""
    return f"hpcfsdp:{uid}"


def array_comment(uid: str, cell_ids: Iterable[str]) -> str:
    """The --comment of one array submit queues: the sweep's, and a token of its cells (in task
    order), by which the next submit, status or cancel finds an array a killed submit queued
    (track/intent.py). The same cells give the same token, so `plan --sbatch` prints the script
    submit writes."""
    token = hashlib.sha256(f"{uid}:{','.join(cell_ids)}".encode()).hexdigest()[:16]
    return f"{sweep_comment(uid)}:{token}"


def slurm_jobs(sweep_dir: Path, cell_ids: Iterable[str]) -> SlurmJobs:
    """The latest Slurm job of each of these cells that this folder queued (or the folder it was
    moved from), and the sweep's cluster and id; jobs queued from another folder (this one a copy
    of it) are left out and named."""
    manifest = read_manifest(sweep_dir)
    own = own_entries(sweep_dir, manifest)
    entries = {cid: own.get(cid, {}) for cid in cell_ids}
    ids = {
        cid: str(e["job_id"])
        for cid, e in entries.items()
        if e.get("executor") == "slurm" and e.get("job_id") and is_job_id(str(e["job_id"]))
    }
    elsewhere = next((str(e[FOLDER_KEY]) for cid, e in manifest.items() if cid not in own), "")
    return SlurmJobs(ids, _queued_on(own) or "", folder_uid(sweep_dir, own), elsewhere)


def own_entries(sweep_dir: Path, manifest: dict[str, dict] | None = None) -> dict[str, dict]:
    """The manifest's entries of jobs this folder queued: those naming it, those of no folder
    (before issue 33), and those naming a folder this one was moved from (moved_from)."""
    manifest = read_manifest(sweep_dir) if manifest is None else manifest
    here = str(Path(sweep_dir).resolve())
    gone: dict[str, bool] = {}
    own = {}
    for cid, entry in manifest.items():
        folder = entry.get(FOLDER_KEY, here)
        if folder != here and folder not in gone:
            gone[folder] = _moved_away(folder, entry.get(UID_KEY))
        if folder == here or gone[folder]:
            own[cid] = entry
    return own


def moved_from(sweep_dir: Path) -> str:
    """The folder this one was moved from while jobs it queued there were in the queue ("" when
    none): the manifest names it, and it holds no manifest of the same sweep id any more."""
    here = str(Path(sweep_dir).resolve())
    folders = {str(e.get(FOLDER_KEY)) for e in own_entries(sweep_dir).values() if e.get(FOLDER_KEY, here) != here}
    return ", ".join(sorted(folders))


def _moved_away(folder: object, uid: object) -> bool:
    """Whether the folder a manifest entry names is gone with its jobs' sweep id: no folder there,
    or one whose manifest names no job of that id (a copy's original still names them)."""
    if not isinstance(folder, str) or not isinstance(uid, str) or not uid:
        return False
    try:
        there = read_manifest(Path(folder))
    except RecordError:
        return False  # a manifest there that cannot be read may still be the original's
    return not any(entry.get(UID_KEY) == uid for entry in there.values())


def folder_uid(sweep_dir: Path, own: dict[str, dict] | None = None) -> str:
    """The sweep id of the jobs this folder queued ("" before its first Slurm submit)."""
    if own is None:
        own = {cid: e for cid, e in own_entries(sweep_dir).items() if FOLDER_KEY in e}
    found = [e[UID_KEY] for e in own.values() if isinstance(e.get(UID_KEY), str) and e[UID_KEY].isalnum()]
    return found[-1] if found else ""


def new_uid() -> str:
    """A sweep id, made at a folder's first Slurm submit."""
    return secrets.token_hex(8)


def owned_entry(sweep_dir: Path, uid: str) -> dict[str, str]:
    """The manifest fields that bind a queued cell to this folder."""
    return {UID_KEY: uid, FOLDER_KEY: str(Path(sweep_dir).resolve())}


def manifest_cluster(sweep_dir: Path) -> str | None:
    """The cluster the sweep's Slurm jobs were queued on (slurm.clusters; "" the default one), from
    the manifest; None before any cell was queued from this folder."""
    return _queued_on(own_entries(sweep_dir))


def _queued_on(manifest: dict[str, dict]) -> str | None:
    """The latest Slurm entry's cluster (submit never queues one folder's cells on two clusters)."""
    entries = [e for e in manifest.values() if e.get("executor") == "slurm"]
    if not entries:
        return None
    latest = max(
        entries, key=lambda e: float(e["submitted_at"]) if isinstance(e.get("submitted_at"), (int, float)) else 0.0
    )
    cluster = str(latest.get("cluster") or "")
    if "," in cluster or cluster.lower() == "all" or slurm_name_problem(cluster):
        # -M all (or a list) would ask, and scancel, every cluster: a manifest never names one.
        raise RecordError(f"manifest.json: cluster {cluster!r}: not one cluster name; not followed")
    return cluster


def update_manifest(sweep_dir: Path, entries: dict[str, dict]) -> None:
    """Add or replace the entries of these cells (atomically: the file names the sweep's jobs)."""
    manifest = read_manifest(sweep_dir)
    manifest.update(entries)
    write_json(Path(sweep_dir) / MANIFEST_NAME, manifest, sort_keys=True, root=sweep_dir)


def write_sweep_files(
    sweep: Sweep, sweep_dir: Path, cells: Iterable[Cell], hints: Mapping[str, Mapping[str, Any]] | None = None
) -> None:
    """matrix.yaml, and the spec.json of each cell about to run, with its batch hints by cell id
    (write_cell_spec)."""
    make_folders(sweep_dir)
    write_text(sweep_dir / MATRIX_NAME, yaml.safe_dump(sweep.raw, sort_keys=False))
    for cell in cells:
        write_cell_spec(
            cell_dir(sweep_dir, cell), cell.spec, cell.id, sweep.name, cell.sources, (hints or {}).get(cell.id)
        )


@contextmanager
def records_set_aside(sweep_dir: Path, cells: Iterable[Cell]) -> Iterator[None]:
    """Keep the cells' current records as attempts (record.keep_as_attempt) for a rerun: status
    then reads the new run's state. If the block fails or is interrupted (sbatch refused, Ctrl-C,
    a local run cut short), each earlier record is current again, and whatever the cut-short run
    recorded is kept as an attempt too: a cell that had no record has none again, so that the same
    command runs it (its `cancelled` record would otherwise read as the cell's outcome)."""
    folders = {cell.id: cell_dir(sweep_dir, cell) for cell in cells}
    kept = {cell_id: keep_as_attempt(folder) for cell_id, folder in folders.items()}
    try:
        yield
    except BaseException:
        for cell_id, folder in folders.items():
            if (earlier := kept[cell_id]) is not None:
                restore_attempt(folder, earlier)
            else:
                keep_as_attempt(folder)
        raise


def write_cell_spec(
    cell_dir: Path,
    spec: RunSpec,
    cell_id: str,
    sweep: str,
    sources: Sources,
    hints: Mapping[str, Any] | None = None,
) -> Path:
    """The spec.json a cell runs from (launch/job.py's CellJob reads it on the compute node): the
    spec as the user wrote it, and beside it its sources as resolved here (the cell uses those,
    not its strings); for a `batch_size: auto` cell its batch hints (record.BATCH_HINT_KEYS: the
    predicted memory its search starts from, or the batch a tune probe already found). Never into a
    cells/ or cells/<id>/ that is a link out of the folder above them."""
    require_inside(cell_dir.parent.parent, cell_dir)
    make_folders(cell_dir)
    path = cell_dir / SPEC_NAME
    meta = {"cell_id": cell_id, "sweep": sweep, "spec": spec.to_dict(), "sources": sources.to_dict()}
    meta.update({key: value for key, value in (hints or {}).items() if key in BATCH_HINT_KEYS})
    write_text(path, json.dumps(meta, indent=2), root=cell_dir.parent.parent)
    return path


# A local submit's queue (the local executor runs its cells one at a time, with no scheduler to
# ask): which cell runs and which wait, for `status` to tell them from cells that have no record
# and will get none. Believed only while the submit that wrote it holds the sweep's lock.
SUBMIT_LOCK_NAME = ".submit.lock"  # launch/lock.py: the flock of one submit at a time
LOCAL_RUN_NAME = ".local_run.json"
LOCAL_RUN_MAX = 1 << 20  # a local run's queue names cells: a megabyte is some 60,000 of them


class LocalRun(NamedTuple):
    running: str  # the cell id running now
    waiting: frozenset[str]  # those after it


def write_local_run(sweep_dir: Path, running: str, waiting: Iterable[str]) -> None:
    """Say which cell the local submit of this process runs now, and which wait (read by local_run)."""
    holder = f"pid {os.getpid()} of {user_name(os.geteuid())} on {os.uname().nodename}"
    write_json(Path(sweep_dir) / LOCAL_RUN_NAME, {"holder": holder, "running": running, "waiting": list(waiting)})


def end_local_run(sweep_dir: Path) -> None:
    remove(Path(sweep_dir) / LOCAL_RUN_NAME)


def local_run(sweep_dir: Path) -> LocalRun | None:
    """The queue of the local submit running on this folder now; None when none runs (no file, or
    its writer no longer holds the sweep's lock: it ended, or was killed)."""
    try:
        run = read_json_object(Path(sweep_dir) / LOCAL_RUN_NAME, kind="local run", limit=LOCAL_RUN_MAX)
    except (FileNotFoundError, RecordError):
        return None
    holder, running, waiting = run.get("holder"), run.get("running"), run.get("waiting")
    if not (isinstance(holder, str) and isinstance(running, str) and isinstance(waiting, list)):
        return None
    try:  # never through a link, never a FIFO (which would hang the open), never more than a note
        fd = open_file(Path(sweep_dir) / SUBMIT_LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: by the writer, if its line says so
        # locks.write_lock_note: "hpcfsdp submit: pid N of USER on HOST, since ..."
        note = os.pread(fd, LOCAL_RUN_MAX, 0).decode(errors="replace")
        return LocalRun(running, frozenset(map(str, waiting))) if f": {holder}," in note else None
    except OSError:
        return None
    finally:
        os.close(fd)  # and with it a shared lock taken
    return None
