"""`hpcfsdp export --to tensorboard DIR`: event files in DIR/<sweep>/<cell id>/, the HParams
experiment in DIR/<sweep>/ (docs/history.md).

Written with tensorboard's own event file writer and protos, as torch's SummaryWriter (and so
torchtitan) writes them: plain scalar summaries, which `EventAccumulator.Scalars()` reads, each
at its step and the wall time the record gives it; the hparams session's start, and its end with a
status (success for an ok cell, failure for any other), so the HParams dashboard can filter on it.
"""

from __future__ import annotations

from pathlib import Path

from .runs import FIGURES, FINAL_PREFIX, ExportedRun, import_extra


def write(runs: list[ExportedRun], sweep: str, destination: str) -> tuple[int, int]:
    """Write one run per record (a re-export replaces it) and the experiment; returns (written, 0)."""
    import_extra("tensorboard")
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    root = Path(destination) / sweep
    hparam_names: dict[str, None] = {}
    for run in runs:
        folder = root / run.cell_id  # the cell's folder name (read.load_records): one plain name
        for old in folder.glob("events.out.tfevents.*"):  # a re-export replaces the run
            old.unlink()
        end = run.ended_at or 0.0
        writer = EventFileWriter(str(folder))
        try:
            hparams = {**run.spec, "status": run.status, **run.provenance}
            hparam_names.update(dict.fromkeys(hparams))
            start = hp.hparams_pb(hparams, trial_id=run.cell_id, start_time_secs=run.started_at)
            writer.add_event(event_pb2.Event(wall_time=run.started_at or end, summary=start))
            for step, loss in run.losses:
                writer.add_event(
                    event_pb2.Event(wall_time=run.wall_times[step], step=step, summary=_scalar("loss", loss))
                )
            for step, seconds in run.step_times:
                summary = _scalar("step_times_s", seconds)
                writer.add_event(event_pb2.Event(wall_time=run.wall_times[step], step=step, summary=summary))
            for name, value in run.figures.items():
                summary = _scalar(FINAL_PREFIX + name, value)
                writer.add_event(event_pb2.Event(wall_time=end, step=run.last_step, summary=summary))
            status = api_pb2.STATUS_SUCCESS if run.ok else api_pb2.STATUS_FAILURE
            ended = plugin_data_pb2.HParamsPluginData(
                session_end_info=plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=end)
            )
            writer.add_event(
                event_pb2.Event(wall_time=end, summary=_plugin_summary(metadata.SESSION_END_INFO_TAG, ended))
            )
        finally:
            writer.close()
    for old in root.glob("events.out.tfevents.*"):
        old.unlink()
    writer = EventFileWriter(str(root))
    try:  # the experiment: which hparams and metrics the HParams dashboard shows as columns
        config = hp.hparams_config_pb(
            hparams=[hp.HParam(name) for name in hparam_names],
            metrics=[hp.Metric(FINAL_PREFIX + name) for name in FIGURES],
        )
        first = min((run.started_at or 0.0 for run in runs), default=0.0)
        writer.add_event(event_pb2.Event(wall_time=first, summary=config))
    finally:
        writer.close()
    return len(runs), 0


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
