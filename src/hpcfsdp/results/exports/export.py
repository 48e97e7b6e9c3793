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
import os
from pathlib import Path
from typing import Any

from ..read import load_records
from .runs import EXTRAS, STEP_SERIES, ExportedRun, ExportError, exported_runs, import_extra

TARGETS = ("tensorboard", "mlflow", "wandb")
MLFLOW_METRICS, MLFLOW_PARAMS, MLFLOW_TAG_CHARS = 1000, 100, 5000  # what MLflow takes in one call / one tag


def export_sweep(sweep_dir: Path, target: str, destination: str) -> tuple[int, int]:
    """Write one run per cell record of the sweep; returns (runs written, runs already there)."""
    if target not in TARGETS:
        raise ExportError(f"export: --to {target}: expected one of {', '.join(TARGETS)}")
    from . import tensorboard, wandb

    writer = {"tensorboard": tensorboard.write, "mlflow": _mlflow, "wandb": wandb.write}[target]
    collection = load_records(sweep_dir)
    runs = list(exported_runs(Path(sweep_dir), collection.frame, collection.spec_fields))
    return writer(runs, Path(sweep_dir).resolve().name, destination)


def tracking_uri(destination: str) -> str:
    """A folder becomes a file: URI (MLflow's file store, no server); a URI (sqlite:///x.db,
    http://host) is used as it is."""
    if "://" in destination or destination.startswith("file:"):
        return destination
    return Path(destination).resolve().as_uri()


def artifact_location(uri: str, sweep: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a sqlite database, in
    <its folder>/mlartifacts/<sweep>, as an absolute file: URI. MLflow's default there is
    ./mlartifacts of the directory the export ran in, which another directory's `mlflow ui` does
    not find. None (MLflow's own choice) for a file store (its folder holds them), another
    database or a server (the server's artifact root)."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0]).resolve()
    return (database.parent / "mlartifacts" / sweep).as_uri()


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
    if run.user:
        tags["mlflow.user"] = run.user  # the UI's "Created by": who ran the cell, not who exported it
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
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(sweep, artifact_location(uri, sweep))
    )
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
            + [Metric(STEP_SERIES, s, _ms(run.wall_times[step]), step) for step, s in run.step_times]
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
