"""The run every export tool gets of a record (ExportedRun, exported_runs), shared by the writers of
export.py (MLflow), tensorboard.py and wandb.py; the optional libraries imported here only (import_extra)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ...contracts.errors import UserError
from ...contracts.files import RecordError
from ...contracts.names import slurm_id_text, slurm_job_of
from ...contracts.record import RECORD_NAME, CellState
from ...sweep.folder.layout import CELLS_DIR, read_manifest
from ..history_rows import attempt_of, setup_key, spec_values, system_of
from ..read import METRICS

EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # target -> the pyproject extra
# The record's figures a run's summary carries (final values): its headline metrics and its step
# time, which is the median of the timed steps (docs/metrics.md), not the last step's.
FIGURES = (*METRICS, "step_time_s", "step_time_p90_s")
FINAL_PREFIX = "final/"  # TensorBoard tag of a figure
# The series of each timed step's time: not the record's `step_times_s` (a list) beside its figure
# `step_time_s` (their median, in the summary), two names one letter apart for two things.
STEP_SERIES = "step_duration_s"
UID_KEY = "sweep_uid"  # the sweep's random id, where the record or its manifest entry has one
# What a run was made from and by (_provenance), beside its spec in the hparams
PROVENANCE_KEYS = ("git_commit", "slurm_job_id", "slurm_array_job_id", "slurm_array_task_id", "sweep_dir", UID_KEY)


class ExportError(UserError, RuntimeError):
    """The export cannot run: a missing extra or an unusable target; one line."""


@dataclass(frozen=True)
class ExportedRun:
    """What one record becomes in every tool. Steps count from 1, as the record's `diverged_step`,
    the progress lines and the report's loss plot count them."""

    cell_id: str
    status: str
    error: str | None  # its first line
    spec: dict[str, Any]
    setup: str
    attempt: str
    system: str | None
    gpu: str | None
    losses: list[tuple[int, float]]  # (step, loss): NaN where the loss was not finite
    step_times: list[tuple[int, float]]  # (step, seconds) of the timed steps, those after the warm-up
    wall_times: dict[int, float]  # step -> when it ended (Unix time; wall_times_of)
    figures: dict[str, float]  # FIGURES the record has
    provenance: dict[str, str]  # what it was made from and by (_provenance): git commit, Slurm job, sweep
    hostnames: list[str]
    versions: dict[str, str]
    started_at: float | None
    duration_s: float | None
    user: str | None = None  # who ran the cell: the owner of its record (MLflow's "Created by")

    @property
    def ok(self) -> bool:
        return self.status == CellState.OK

    @property
    def ended_at(self) -> float | None:
        if self.started_at is None:
            return None
        return self.started_at + (self.duration_s or 0.0)

    @property
    def last_step(self) -> int:
        """The step the figures are shown at: the last one trained (0 for a cell that trained none)."""
        return max((step for step, _ in self.losses + self.step_times), default=0)


def import_extra(target: str) -> None:
    """Import the target's library (lazily, here only), or say which extra installs it."""
    import importlib

    try:
        importlib.import_module(target)
    except ImportError:
        raise ExportError(
            f"export --to {target} needs the '{EXTRAS[target]}' extra: pip install 'hpcfsdp[{EXTRAS[target]}]'"
        ) from None


