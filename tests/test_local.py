"""The embedded default: `hpcfsdp submit --executor local` runs cells with torchrun on this machine."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from hpcfsdp.cli import main

SWEEP = """
name: local_e2e
base: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, gpus_per_node: 2}
matrix:
  strategy: [fsdp2_zero3]
include:
  - {strategy: ddp, model: MODEL_DIR}
"""


def test_local_executor_runs_cells_and_records_failures(tmp_path, capsys):
    # A model folder that passes the plan-time checks (config.json exists) but cannot be built.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    jobs = tmp_path / "local.yaml"
    jobs.write_text(SWEEP.replace("MODEL_DIR", str(broken)))
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 3  # a cell failed
    captured = capsys.readouterr()
    out = captured.out
    # The progress goes to stderr; stdout holds what collect prints (the table), nothing before it.
    assert "[1/2] " in captured.err and "[2/2] " in captured.err and "sweep folder: " in captured.err
    assert "[1/" not in out and not out.startswith("sweep folder")
    # each cell's line: its outcome, its seconds, and an ok cell's tokens/s
    assert re.search(r"^    ok in \d+ s, [\d,]+ tokens/s$", captured.err, re.M), captured.err
    assert re.search(r"^    error in \d+ s$", captured.err, re.M), captured.err
    records = {
        r["spec"]["strategy"]: r
        for r in (json.loads(p.read_text()) for p in tmp_path.glob("local_e2e/cells/*/result.json"))
    }
    assert records["fsdp2_zero3"]["status"] == "ok" and records["fsdp2_zero3"]["world_size"] == 2
    # Rank 0 said how far it got, for status --watch: the last step of its training (and any stage after).
    cell = tmp_path / "local_e2e/cells" / records["fsdp2_zero3"]["cell_id"]
    progress = json.loads((cell / "progress.json").read_text())
    assert (progress["step"], progress["steps"]) == (3, 3) and progress["stage"] in ("train", "comm_profile"), progress
    # Each launch's wall time is in the manifest: from before torchrun started to after it ended.
    manifest = json.loads((tmp_path / "local_e2e/manifest.json").read_text())
    for record in records.values():
        entry = manifest[record["cell_id"]]
        assert entry["submitted_at"] < record["started_at"] < entry["ended_at"], entry
    failed = records["ddp"]
    assert failed["status"] == "error" and failed["stage"] == "model" and "no-such-architecture" in failed["error"]
    # One supervisor process launched both cells: the first paid the imports, the second forked at once.
    said = [
        re.search(r"supervisor \(pid (\d+)\): rank\(s\) forked after (\d+\.\d) s of imports", log).groups()
        for log in (
            (tmp_path / "local_e2e/cells" / records[strategy]["cell_id"] / "log.txt").read_text()
            for strategy in ("fsdp2_zero3", "ddp")
        )
    ]
    assert said[0][0] == said[1][0] and float(said[0][1]) > 0.5 and float(said[1][1]) < 0.5, said
    # The run ends in the comparison table, failed cell included.
    table = out[out.index("| strategy") :]
    assert "| ok " in table and "| error " in table
    assert (tmp_path / "local_e2e/report/results.csv").is_file()
    # `logs` of a cell the local executor ran prints its log (why first), not where the log is.
    assert main(["logs", str(tmp_path / "local_e2e"), failed["cell_id"]]) == 0
    printed = capsys.readouterr().out
    log = (tmp_path / "local_e2e/cells" / failed["cell_id"] / "log.txt").read_text()
    assert printed.startswith(f"== {failed['cell_id']}: error at model: ") and log in printed
    assert "no-such-architecture" in log


LAUNCH_PHASES = ["launcher_start", "imports", "process_group", "data", "model_build", "shard", "warmup"]


def test_a_local_launchs_record_accounts_for_its_whole_span_phase_by_phase_tear_down_included(tmp_path):
    """The record's phases add up to launch_span_s (torchrun's start to the record's write), which
    holds the start-up duration_s leaves out; the executor adds the tear-down after the exit."""
    jobs = tmp_path / "phases.yaml"
    jobs.write_text(
        "name: phases\nbase: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1,"
        " gpus_per_node: 2, comm_profile_steps: 0}\nmatrix: {strategy: [ddp]}\n"
    )
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("phases/cells/*/result.json")
    record = json.loads(path.read_text())
    phases = record["phases"]
    assert set(phases) == {*LAUNCH_PHASES, "timed_window", "measurement", "teardown"}, phases
    assert all(seconds >= 0 for seconds in phases.values())
    # torch's imports: the supervisor's before it forks the ranks (launcher_start), or a rank's own
    assert phases["launcher_start"] + phases["imports"] > 0.1
    span = record["launch_span_s"]
    assert sum(phases.values()) - phases["teardown"] == pytest.approx(span, abs=0.01)
    assert span > record["duration_s"] + phases["imports"]
    entry = json.loads((tmp_path / "phases/manifest.json").read_text())[record["cell_id"]]
    launched = record["started_at"] + record["duration_s"] - span
    assert entry["submitted_at"] <= launched
    assert launched + span + phases["teardown"] == pytest.approx(entry["ended_at"], abs=1.0)


def test_a_processs_start_is_read_to_the_hundredth_not_to_the_boots_whole_second():
    """A record's launcher_start and imports meet at the rank's process start, which /proc gives in
    clock ticks since boot. Counted from /proc/stat's btime (whole seconds) every start read up to a
    second early (0.23 s on the CPU machine): a new process's start must lie between the moment
    before it was started and its first line, to the ticks' and /proc/uptime's hundredths."""
    import subprocess
    import sys

    first_line = "import time; now = time.time(); from hpcfsdp.cell.measure.phases import process_started"
    before = time.time()
    child = subprocess.run(
        [sys.executable, "-c", f"{first_line}; print(process_started(), now)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    started, now = map(float, child.stdout.split())
    assert before - 0.03 <= started <= now, (before, started, now)


def test_cell_whose_spec_no_longer_validates_still_leaves_a_record(tmp_path):
    from hpcfsdp.contracts.sources import PRESETS_DIR
    from hpcfsdp.contracts.spec import RunSpec
    from hpcfsdp.sweep.folder.layout import write_cell_spec

    model = tmp_path / "model-deleted-after-plan"
    model.mkdir()
    shutil.copy(PRESETS_DIR / "tiny.json", model / "config.json")
    spec, sources = RunSpec.resolved({"device": "cpu", "model": str(model)})
    cell_dir = tmp_path / "cell"
    write_cell_spec(cell_dir, spec, "c1", "s", sources)
    shutil.rmtree(model)
    with pytest.raises(SystemExit, match="model-deleted-after-plan"):
        main(["run", "--cell-dir", str(cell_dir)])
    record = json.loads((cell_dir / "result.json").read_text())
    assert record["status"] == "error" and record["stage"] == "setup" and "model-deleted-after-plan" in record["error"]
    assert record["world_size"] == 1 and record["versions"]["torch"] and record["launch_id"]


def test_local_cell_past_its_time_limit_records_timeout(tmp_path, monkeypatch, capsys):
    """Under the local executor, slurm.time_min still holds: a stuck cell ends as `timeout`."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:hang")  # every rank stops making progress
    jobs = tmp_path / "stuck.yaml"
    jobs.write_text(
        "name: stuck\nbase: {model: tiny, device: cpu, precision: fp32, seq_len: 32, gpus_per_node: 2}\n"
        "slurm: {time_min: 1, signal_delay_s: 30}\n"
    )
    started = time.monotonic()
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 3
    assert 60 <= time.monotonic() - started < 120
    (path,) = tmp_path.glob("stuck/cells/*/result.json")
    record = json.loads(path.read_text())
    assert record["status"] == "timeout" and record["stage"] == "train", record.get("error")
    assert "| timeout " in capsys.readouterr().out
