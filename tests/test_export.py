"""A real record (the tiny model, 2 ranks under torchrun on CPU): its provenance, its row in the
history, and its export to TensorBoard, MLflow and W&B (offline), read back with their own readers."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import torch

from conftest import ROOT, run_torchrun_cell
from hpcfsdp.cli import main
from hpcfsdp.record import write_record
from hpcfsdp.results.history_rows import setup_key

SETTINGS = {"NCCL_DEBUG": "WARN", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTORCH_JIT": "1"}
SECRETS = {
    "NCCL_TEST_TOKEN": "tok-123",
    "PYTORCH_HUB_API_KEY": "key-456",
    "TORCH_PASSWORD": "pw-789",
    "HF_TOKEN": "hf-000",
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A sweep folder with one real ok record, trained with NCCL / TORCH / PYTORCH settings and
    secrets in its environment, and one failed record written beside it."""
    tmp = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**SETTINGS, **SECRETS}.items():
            env.setenv(name, value)
        record = run_torchrun_cell(tmp, 2, strategy="fsdp2_zero3")
    assert record["status"] == "ok", record.get("error")
    sweep_dir = tmp / "results" / "t"
    failed = {key: record[key] for key in ("sweep", "world_size", "nodes", "versions", "slurm", "launch_id")}
    failed.update(
        status="error",
        stage="shard",
        error="RuntimeError: injected\nsecond line",
        cell_id="broken-cell",
        spec={**record["spec"], "strategy": "ddp"},
        started_at=record["started_at"] + 60,
        duration_s=5.0,
    )
    write_record(sweep_dir / "cells" / "broken-cell" / "result.json", failed)
    return sweep_dir, record, failed


def test_a_record_carries_driver_cuda_nccl_and_the_framework_settings_but_no_secret(sweep):
    sweep_dir, record, _ = sweep
    assert {"cuda", "nccl", "driver"} <= set(record["versions"])
    assert record["versions"]["cuda"] == torch.version.cuda  # None on this CPU build, like nccl and driver
    assert record["environment"].items() >= SETTINGS.items()
    assert all(name.startswith(("NCCL_", "TORCH_", "PYTORCH_")) for name in record["environment"])
    text = (sweep_dir / "cells" / record["cell_id"] / "result.json").read_text()
    assert not [s for pair in SECRETS.items() for s in pair if s in text]
    assert {"cluster_name", "job_partition"} <= set(record["slurm"])


def test_collect_appends_the_real_record_with_its_system_and_versions(sweep, capsys):
    sweep_dir, record, _ = sweep
    assert main(["collect", str(sweep_dir), "--no-plots", "--history", str(sweep_dir.parent / "real.duckdb")]) == 0
    assert "Slurm accounting" not in capsys.readouterr().err  # no cell ran under Slurm: nothing to ask
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
    assert rows[1] == ok and rows[0][:2] == ("broken-cell", "error")


