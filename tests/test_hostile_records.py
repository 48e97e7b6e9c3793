"""Records, logs and shared files of the right shape but hostile content (issue 33, items 6-13):
values out of range, absurd numbers, links, FIFOs, DuckDB's own lock, huge counts and integers.

Records are written with the project's record writer and then spoiled as a hand would; every
collection goes through the real `hpcfsdp collect`, `status`, `logs` and `export` commands and a
real DuckDB file. The ones that could hang run in a process of their own, under a time limit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.names import slurm_id_text, slurm_job_of
from hpcfsdp.contracts.record import RECORD_NAME, SPEC_NAME, write_record
from hpcfsdp.results import history
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.folder.layout import MANIFEST_NAME
from hpcfsdp.sweep.launch.collect_job import COLLECT_JOB_NAME, collect_line
from test_history import EARLIER, write_sweep
from test_refusals import spoil

HANG_LIMIT_S = 60  # a command that reads a FIFO or /dev/zero would never end; these end in seconds

# Right types, out of range: each makes its record corrupt (field -> value, and the problem named).
OUT_OF_RANGE = {
    "started_at": (1e300, "started_at: expected a Unix time from 2000-01-01 to a day after now"),
    "duration_s": (-1e12, "duration_s: expected a number from 0 to 1e+15"),
    "slurm_accounting": ({"elapsed_s": 10**30}, "slurm_accounting.elapsed_s: expected an integer within 64 bits"),
    "tokens_per_s_per_gpu": (float("inf"), "tokens_per_s_per_gpu: expected a number from 0 to 1e+15"),
    "peak_memory_gib": (-0.24, "peak_memory_gib: expected a number from 0 to 1e+15"),
    "mfu": (float("nan"), "mfu: expected a number from 0 to 1e+15"),
    "tokens_per_s": (10**30, "tokens_per_s: expected an integer within 64 bits"),
    "step_times_s": ([0.5, float("-inf")], "step_times_s[1]: expected a number from 0 to 1e+15"),
}


def cells_of(sweep: Path) -> list[Path]:
    return sorted((sweep / "cells").glob(f"*/{RECORD_NAME}"))


def run_cli(*argv: str, timeout: float = HANG_LIMIT_S) -> subprocess.CompletedProcess:
    """`hpcfsdp ARGV` in a process of its own, killed past `timeout` (the test then fails)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "hpcfsdp", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


# ---------------------------------------------------------------------------------------------
# 6, 7, 12: ranges in the record's schema


def test_a_record_out_of_range_is_corrupt_named_skipped_and_never_stops_collect_or_export(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "ranges", 0, {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0, "e": 900.0})
    paths = cells_of(sweep)
    pristine = json.loads(paths[0].read_text())
    spoiled = {}
    for index, (field, (value, _)) in enumerate(OUT_OF_RANGE.items()):  # each a copy of the first cell, spoiled
        path = paths[0].parent.with_name(f"{paths[0].parent.name}-{index}") / RECORD_NAME
        path.parent.mkdir()
        path.write_text(json.dumps({**pristine, field: value}))  # NaN and Infinity as Python's json writes them
        spoiled[path] = field
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    for path, field in spoiled.items():
        (line,) = [line for line in captured.err.splitlines() if str(path) in line]
        assert line.startswith(f"warning: skipped {path}: ") and OUT_OF_RANGE[field][1] in line, line
    assert "inf" not in captured.out.lower() and "-0.24" not in captured.out
    table = pd.read_parquet(sweep / "report" / "results.parquet")
    assert sorted(table["cell_id"]) == [path.parent.name for path in paths]  # only the records in range
    for target in ("tensorboard", "mlflow"):
        assert main(["export", str(sweep), "--to", target, str(tmp_path / target)]) == 0
        assert f"exported {len(paths)} run(s)" in capsys.readouterr().out


def test_a_diverged_record_may_hold_null_nan_and_infinite_losses(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "diverged", 0, {"a": 1000.0, "b": "diverged"})
    path = next(p for p in cells_of(sweep) if json.loads(p.read_text())["status"] == "diverged")
    record = json.loads(path.read_text())
    record.update(losses=[11.0, 10.5, None, float("nan"), float("inf")], diverged_step=3)
    path.write_text(json.dumps(record))
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert "skipped" not in captured.err and "1 diverged" in (sweep / "report" / "summary.md").read_text()
    for target in ("tensorboard", "mlflow"):
        assert main(["export", str(sweep), "--to", target, str(tmp_path / target)]) == 0
        assert "exported 2 run(s)" in capsys.readouterr().out


