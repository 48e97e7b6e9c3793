"""The result record: the contract between `hpcfsdp run` and the collector.

One JSON file per cell, written atomically (files.py) so a reader never sees half a record. Its
shape is typed here (Record, OkRecord, FailedRecord and the mappings they hold), once: the fields
read_record checks are those the TypedDicts mark Checked. `status`, `submit` and `collect` all read
through `read_record` / `validity.record_state`, so a file one of them calls corrupt is corrupt to all three,
named in one line, never a traceback.

A rerun never destroys a record: the current one moves to `attempts/<n>.json` first
(`keep_as_attempt`), so `result.json` is always the latest attempt and every earlier one is kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict, cast

from .files import RecordError, read_json_object, write_json
from .jsontypes import (
    JSON_VALUE_REF,
    Checked,
    Figure,
    Moment,
    annotation_schema,
    checked_fields,
    compiled_check,
    core_schema,
    integer_out_of_int64,
    shown,
    typed_dict_check,
    value_problem,
)
from .recordspec import spec_problem, spec_schema

# The version write_record writes, and those read_record reads. 2: strict JSON, `losses` holds null
# for a step whose loss was not finite and `nonfinite_steps` names those steps; 1 wrote a bare NaN
# there (Python's json reads it, other parsers refuse it) and is read as it was.
SCHEMA_VERSION = 2
READ_SCHEMA_VERSIONS = (1, 2)


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
# The stages of a record's `memory` readings, in the order a cell takes them (cell/build.py, cell/run.py);
# a record file sorts its keys, so readers put them back in this order (memory_in_stage_order).
MEMORY_STAGES = ("after_model", "after_shard", "after_optimizer", "after_warmup", "end")
SPEC_NAME = "spec.json"  # beside the record: {cell_id, sweep, spec}, written by submit
# In spec.json of a `batch_size: auto` cell: the predicted memory per batch its search starts from
# (sweep/predict/memory.py), or the batch_search record of a tune probe of the same setup, whose
# chosen batch the cell measures without searching again (tune's final stage).
BATCH_PREDICTION_KEY = "batch_prediction"
BATCH_FOUND_KEY = "batch_found"
BATCH_HINT_KEYS = (BATCH_PREDICTION_KEY, BATCH_FOUND_KEY)
# Beside the record while the cell runs: rank 0's stage and step ({stage, step, steps, at}), for status --watch
PROGRESS_NAME = "progress.json"

# ---------------------------------------------------------------------------------------------
# The record's shape (docs/record.md). A field marked Checked is one that collect, the history,
# status or export reads: a record whose value has another type than the annotation's, null aside,
# is corrupt (read_record), so that the history only ever receives typed rows. The other fields are
# carried to results.csv as they are. A Figure (a measurement) must also be from 0 to 1e15, a
# Moment a time from 2000-01-01 to a day after now, and every integer of a record fit 64 bits:
# a record out of range is corrupt too, and never ranked. A checked mapping checks each key it
# declares, and takes any other key (a newer hpcfsdp's) as a single value.


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
    elapsed_s: Figure[int | None]
    queue_wait_s: Figure[float | None]
    consumed_energy_j: Figure[int | None]  # null where the cluster gathers no energy


class Spread(TypedDict, total=False):
    """`tokens_per_s_spread`: tokens/s per GPU at the timed window's 10th and 90th percentile step
    (each step on its slowest rank; p10 is the slow end)."""

    p10: Figure[float]
    p90: Figure[float]


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
    predicted_batch: int | None  # the prediction's batch the search probed first; null without one
    reused_from: str  # tune's final stage: the probe (stage/run) whose search this is; the cell searched none


class RankResources(TypedDict, total=False):  # a rank in `ranks` (cell/ranks/resources.py); GPU's null on CPU
    rank: int
    pid: int
    host: str  # SLURMD_NODENAME, else the host name
    device: str  # cuda:0, cpu
    gpu_uuid: str | None  # GPU-..., and the bus id 00000000:1A:00.0, as nvidia-smi writes them
    gpu_bus_id: str | None
    gpu_name: str | None
    gpu_memory_gib: float | None
    cpus: int | None  # the CPUs the rank may run on (its affinity)


class Record(TypedDict, total=False):
    """The fields every record has (a `launch` record, written by the submitter, lacks those of the
    run: its ranks, devices and versions)."""

    status: str  # one of STATUSES: write_record and read_record insist on it
    schema_version: int
    cell_id: Checked[str | None]
    sweep: Checked[str | None]
    spec: dict[str, Any]  # the resolved RunSpec; checked against RunSpec's fields (spec_problem)
    world_size: Figure[int | None]
    nodes: Figure[int | None]
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
    started_at: Moment[float | None]
    duration_s: Figure[float | None]  # run_cell's start to the record's write: start-up and imports left out
    launch_span_s: Figure[float | None]  # the launcher's start (torchrun, srun) to the record's write
    phases: dict[str, float]  # where the launch's time went, in seconds (cell/measure/phases.py)
    slurm_accounting: Checked[SlurmAccounting | None]
    batch_search: BatchSearchRecord  # a `batch_size: auto` cell's, failed or not
    ranks: list[RankResources]  # what each rank ran on, in rank order
    resource_problems: Checked[list[str] | None]  # how they differ from the spec, a sentence each


class OkRecord(Record, total=False):
    """An `ok` record: the measurements (docs/metrics.md); some only where enabled."""

    tokens_per_s: Figure[float | None]
    tokens_per_s_per_gpu: Figure[float | None]  # the timed window's mean
    tokens_per_s_spread: Checked[Spread | None]  # null where the steps were not timed one by one
    samples_per_s: Figure[float | None]
    tokens_per_step: int
    step_time_s: Figure[float | None]
    step_time_p90_s: Figure[float | None]
    step_times_s: Figure[list[float] | None]
    window_step_time_s: Figure[float | None]
    optimizer_step_s: Figure[
        float | None
    ]  # stop_when_stable only: clipping and the optimizer step (median, slowest rank)
    warmup_steps: int
    timed_steps: int
    data_time_fraction: Figure[float | None]
    flops_per_token: Figure[float | None]
    non_embedding_params: int
    flops_tied_lm_head: bool
    tflops_per_gpu: Figure[float | None]
    peak_tflops: Figure[float | None]
    mfu: Figure[float | None]
    memory: dict[str, dict[str, float]]  # per stage, max over ranks
    peak_memory_gib: Figure[float | None]
    peak_memory_kind: str
    memory_capacity_gib: Figure[float | None]
    gpu_hours_per_billion_tokens: Figure[float | None]
    energy_j: Figure[float | None]
    joules_per_token: Figure[float | None]
    energy_per_rank_j: Figure[list[float] | None]
    # Every step's loss; a step whose loss was not finite is null (schema 2, naming it in
    # nonfinite_steps; schema 1 wrote NaN or Infinity): how a diverged cell looks, not a corrupt record.
    losses: Checked[Sequence[float | None] | None]
    nonfinite_steps: Checked[list[int] | None]  # the steps (from 1) whose loss is null in `losses`
    finished_steps: int  # a `timeout` record's: the steps it finished, whose figures it keeps (tokens_per_s, ...)
    final_loss: Checked[float | None]
    optimizer_tracks_model: bool
    # How many of the model's parameter tensors moved between the first step and the last, of how
    # many: 0 of N is a model that did not train (contracts/validity.py's evidence).
    parameters_changed: int
    parameters_total: int
    model_source: dict[str, Any]
    data_source: dict[str, Any]
    float8_linears: int
    comm_s_per_step: Figure[float | None]
    comm_exposed_s_per_step: Figure[float | None]
    comm_profile_step_time_s: Figure[float | None]
    comm_profile_steps: int
    comm_fraction: Figure[float | None]
    comm_exposed_fraction: Figure[float | None]
    gpu_util_mean: Figure[float | None]
    gpu_util_min: Figure[float | None]
    sm_clock_mhz_mean: Figure[float | None]
    power_w_mean: Figure[float | None]
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
    failed_signal: str | None  # the signal that ended failed_rank (SIGKILL, SIGSEGV, SIGSTOP, ...), where known
    failed_pid: int  # a record the node's supervisor wrote (cell/supervise/): failed_rank's process
    failed_node: str  # and the node it ran on
    recorded_by: str  # "supervisor (pid P on NODE)" where the node's supervisor wrote the record
    memory_at_failure: dict[str, float]
    memory_snapshot: str  # an `oom` record's, with memory_snapshot: true on a GPU
    diverged_step: int
    losses: Checked[Sequence[float | None] | None]  # a `diverged` record's: every loss known, null where not finite
    nonfinite_steps: Checked[list[int] | None]  # the steps (from 1) whose loss is null in `losses`
    slurm_state: str  # one of Slurm's endings: its word, and what to change
    advice: str


CHECKED_FIELDS = checked_fields(OkRecord, FailedRecord)  # name -> annotation: what read_record checks


def stage_rank(stage: str) -> tuple[int, str]:
    """A memory stage's place in run order; a stage this version does not know goes last."""
    return (MEMORY_STAGES.index(stage), "") if stage in MEMORY_STAGES else (len(MEMORY_STAGES), stage)


