"""A real record (the tiny model, 2 ranks under torchrun on CPU): its provenance, its row in the
history, and its export to TensorBoard, MLflow and W&B (offline), read back with their own readers."""

from __future__ import annotations

import json
import math
import os
import pwd
import socket
import struct
import subprocess
import sys
import zlib
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest
import torch

from conftest import ROOT, run_torchrun_cell
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.contracts.validity import cell_id_of
from hpcfsdp.results.exports.runs import launch_of
from hpcfsdp.results.history_rows import setup_key

SETTINGS = {"NCCL_DEBUG": "WARN", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTORCH_JIT": "1"}
SECRETS = {
    "NCCL_TEST_TOKEN": "tok-123",
    "PYTORCH_HUB_API_KEY": "key-456",
    "TORCH_PASSWORD": "pw-789",
    "HF_TOKEN": "hf-000",
}


DIVERGING = {"strategy": "ddp", "lr": 1.0e12, "steps": 6, "comm_profile_steps": 0}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SWEEP_UID = "a1b2c3d4e5f60718"
# The measured cell's step times: the record's step time is their median (0.3), not the last (0.5).
STEP_TIMES = [0.3, 0.1, 0.5]


@pytest.fixture(scope="module")
def sweep(cells) -> tuple[Path, dict, dict]:
    """The sweep folder, its real ok record (trained with NCCL / TORCH / PYTORCH settings and
    secrets in its environment) and the failed record written beside it."""
    sweep_dir, records = cells
    return sweep_dir, records["ok"], records["broken"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The sweep folder `t` and its four records, by role: a real ok cell (2 ranks, fsdp2_zero3); a
    real diverged one (lr 1e12); a failed one written beside them; and an ok one written as a Slurm
    array task (job 4242, task 3, sweep id in the manifest) whose step times' median is not the
    last step's time."""
    tmp = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**SETTINGS, **SECRETS}.items():
            env.setenv(name, value)
        record = run_torchrun_cell(tmp, 2, strategy="fsdp2_zero3")
    assert record["status"] == "ok", record.get("error")
    diverged = run_torchrun_cell(tmp, 2, **DIVERGING)
    assert diverged["status"] == "diverged", diverged.get("error")
    sweep_dir = tmp / "results" / "t"
    copied = ("sweep", "world_size", "nodes", "versions", "slurm", "launch_id", "git_commit", "hostnames")
    failed = {key: record[key] for key in copied}
    broken_spec = {**record["spec"], "strategy": "ddp"}
    failed.update(
        status="error",
        stage="shard",
        error="RuntimeError: injected\nsecond line",
        cell_id=cell_id_of(broken_spec),  # its folder's: a record must make its folder's id (issue 51)
        spec=broken_spec,
        started_at=record["started_at"] + 60,
        duration_s=5.0,
    )
    write_record(sweep_dir / "cells" / failed["cell_id"] / "result.json", failed)
    measured_spec = {**record["spec"], "batch_size": 2}
    measured = {
        **record,
        "cell_id": cell_id_of(measured_spec),
        "spec": measured_spec,
        **{name: 2 * record[name] for name in ("tokens_per_step", "tokens_per_s", "tokens_per_s_per_gpu")},
        "step_times_s": STEP_TIMES,
        "step_time_s": 0.3,
        "step_time_p90_s": 0.46,
        "started_at": record["started_at"] + 120,
        "duration_s": 30.0,
        "hostnames": ["n1", "n2"],
        "git_commit": COMMIT,
        "launch_id": "slurm-4250-0",
        "slurm": {
            "job_id": "4250",
            "array_job_id": "4242",
            "array_task_id": "3",
            "job_nodelist": "n[1-2]",
            "cluster_name": "alps",
            "job_partition": "gpu",
        },
    }
    write_record(sweep_dir / "cells" / measured["cell_id"] / "result.json", measured)
    entry = {"executor": "slurm", "job_id": "4242_3", "cluster": "", "submitted_at": record["started_at"]}
    local = {"executor": "local", "job_id": None, "submitted_at": record["started_at"]}
    planned = {cell["cell_id"]: local for cell in (record, diverged, failed)}  # the cells a plan made (issue 51)
    manifest = {**planned, measured["cell_id"]: {**entry, "sweep_uid": SWEEP_UID}}
    (sweep_dir / "manifest.json").write_text(json.dumps(manifest))
    return sweep_dir, {"ok": record, "diverged": diverged, "broken": failed, "measured": measured}


def test_a_record_carries_driver_cuda_nccl_and_the_framework_settings_but_no_secret(sweep):
    sweep_dir, record, _ = sweep
    assert {"cuda", "nccl", "driver"} <= set(record["versions"])
    assert record["versions"]["cuda"] == torch.version.cuda  # None on this CPU build, like nccl and driver
    assert record["environment"].items() >= SETTINGS.items()
    assert all(name.startswith(("NCCL_", "TORCH_", "PYTORCH_", "OMP_", "MKL_")) for name in record["environment"])
    text = (sweep_dir / "cells" / record["cell_id"] / "result.json").read_text()
    assert not [s for pair in SECRETS.items() for s in pair if s in text]
    assert {"cluster_name", "job_partition"} <= set(record["slurm"])


def test_collect_appends_the_real_record_with_its_system_and_versions(sweep, capsys):
    sweep_dir, record, broken = sweep
    assert main(["collect", str(sweep_dir), "--no-plots", "--history", str(sweep_dir.parent / "real.duckdb")]) == 0
    err = capsys.readouterr().err  # only the cell recorded as a Slurm array task is asked about
    assert "Slurm accounting" not in err or "not added to 1 record(s)" in err
    with duckdb.connect(str(sweep_dir.parent / "real.duckdb"), read_only=True) as con:
        rows = con.execute(
            "SELECT cell_id, status, cluster, gpu, torch_version, setup, tokens_per_s_per_gpu, "
            "peak_memory_gib FROM runs ORDER BY cell_id"
        ).fetchall()
    ok = (
        record["cell_id"],
        "ok",
        socket.gethostname(),
        "cpu",
        torch.__version__,
        setup_key(record["spec"]),
        pytest.approx(record["tokens_per_s_per_gpu"]),
        pytest.approx(record["peak_memory_gib"]),
    )
    by_cell = {row[0]: row for row in rows}
    assert by_cell[record["cell_id"]] == ok and by_cell[broken["cell_id"]][:2] == (broken["cell_id"], "error")


# ---------------------------------------------------------------------------------------------
# What every export must say of each record, read back from each tool as plain values


def launch(record: dict) -> tuple[float, float]:
    """The exported run's start and length: the launch's (launch_span_s, to the record's write)
    where the record has it, else the cell's own started_at and duration_s."""
    end = record["started_at"] + record["duration_s"]
    length = record.get("launch_span_s", record["duration_s"])
    return end - length, length


def test_the_exported_runs_last_the_launchs_whole_span_not_the_cells_duration(cells):
    """A real launch's record: its span (torchrun's start to the record's write) holds the imports
    and start-up that duration_s leaves out, and each exporter's run lasts that span."""
    _, records = cells
    record = records["ok"]
    assert record["launch_span_s"] > record["duration_s"] + record["phases"]["imports"] * 0.99
    started, length = launch(record)
    assert length == record["launch_span_s"] and started < record["started_at"]


def expected_runs(sweep_dir: Path, records: dict[str, dict]) -> dict[str, dict]:
    """cell id -> what its run must hold in every tool: the loss and step-time series at the steps
    the record counts (the first optimizer step is 1), the record's figures, and its provenance."""
    runs = {}
    for role, record in records.items():
        warmup = record.get("warmup_steps", 0)
        runs[record["cell_id"]] = {
            "role": role,
            "losses": list(enumerate(record.get("losses") or [], 1)),
            "step_times": [(warmup + i, t) for i, t in enumerate(record.get("step_times_s") or [], 1)],
            "step_time_s": record.get("step_time_s"),
            "provenance": {
                "git_commit": record.get("git_commit"),
                "sweep_dir": str(sweep_dir.resolve()),
                **(
                    {
                        "slurm_job_id": "4242_3",
                        "slurm_array_job_id": "4242",
                        "slurm_array_task_id": "3",
                        "sweep_uid": SWEEP_UID,
                    }
                    if role == "measured"
                    else {}
                ),
            },
        }
    return runs


def same_losses(got: list[tuple[int, float]], expected: list[tuple[int, float | None]]) -> bool:
    """Steps equal, values equal (float32 in event files), NaN where the record has null."""
    if [step for step, _ in got] != [step for step, _ in expected]:
        return False
    for (_, value), (_, want) in zip(got, expected):
        if want is None or not math.isfinite(want):
            if not math.isnan(value):
                return False
        elif value != pytest.approx(want, rel=1e-6):
            return False
    return True


def test_the_diverged_record_is_strict_json_with_null_at_its_diverged_step(cells):
    """JSON parsers outside Python (node, jq, DuckDB) refuse a bare NaN: the record holds null at
    the diverged step and names it in nonfinite_steps; DuckDB's read_json reads the file."""
    sweep_dir, records = cells
    diverged = records["diverged"]
    path = sweep_dir / "cells" / diverged["cell_id"] / "result.json"

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    strict = json.loads(path.read_text(), parse_constant=refuse)
    step = strict["diverged_step"]
    assert strict["schema_version"] == 2 and strict["nonfinite_steps"] == [step] and step >= 2
    assert strict["losses"][step - 1] is None and all(isinstance(x, float) for x in strict["losses"][: step - 1])
    with duckdb.connect() as con:
        losses, nonfinite = con.execute("SELECT losses, nonfinite_steps FROM read_json(?)", [str(path)]).fetchone()
    assert losses == strict["losses"] and nonfinite == [step]


def test_export_to_tensorboard_writes_plain_scalars_its_reader_reads_back(cells, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata

    sweep_dir, records = cells
    record = records["ok"]
    for _ in range(2):  # a second export replaces the runs, it does not add to them
        assert main(["export", str(sweep_dir), "--to", "tensorboard", str(tmp_path / "tb")]) == 0
    assert f"exported 4 run(s) of {sweep_dir} to tensorboard" in capsys.readouterr().out

    def read(run: str) -> EventAccumulator:
        assert len(list((tmp_path / "tb" / "t" / run).glob("events.out.tfevents.*"))) == 1
        events = EventAccumulator(str(tmp_path / "tb" / "t" / run))
        events.Reload()
        return events

    def hparams(events: EventAccumulator) -> dict:
        content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
        info = metadata.parse_session_start_info_plugin_data(content)
        return {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}

    def status(events: EventAccumulator) -> int:
        content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_END_INFO_TAG]
        return metadata.parse_session_end_info_plugin_data(content).status

    for cell_id, want in expected_runs(sweep_dir, records).items():
        events = read(cell_id)
        got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        assert same_losses(got.get("loss", []), want["losses"]), (cell_id, got.get("loss"))
        assert got.get("step_duration_s", []) == [(s, pytest.approx(t, rel=1e-6)) for s, t in want["step_times"]]
        assert "step_times_s" not in got  # not the record's list's name beside its figure step_time_s
        provenance = {key: value for key, value in want["provenance"].items() if value}
        assert hparams(events).items() >= {**provenance, "status": records[want["role"]]["status"]}.items()
        ok = want["role"] in ("ok", "measured")
        assert status(events) == (api_pb2.STATUS_SUCCESS if ok else api_pb2.STATUS_FAILURE), cell_id
        if ok:  # the figure is the record's median, at the last step
            assert got["final/step_time_s"] == [(want["losses"][-1][0], pytest.approx(want["step_time_s"]))]
    measured = read(records["measured"]["cell_id"])
    assert measured.Scalars("final/step_time_s")[0].value != pytest.approx(STEP_TIMES[-1])

    ok = read(record["cell_id"])
    assert hparams(ok).items() >= record["spec"].items()
    assert "final/mfu" not in ok.Tags()["scalars"]  # a CPU run has no MFU
    # Each point at the time the record gives its step: the last timed step at the record's end,
    # each earlier one a step time before; the warm-up steps at the start of the first timed one.
    end = record["started_at"] + record["duration_s"]
    walls = {e.step: e.wall_time for e in ok.Scalars("loss")}
    times = dict(expected_runs(sweep_dir, records)[record["cell_id"]]["step_times"])
    steps = sorted(walls)
    assert walls[steps[-1]] == pytest.approx(end)
    for step in steps[:-1]:  # a step ends where the next one starts; a warm-up step has no time of its own
        assert walls[step] == pytest.approx(walls[step + 1] - times.get(step + 1, 0.0))
    assert len(set(walls.values())) == len(times) + 1

    broken = read(records["broken"]["cell_id"])
    assert broken.Tags()["scalars"] == [] and hparams(broken)["strategy"] == "ddp"
    experiment = EventAccumulator(str(tmp_path / "tb" / "t"))
    experiment.Reload()
    assert metadata.EXPERIMENT_TAG in experiment.PluginTagToContent(metadata.PLUGIN_NAME)


def test_tensorboard_dashboard_gets_each_hparam_typed_the_varying_ones_first_and_files_named_from_the_cell(
    cells, tmp_path
):
    """Read as the HParams dashboard reads it (tensorboard's own GetExperiment handler over its
    data provider): every hparam has a type, the discrete ones their values (status can be
    filtered), and the hparams that differ between runs come first. The event files are named
    from the cell, the same in every export: not from the export's time, host and process."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment

    sweep_dir, records = cells
    names = []
    for _ in range(2):
        assert main(["export", str(sweep_dir), "--to", "tensorboard", str(tmp_path / "tb")]) == 0
        names.append(sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "tb").rglob("events.*")))
    assert names[0] == names[1] and len(names[0]) == 5
    record = records["ok"]
    # named from the run's start: the launch's (started_at less what came before the cell's own clock)
    launched = record["started_at"] + record["duration_s"] - record["launch_span_s"]
    assert f"tb/t/{record['cell_id']}/events.out.tfevents.{int(launched):010d}.{record['cell_id']}" in names[0]
    assert not any(socket.gethostname() in name for name in names[0])
    logdir = str(tmp_path / "tb" / "t")
    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(logdir)
    runs.Reload()
    tb = base_plugin.TBContext(
        logdir=logdir, multiplexer=runs, data_provider=data_provider.MultiplexerDataProvider(runs, logdir)
    )
    request = api_pb2.GetExperimentRequest(hparams_limit=12)  # the dashboard asks for the first few
    experiment = get_experiment.Handler(context.RequestContext(), backend_context.Context(tb), "", request).run()
    shown = {info.name: info for info in experiment.hparam_infos}
    differs = [name for name, info in shown.items() if info.differs]
    assert list(shown)[: len(differs)] == differs and {"status", "strategy", "batch_size", "lr"} <= set(differs)
    assert len(differs) < len(shown) and all(info.type != api_pb2.DATA_TYPE_UNSET for info in shown.values())
    first = api_pb2.GetExperimentRequest(hparams_limit=5)  # what the dashboard shows before any choice
    top = get_experiment.Handler(context.RequestContext(), backend_context.Context(tb), "", first).run()
    assert {"strategy", "status"} <= {info.name for info in top.hparam_infos}
    # tensorboard --inspect: every run's steps in order
    from tensorboard.backend.event_processing import event_file_inspector as inspector

    for unit in inspector.get_inspection_units(logdir=logdir):
        for observed in inspector.get_dict_to_print(unit.field_to_obs).values():
            assert not (observed or {}).get("outoforder_steps"), (unit.name, observed)
    assert {v.string_value for v in shown["status"].domain_discrete.values} == {"ok", "diverged", "error"}
    assert shown["lr"].type == api_pb2.DATA_TYPE_FLOAT64


def test_two_sweeps_exported_into_one_tensorboard_folder_are_distinct_trials(cells, tmp_path):
    """docs/history.md's layout: each sweep in DIR/<sweep>/, `tensorboard --logdir DIR`. Read as the
    HParams dashboard reads it (tensorboard's own ListSessionGroups and GetExperiment handlers over
    its data provider, asked as the dashboard asks by default): the same cell id in two sweeps is
    two trials (the dashboard groups sessions by their group name), never one averaged row, and
    strategy and status are among the 5 hparams it shows first."""
    import shutil

    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups

    sweep_dir, records = cells
    again = tmp_path / "t-again"
    shutil.copytree(sweep_dir, again)
    for folder in (sweep_dir, again):
        assert main(["export", str(folder), "--to", "tensorboard", str(tmp_path / "tb")]) == 0
    logdir = str(tmp_path / "tb")
    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(logdir)
    runs.Reload()
    provider = data_provider.MultiplexerDataProvider(runs, logdir)
    tb = backend_context.Context(base_plugin.TBContext(logdir=logdir, multiplexer=runs, data_provider=provider))
    top = get_experiment.Handler(context.RequestContext(), tb, "", api_pb2.GetExperimentRequest(hparams_limit=5)).run()
    assert {"strategy", "status"} <= {info.name for info in top.hparam_infos}, top.hparam_infos
    request = api_pb2.ListSessionGroupsRequest(  # the dashboard's first request: every column, no filter
        col_params=[api_pb2.ColParams(hparam=info.name, include_in_result=True) for info in top.hparam_infos],
        allowed_statuses=list(api_pb2.Status.values()),
        aggregation_type=api_pb2.AGGREGATION_AVG,
        start_index=0,
        slice_size=100,
    )
    groups = list_session_groups.Handler(context.RequestContext(), tb, "", request).run().session_groups
    names = sorted(group.name for group in groups)
    cell_ids = [record["cell_id"] for record in records.values()]
    assert names == sorted(f"{sweep}/{cell}" for sweep in ("t", "t-again") for cell in cell_ids), names
    assert all(len(group.sessions) == 1 for group in groups)


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_export_to_mlflow_writes_a_store_its_client_reads_back(cells, tmp_path, capsys, store):
    """A file store (a folder) and a database (sqlite:///...), with the mlflow extra: mlflow-skinny,
    SQLAlchemy and alembic."""
    from mlflow.tracking import MlflowClient

    sweep_dir, records = cells
    record = records["ok"]
    target = str(tmp_path / "mlruns") if store == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export", str(sweep_dir), "--to", "mlflow", target]) == 0
    assert main(["export", str(sweep_dir), "--to", "mlflow", target]) == 0
    assert "exported 0 run(s)" in capsys.readouterr().out.splitlines()[-1]

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri() if store == "file" else target)
    experiment = client.get_experiment_by_name("t")
    if store == "sqlite":  # beside the database, wherever the export ran (the test's working directory is elsewhere)
        assert experiment.artifact_location == (tmp_path / "mlartifacts" / "t").as_uri()
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {r["cell_id"] for r in records.values()}
    for cell_id, want in expected_runs(sweep_dir, records).items():
        run, source = runs[cell_id], records[want["role"]]
        history = {
            name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
            for name in ("loss", "step_duration_s")
        }
        assert same_losses(history["loss"], want["losses"]), (cell_id, history["loss"])
        assert history["step_duration_s"] == want["step_times"]
        assert run.data.metrics.get("step_time_s") == want["step_time_s"]  # the record's median, not the last step's
        started, length = launch(source)
        assert run.info.start_time == int(started * 1000)
        assert run.info.end_time == int((started + length) * 1000)
        provenance = {f"hpcfsdp.{key}": value for key, value in want["provenance"].items() if value}
        assert run.data.tags.items() >= provenance.items()
        assert run.data.tags["mlflow.source.git.commit"] == source["git_commit"]
        assert run.data.tags["hpcfsdp.hostnames"] == ",".join(source["hostnames"])
        assert run.info.status == ("FINISHED" if source["status"] == "ok" else "FAILED")
        # the UI's "Created by": who ran the cell (its record's owner), not "-"
        assert run.info.user_id == run.data.tags["mlflow.user"] == pwd.getpwuid(os.getuid()).pw_name
    ok = runs[record["cell_id"]]
    assert ok.data.params == {name: str(value) for name, value in record["spec"].items()}
    assert ok.data.tags["hpcfsdp.setup"] == setup_key(record["spec"]) and ok.data.tags["hpcfsdp.status"] == "ok"
    assert ok.data.metrics["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s_per_gpu"])
    assert ok.data.metrics["peak_memory_gib"] == pytest.approx(record["peak_memory_gib"])
    assert runs[records["measured"]["cell_id"]].data.metrics["step_time_s"] != STEP_TIMES[-1]
    broken = runs[records["broken"]["cell_id"]]
    assert broken.info.status == "FAILED" and broken.data.tags["hpcfsdp.error"] == "RuntimeError: injected"
    assert broken.data.metrics == {}


WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of framed chunks


def wandb_records(path: Path) -> list:
    """The records of a .wandb transaction log, parsed with wandb's own protobuf `Record`.

    wandb 0.2x moved its reader (the Python `datastore`) into the Go wandb-core, which offers no
    call to read a file: this unframes the log as that datastore did (a 7-byte header `:W&B`,
    0xBEE1, version; then chunks of checksum, length, type: full, first, middle, last), and checks
    each chunk's checksum (CRC-32 of its type and data) as that reader did."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum, f"{path}: bad checksum at {pos}"
        pending += chunk
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    assert pos == len(data) and not pending
    return records


def read_wandb_run(folder: Path) -> dict:
    """An offline run: its run record, config, history rows, summary and exit record."""
    (path,) = folder.glob("run-*.wandb")
    run: dict = {"config": {}, "history": [], "summary": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":  # the config given to wandb.init comes with it
            run["run"] = record.run
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append(
                {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "summary":
            run["summary"].update(
                {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            run["exit"] = record.exit
    return run


def wandb_inspect(folder: Path) -> dict:
    """An offline run as wandb's own reader tells it: `wandb leet inspect --summary --json`."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_export_to_wandb_writes_offline_runs_its_reader_reads_back(cells, tmp_path, capsys):
    sweep_dir, records = cells
    record = records["ok"]
    out = tmp_path / "wb"
    assert main(["export", str(sweep_dir), "--to", "wandb", str(out)]) == 0
    assert main(["export", str(sweep_dir), "--to", "wandb", str(out)]) == 0  # exported before: skipped
    printed = capsys.readouterr().out.splitlines()
    assert f"exported 4 run(s) of {sweep_dir} to wandb" in printed[0] and "exported 0 run(s)" in printed[-1]

    # Each folder named from its record (its start, UTC, and its id), not the export's time; no link left dangling
    named = {
        f"offline-run-{datetime.fromtimestamp(launch_of(r)[0], timezone.utc):%Y%m%d_%H%M%S}" for r in records.values()
    }
    assert {folder.name.rsplit("-", 1)[0] for folder in (out / "wandb").glob("offline-run-*")} == named
    assert all(path.exists() for path in (out / "wandb").iterdir())
    runs = {}
    for folder in sorted((out / "wandb").glob("offline-run-*")):
        run = read_wandb_run(folder)
        runs[run["run"].display_name] = run
        # nothing of the exporting machine: no requirements.txt, no metadata (OS, program, git)
        assert [p.name for p in (folder / "files").iterdir()] == []
    assert set(runs) == {r["cell_id"] for r in records.values()}
    for cell_id, want in expected_runs(sweep_dir, records).items():
        run, source = runs[cell_id], records[want["role"]]
        rows = {row["_step"]: row for row in run["history"]}
        losses = [(step, row["loss"]) for step, row in sorted(rows.items()) if "loss" in row]
        assert same_losses(losses, want["losses"]), losses  # wandb writes NaN, which json.loads reads
        series = [(s, row["step_duration_s"]) for s, row in sorted(rows.items()) if "step_duration_s" in row]
        assert series == want["step_times"]
        # the launch's start and span under names of their own, not the record's started_at / duration_s
        assert "started_at" not in run["summary"] and "duration_s" not in run["summary"]
        assert run["summary"]["launch_started_at"] == pytest.approx(launch(source)[0])
        assert run["summary"]["launch_span_s"] == pytest.approx(launch(source)[1])
        assert run["summary"].get("step_time_s") == want["step_time_s"]  # the record's median
        assert run["summary"].items() >= {k: v for k, v in want["provenance"].items() if v}.items()
        # When and where the run was made, from the record: not when and where it was exported.
        started, length = launch(source)
        assert run["run"].start_time.ToNanoseconds() == int(started * 1e9)
        assert run["summary"]["_runtime"] == pytest.approx(length)
        assert run["summary"]["_wandb.runtime"] == round(length)
        assert run["exit"].runtime == round(length)
        assert run["run"].host == ",".join(source.get("hostnames", []))
        assert run["run"].git.commit == source["git_commit"] and run["run"].git.remote_url == ""
        assert run["exit"].exit_code == (0 if source["status"] == "ok" else 1)
        for row in rows.values():
            assert row["_runtime"] == pytest.approx(row["_timestamp"] - started)
    for folder in (out / "wandb").glob("offline-run-*"):  # and wandb's own reader (wandb-core) reads the same
        seen = wandb_inspect(folder)
        source = next(r for r in records.values() if r["cell_id"] == seen["name"])
        started = datetime.fromisoformat(seen["start_time"].replace("Z", "+00:00")).timestamp()
        assert started == pytest.approx(launch(source)[0], abs=1e-3)
        assert seen["state"] == ("finished" if source["status"] == "ok" else "failed")
        assert seen["summary"]["_runtime"] == pytest.approx(launch(source)[1])
        assert seen["summary"].get("step_time_s") == source.get("step_time_s")
    ok = runs[record["cell_id"]]
    assert ok["run"].project == "t" and ok["run"].run_group == setup_key(record["spec"])
    assert {k: v for k, v in ok["config"].items() if not k.startswith("_")} == record["spec"]
    last = max(ok["history"], key=lambda row: row["_step"])
    assert last["_timestamp"] == pytest.approx(record["started_at"] + record["duration_s"])
    assert ok["summary"]["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s_per_gpu"])
    assert ok["summary"]["peak_memory_gib"] == pytest.approx(record["peak_memory_gib"])
    assert ok["summary"]["status"] == "ok" and "mfu" not in ok["summary"]  # a CPU run has no MFU
    assert runs[records["measured"]["cell_id"]]["summary"]["step_time_s"] != STEP_TIMES[-1]
    broken = runs[records["broken"]["cell_id"]]
    assert broken["history"] == [] and broken["config"]["strategy"] == "ddp"
    assert broken["summary"]["status"] == "error" and broken["summary"]["error"] == "RuntimeError: injected"


def test_a_wandb_log_read_and_written_again_is_the_same_bytes(tmp_path):
    """The frames exports/wandb.py writes back are wandb's own: a log wandb wrote (one record longer
    than a 32 KiB block among them) read and written again is byte for byte what wandb wrote."""
    import wandb

    from hpcfsdp.results.exports.wandb import read_log, write_log

    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="p", id="frames", settings=settings)
    run.config.update({"long": "x" * 100_000})
    for step in range(1, 200):
        run.log({"loss": 1.0 / step, "text": "y" * (step * 37)}, step=step)
    run.finish()
    wandb.teardown()
    (log,) = (tmp_path / "wandb").glob("offline-run-*-frames/run-frames.wandb")
    written = log.read_bytes()
    assert len(written) > 3 * WANDB_BLOCK
    write_log(log, read_log(log))
    assert log.read_bytes() == written


# Runs one hpcfsdp command in a fresh interpreter, with the named modules made unimportable.
PROBE = """
import json, sys
for name in json.loads(sys.argv[2]):
    sys.modules[name] = None  # `import name` now raises ImportError, as when the package is not installed
from hpcfsdp.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_fresh(args: list[str], blocked: list[str] = ()) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(list(blocked))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.stdout, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_an_exporter_without_its_extra_says_which_extra_in_one_line(sweep, tmp_path):
    sweep_dir, _, _ = sweep
    for target, blocked in (("tensorboard", ["tensorboard"]), ("mlflow", ["mlflow"]), ("wandb", ["wandb"])):
        result, err = run_fresh(["export", str(sweep_dir), "--to", target, str(tmp_path / target)], blocked)
        assert result["code"] == 1
        assert err.strip() == f"error: export --to {target} needs the '{target}' extra: pip install 'hpcfsdp[{target}]'"


def test_an_mlflow_database_store_without_sqlalchemy_is_one_line_naming_the_extra(sweep, tmp_path):
    """mlflow-skinny alone has no database store: one line naming what to install, not MLflow's
    44-line traceback about its model registry."""
    sweep_dir, _, _ = sweep
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result, err = run_fresh(["export", str(sweep_dir), "--to", "mlflow", uri], ["sqlalchemy"])
    assert result["code"] == 1
    needs = "a database store needs sqlalchemy: pip install 'hpcfsdp[mlflow]'"
    assert err.strip() == f"error: export --to mlflow {uri}: {needs}"
    assert not (tmp_path / "mlflow.db").exists()


def test_export_loads_no_torch(sweep, tmp_path):
    sweep_dir, _, _ = sweep
    for target in ("tensorboard", "mlflow", "wandb"):
        result, err = run_fresh(["export", str(sweep_dir), "--to", target, str(tmp_path / target)])
        assert result == {"code": 0, "torch": False}, err[-2000:]
