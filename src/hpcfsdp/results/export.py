"""`hpcfsdp export SWEEP --to tensorboard|mlflow|wandb DIR`: one run per cell record, where people
already look at runs (docs/history.md).

Each run holds the loss per step and the step time as series, the spec as hyperparameters /
params, and the headline metrics (tokens/s per GPU, MFU, peak memory) as final values. The writers
are the libraries' own, imported here only: tensorboard, mlflow and wandb are optional extras
(`pip install 'hpcfsdp[tensorboard]'`, `'hpcfsdp[mlflow]'`, `'hpcfsdp[wandb]'`). W&B runs are
written offline only (nothing leaves the machine): `wandb sync DIR/wandb/offline-run-*` uploads them.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import UserError
from .history_rows import attempt_of, setup_key, spec_values, system_of
from .read import METRICS, load_records

TARGETS = ("tensorboard", "mlflow", "wandb")
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # target -> the pyproject extra
FINAL_PREFIX = "final/"  # TensorBoard tag of a headline metric
MLFLOW_METRICS, MLFLOW_PARAMS = 1000, 100  # the most MLflow's log_batch takes in one call


class ExportError(UserError, RuntimeError):
    """The export cannot run: a missing extra or an unusable target; one line."""


def export_sweep(sweep_dir: Path, target: str, destination: str) -> tuple[int, int]:
    """Write one run per cell record of the sweep; returns (runs written, runs already there)."""
    if target not in TARGETS:
        raise ExportError(f"export: --to {target}: expected one of {', '.join(TARGETS)}")
    writer = {"tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}[target]
    collection = load_records(sweep_dir)
    runs = list(_runs(collection.frame, collection.spec_fields))
    return writer(runs, Path(sweep_dir).resolve().name, destination)


def _import_extra(target: str) -> None:
    """Import the target's library (lazily, here only), or say which extra installs it."""
    import importlib

    try:
        importlib.import_module(target)
    except ImportError:
        raise ExportError(
            f"export --to {target} needs the '{EXTRAS[target]}' extra: pip install 'hpcfsdp[{EXTRAS[target]}]'"
        ) from None


