"""What a record, a lock or a full disk can do to collect, the history and export: nothing.

Records are written with the project's record writer and then spoiled as a careless or hostile
hand would; every collection goes through the real `hpcfsdp collect` and a real DuckDB file; the
full disk is a real tmpfs of a few MiB (mounted as root, unmounted at the end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

from hpcfsdp.cache.hub import CacheMissError, lookup_model, read_cache_manifest
from hpcfsdp.cache.verify import verify_cache
from hpcfsdp.cli import main
from hpcfsdp.contracts.files import write_json
from hpcfsdp.contracts.record import write_record
from hpcfsdp.results import history
from hpcfsdp.sweep.define.matrix import load_sweep
from test_history import EARLIER, write_sweep

# ---------------------------------------------------------------------------------------------
# Paths, filters and names from records


def spoil(record_path: Path, **fields) -> None:
    """Rewrite a record with these fields changed, as a hand editing the file would."""
    record = json.loads(record_path.read_text())
    record.update(fields)
    record_path.write_text(json.dumps(record))


def test_a_record_cannot_steer_export_or_collect_with_its_cell_id(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "steer", 0, {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0, "e": 900.0})
    paths = sorted((sweep / "cells").glob("*/result.json"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "events.out.tfevents.keep").write_text("not the export's")
    hostile = ["../../../victim", str(victim), 5, "it's \" a quote"]
    for path, cell_id in zip(paths, hostile, strict=False):
        spoil(path, cell_id=cell_id, launch_id="x' OR '1'='1")
    spoil(paths[4], launch_id="x' OR '1'='1")
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    # An id that is no text makes the record corrupt; an id of another cell is no record of this one
    # (issue 44, item 10): each named in one line and skipped.
    err = capsys.readouterr().err
    assert f"warning: skipped {paths[2]}: cell_id: expected text or null, got 5\n" in err
    for path, cell_id in zip(paths[:4], hostile, strict=True):
        if cell_id != 5:
            assert f"warning: skipped {path}: the record of cell {json.dumps(cell_id)[:37]}" in err
    kept = [paths[4].parent.name]
    csv = (sweep / "report" / "results.csv").read_text()
    assert all(name in csv for name in kept)  # each cell named by its folder
    tb, store = tmp_path / "tb", tmp_path / "mlruns"
    for target, destination in (("tensorboard", tb), ("mlflow", store)):
        assert main(["export", str(sweep), "--to", target, str(destination)]) == 0, capsys.readouterr().err
        assert "exported 1 run(s)" in capsys.readouterr().out
    assert main(["export", str(sweep), "--to", "mlflow", str(store)]) == 0  # quotes: matched, not filtered
    assert "(1 exported before, left as they were)" in capsys.readouterr().out
    assert sorted(p.name for p in (tb / "steer").iterdir() if p.is_dir()) == sorted(kept)
    assert [p.name for p in victim.iterdir()] == ["events.out.tfevents.keep"]
    assert not list(tmp_path.glob("*.tfevents.*")) and not (tmp_path / "x").exists()


def test_a_cache_manifest_path_out_of_the_cache_is_never_followed(tmp_path):
    cache = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    entry = {
        "key": "model:org/m@main",
        "item": "org/m@main",
        "kind": "model",
        "path": "../outside",
        "files": [{"path": "config.json", "size": 2, "sha256": "0" * 64}],
        "total_bytes": 2,
    }
    write_json(cache / "manifest.json", {"version": 1, "items": {entry["key"]: entry}})
    assert read_cache_manifest(cache)["items"]  # a well-formed manifest, with one hostile path
    with pytest.raises(CacheMissError, match=r"path '\.\./outside' leads out of the cache; not followed"):
        lookup_model("org/m", cache)
    lines: list[str] = []
    assert verify_cache(cache, out=lines.append) is False
    assert any("leads out of the cache" in line for line in lines), lines
    entry["path"], entry["files"][0]["path"] = "models/m", "/etc/passwd"
    write_json(cache / "manifest.json", {"version": 1, "items": {entry["key"]: entry}})
    with pytest.raises(CacheMissError, match=r"path '/etc/passwd' leads out of the cache"):
        lookup_model("org/m", cache)


# ---------------------------------------------------------------------------------------------
# Mistyped records


MISTYPED = {
    "duration_s": "fast",
    "world_size": 2.5,
    "hostnames": "node-1",
    "slurm": {"job_id": [1]},
    "started_at": True,
}


def test_a_mistyped_record_is_corrupt_named_skipped_and_retried(tmp_path, capsys):
    results = tmp_path / "results"
    cells = {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0, "e": 900.0, "a_again": 1000.0}
    sweep = write_sweep(results, "typed", 0, cells)
    paths = sorted((sweep / "cells").glob("*/result.json"))
    spoiled = dict(zip(paths[1:], MISTYPED.items(), strict=True))  # all but the first record
    for path, (field, value) in spoiled.items():
        spoil(path, **{field: value})
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    for path, (field, _) in spoiled.items():
        (line,) = [line for line in captured.err.splitlines() if str(path) in line]
        assert line.startswith(f"warning: skipped {path}: {field}") and "expected" in line, line
    with duckdb.connect(str(results / "history.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT cell_id, duration_s, world_size FROM runs").fetchall()
    (good,) = set(paths) - set(spoiled)
    assert [row[0] for row in rows] == [good.parent.name]  # only the typed record


def test_submit_retry_failed_reruns_a_mistyped_record(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("name: retry\nbase: {device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1}\n")
    (cell,) = load_sweep(jobs).cells
    record = tmp_path / "results" / "retry" / "cells" / cell.id / "result.json"
    write_record(record, {"status": "ok", "cell_id": cell.id, "spec": cell.spec.to_dict(), "world_size": "one"})
    argv = ["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"corrupt record: {record}: world_size: expected an integer" in captured.err
    assert main([*argv, "--retry-failed"]) == 0
    assert cell.id in capsys.readouterr().out  # the one printed command reruns it


# ---------------------------------------------------------------------------------------------
# The regression gate and the history's lock

HOLDER = """
import sys, time
from pathlib import Path
from hpcfsdp.results.history import updated_history
with updated_history(Path(sys.argv[1]), print) as store:
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold_history(path: Path, seconds: float) -> subprocess.Popen:
    """Another collect, in the middle of updating the history for `seconds`."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_the_regression_gate_waits_for_the_history_lock_and_fails_when_it_cannot_check(tmp_path, capsys, monkeypatch):
    results = tmp_path / "results"
    for index in range(3):
        earlier = write_sweep(results, f"s{index}", index, {"a": EARLIER["a"][index]})
        assert main(["collect", str(earlier), "--no-plots"]) == 0
    store = results / "history.duckdb"
    slow = write_sweep(results, "s3", 3, {"a": 500.0})  # half its setup's median: a regression
    holder = hold_history(store, 2)
    try:
        assert main(["collect", str(slow), "--no-plots", "--fail-on-regression"]) == 1
    finally:
        holder.wait(timeout=60)
    captured = capsys.readouterr()
    assert f"waiting up to 120 s for the history {store}: another collect updates it (pid {holder.pid}" in captured.err
    assert "regression: " in captured.out and "below the median" in captured.out

    # Held past the wait: the gate cannot look, so it fails; it never passes silently.
    fine = write_sweep(results, "s4", 4, {"a": 1000.0})
    monkeypatch.setattr(history, "LOCK_WAIT_S", 0.5)
    holder = hold_history(store, 30)
    try:  # 3: the history could not be checked (1 is a regression; both fail the gate)
        assert main(["collect", str(fine), "--no-plots", "--fail-on-regression"]) == 3
    finally:
        holder.kill()
        holder.wait()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: history {store}: not updated (another collect has held its lock for 0.5 s: pid {holder.pid} of root "
        f"(collect: pid {holder.pid} of root on {os.uname().nodename})); --no-history collects without it"
    ]
    assert main(["collect", str(fine), "--no-plots", "--fail-on-regression"]) == 0  # free again: it checks


# ---------------------------------------------------------------------------------------------
# A full disk


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A tmpfs of 4 MiB, unmounted at the end (needs root, as the test suite does)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False, timeout=30)


def fill(disk: Path) -> Path:
    """Fill the disk up to its last byte; returns the filler (remove it to make room)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (65536, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_full_disk_leaves_no_half_written_file_and_names_the_file(small_disk, capsys):
    results = small_disk / "results"
    sweep = write_sweep(results, "full", 0, {"a": 1000.0, "c": 1500.0})
    filler = fill(small_disk)
    before = files_under(results)
    assert main(["collect", str(sweep), "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (history_error,) = [line for line in err.splitlines() if line.startswith("error: history")]
    assert history_error.startswith(f"error: history {results / 'history.duckdb'}: not updated (")
    assert "No space left on device" in history_error and "/." not in history_error  # no temporary name
    assert f"{sweep / 'report'}" in err.splitlines()[-1] and "No space left on device" in err.splitlines()[-1]
    after = files_under(results)
    assert {name: data for name, data in after.items() if name not in before and not name.endswith(".lock")} == {}
    assert not [name for name in after if Path(name).name.startswith(".")]  # no temporary file left

    filler.unlink()
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    capsys.readouterr()
    written = files_under(results)
    assert written["full/report/results.csv"] and written["history.duckdb"]
    fill(small_disk)
    assert main(["collect", str(sweep), "--no-plots"]) == 1
    again = files_under(results)
    for name in ("history.duckdb", "full/report/results.csv", "full/report/summary.md"):
        assert again[name] == written[name], name  # the last good file, whole
    with duckdb.connect(str(results / "history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (2,)


# ---------------------------------------------------------------------------------------------
# YAML merge keys; Markdown in names


def test_yaml_merge_keys_are_accepted_within_the_alias_and_depth_bounds(tmp_path, capsys):
    jobs = tmp_path / "merge.yaml"
    jobs.write_text(
        textwrap.dedent(
            """
            name: merged
            base: &defaults
              device: cpu
              precision: fp32
              seq_len: 32
            include:
              - <<: *defaults
                seq_len: 64
              - <<: [*defaults, {strategy: ddp}]
            """
        )
    )
    sweep = load_sweep(jobs)
    shapes = sorted((c.spec.seq_len, c.spec.strategy, c.spec.device, c.spec.precision) for c in sweep.cells)
    assert shapes == [  # the includes only: a file of includes makes no base cell (issue 43)
        (32, "ddp", "cpu", "fp32"),
        (64, "fsdp2_zero3", "cpu", "fp32"),
    ]
    duplicate = tmp_path / "duplicate.yaml"
    duplicate.write_text("base: &d {device: cpu}\ninclude:\n  - <<: *d\n    seq_len: 64\n    seq_len: 32\n")
    assert main(["plan", str(duplicate)]) == 2
    assert "duplicate key 'seq_len' (first at line 4)" in capsys.readouterr().err
    # A bomb of merges: each level merges the one below ten times.
    levels = ["a0: &a0 {x0: 1, y0: 2, z0: 3, w0: 4, v0: 5, u0: 6, t0: 7, s0: 8, r0: 9, q0: 10}"]
    for level in range(1, 8):
        merges = ", ".join(f"*a{level - 1}" for _ in range(10))
        levels.append(f"a{level}: &a{level} {{<<: [{merges}], k{level}: {{<<: [{merges}]}}}}")
    bomb = tmp_path / "merge_bomb.yaml"
    bomb.write_text(
        "base: {device: cpu}\nsetup_anchors_are_not_a_section:\n" + "".join(f"  {line}\n" for line in levels)
    )
    assert main(["plan", str(bomb)]) == 2
    assert "once its aliases are expanded (an alias bomb?)" in capsys.readouterr().err
    deep = tmp_path / "merge_deep.yaml"
    deep.write_text("base: &d {device: cpu}\ninclude:\n  - <<: *d\n    x: " + "[" * 100 + "]" * 100 + "\n")
    assert main(["plan", str(deep)]) == 2
    assert "nested more than 64 levels deep" in capsys.readouterr().err


def test_markdown_in_names_and_records_is_shown_as_written(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "**bold**_x_~~gone~~", 0, {"a": 1000.0, "c": 1500.0})
    path = next((sweep / "cells").glob("*/result.json"))
    spoil(path, device_name="`code` $x$ &amp; <b>h</b> # [l](http://e)")
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    summary = (sweep / "report" / "summary.md").read_text()
    title = summary.splitlines()[0]
    assert title.startswith(r"# \*\*bold\*\*\_x\_\~\~gone\~\~: "), title
    assert r"\`code\` \$x\$ \&amp; \<b>h\</b> \# \[l\](http://e)" in summary
    assert "fsdp2_zero3" in summary  # an underscore inside a word stays as it is


@pytest.mark.parametrize("folder", ["100%", "my results", "run#2", "bob's", "back\\slash"])
def test_submit_refuses_a_sweep_folder_whose_path_breaks_the_sbatch_lines(tmp_path, capsys, folder):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("name: paths\nbase: {device: cpu}\n")
    results = tmp_path / folder
    assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {results / 'paths'}: the sweep folder's path holds ") and err.count("\n") == 1, err
    assert not results.exists()  # nothing written, nothing queued
