"""The result record: the contract between `hpcfsdp run` and the collector.

One JSON file per cell, written atomically (files.py) so a reader never sees half a record. Its
shape is typed here (Record, OkRecord, FailedRecord and the mappings they hold), once: the fields
read_record checks are those the TypedDicts mark Checked. `status`, `submit` and `collect` all read
through `read_record` / `record_state`, so a file one of them calls corrupt is corrupt to all three,
named in one line, never a traceback.

A rerun never destroys a record: the current one moves to `attempts/<n>.json` first
(`keep_as_attempt`), so `result.json` is always the latest attempt and every earlier one is kept.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict, cast

from .fields import choices
from .files import RecordError, read_json_object, write_json
from .jsontypes import SCALAR_TYPES, TYPE_WORDS, Checked, checked_fields, shown, value_problem
from .spec import RunSpec

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
    HANG = "hang"  # a step (or collective) that ran past its timeout: a rank stopped answering
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
        CellState.HANG,
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

# ---------------------------------------------------------------------------------------------
# The record's shape (docs/record.md). A field marked Checked is one that collect, the history,
# status or export reads: a record whose value has another type than the annotation's, null aside,
# is corrupt (read_record), so that the history only ever receives typed rows. The other fields are
# carried to results.csv as they are. A checked mapping checks each key it declares, and takes any
# other key (a newer hpcfsdp's) as a single value.


class SlurmJob(TypedDict, total=False):
    """`slurm`: the job's SLURM_* variables (each null outside Slurm)."""

    job_id: str | int | None
    array_job_id: str | int | None
    array_task_id: str | int | None
    job_nodelist: str | None
    cluster_name: str | None
    job_partition: str | None


class SlurmAccounting(TypedDict, total=False):
    """`slurm_accounting`: sacct's answer for the job, added by collect or status once it ended."""

    state: str | None
    submit: str | None  # the cluster's local time, as sacct prints it; start and end too
    start: str | None
    end: str | None
    elapsed_s: int | None
    queue_wait_s: float | None
    consumed_energy_j: int | None  # null where the cluster gathers no energy


class BatchProbe(TypedDict, total=False):
    """One batch the search tried (figures: the max over ranks)."""

    batch_size: int
    status: Literal["ok", "oom", "over_margin"]
    peak_memory_gib: float
    peak_reserved_gib: float | None  # CUDA only
    tokens_per_s_per_gpu: float | None  # null for an OOM
    wall_s: float
    error: str  # an OOM's first line


class BatchSearchRecord(TypedDict, total=False):
    """`batch_search`: what a `batch_size: auto` cell's search tried and found (cell/batch_search.py)."""

    probes: list[BatchProbe]
    largest_fitting_batch: int | None
    smallest_failing_batch: int | None
    chosen_batch_size: int | None
    capped: bool
    first_batch: int
    cap: int
    margin: float
    capacity_gib: float | None
    limit_gib: float | None
    probe_steps: int
    wall_s: float


class Record(TypedDict, total=False):
    """The fields every record has (a `launch` record, written by the submitter, lacks those of the
    run: its ranks, devices and versions)."""

    status: str  # one of STATUSES: write_record and read_record insist on it
    schema_version: int
    cell_id: Checked[str | None]
    sweep: Checked[str | None]
    spec: dict[str, Any]  # the resolved RunSpec; checked against RunSpec's fields (spec_problem)
    world_size: Checked[int | None]
    nodes: Checked[int | None]
    device_type: str
    device_name: Checked[str | None]
    gpu_count: int
    backend: str
    hostnames: Checked[list[str] | None]
    slurm: Checked[SlurmJob | None]
    versions: Checked[dict[str, str | None] | None]
    environment: dict[str, str]
    git_commit: Checked[str | None]
    launch_id: Checked[str | None]
    started_at: Checked[float | None]
    duration_s: Checked[float | None]
    slurm_accounting: Checked[SlurmAccounting | None]
    batch_search: BatchSearchRecord  # a `batch_size: auto` cell's, failed or not


class OkRecord(Record, total=False):
    """An `ok` record: the measurements (docs/metrics.md); some only where enabled."""

    tokens_per_s: float
    tokens_per_s_per_gpu: Checked[float | None]
    samples_per_s: float
    tokens_per_step: int
    step_time_s: Checked[float | None]
    step_time_p90_s: float
    step_times_s: Checked[list[float] | None]
    window_step_time_s: float
    optimizer_step_s: float  # stop_when_stable only: clipping and the optimizer step (median, slowest rank)
    warmup_steps: int
    timed_steps: int
    data_time_fraction: Checked[float | None]
    flops_per_token: float
    non_embedding_params: int
    flops_tied_lm_head: bool
    tflops_per_gpu: float
    peak_tflops: float | None
    mfu: Checked[float | None]
    memory: dict[str, dict[str, float]]  # per stage, max over ranks
    peak_memory_gib: Checked[float | None]
    peak_memory_kind: str
    memory_capacity_gib: Checked[float | None]
    gpu_hours_per_billion_tokens: Checked[float | None]
    energy_j: float | None
    joules_per_token: Checked[float | None]
    energy_per_rank_j: list[float] | None
    losses: Checked[list[float] | None]
    final_loss: Checked[float | None]
    optimizer_tracks_model: bool
    model_source: dict[str, Any]
    data_source: dict[str, Any]
    float8_linears: int
    comm_s_per_step: float
    comm_exposed_s_per_step: float
    comm_profile_step_time_s: float
    comm_profile_steps: int
    comm_fraction: float
    comm_exposed_fraction: Checked[float | None]
    gpu_util_mean: Checked[float | None]
    gpu_util_min: float
    sm_clock_mhz_mean: float
    power_w_mean: float
    gpu_utilisation_per_rank: list[dict[str, Any]]
    profile_trace_dir: str
    memory_snapshot: str
    final_param_norm: float