def _runs(frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """What a run holds, per record: plain Python values (NaN -> None)."""
    if frame.empty:
        return
    for record in frame.to_dict("records"):
        spec = spec_values({name: record.get(name) for name in spec_fields})
        warmup = int(_number(record.get("warmup_steps")) or 0)
        started, duration = _number(record.get("started_at")), _number(record.get("duration_s"))
        yield {
            "cell_id": record["cell_id"],
            "status": record["status"],
            "error": record.get("error") if isinstance(record.get("error"), str) else None,
            "spec": spec,
            "setup": setup_key(spec),
            "attempt": attempt_of(record.get("launch_id"), record.get("started_at")),
            "system": system_of(record.get("slurm.cluster_name"), record.get("hostnames")),
            "gpu": record.get("device_name") if isinstance(record.get("device_name"), str) else None,
            "losses": _finite_steps(record.get("losses")),  # (step, loss): a diverged step has none
            "step_times": [(warmup + i, t) for i, t in enumerate(_numbers(record.get("step_times_s")))],
            "metrics": {name: value for name in METRICS if (value := _number(record.get(name))) is not None},
            "started_at": started,
            "ended_at": started + duration if started is not None and duration is not None else started,
            "versions": {
                str(key).split(".", 1)[1]: value
                for key, value in record.items()
                if str(key).startswith("versions.") and isinstance(value, str)
            },
        }


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _numbers(values: Any) -> list[float]:
    return [float(v) for v in values] if isinstance(values, list) else []


def _finite_steps(values: Any) -> list[tuple[int, float]]:
    """(step, value) of each finite number of a series: a diverged cell's losses hold null, NaN or
    Infinity at the steps that were not finite, which no tracker takes."""
    if not isinstance(values, list):
        return []
    return [
        (step, float(v))
        for step, v in enumerate(values)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _last_step(run: dict[str, Any]) -> int:
    return max((step for step, _ in run["losses"]), default=0)


# ---------------------------------------------------------------------------------------------
# TensorBoard: <DIR>/<sweep>/<cell id>/ event files; the hparams experiment in <DIR>/<sweep>/


def _tensorboard(runs: list[dict[str, Any]], sweep: str, destination: str) -> tuple[int, int]:
    _import_extra("tensorboard")
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from tensorboard.plugins.scalar.summary_v2 import scalar_pb
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    root = Path(destination) / sweep
    hparam_names: dict[str, None] = {}
    for run in runs:
        folder = root / run["cell_id"]  # the cell's folder name (read.load_records): one plain name
        for old in folder.glob("events.out.tfevents.*"):  # a re-export replaces the run
            old.unlink()
        wall = run["ended_at"] or run["started_at"] or 0.0
        writer = EventFileWriter(str(folder))
        try:
            hparams = {**run["spec"], "status": run["status"]}
            hparam_names.update(dict.fromkeys(hparams))
            writer.add_event(
                event_pb2.Event(
                    wall_time=run["started_at"] or wall,
                    summary=hp.hparams_pb(hparams, trial_id=run["cell_id"], start_time_secs=run["started_at"]),
                )
            )
            for step, loss in run["losses"]:
                writer.add_event(event_pb2.Event(wall_time=wall, step=step, summary=scalar_pb("loss", loss)))
            for step, seconds in run["step_times"]:
                writer.add_event(event_pb2.Event(wall_time=wall, step=step, summary=scalar_pb("step_time_s", seconds)))
            last = _last_step(run)
            for name, value in run["metrics"].items():
                summary = scalar_pb(FINAL_PREFIX + name, value)
                writer.add_event(event_pb2.Event(wall_time=wall, step=last, summary=summary))
        finally:
            writer.close()
    for old in root.glob("events.out.tfevents.*"):
        old.unlink()
    writer = EventFileWriter(str(root))
    try:  # the experiment: which hparams and metrics the HParams dashboard shows as columns
        config = hp.hparams_config_pb(
            hparams=[hp.HParam(name) for name in hparam_names],
            metrics=[hp.Metric(FINAL_PREFIX + name) for name in METRICS],
        )
        first = min((run["started_at"] or 0.0 for run in runs), default=0.0)
        writer.add_event(event_pb2.Event(wall_time=first, summary=config))
    finally:
        writer.close()
    return len(runs), 0


# ---------------------------------------------------------------------------------------------
# MLflow: experiment = the sweep, one run per record, in a file store (or any tracking URI)


def tracking_uri(destination: str) -> str:
    """A folder becomes a file: URI (MLflow's file store, no server); a URI (sqlite:///x.db,
    http://host) is used as it is."""
    if "://" in destination or destination.startswith("file:"):
        return destination
    return Path(destination).resolve().as_uri()


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


def _mlflow(runs: list[dict[str, Any]], sweep: str, destination: str) -> tuple[int, int]:
    _import_extra("mlflow")
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(destination)
    if uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless this is set.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(sweep)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(sweep)
    exported = _exported_attempts(client, experiment_id)
    written = skipped = 0
    for run in runs:
        if (run["cell_id"], run["attempt"]) in exported:
            skipped += 1  # this record was exported before
            continue
        start_ms = int(run["started_at"] * 1000) if run["started_at"] else None
        end_ms = int(run["ended_at"] * 1000) if run["ended_at"] else start_ms
        tags = {
            "hpcfsdp.cell_id": run["cell_id"],
            "hpcfsdp.attempt": run["attempt"],
            "hpcfsdp.setup": run["setup"],
            "hpcfsdp.status": run["status"],
            "hpcfsdp.system": run["system"],
            "hpcfsdp.gpu": run["gpu"],
            **{f"hpcfsdp.version.{k}": v for k, v in run["versions"].items()},
        }
        if run["error"]:
            tags["hpcfsdp.error"] = run["error"].splitlines()[0][:5000]
        created = client.create_run(
            experiment_id,
            start_time=start_ms,
            run_name=run["cell_id"],
            tags={key: value for key, value in tags.items() if value},
        )
        run_id = created.info.run_id
        stamp = end_ms or 0
        last = _last_step(run)
        metrics = (
            [Metric("loss", loss, stamp, step) for step, loss in run["losses"]]
            + [Metric("step_time_s", seconds, stamp, step) for step, seconds in run["step_times"]]
            + [Metric(name, value, stamp, last) for name, value in run["metrics"].items()]
        )
        params = [Param(name, str(value)) for name, value in sorted(run["spec"].items())]
        for first in range(0, len(params), MLFLOW_PARAMS):
            client.log_batch(run_id, params=params[first : first + MLFLOW_PARAMS])
        for first in range(0, len(metrics), MLFLOW_METRICS):
            client.log_batch(run_id, metrics=metrics[first : first + MLFLOW_METRICS])
        status = RunStatus.FINISHED if run["status"] == "ok" else RunStatus.FAILED
        client.set_terminated(run_id, RunStatus.to_string(status), end_time=end_ms)
        written += 1
    return written, skipped


# ---------------------------------------------------------------------------------------------
# Weights & Biases: offline runs in <DIR>/wandb/offline-run-<time>-<id>, project = the sweep


def wandb_run_id(sweep: str, run: dict[str, Any]) -> str:
    """One W&B run id per record (sweep, cell, attempt): a re-export finds the runs it wrote, and
    `wandb sync` of the same record twice updates one run."""
    return hashlib.sha256(f"{sweep}/{run['cell_id']}/{run['attempt']}".encode()).hexdigest()[:16]


def _wandb(runs: list[dict[str, Any]], sweep: str, destination: str) -> tuple[int, int]:
    _import_extra("wandb")
    import wandb

    root = Path(destination)
    root.mkdir(parents=True, exist_ok=True)
    written = skipped = 0
    for run in runs:
        run_id = wandb_run_id(sweep, run)
        if any((root / "wandb").glob(f"offline-run-*-{run_id}")):
            skipped += 1  # this record was exported before
            continue
        started = run["started_at"]
        writer = wandb.init(
            mode="offline",
            dir=str(root),
            project=sweep,
            id=run_id,
            name=run["cell_id"],
            group=run["setup"],
            config=run["spec"],
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True),
            reinit="create_new",
        )
        try:
            rows: dict[int, dict[str, float]] = {}
            for step, loss in run["losses"]:
                rows.setdefault(step, {})["loss"] = loss
            for step, seconds in run["step_times"]:
                rows.setdefault(step, {})["step_time_s"] = seconds
            for step in sorted(rows):
                writer.log(rows[step], step=step)
            writer.summary.update(
                {
                    **run["metrics"],
                    "status": run["status"],
                    "error": (run["error"] or "").split("\n", 1)[0],
                    "attempt": run["attempt"],
                    "system": run["system"] or "",
                    "gpu": run["gpu"] or "",
                    "started_at": started,
                    **{f"version.{k}": v for k, v in run["versions"].items()},
                }
            )
        finally:
            writer.finish(exit_code=0 if run["status"] == "ok" else 1)
        written += 1
    return written, skipped