def memory_in_stage_order(memory: Mapping[str, Any]) -> dict[str, Any]:
    return {stage: memory[stage] for stage in sorted(memory, key=stage_rank)}


class RecordState(NamedTuple):
    """What a cell's record says: its status, or missing / corrupt (then `problem` names the file)."""

    status: str
    record: dict[str, Any] | None = None
    problem: str = ""


def write_record(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Write a record built here (OkRecord, FailedRecord) or read and amended (accounting added), as
    this SCHEMA_VERSION: strict JSON, which every parser reads (write_json); a loss that was not
    finite becomes null in `losses`, and `nonfinite_steps` names its step."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"record status must be one of {STATUSES}, got {record.get('status')!r}")
    return write_json(path, {**_with_nonfinite_steps(record), "schema_version": SCHEMA_VERSION}, sort_keys=True)


def _with_nonfinite_steps(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with null for each loss that is a float but not finite (NaN, inf: JSON has no
    word for them), and the steps whose loss is null, counted from 1 as `diverged_step` and the
    progress lines count them, in `nonfinite_steps` (empty when every loss is finite). A record
    without a list of losses is as it was; any other value in the list stays, for the reader to
    refuse."""
    losses = record.get("losses")
    if not isinstance(losses, list):
        return dict(record)
    kept = [None if isinstance(loss, float) and not math.isfinite(loss) else loss for loss in losses]
    return {**record, "losses": kept, "nonfinite_steps": [step for step, loss in enumerate(kept, 1) if loss is None]}


def failure_record(
    status: str, stage: str, error: str, trace: str | None = None, /, cell: dict[str, Any] | None = None, **fields: Any
) -> FailedRecord:
    """The fields every failed cell's record has: its status, the stage it failed at, the error on
    one line and, where there is one, the traceback (or a log's tail). `cell`: the cell's spec.json
    ({cell_id, sweep, spec, sources}), for a record written where the run's own context is not known (a
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


# A record is some 10 KB, and 48 bytes a step more (its losses and step times, as write_record
# writes them): 4 MiB is some 85,000 steps, days of one cell. A larger file is no record of a
# benchmark, and would cost status and collect seconds and hundreds of MB each (issue 44, item 11).
MAX_RECORD_BYTES = 4 << 20


def read_record(path: str | Path, root: str | Path | None = None) -> dict[str, Any]:
    """The record at path, checked: RecordError (one line) when it cannot be used (larger than
    MAX_RECORD_BYTES too); FileNotFoundError when there is none. A plain dict, not a Record: only
    its Checked fields are known to hold their declared types."""
    path = path if isinstance(path, Path) else Path(path)
    record = read_json_object(path, root, limit=MAX_RECORD_BYTES)
    version = record.get("schema_version")
    if version not in READ_SCHEMA_VERSIONS:
        expected = " or ".join(map(str, READ_SCHEMA_VERSIONS))
        raise RecordError(f"{path}: schema_version {shown(version)} is not supported (expected {expected})")
    if record.get("status") not in STATUSES:
        raise RecordError(f"{path}: status {shown(record.get('status'))} is not one of {', '.join(STATUSES)}")
    check = _compiled_record_check()
    problem = None if check is not None and check(record) else _record_problem(record)
    if problem:
        raise RecordError(f"{path}: {problem}")
    return record


def _record_problem(record: dict[str, Any]) -> str | None:
    """What makes a parsed record unusable ("tokens_per_s_per_gpu: expected a number or null, got
    "fast""), or None: its spec, and the fields marked Checked. A wrong value elsewhere is carried
    to results.csv as it is."""
    big = integer_out_of_int64(record)
    if big:  # its key path is the record's own text: a newline or escape in a key stays one line
        where = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in big)
        return f"{where}: expected an integer within 64 bits (-2**63 to 2**63 - 1)"
    problem = spec_problem(record.get("spec"))
    if problem:
        return problem
    for name, hint in CHECKED_FIELDS.items():
        problem = value_problem(name, record.get(name), hint)
        if problem:
            return problem
    return None


@functools.cache
def _compiled_record_check() -> Callable[[Any], bool] | None:
    """_record_problem compiled (jsontypes.compiled_check) from the same declarations: the Checked
    fields and their marks, RunSpec's fields, types, choices and ranges; every other value any
    JSON whose integers fit 64 bits. None where pydantic-core is missing."""
    if core_schema is None:
        return None
    fields = {name: annotation_schema(hint) for name, hint in CHECKED_FIELDS.items()}
    any_json = core_schema.definition_reference_schema(JSON_VALUE_REF)
    return compiled_check(typed_dict_check({**fields, "spec": spec_schema()}, any_json, required=("spec",)))
