"""The result record: the contract between `hpcfsdp run` and the collector.

One JSON file per cell, written atomically (temp file + rename) so a reader never sees half a
record. This module is also the one reader of a sweep folder's JSON files (records, spec.json,
manifest.json): `status`, `submit` and `collect` all read through `read_record` / `record_state`,
so a file one of them calls corrupt is corrupt to all three, named in one line, never a traceback.

A rerun never destroys a record: the current one moves to `attempts/<n>.json` first
(`keep_as_attempt`), so `result.json` is always the latest attempt and every earlier one is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from .errors import UserError
from .fields import choices
from .spec import RunSpec

try:
    import orjson
except ImportError:  # a dependency; without it records are parsed by the standard library, slower
    orjson = None  # type: ignore[assignment]

SCHEMA_VERSION = 1


class CellState(str, Enum):
    """Every state a cell can be in, as status, submit and collect name it (one set for all three).

    A str, so a state equals the text it is written as in records, tables and JSON.
    """

    # what a record's `status` says
    OK = "ok"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"  # the time limit
    DIVERGED = "diverged"  # a loss that is not finite
    CANCELLED = "cancelled"  # scancel, or an interrupted local submit
    NODE_FAIL = "node_fail"
    # Slurm's other endings (endings.py): PREEMPTED, OUT_OF_MEMORY (host memory), DEADLINE, BOOT_FAIL
    PREEMPTED = "preempted"
    HOST_OOM = "host_oom"
    DEADLINE = "deadline"
    BOOT_FAIL = "boot_fail"
    # what the sweep folder and the scheduler say of a cell
    MISSING = "missing"  # no record (yet)
    CORRUPT = "corrupt"  # a record file that cannot be read, or holds values of the wrong type
    STALE = "stale"  # a record made with other values of the cell's fields (a default changed since)
    PENDING = "pending"  # queued
    RUNNING = "running"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# What a record's `status` may say.
STATUSES = tuple(
    s.value
    for s in (
        CellState.OK,
        CellState.OOM,
        CellState.ERROR,
        CellState.TIMEOUT,
        CellState.DIVERGED,
        CellState.CANCELLED,
        CellState.NODE_FAIL,
        CellState.PREEMPTED,
        CellState.HOST_OOM,
        CellState.DEADLINE,
        CellState.BOOT_FAIL,
    )
)
MISSING, CORRUPT = CellState.MISSING, CellState.CORRUPT
ACCOUNTING_KEY = "slurm_accounting"  # added to a record by collect / status once its Slurm job ended
RECORD_NAME = "result.json"  # the current record: the latest attempt
ATTEMPTS_DIR = "attempts"  # earlier records of the cell, 1.json, 2.json, ... in the order they were replaced
SPEC_NAME = "spec.json"  # beside the record: {cell_id, sweep, spec}, written by submit

# Fields the tables and plots compute with: a number (or null) each, lists of numbers.
NUMBER_FIELDS = (
    "tokens_per_s_per_gpu",
    "mfu",
    "peak_memory_gib",
    "data_time_fraction",
    "comm_exposed_fraction",
    "gpu_util_mean",
    "step_time_s",
    "final_loss",
    "gpu_hours_per_billion_tokens",
    "joules_per_token",
    "memory_capacity_gib",
)
NUMBER_LIST_FIELDS = ("losses", "step_times_s")
# The other fields that collect, the history, status and export read (docs/record.md), and the JSON
# types each may hold besides null: a record that holds another type is corrupt, so that the
# history only ever receives typed rows. A mapping's keys are checked the same way ("*": any key).
TEXT, INTEGER, NUMBER = (str,), (int,), (int, float)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "cell_id": TEXT,
    "sweep": TEXT,
    "stage": TEXT,
    "error": TEXT,
    "launch_id": TEXT,
    "git_commit": TEXT,
    "device_name": TEXT,
    "world_size": INTEGER,
    "nodes": INTEGER,
    "started_at": NUMBER,
    "duration_s": NUMBER,
}
MAPPING_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "slurm": {
        "job_id": (str, int),
        "array_job_id": (str, int),
        "array_task_id": (str, int),
        "job_nodelist": TEXT,
        "cluster_name": TEXT,
        "job_partition": TEXT,
    },
    "versions": {"*": TEXT},
    ACCOUNTING_KEY: {
        "state": TEXT,
        "submit": TEXT,
        "start": TEXT,
        "end": TEXT,
        "elapsed_s": INTEGER,
        "queue_wait_s": NUMBER,
        "consumed_energy_j": INTEGER,
    },
}
TEXT_LIST_FIELDS = ("hostnames",)
# Exact types, as json.loads gives them: true is a bool, not the number 1.
NUMBER_TYPES = frozenset({int, float})
SCALAR_TYPES = frozenset({str, int, float, bool})
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
# Every record has these spec fields (the cell id and every table group by them).
REQUIRED_SPEC_FIELDS = ("strategy", "batch_size")


class RecordError(UserError, ValueError):
    """A record (or other sweep JSON file) that cannot be used: one line naming the path and what is wrong."""


class RecordState(NamedTuple):
    """What a cell's record says: its status, or missing / corrupt (then `problem` names the file)."""

    status: str
    record: dict[str, Any] | None = None
    problem: str = ""


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    if record.get("status") not in STATUSES:
        raise ValueError(f"record status must be one of {STATUSES}, got {record.get('status')!r}")
    return write_json(path, {"schema_version": SCHEMA_VERSION, **record}, sort_keys=True)