def test_absurd_numbers_never_win_the_recommendation(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "absurd", 0, {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0, "e": 900.0})
    by_speed = {json.loads(p.read_text())["tokens_per_s_per_gpu"]: p for p in cells_of(sweep)}
    spoil(by_speed[1000.0], tokens_per_s_per_gpu=float("inf"), tokens_per_s=float("inf"))
    spoil(by_speed[1500.0], peak_memory_gib=-0.24)
    spoil(by_speed[800.0], tokens_per_s_per_gpu=1e308)  # finite, but x 2 GPUs is not
    # In range (a Figure is from 0 up), but 1e9 / (3600 x -0.0) is -inf GPU-hours per billion tokens.
    spoil(by_speed[900.0], tokens_per_s_per_gpu=-0.0, gpu_hours_per_billion_tokens=None, peak_memory_gib=0.01)
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    out = capsys.readouterr().out
    recommended = [line for line in out.splitlines() if line.startswith(("Fastest", "Most memory", "Cheapest"))]
    assert len(recommended) == 3
    assert all(by_speed[2000.0].parent.name in line for line in recommended), recommended
    assert not any("inf" in line or "-0.24" in line for line in recommended)


def test_integers_past_64_bits_in_a_record_make_it_corrupt_however_json_reads_them(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "big", 0, {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0})
    paths = cells_of(sweep)
    texts = {  # orjson read the first two as floats, the third as an integer; json keeps all three
        paths[1]: ('"seed": 0', '"seed": 99999999999999999999', "spec.seed"),
        paths[2]: ('"batch_size": ', '"batch_size": 1' + "0" * 400 + ', "x": ', "spec.batch_size"),
        paths[3]: ('"world_size": 2', '"world_size": 18446744073709551615', "world_size"),
    }
    for path, (old, new, _) in texts.items():
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    err = capsys.readouterr().err
    for path, (_, _, field) in texts.items():
        (line,) = [line for line in err.splitlines() if str(path) in line]
        assert f"{field}: expected an integer within 64 bits" in line, line