def test_export_to_tensorboard_writes_one_run_per_cell_that_its_reader_reads_back(sweep, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata
    from tensorboard.util import tensor_util

    sweep_dir, record, _ = sweep
    for _ in range(2):  # a second export replaces the runs, it does not add to them
        assert main(["export", str(sweep_dir), "--to", "tensorboard", str(tmp_path / "tb")]) == 0
    assert f"exported 2 run(s) of {sweep_dir} to tensorboard" in capsys.readouterr().out

    def read(run: str) -> EventAccumulator:
        assert len(list((tmp_path / "tb" / "t" / run).glob("events.out.tfevents.*"))) == 1
        events = EventAccumulator(str(tmp_path / "tb" / "t" / run))
        events.Reload()
        return events

    def series(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]

    def hparams(events: EventAccumulator) -> dict:
        content = events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
        info = metadata.parse_session_start_info_plugin_data(content)
        return {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}

    ok = read(record["cell_id"])
    steps, warmup = record["spec"]["steps"], record["spec"]["warmup_steps"]

    def near(value: float):  # event files hold float32
        return pytest.approx(value, rel=1e-6)

    assert series(ok, "loss") == [(step, near(loss)) for step, loss in enumerate(record["losses"])]
    assert series(ok, "step_time_s") == [(warmup + i, near(t)) for i, t in enumerate(record["step_times_s"])]
    assert series(ok, "final/tokens_per_s_per_gpu") == [(steps - 1, near(record["tokens_per_s_per_gpu"]))]
    assert series(ok, "final/peak_memory_gib") == [(steps - 1, near(record["peak_memory_gib"]))]
    assert "final/mfu" not in ok.Tags()["tensors"]  # a CPU run has no MFU
    assert hparams(ok) == {**{k: v for k, v in record["spec"].items()}, "status": "ok"}

    broken = read("broken-cell")
    assert broken.Tags()["tensors"] == [metadata.SESSION_START_INFO_TAG]
    assert hparams(broken)["status"] == "error" and hparams(broken)["strategy"] == "ddp"
    experiment = EventAccumulator(str(tmp_path / "tb" / "t"))
    experiment.Reload()
    assert metadata.EXPERIMENT_TAG in experiment.PluginTagToContent(metadata.PLUGIN_NAME)


def test_export_to_mlflow_writes_a_file_store_its_client_reads_back(sweep, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    sweep_dir, record, _ = sweep
    store = tmp_path / "mlruns"
    assert main(["export", str(sweep_dir), "--to", "mlflow", str(store)]) == 0
    assert main(["export", str(sweep_dir), "--to", "mlflow", str(store)]) == 0
    assert "exported 0 run(s)" in capsys.readouterr().out.splitlines()[-1]

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("t")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {record["cell_id"], "broken-cell"}
    ok = runs[record["cell_id"]]
    assert ok.info.status == "FINISHED" and ok.info.start_time == int(record["started_at"] * 1000)
    assert ok.data.params == {name: str(value) for name, value in record["spec"].items()}
    assert ok.data.tags["hpcfsdp.setup"] == setup_key(record["spec"]) and ok.data.tags["hpcfsdp.status"] == "ok"
    assert ok.data.metrics["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s_per_gpu"])
    assert ok.data.metrics["peak_memory_gib"] == pytest.approx(record["peak_memory_gib"])
    losses = client.get_metric_history(ok.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(losses, key=lambda m: m.step)] == list(enumerate(record["losses"]))
    times = client.get_metric_history(ok.info.run_id, "step_time_s")
    warmup = record["spec"]["warmup_steps"]
    assert sorted((m.step, m.value) for m in times) == [(warmup + i, t) for i, t in enumerate(record["step_times_s"])]
    broken = runs["broken-cell"]
    assert broken.info.status == "FAILED" and broken.data.tags["hpcfsdp.error"] == "RuntimeError: injected"
    assert broken.data.metrics == {}


WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of framed chunks


def wandb_records(path: Path) -> list:
    """The records of a .wandb transaction log, parsed with wandb's own protobuf `Record`.

    wandb 0.2x moved its reader (the Python `datastore`) into the Go wandb-core, which offers no
    call to read a file: this unframes the log as that datastore did (a 7-byte header `:W&B`,
    0xBEE1, version; then chunks of checksum, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_wandb_run(folder: Path) -> dict:
    """An offline run: its run record, config, history rows, summary and exit code."""
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
            run["exit_code"] = record.exit.exit_code
    return run


def test_export_to_wandb_writes_offline_runs_its_reader_reads_back(sweep, tmp_path, capsys):
    sweep_dir, record, _ = sweep
    out = tmp_path / "wb"
    assert main(["export", str(sweep_dir), "--to", "wandb", str(out)]) == 0
    assert main(["export", str(sweep_dir), "--to", "wandb", str(out)]) == 0  # exported before: skipped
    printed = capsys.readouterr().out.splitlines()
    assert f"exported 2 run(s) of {sweep_dir} to wandb" in printed[0] and "exported 0 run(s)" in printed[-1]

    runs = {}
    for folder in sorted((out / "wandb").glob("offline-run-*")):
        run = read_wandb_run(folder)
        runs[run["run"].display_name] = run
    assert set(runs) == {record["cell_id"], "broken-cell"}
    ok = runs[record["cell_id"]]
    assert ok["run"].project == "t" and ok["run"].run_group == setup_key(record["spec"]) and ok["exit_code"] == 0
    assert {k: v for k, v in ok["config"].items() if not k.startswith("_")} == record["spec"]
    warmup = record["spec"]["warmup_steps"]
    steps = {row["_step"]: row for row in ok["history"]}
    assert [(step, row["loss"]) for step, row in sorted(steps.items())] == list(enumerate(record["losses"]))
    assert [(step, row["step_time_s"]) for step, row in sorted(steps.items()) if "step_time_s" in row] == [
        (warmup + i, t) for i, t in enumerate(record["step_times_s"])
    ]
    assert ok["summary"]["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s_per_gpu"])
    assert ok["summary"]["peak_memory_gib"] == pytest.approx(record["peak_memory_gib"])
    assert ok["summary"]["status"] == "ok" and "mfu" not in ok["summary"]  # a CPU run has no MFU
    broken = runs["broken-cell"]
    assert broken["exit_code"] == 1 and broken["history"] == [] and broken["config"]["strategy"] == "ddp"
    assert broken["summary"]["status"] == "error" and broken["summary"]["error"] == "RuntimeError: injected"


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


def test_export_loads_no_torch(sweep, tmp_path):
    sweep_dir, _, _ = sweep
    for target in ("tensorboard", "mlflow", "wandb"):
        result, err = run_fresh(["export", str(sweep_dir), "--to", target, str(tmp_path / target)])
        assert result == {"code": 0, "torch": False}, err[-2000:]
