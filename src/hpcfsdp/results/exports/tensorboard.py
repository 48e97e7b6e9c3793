"""`hpcfsdp export --to tensorboard DIR`: event files in DIR/<sweep>/<cell id>/, the HParams
experiment in DIR/<sweep>/ (docs/history.md).

Written with tensorboard's own event file writer and protos, as torch's SummaryWriter (and so
torchtitan) writes them: plain scalar summaries, which `EventAccumulator.Scalars()` reads, each
at its step and the wall time the record gives it; the hparams session's start, and its end with a
status (success for an ok cell, failure for any other), so the HParams dashboard can filter on it.

The experiment declares each hparam with its type and, where its values are few, their domain
(strings, booleans, a handful of numbers: the dashboard filters by checkbox; more numbers: an
interval), the hparams whose value differs between the runs first: those the dashboard shows as
columns are the ones that tell runs apart. Without a type the dashboard can filter on nothing,
and with 60 columns in the spec's order the varying ones are hidden.

Each file is named from the cell (its record's start and the cell id), not from the export's time,
host and process as the event writer names it: a re-export writes the same names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runs import FIGURES, FINAL_PREFIX, PROVENANCE_KEYS, STEP_SERIES, ExportedRun, import_extra


def write(runs: list[ExportedRun], sweep: str, destination: str) -> tuple[int, int]:
    """Write one run per record (a re-export replaces it) and the experiment; returns (written, 0)."""
    import_extra("tensorboard")
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    root = Path(destination) / sweep
    declared: list[dict[str, Any]] = []
    for run in runs:
        folder = root / run.cell_id  # the cell's folder name (read.load_records): one plain name
        for old in folder.glob("events.out.tfevents.*"):  # a re-export replaces the run
            old.unlink()
        end = run.ended_at or 0.0
        writer = EventFileWriter(str(folder))
        try:
            hparams = {**run.spec, "status": run.status, **run.provenance}
            declared.append(hparams)
            # The trial is the sweep's cell: two sweeps exported into one folder (docs/history.md) that
            # share a cell id are two trials, never one whose figures the dashboard averages.
            trial = f"{sweep}/{run.cell_id}"
            start = hp.hparams_pb(hparams, trial_id=trial, start_time_secs=run.started_at)
            writer.add_event(event_pb2.Event(wall_time=run.started_at or end, summary=start))
            series = [(step, "loss", loss) for step, loss in run.losses]
            series += [(step, STEP_SERIES, seconds) for step, seconds in run.step_times]
            for step, tag, value in sorted(series, key=lambda point: point[0]):  # in step order (tensorboard --inspect)
                summary = _scalar(tag, value)
                writer.add_event(event_pb2.Event(wall_time=run.wall_times[step], step=step, summary=summary))
            for name, value in run.figures.items():
                summary = _scalar(FINAL_PREFIX + name, value)
                writer.add_event(event_pb2.Event(wall_time=end, step=run.last_step, summary=summary))
            status = api_pb2.STATUS_SUCCESS if run.ok else api_pb2.STATUS_FAILURE
            ended = plugin_data_pb2.HParamsPluginData(
                session_end_info=plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=end)
            )
            summary = _plugin_summary(metadata.SESSION_END_INFO_TAG, ended)
            writer.add_event(event_pb2.Event(wall_time=end, step=run.last_step, summary=summary))
        finally:
            writer.close()
        _name_from_cell(folder, f"{int(run.started_at or 0):010d}.{run.cell_id}")
    for old in root.glob("events.out.tfevents.*"):
        old.unlink()
    writer = EventFileWriter(str(root))
    first = min((run.started_at or 0.0 for run in runs), default=0.0)
    try:  # the experiment: which hparams and metrics the HParams dashboard shows as columns
        writer.add_event(event_pb2.Event(wall_time=first, summary=experiment_summary(declared)))
    finally:
        writer.close()
    _name_from_cell(root, f"{int(first):010d}.{sweep}")
    return len(runs), 0


def experiment_summary(runs: Sequence[dict[str, Any]]):  # -> summary_pb2.Summary
    """The experiment of these runs' hparams: each with its domain; strategy, status and the spec
    fields whose value differs between runs, SHOWN of them in all, first and marked `differs` (the
    dashboard sorts on it, then on the name, and shows the first SHOWN), then the others; and the
    records' figures as metrics."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp

    names = list(dict.fromkeys(name for hparams in runs for name in hparams))
    values = {name: [hparams.get(name) for hparams in runs] for name in names}
    spec = [name for name in names if name not in (*ALWAYS_SHOWN, *PROVENANCE_KEYS)]
    varying = [name for name in spec if len({repr(value) for value in values[name]}) > 1]
    # The dashboard shows the first few hparams, `differs` ones first, each group by name: strategy and
    # status, then as many varying spec fields as fit; provenance (job ids, commits) never crowds them out.
    varying = [*(name for name in ALWAYS_SHOWN if name in names), *varying][:SHOWN]
    ordered = [*varying, *(name for name in names if name not in varying)]
    config = hp.hparams_config_pb(
        hparams=[hp.HParam(name, _domain(values[name])) for name in ordered],
        metrics=[hp.Metric(FINAL_PREFIX + name) for name in FIGURES],
    )
    experiment = metadata.parse_experiment_plugin_data(config.value[0].metadata.plugin_data.content)
    for info in experiment.hparam_infos:
        info.differs = info.name in varying
    return _plugin_summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment))


SHOWN = 5  # the hparams TensorBoard's HParams dashboard shows at first
ALWAYS_SHOWN = ("strategy", "status")
DISCRETE_NUMBERS = 20  # at most this many distinct numbers: a checkbox each; more: an interval


def _domain(values: list[Any]):  # -> hp.Domain | None
    """The hparam's domain from the values the runs that have it give it (a failed cell has no
    Slurm job id); None (no type) when they mix types."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    values = [value for value in values if value is not None]
    kinds = {bool if isinstance(v, bool) else float if isinstance(v, (int, float)) else type(v) for v in values}
    if len(kinds) != 1 or kinds - {bool, float, str}:
        return None
    (kind,) = kinds
    distinct = sorted({kind(value) for value in values})
    if kind is float and len(distinct) > DISCRETE_NUMBERS:
        return hp.RealInterval(distinct[0], distinct[-1])
    return hp.Discrete(distinct, dtype=kind)


def _name_from_cell(folder: Path, name: str) -> None:
    """Rename the one event file of folder (the writer names it events.out.tfevents.<now>.<host>.
    <pid>.<n>) events.out.tfevents.<name>: TensorBoard reads any file whose name holds `tfevents`."""
    (path,) = folder.glob("events.out.tfevents.*")  # the runs' earlier files are deleted before writing
    path.rename(path.with_name(f"events.out.tfevents.{name}"))


def _scalar(tag: str, value: float):  # -> summary_pb2.Summary (tensorboard is imported lazily)
    """A plain scalar summary, as torch's SummaryWriter.add_scalar writes it (not a tensor summary)."""
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])


def _plugin_summary(tag: str, data):  # data: HParamsPluginData
    """A summary holding HParams plugin data, as tensorboard's own hparams summaries are made."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata

    value = summary_pb2.Summary.Value(
        tag=tag, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR
    )
    return summary_pb2.Summary(value=[value])