def test_submit_retry_failed_reruns_a_record_out_of_range(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("name: retry\nbase: {device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1}\n")
    (cell,) = load_sweep(jobs).cells
    record = tmp_path / "results" / "retry" / "cells" / cell.id / RECORD_NAME
    write_record(
        record, {"status": "ok", "cell_id": cell.id, "spec": cell.spec.to_dict(), "tokens_per_s_per_gpu": -5.0}
    )
    argv = ["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"corrupt record: {record}: tokens_per_s_per_gpu: expected a number from 0 to 1e+15" in captured.err
    assert main([*argv, "--retry-failed"]) == 0
    assert cell.id in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 8, 9: shared history and references files


def test_a_history_and_references_reached_through_links_are_written_through_them(tmp_path, capsys):
    shared = tmp_path / "shared"
    results = tmp_path / "results"
    first = write_sweep(shared, "s0", 0, {name: values[0] for name, values in EARLIER.items()})
    assert main(["collect", str(first), "--no-plots"]) == 0
    results.mkdir()
    (results / "history.duckdb").symlink_to(shared / "history.duckdb")
    (shared / "references.yaml").write_text("references: []\n")
    (results / "references.yaml").symlink_to(shared / "references.yaml")
    second = write_sweep(results, "s1", 1, {name: values[1] for name, values in EARLIER.items()})
    assert main(["collect", str(second), "--no-plots"]) == 0
    path = str(results / "history.duckdb")
    assert main(["history", "--history", path, "--set-reference"]) == 0
    capsys.readouterr()
    for name in ("history.duckdb", "references.yaml"):
        assert (results / name).is_symlink(), name  # never replaced by a file of its own
    with duckdb.connect(str(shared / "history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (8,)
    assert "tokens_per_s_per_gpu" in (shared / "references.yaml").read_text()
    assert not [p.name for p in results.iterdir() if p.name.startswith(".")]


CLIENT = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
con.execute("CREATE TABLE notes AS SELECT 42 AS answer")
print("open", flush=True)
sys.stdin.readline()
con.close()
"""


def test_collect_waits_for_another_duckdb_client_and_never_drops_its_table(tmp_path, capsys, monkeypatch):
    results = tmp_path / "results"
    first = write_sweep(results, "s0", 0, {"a": 1000.0})
    assert main(["collect", str(first), "--no-plots"]) == 0
    store = results / "history.duckdb"
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(store)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert client.stdout is not None and client.stdin is not None
    try:
        assert client.stdout.readline().strip() == "open"
        monkeypatch.setattr(history, "LOCK_WAIT_S", 0.5)
        second = write_sweep(results, "s1", 1, {"a": 1000.0})
        assert main(["collect", str(second), "--no-plots", "--fail-on-regression"]) == 3  # the gate fails
        said = capsys.readouterr().err.splitlines()
        (error,) = [line for line in said if line.startswith("error:")]
        assert error.startswith(
            f"error: history {store}: not updated (another DuckDB client has held it open for 0.5 s: "
        )
        # the one bounded wait of every lock (files.take_lock, here with lockf): its line names the holder
        (waiting,) = [line for line in said if line.startswith("waiting up to")]
        assert waiting.startswith(f"waiting up to 0.5 s for the history {store}: another DuckDB client has it open (")
        assert f"(PID {client.pid})" in waiting, waiting
        assert f"(PID {client.pid})" in error and error.endswith("; --no-history collects without it")
        client.stdin.write("\n")
        client.stdin.flush()
        client.wait(timeout=30)
    finally:
        client.kill()
        client.wait()
    with duckdb.connect(str(store), read_only=True) as con:
        assert con.execute("SELECT answer FROM notes").fetchone() == (42,)  # the other client's table
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    assert main(["collect", str(second), "--no-plots", "--fail-on-regression"]) == 0  # free again
    with duckdb.connect(str(store), read_only=True) as con:
        assert con.execute("SELECT answer FROM notes").fetchone() == (42,)
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (2,)


def test_the_collect_job_says_the_history_was_unusable_not_that_a_cell_regressed(tmp_path):
    sweep = tmp_path / "s"
    sweep.mkdir()
    lines = {}
    for code, error in ((0, None), (1, None), (3, None), (1, "s: not a sweep folder")):
        (sweep / COLLECT_JOB_NAME).write_text(json.dumps({"job_id": "77", "exit_status": code, "error": error}))
        lines[(code, error)] = collect_line(sweep)
    assert "(report written)" in lines[(0, None)]
    assert "a cell regressed" in lines[(1, None)]
    assert "history could not be updated" in lines[(3, None)] and "regressed" not in lines[(3, None)]
    assert "collect failed: s: not a sweep folder" in lines[(1, "s: not a sweep folder")]


def test_an_error_that_starts_like_a_formula_is_text_in_results_csv(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "formula", 0, {"a": "error", "b": "error", "c": "error", "d": "error"})
    failed = [p for p in cells_of(sweep) if json.loads(p.read_text())["status"] == "error"]
    errors = ['=HYPERLINK("http://x","y")', "+1+2", "-2+3", "@SUM(A1:A9)"]
    for path, error in zip(failed, errors, strict=True):
        spoil(path, error=error)
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    capsys.readouterr()
    csv = pd.read_csv(sweep / "report" / "results.csv")
    assert sorted(csv["error"].dropna()) == sorted("'" + error for error in errors)
    assert sorted(pd.read_parquet(sweep / "report" / "results.parquet")["error"].dropna()) == sorted(errors)


# ---------------------------------------------------------------------------------------------
# 10, 11: logs, FIFOs and odd files


def slurm_cell(tmp_path: Path, spec_changes: dict | None = None, job_id: str = "4242_0") -> tuple[Path, str]:
    """A sweep folder of one failed Slurm cell, its spec.json, manifest entry and record."""
    sweep = write_sweep(tmp_path / "results", "logs", 0, {"a": "error"})
    (path,) = cells_of(sweep)
    record = json.loads(path.read_text())
    record["slurm"].update(job_id=job_id, array_job_id=job_id.split("_")[0], array_task_id=job_id.split("_")[-1])
    path.write_text(json.dumps(record))
    cell = path.parent.name
    spec = {**record["spec"], **(spec_changes or {})}
    (path.parent / SPEC_NAME).write_text(json.dumps({"cell_id": cell, "sweep": "logs", "spec": spec}))
    manifest = {cell: {"executor": "slurm", "job_id": job_id, "submitted_at": time.time()}}
    (sweep / MANIFEST_NAME).write_text(json.dumps(manifest))
    return sweep, cell


def test_logs_never_follow_a_link_out_of_the_sweep_folder_and_read_only_the_end(tmp_path):
    sweep, cell = slurm_cell(tmp_path)
    secret = tmp_path / "shadow"
    secret.write_text("root:SECRET-HASH:19000::::::\n")
    folder = sweep / "slurm" / "4242_0"
    folder.mkdir(parents=True)
    (folder / "4242_0_0_log.err").symlink_to(secret)
    (folder / "4242_0_1_log.err").symlink_to("/dev/zero")
    long_log = folder / "4242_0_2_log.err"
    with long_log.open("w") as handle:
        handle.write("first line, long gone\n" + ("x" * 99 + "\n") * 100_000 + "RuntimeError: the end\n")
    os.truncate(long_log, long_log.stat().st_size)  # ~10 MB: more than is read
    done = run_cli("logs", str(sweep), cell, "--stderr")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "SECRET" not in done.stdout
    assert f"node 0: {folder / '4242_0_0_log.err'} <== not shown: a link to {secret}, out of the sweep folder" in (
        done.stdout
    )
    assert "<== not shown: a link to /dev/zero, out of the sweep folder" in done.stdout
    assert "RuntimeError: the end" in done.stdout and "first line, long gone" not in done.stdout
    assert len(done.stdout) < 9 << 20


def test_logs_build_no_path_from_a_job_id_that_is_none(tmp_path):
    sweep, cell = slurm_cell(tmp_path)
    (sweep / MANIFEST_NAME).write_text(json.dumps({cell: {"executor": "slurm", "job_id": "../../../etc"}}))
    record = cells_of(sweep)[0]
    spoil(record, slurm={"job_id": "1,2"})
    done = run_cli("logs", str(sweep), cell, "--stderr")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{cell}: no Slurm job and no local run's log" in done.stdout
    assert "etc" not in done.stdout and "1,2" not in done.stdout


# A Slurm id as text had two copies: slurm_job_of's (names.py) and the export's provenance's (exports/runs.py).
# Where they disagreed: the value, and what each said, as comments; the one answer now.
ID_EDGES = [
    (4242.5, None),  # slurm_job_of's: "4242.5", the export's: None
    (math.inf, None),  # "inf", None
    (True, None),  # "True", None
    (False, None),  # "False", None
    ([4242], None),  # "[4242]", None
    ({"id": 4242}, None),  # "{'id': 4242}", None
    (pd.NA, None),  # TypeError (NA has no truth value), None
    (np.int64(4242), "4242"),  # "4242", None: an id from a nullable integer column went unexported
    (np.float32(4242.0), "4242"),  # "4242.0", None
]
# Where they agreed.
ID_AGREED = [(None, None), (math.nan, None), ("", None), ("4242", "4242"), (4242, "4242"), (4242.0, "4242"), (0, "0")]


@pytest.mark.parametrize(("value", "text"), [*ID_EDGES, *ID_AGREED])
def test_a_slurm_id_is_text_only_where_it_is_text_or_a_whole_number(value, text):
    assert slurm_id_text(value) == text


@pytest.mark.parametrize(("value", "text"), ID_EDGES)
def test_a_records_job_is_its_own_job_id_where_its_array_id_is_no_id(value, text):
    slurm = {"job_id": "4250", "array_job_id": value, "array_task_id": 3}
    assert slurm_job_of(slurm) == (f"{text}_3" if text else "4250")


def test_logs_find_a_cells_job_by_its_own_id_where_the_records_array_id_is_spoiled(tmp_path):
    sweep, cell = slurm_cell(tmp_path, job_id="4250")
    (sweep / MANIFEST_NAME).write_text(json.dumps({cell: {"executor": "local"}}))  # the record alone names the job
    spoil(cells_of(sweep)[0], slurm={"job_id": "4250", "array_job_id": True, "array_task_id": 0})
    folder = sweep / "slurm" / "4250"
    folder.mkdir(parents=True)
    (folder / "4250_0_log.err").write_text("RuntimeError: the end\n")
    done = run_cli("logs", str(sweep), cell, "--stderr")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "==> job 4250, node 0" in done.stdout and "RuntimeError: the end" in done.stdout


@pytest.mark.parametrize("spec_changes", [{"nodes": "x"}, {"nodes": 10**12}, {"gpus_per_node": None}])
def test_logs_of_a_cell_whose_spec_json_is_spoiled_end_in_one_line_or_its_logs(tmp_path, spec_changes):
    sweep, cell = slurm_cell(tmp_path, spec_changes)
    folder = sweep / "slurm" / "4242_0"
    folder.mkdir(parents=True)
    (folder / "4242_0_0_log.err").write_text("ValueError: bad\n")
    done = run_cli("logs", str(sweep), cell, "--stderr")
    assert "Traceback" not in done.stderr and done.returncode == 0, done.stderr
    assert "ValueError: bad" in done.stdout


@pytest.mark.parametrize("odd", ["fifo", "dev_zero", "folder", "empty"])
def test_an_odd_file_named_result_json_hangs_nothing_and_is_named_corrupt(tmp_path, odd):
    sweep = write_sweep(tmp_path / "results", "odd", 0, {"a": 1000.0, "b": 2000.0})
    path = cells_of(sweep)[1]
    path.unlink()
    if odd == "fifo":
        os.mkfifo(path)
    elif odd == "dev_zero":
        path.symlink_to("/dev/zero")
    elif odd == "folder":
        path.mkdir()
    else:
        path.write_text("")
    cell = path.parent.name
    record = json.loads(cells_of(sweep)[0].read_text())
    (path.parent / SPEC_NAME).write_text(json.dumps({"cell_id": cell, "sweep": "odd", "spec": record["spec"]}))
    for argv in (
        ["status", str(sweep)],
        ["collect", str(sweep), "--no-plots", "--no-history"],
        ["logs", str(sweep), cell],
        ["export", str(sweep), "--to", "tensorboard", str(tmp_path / "tb")],
    ):
        done = run_cli(*argv)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
        assert done.returncode in (0, 1, 3), (argv, done.returncode, done.stderr)  # 3: status of a corrupt cell
    done = run_cli("collect", str(sweep), "--no-plots", "--no-history")
    (line,) = [line for line in done.stderr.splitlines() if str(path) in line]
    assert line.startswith(f"warning: skipped {path}: ")


def test_wrong_types_in_the_cache_manifest_are_one_line_at_verify_and_plan(tmp_path):
    cache = tmp_path / "cache"
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "name: c\nbase: {device: cpu, precision: fp32, model: org/m, seq_len: 16, steps: 2, warmup_steps: 1}\n"
    )
    entries = [
        {"items": []},
        {"items": {"model:org/m@main": "x"}},
        {"items": {"model:org/m@main": {"kind": 5, "path": ["a"], "files": "x", "item": None}}},
        {"items": {"model:org/m@main": {"kind": "model", "path": "m", "files": [{"path": 3, "size": "big"}]}}},
        {"items": {"model:org/m@main": {"kind": "model", "path": "m", "files": [None], "sha": 7}}},
    ]
    for manifest in entries:
        cache.mkdir(exist_ok=True)
        (cache / "manifest.json").write_text(json.dumps({"version": 1, **manifest}))
        for argv in (["download", "--verify", "--cache-dir", str(cache)], ["plan", str(jobs)]):
            done = subprocess.run(
                [sys.executable, "-m", "hpcfsdp", *argv],
                capture_output=True,
                text=True,
                timeout=HANG_LIMIT_S,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCFSDP_CACHE": str(cache)},
            )
            assert "Traceback" not in done.stderr, (manifest, argv, done.stderr)
            errors = [
                line for line in done.stderr.strip().splitlines() if not line.startswith("note:")
            ]  # not plan's note
            assert done.returncode in (1, 2) and len(errors) == 1, (manifest, argv, done)