def failure_record(
    status: str, stage: str, error: str, trace: str | None = None, cell: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """The fields every failed cell's record has: its status, the stage it failed at, the error on
    one line and, where there is one, the traceback (or a log's tail). `cell`: the cell's spec.json
    ({cell_id, sweep, spec}), for a record written where the run's own context is not known (a
    spec the compute node rejects, a launch that never ran): its identity and size. The callers
    add their own fields."""
    record: dict[str, Any] = {"status": status, "stage": stage, "error": error}
    if trace is not None:
        record["traceback"] = trace
    if cell is not None:
        spec = cell["spec"]
        nodes, per_node = spec.get("nodes", 1), spec.get("gpus_per_node", 1)
        record.update(cell_id=cell["cell_id"], sweep=cell["sweep"], spec=spec, world_size=nodes * per_node, nodes=nodes)
    return {**record, **fields}


def write_json(path: str | Path, value: Any, sort_keys: bool = False) -> Path:
    """The one atomic JSON writer (records, the sweep's and the cache's manifests): see
    atomic_output. Values JSON does not know are written as text."""
    text = json.dumps(value, indent=2, sort_keys=sort_keys, default=str) + "\n"
    return write_text(path, text)


def write_text(path: str | Path, text: str) -> Path:
    """Write a text file atomically (atomic_output)."""
    with atomic_output(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A temporary file of a unique name beside path for the block to write (a table, a plot, a
    YAML file), then fsync and rename over path: a reader sees the old file or the new one, never
    half of one, and a write that fails (a full disk) leaves the old file, or none, and no
    temporary file. Its OSError names path, not the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it; mkstemp makes 0600
        finally:
            os.close(fd)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno is None:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def parse_json(data: bytes) -> Any:
    """JSON text to a value: orjson (several times faster: collect parses every record of a sweep)
    where it is installed and the text is within what it reads (64-bit integers, no NaN, 1,024
    levels); the standard library otherwise, so values and error messages stay those of `json`."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data.decode("utf-8"))


def read_json_object(path: str | Path, root: str | Path | None = None, kind: str = "record") -> dict[str, Any]:
    """A JSON object from path, or RecordError naming the path (a `kind` of file) and why not:
    unreadable, not UTF-8, not JSON, too deep (RecursionError) or an integer past Python's digit
    limit (ValueError), not an object, or (with root) a link that leads out of the folder root.
    FileNotFoundError when there is no file."""
    path = Path(path)
    if root is not None and not _inside(path, root):
        raise RecordError(f"{path}: leads out of {root} (a symbolic link); not read")
    try:
        value = parse_json(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):  # no file (a file where its folder should be: none either)
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise RecordError(f"{path}: unreadable {kind} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: unreadable {kind} (not UTF-8 text)") from None
    except RecursionError:
        raise RecordError(f"{path}: unreadable {kind} (JSON nested too deeply)") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise RecordError(f"{path}: unreadable {kind} ({_one_line(exc)})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_record(path: str | Path, root: str | Path | None = None) -> dict[str, Any]:
    """The record at path, checked: RecordError (one line) when it cannot be used; FileNotFoundError
    when there is none."""
    path = Path(path)
    record = read_json_object(path, root)
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {_shown(version)} is not supported (expected {SCHEMA_VERSION})")
    if record.get("status") not in STATUSES:
        raise RecordError(f"{path}: status {_shown(record.get('status'))} is not one of {', '.join(STATUSES)}")
    problem = _record_problem(record)
    if problem:
        raise RecordError(f"{path}: {problem}")
    return record


def record_state(path: str | Path, root: str | Path | None = None) -> RecordState:
    """missing, corrupt (with the one-line problem), or the record's status and the record."""
    try:
        record = read_record(path, root)
    except FileNotFoundError:
        return RecordState(MISSING)
    except RecordError as exc:
        return RecordState(CORRUPT, problem=str(exc))
    return RecordState(record["status"], record)


def _record_problem(record: dict[str, Any]) -> str | None:
    """What makes a parsed record unusable ("tokens_per_s_per_gpu: expected a number or null, got
    "fast""), or None: its spec, and the fields the collector computes with. A wrong value
    elsewhere is carried to results.csv as it is."""
    problem = spec_problem(record.get("spec"))
    if problem:
        return problem
    for name in NUMBER_FIELDS:
        if record.get(name) is not None and type(record[name]) not in NUMBER_TYPES:
            return f"{name}: expected a number or null, got {_shown(record[name])}"
    for name in NUMBER_LIST_FIELDS:
        values = record.get(name)
        if values is not None and not (isinstance(values, list) and set(map(type, values)) <= NUMBER_TYPES):
            return f"{name}: expected a list of numbers, got {_shown(values)}"
    for name in TEXT_LIST_FIELDS:
        values = record.get(name)
        if values is not None and not (isinstance(values, list) and set(map(type, values)) <= {str}):
            return f"{name}: expected a list of text, got {_shown(values)}"
    for name, allowed in FIELD_TYPES.items():
        problem = _type_problem(name, record.get(name), allowed)
        if problem:
            return problem
    for name, keys in MAPPING_TYPES.items():
        mapping = record.get(name)
        if mapping is None:
            continue
        if not isinstance(mapping, dict):
            return f"{name}: expected an object, got {_shown(mapping)}"
        for key, value in mapping.items():
            problem = _type_problem(f"{name}.{key}", value, keys.get(key, keys.get("*", ())))
            if problem:
                return problem
    return None


def _type_problem(name: str, value: Any, allowed: tuple[type, ...]) -> str | None:
    """Whether value (null aside) has one of the allowed types (exactly: true is no integer);
    an empty `allowed` lets any single value through (a field of a newer hpcfsdp)."""
    if value is None:
        return None
    if not allowed:
        return None if type(value) in SCALAR_TYPES else f"{name}: expected a single value, got {_shown(value)}"
    if type(value) in allowed:
        return None
    words = "a number" if float in allowed else " or ".join(TYPE_WORDS[kind] for kind in allowed)
    return f"{name}: expected {words} or null, got {_shown(value)}"


def spec_problem(spec: Any) -> str | None:
    """What makes a recorded spec unusable, or None. A field RunSpec has must have its type (and
    be one of its choices); a field it lacks (written by a newer hpcfsdp) must be a single value.
    A field the spec lacks is newer than the record: its default is what the record was made with."""
    if not isinstance(spec, dict):
        return f"spec: expected an object (the run's RunSpec), got {_shown(spec)}"
    for name in REQUIRED_SPEC_FIELDS:
        if name not in spec:
            return f"spec.{name}: missing"
    types, allowed = _spec_types(), choices(RunSpec)
    for name, value in spec.items():
        expected = types.get(name)
        if expected is None:
            if value is not None and type(value) not in SCALAR_TYPES:
                return f"spec.{name}: expected text, a number or true/false, got {_shown(value)}"
        elif not (type(value) is expected or (expected is float and type(value) is int)):
            return f"spec.{name}: expected {TYPE_WORDS[expected]}, got {_shown(value)}"
        elif name in allowed and value not in allowed[name]:
            return f"spec.{name}: expected one of {', '.join(allowed[name])}, got {_shown(value)}"
    return None


def _spec_types() -> dict[str, type]:
    return {f.name: type(f.default) for f in dataclasses.fields(RunSpec)}


def _shown(value: Any, limit: int = 40) -> str:
    """A value as it reads in the JSON file, cut short: "fast", [1, "x"]; None is a key null or absent."""
    if value is None:
        return "null or missing"
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # an integer past the digit limit, or deep nesting
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def _inside(path: Path, root: str | Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


# ---------------------------------------------------------------------------------------------
# Attempts: a rerun keeps the record it replaces


def keep_as_attempt(cell_dir: str | Path) -> Path | None:
    """Move the cell's current record to attempts/<n>.json (n one past the highest there), never
    over an attempt kept before; returns where it went, or None when there was no record."""
    current = Path(cell_dir) / RECORD_NAME
    if not os.path.lexists(current):
        return None
    folder = current.parent / ATTEMPTS_DIR
    folder.mkdir(exist_ok=True)
    number = 1 + max((int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()), default=0)
    while True:
        target = folder / f"{number}.json"
        try:
            os.link(current, target, follow_symlinks=False)  # fails where target exists: nothing is overwritten
        except FileExistsError:
            number += 1
            continue
        except FileNotFoundError:  # another process moved it first
            return None
        except OSError:  # a file system without hard links; submit holds the sweep's lock
            if target.exists():
                number += 1
                continue
            os.replace(current, target)
            return target
        current.unlink()
        return target


def restore_attempt(cell_dir: str | Path, kept: Path) -> None:
    """Make a record set aside by keep_as_attempt current again (a rerun that did not happen, or
    was interrupted); a record written since, the interrupted run's, is kept as an attempt first."""
    keep_as_attempt(cell_dir)
    os.replace(kept, Path(cell_dir) / RECORD_NAME)


def slurm_job_of(slurm: Any) -> str | None:
    """The id Slurm knows a record's job by (a record's `slurm` object): ARRAY_TASK for an array
    task, as sacct and squeue print it, else the job id; None outside Slurm."""
    if not isinstance(slurm, dict):
        return None
    array, task, job = (_id_text(slurm.get(key)) for key in ("array_job_id", "array_task_id", "job_id"))
    found = f"{array}_{task}" if array and task else job
    return found if found and is_job_id(found) else None


def is_job_id(text: str) -> bool:
    """A Slurm job id as squeue and sacct take it (JOB or ARRAY_TASK): a value from a file that
    becomes their argument must be nothing else (a comma would name other jobs)."""
    return bool(re.fullmatch(r"[0-9]+(_[0-9]+)?", text))


def _id_text(value: Any) -> str | None:
    """An id as text: 4242 whether the JSON held "4242" or a DataFrame made it 4242.0; None for nothing."""
    if value is None or value != value or value == "":  # None, NaN, empty
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