def exported_runs(sweep_dir: Path, frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> Iterator[ExportedRun]:
    """One ExportedRun per record of the sweep's frame (read.load_records: one row per record)."""
    if frame.empty:
        return
    manifest = _manifest(sweep_dir)
    folder = str(sweep_dir.resolve())
    for record in frame.to_dict("records"):
        spec = spec_values({name: record.get(name) for name in spec_fields})
        warmup = int(_number(record.get("warmup_steps")) or 0)
        started, duration = launch_of(record)
        losses = [(step, _loss(value)) for step, value in enumerate(_list(record.get("losses")), 1)]
        step_times = [
            (warmup + step, float(t))
            for step, t in enumerate(_list(record.get("step_times_s")), 1)
            if _number(t) is not None
        ]
        entry = manifest.get(record["cell_id"])
        yield ExportedRun(
            cell_id=record["cell_id"],
            status=str(record["status"]),
            error=record["error"].splitlines()[0] if _text(record.get("error")) else None,
            spec=spec,
            setup=setup_key(spec),
            attempt=attempt_of(record.get("launch_id"), record.get("started_at")),
            system=system_of(record.get("slurm.cluster_name"), record.get("hostnames")),
            gpu=_text(record.get("device_name")),
            losses=losses,
            step_times=step_times,
            wall_times=wall_times_of([step for step, _ in losses], step_times, started, duration),
            figures={name: value for name in FIGURES if (value := _number(record.get(name))) is not None},
            provenance=_provenance(record, folder, entry if isinstance(entry, dict) else {}),
            hostnames=[str(h) for h in _list(record.get("hostnames"))],
            versions={
                str(key).split(".", 1)[1]: value
                for key, value in record.items()
                if str(key).startswith("versions.") and isinstance(value, str)
            },
            started_at=started,
            duration_s=duration,
            user=_owner(sweep_dir / CELLS_DIR / str(record["cell_id"]) / RECORD_NAME),
        )


def _owner(path: Path) -> str | None:
    """The user name of the file's owner (its uid where no name is known); None without the file."""
    import pwd

    try:
        uid = path.stat().st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def launch_of(record: Mapping[Any, Any]) -> tuple[float | None, float | None]:
    """The run's start and length: the launch's whole span (launch_span_s: from torchrun's or srun's
    start, imports and set-up included), ending at the record's write, where the record has it;
    else the cell's own (started_at, duration_s)."""
    started, duration = _number(record.get("started_at")), _number(record.get("duration_s"))
    span = _number(record.get("launch_span_s"))
    if started is None or duration is None or span is None:
        return started, duration
    return started + duration - span, span


def wall_times_of(
    steps: list[int], step_times: list[tuple[int, float]], started: float | None, duration: float | None
) -> dict[int, float]:
    """When each step ended, from what the record knows: the last timed step at the record's end
    (started_at + duration_s), each earlier timed step one step time before the next one ended;
    a step without a time of its own (a warm-up step) at the start of the first timed step, and
    every step of a record without step times (a failed cell's) at the record's end."""
    end = (started or 0.0) + (duration or 0.0)
    walls, moment = {}, end
    for step, seconds in reversed(step_times):
        walls[step] = moment
        moment -= seconds
    first_timed = min(walls, default=None)
    for step in steps:
        walls.setdefault(step, moment if first_timed is not None and step < first_timed else end)
    return walls


def _provenance(record: Mapping[Any, Any], folder: str, entry: Mapping[str, Any]) -> dict[str, str]:
    """What the run was made from and by: the record's git commit, its Slurm job (ARRAY_TASK as
    squeue and sacct print it, and its two parts), the sweep folder and the sweep's random id."""
    slurm = {key: record.get(f"slurm.{key}") for key in ("job_id", "array_job_id", "array_task_id")}
    found = {
        "git_commit": _text(record.get("git_commit")),
        "slurm_job_id": slurm_job_of(slurm),
        "slurm_array_job_id": slurm_id_text(slurm["array_job_id"]),
        "slurm_array_task_id": slurm_id_text(slurm["array_task_id"]),
        "sweep_dir": folder,
        UID_KEY: _text(record.get(UID_KEY)) or _text(entry.get(UID_KEY)),
    }
    return {key: value for key, value in found.items() if value}


def _manifest(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's manifest (cell id -> entry); {} when it has none or cannot be read (load_records
    has named it then)."""
    try:
        return read_manifest(sweep_dir)
    except RecordError:
        return {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _loss(value: Any) -> float:
    """A loss as the tools take it: a number, NaN for one that was not finite (null in a record of
    schema 2, NaN or Infinity in one of schema 1)."""
    number = _number(value)
    return math.nan if number is None else number


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# ---------------------------------------------------------------------------------------------
# MLflow: experiment = the sweep, one run per record, in a file store or a database (any tracking URI)