class FailedRecord(Record, total=False):
    """A record of any other status: where and why the cell failed."""

    stage: Checked[str | None]  # setup, data, batch_search, model, shard, train, comm_profile, profile, launch
    error: Checked[str | None]  # one line
    traceback: str  # or, for a `launch` record, the tail of the cell's logs
    failed_rank: int
    memory_at_failure: dict[str, float]
    memory_snapshot: str  # an `oom` record's, with memory_snapshot: true on a GPU
    diverged_step: int
    losses: Checked[list[float] | None]  # a `diverged` record's: every loss known
    slurm_state: str  # one of Slurm's endings: its word, and what to change
    advice: str


CHECKED_FIELDS = checked_fields(OkRecord, FailedRecord)  # name -> annotation: what read_record checks
# Every record has these spec fields (the cell id and every table group by them).
REQUIRED_SPEC_FIELDS = ("strategy", "batch_size")


class RecordState(NamedTuple):
    """What a cell's record says: its status, or missing / corrupt (then `problem` names the file)."""

    status: str
    record: dict[str, Any] | None = None
    problem: str = ""


def write_record(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Write a record built here (OkRecord, FailedRecord) or read and amended (accounting added)."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"record status must be one of {STATUSES}, got {record.get('status')!r}")
    return write_json(path, {"schema_version": SCHEMA_VERSION, **record}, sort_keys=True)


def failure_record(
    status: str, stage: str, error: str, trace: str | None = None, /, cell: dict[str, Any] | None = None, **fields: Any
) -> FailedRecord:
    """The fields every failed cell's record has: its status, the stage it failed at, the error on
    one line and, where there is one, the traceback (or a log's tail). `cell`: the cell's spec.json
    ({cell_id, sweep, spec}), for a record written where the run's own context is not known (a
    spec the compute node rejects, a launch that never ran): its identity and size. The callers
    add their own fields."""
    record: FailedRecord = {"status": status, "stage": stage, "error": error}
    if trace is not None:
        record["traceback"] = trace
    if cell is not None:
        spec = cell["spec"]
        nodes, per_node = spec.get("nodes", 1), spec.get("gpus_per_node", 1)
        record.update(
            {
                "cell_id": cell["cell_id"],
                "sweep": cell["sweep"],
                "spec": spec,
                "world_size": nodes * per_node,
                "nodes": nodes,
            }
        )
    return cast(FailedRecord, {**record, **fields})  # the callers' fields: the run's context, Slurm's ending


def read_record(path: str | Path, root: str | Path | None = None) -> dict[str, Any]:
    """The record at path, checked: RecordError (one line) when it cannot be used; FileNotFoundError
    when there is none. A plain dict, not a Record: only its Checked fields are known to hold
    their declared types."""
    path = Path(path)
    record = read_json_object(path, root)
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {shown(version)} is not supported (expected {SCHEMA_VERSION})")
    if record.get("status") not in STATUSES:
        raise RecordError(f"{path}: status {shown(record.get('status'))} is not one of {', '.join(STATUSES)}")
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
    "fast""), or None: its spec, and the fields marked Checked. A wrong value elsewhere is carried
    to results.csv as it is."""
    problem = spec_problem(record.get("spec"))
    if problem:
        return problem
    for name, hint in CHECKED_FIELDS.items():
        problem = value_problem(name, record.get(name), hint)
        if problem:
            return problem
    return None


def spec_problem(spec: Any) -> str | None:
    """What makes a recorded spec unusable, or None. A field RunSpec has must have its type (and
    be one of its choices); a field it lacks (written by a newer hpcfsdp) must be a single value.
    A field the spec lacks is newer than the record: its default is what the record was made with."""
    if not isinstance(spec, dict):
        return f"spec: expected an object (the run's RunSpec), got {shown(spec)}"
    for name in REQUIRED_SPEC_FIELDS:
        if name not in spec:
            return f"spec.{name}: missing"
    types, allowed = _spec_types(), choices(RunSpec)
    for name, value in spec.items():
        expected = types.get(name)
        if expected is None:
            if value is not None and type(value) not in SCALAR_TYPES:
                return f"spec.{name}: expected text, a number or true/false, got {shown(value)}"
        elif not (type(value) is expected or (expected is float and type(value) is int)):
            return f"spec.{name}: expected {TYPE_WORDS[expected]}, got {shown(value)}"
        elif name in allowed and value not in allowed[name]:
            return f"spec.{name}: expected one of {', '.join(allowed[name])}, got {shown(value)}"
    return None


def _spec_types() -> dict[str, type]:
    return {f.name: type(f.default) for f in dataclasses.fields(RunSpec)}


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
