"""`hpcfsdp export SWEEP --to tensorboard|mlflow|wandb DIR`: one run per cell record, where people
already look at runs (docs/history.md).

Every tool gets the same run of a record (ExportedRun): the loss and the timed steps' times as
series, at the steps the record, the report's loss plot and the progress lines count (the first
optimizer step is 1); the record's own figures (its median step time, tokens/s per GPU, MFU, peak
memory) as the run's summary, never the last point of a series; the spec as hyperparameters /
params; when, where and from what the run was made (start, duration, hosts, versions, git commit,
Slurm job, sweep folder) as the record says, never the exporting machine. The writers are the
libraries' own, imported here only: tensorboard, mlflow and wandb are optional extras
(`pip install 'hpcfsdp[tensorboard]'`, `'hpcfsdp[mlflow]'`, `'hpcfsdp[wandb]'`). W&B runs are
written offline only (nothing leaves the machine; wandb.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ...contracts.errors import UserError
from ...contracts.files import RecordError
from ...contracts.record import CellState, slurm_job_of
from ...sweep.folder.layout import read_manifest
from ..history_rows import attempt_of, setup_key, spec_values, system_of
from ..read import METRICS, load_records

TARGETS = ("tensorboard", "mlflow", "wandb")
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # target -> the pyproject extra
# The record's figures a run's summary carries (final values): its headline metrics and its step
# time, which is the median of the timed steps (docs/metrics.md), not the last step's.
FIGURES = (*METRICS, "step_time_s", "step_time_p90_s")
FINAL_PREFIX = "final/"  # TensorBoard tag of a figure
UID_KEY = "sweep_uid"  # the sweep's random id, where the record or its manifest entry has one
MLFLOW_METRICS, MLFLOW_PARAMS, MLFLOW_TAG_CHARS = 1000, 100, 5000  # what MLflow takes in one call / one tag


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


def export_sweep(sweep_dir: Path, target: str, destination: str) -> tuple[int, int]:
    """Write one run per cell record of the sweep; returns (runs written, runs already there)."""
    if target not in TARGETS:
        raise ExportError(f"export: --to {target}: expected one of {', '.join(TARGETS)}")
    from . import tensorboard, wandb

    writer = {"tensorboard": tensorboard.write, "mlflow": _mlflow, "wandb": wandb.write}[target]
    collection = load_records(sweep_dir)
    runs = list(exported_runs(Path(sweep_dir), collection.frame, collection.spec_fields))
    return writer(runs, Path(sweep_dir).resolve().name, destination)


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
        started, duration = _number(record.get("started_at")), _number(record.get("duration_s"))
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
        )


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
        "slurm_array_job_id": _id_text(slurm["array_job_id"]),
        "slurm_array_task_id": _id_text(slurm["array_task_id"]),
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


def _id_text(value: Any) -> str | None:
    """A Slurm id as text: 4242 whether the JSON held "4242" or a DataFrame made it 4242.0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return _text(value) or (str(value) if isinstance(value, int) and not isinstance(value, bool) else None)


# ---------------------------------------------------------------------------------------------
# MLflow: experiment = the sweep, one run per record, in a file store or a database (any tracking URI)


def tracking_uri(destination: str) -> str:
    """A folder becomes a file: URI (MLflow's file store, no server); a URI (sqlite:///x.db,
    http://host) is used as it is."""
    if "://" in destination or destination.startswith("file:"):
        return destination
    return Path(destination).resolve().as_uri()


def _database_needs(uri: str) -> None:
    """A database store (sqlite:///x.db, postgresql://...) is MLflow's SQLAlchemy store, which
    mlflow-skinny alone lacks (it then fails on the model registry, in a 44-line traceback):
    name what to install in one line."""
    from mlflow.store.db.db_types import DATABASE_ENGINES

    scheme = uri.split(":", 1)[0].split("+", 1)[0]
    missing = [name for name in ("sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
    if scheme in DATABASE_ENGINES and missing:
        raise ExportError(
            f"export --to mlflow {uri}: a database store needs {' and '.join(missing)}: "
            f"pip install 'hpcfsdp[{EXTRAS['mlflow']}]'"
        )


def _exported_attempts(client: Any, experiment_id: str) -> set[tuple[str, str]]:
    """(cell id, attempt) of every run exported to the experiment before, compared here rather
    than in a search filter: the values come from records, and a quote in one would end the
    filter's string."""
    found, token = set(), None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        found |= {(run.data.tags.get("hpcfsdp.cell_id"), run.data.tags.get("hpcfsdp.attempt")) for run in page}
        token = page.token
        if not token:
            return found


def mlflow_tags(run: ExportedRun) -> dict[str, str]:
    """The run's tags: hpcfsdp.* for what MLflow has no word for, and MLflow's own for the git
    commit and the host, so that its UI shows them where it shows its own runs'."""
    tags = {
        "hpcfsdp.cell_id": run.cell_id,
        "hpcfsdp.attempt": run.attempt,
        "hpcfsdp.setup": run.setup,
        "hpcfsdp.status": run.status,
        "hpcfsdp.system": run.system,
        "hpcfsdp.gpu": run.gpu,
        "hpcfsdp.hostnames": ",".join(run.hostnames),
        "hpcfsdp.error": run.error,
        **{f"hpcfsdp.{key}": value for key, value in run.provenance.items()},
        **{f"hpcfsdp.version.{key}": value for key, value in run.versions.items()},
    }
    if run.provenance.get("git_commit", "unknown") != "unknown":
        tags["mlflow.source.git.commit"] = run.provenance["git_commit"]
    return {key: value[:MLFLOW_TAG_CHARS] for key, value in tags.items() if value}


def _mlflow(runs: list[ExportedRun], sweep: str, destination: str) -> tuple[int, int]:
    import_extra("mlflow")
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(destination)
    if uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    _database_needs(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(sweep)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(sweep)
    exported = _exported_attempts(client, experiment_id)
    written = skipped = 0
    for run in runs:
        if (run.cell_id, run.attempt) in exported:
            skipped += 1  # this record was exported before
            continue
        start = _ms(run.started_at) if run.started_at else None
        created = client.create_run(experiment_id, start_time=start, run_name=run.cell_id, tags=mlflow_tags(run))
        run_id = created.info.run_id
        end = _ms(run.ended_at)
        metrics = (
            [Metric("loss", loss, _ms(run.wall_times[step]), step) for step, loss in run.losses]
            + [Metric("step_times_s", s, _ms(run.wall_times[step]), step) for step, s in run.step_times]
            + [Metric(name, value, end, run.last_step) for name, value in run.figures.items()]
        )
        params = [Param(name, str(value)) for name, value in sorted(run.spec.items())]
        for first in range(0, len(params), MLFLOW_PARAMS):
            client.log_batch(run_id, params=params[first : first + MLFLOW_PARAMS])
        for first in range(0, len(metrics), MLFLOW_METRICS):
            client.log_batch(run_id, metrics=metrics[first : first + MLFLOW_METRICS])
        status = RunStatus.FINISHED if run.ok else RunStatus.FAILED
        client.set_terminated(run_id, RunStatus.to_string(status), end_time=end or None)
        written += 1
    return written, skipped


def _ms(seconds: float | None) -> int:
    """A Unix time in milliseconds, as MLflow stamps runs and metrics (0 for none)."""
    return int(seconds * 1000) if seconds else 0
