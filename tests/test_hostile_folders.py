"""Hostile input, round 5 (issue 44, items 4 and 9-11): text that is no text (lone surrogates, cell
folders whose names are not UTF-8), another cell's record copied into a cell's folder, records of
megabytes, and a controller that cannot be reached.

Sweeps are written with the project's record writer (test_history.write_sweep) and spoiled as a
hand would; every reading goes through the real `hpcfsdp collect`, `status` and `export` commands,
and the JSON answers through strict parsers (orjson, DuckDB).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import duckdb
import orjson
import pandas as pd
import pytest

from conftest import client_conf, free_port
from hpcfsdp.cli import main
from hpcfsdp.contracts.files import write_json
from hpcfsdp.contracts.record import MAX_RECORD_BYTES, RECORD_NAME, SPEC_NAME, write_record
from hpcfsdp.results.defaults import HISTORY_NAME
from hpcfsdp.results.read import load_records
from hpcfsdp.sweep.folder.layout import MANIFEST_NAME, owned_entry
from hpcfsdp.sweep.track.status import sweep_status
from test_history import write_sweep


def cells_of(sweep: Path) -> list[Path]:
    return sorted((sweep / "cells").glob(f"*/{RECORD_NAME}"))


def planned_sweep(results: Path, name: str, cells: dict[str, float | str]) -> Path:
    """test_history.write_sweep, with the spec.json of each cell that submit writes (status reads those)."""
    sweep = write_sweep(results, name, 0, cells)
    for path in cells_of(sweep):
        record = json.loads(path.read_text())
        meta = {"cell_id": path.parent.name, "sweep": name, "spec": record["spec"]}
        (path.parent / SPEC_NAME).write_text(json.dumps(meta))
    return sweep


def history_cells(results: Path) -> set[str]:
    with duckdb.connect(str(results / HISTORY_NAME), read_only=True) as con:
        return {row[0] for row in con.execute("SELECT DISTINCT cell_id FROM runs").fetchall()}


# ---------------------------------------------------------------------------------------------
# 4: lone surrogates and cell folders whose names are not UTF-8


def test_a_lone_surrogate_or_a_non_utf8_cell_folder_is_one_corrupt_cell_and_the_others_are_reported(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = planned_sweep(results, "surrogates", {"a": 1000.0, "b": 2000.0, "c": 1500.0, "d": 800.0})
    paths = cells_of(sweep)
    spoiled_record, spoiled_spec, kept = paths[0], paths[1], paths[2:]
    record = json.loads(spoiled_record.read_text())
    spoiled_record.write_text(json.dumps({**record, "error": "\ud800"}))  # json writes it as "\ud800"
    spec = json.loads(spoiled_spec.read_text())
    spoiled_spec.write_text(json.dumps({**spec, "spec": {**spec["spec"], "model": "tiny\udcff"}}))
    odd = os.fsencode(sweep / "cells") + b"/caf\xe9"  # Latin-1, not UTF-8
    shutil.copytree(kept[0].parent, os.fsdecode(odd))

    assert main(["collect", str(sweep), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"warning: skipped {spoiled_record}: unreadable record (a lone surrogate, which is no text, in error)" in err
    assert (
        f"warning: skipped {spoiled_spec}: unreadable record (a lone surrogate, which is no text, in spec.model)" in err
    )
    assert f"{sweep / 'cells'}/caf\\udce9: a cell folder whose name is no cell id (not UTF-8 text, " in err
    table = pd.read_parquet(sweep / "report" / "results.parquet")
    assert sorted(table["cell_id"]) == sorted(path.parent.name for path in kept)
    assert history_cells(results) == {path.parent.name for path in kept}

    assert main(["status", str(sweep), "--json"]) == 3
    out = capsys.readouterr().out.encode()
    out.decode("utf-8")  # strict UTF-8
    document = orjson.loads(out)  # strict JSON: no lone surrogate
    states = {cell["cell_id"]: cell["status"] for cell in document["cells"]}
    assert states["caf\\udce9"] == "corrupt"
    assert [states[path.parent.name] for path in paths] == ["corrupt", "corrupt", "ok", "ok"]
    (tmp_path / "status.json").write_bytes(out)
    assert duckdb.sql(f"SELECT count(*) FROM read_json('{tmp_path / 'status.json'}')").fetchall() == [(1,)]
    assert main(["status", str(sweep)]) == 3  # the table, on a strict UTF-8 stdout too
    assert "caf\\udce9" in capsys.readouterr().out

    assert main(["export", str(sweep), "--to", "tensorboard", str(tmp_path / "tb")]) == 0
    assert "exported 2 run(s)" in capsys.readouterr().out


def test_a_cell_spec_json_with_a_lone_surrogate_is_named_and_status_goes_on(tmp_path, capsys):
    sweep = planned_sweep(tmp_path / "results", "specs", {"a": 1000.0, "b": 2000.0})
    first, second = cells_of(sweep)
    first.unlink()
    record = json.loads(second.read_text())
    (first.parent / SPEC_NAME).write_text(
        json.dumps({"cell_id": first.parent.name, "sweep": "specs", "spec": {**record["spec"], "strategy": "d\ud800"}})
    )
    assert main(["status", str(sweep), "--json"]) == 3
    captured = capsys.readouterr()
    document = orjson.loads(captured.out.encode())
    assert {cell["cell_id"]: cell["strategy"] for cell in document["cells"]}[first.parent.name] == "?"
    assert main(["collect", str(sweep), "--no-plots", "--no-history"]) == 0
    err = capsys.readouterr().err
    assert (
        f"{first.parent / SPEC_NAME}: unreadable cell spec (a lone surrogate, which is no text, in spec.strategy)"
        in err
    )


@pytest.mark.parametrize(
    "yaml_text, line",
    [
        ('name: "sweep\\ud800"\nbase: {model: tiny, device: cpu}\n', 1),
        ('name: s\nbase: {model: tiny, device: cpu}\nsetup:\n  - "export X=\\udcff"\n', 4),
        ('name: s\nbase: {model: tiny, device: cpu}\nslurm: {extra_sbatch: {"res\\ud800": x}}\n', 3),
    ],
)
def test_a_lone_surrogate_in_the_jobs_yaml_is_refused_at_plan_in_one_line(tmp_path, capsys, yaml_text, line):
    jobs = tmp_path / "s.yaml"
    jobs.write_text(yaml_text)
    for argv in (["plan", str(jobs)], ["plan", str(jobs), "--sbatch"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: {jobs}:{line}: not valid YAML (a lone surrogate (\\ud800-\\udfff), which is no text)\n"


# ---------------------------------------------------------------------------------------------
# 10: another cell's record


def test_another_cells_record_copied_into_a_cell_folder_is_corrupt_and_never_enters_the_history(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = planned_sweep(results, "copied", {"a": 1000.0, "b": 2000.0, "c": 1500.0})
    first, second, third = cells_of(sweep)
    third.unlink()
    shutil.copy(first, third)  # the first cell's record, as the third's
    assert main(["status", str(sweep), "--json"]) == 3
    document = json.loads(capsys.readouterr().out)
    assert {cell["cell_id"]: cell["status"] for cell in document["cells"]}[third.parent.name] == "corrupt"
    assert f'{third}: the record of cell "{first.parent.name}", not of this cell\'s folder' in document["warnings"]
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    assert f'warning: skipped {third}: the record of cell "{first.parent.name}"' in capsys.readouterr().err
    assert history_cells(results) == {first.parent.name, second.parent.name}
    with duckdb.connect(str(results / HISTORY_NAME), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (2,)


# ---------------------------------------------------------------------------------------------
# 11: big records


def test_a_record_of_a_hundred_thousand_steps_is_far_below_the_cap_and_a_bigger_file_is_corrupt(tmp_path, capsys):
    sweep = planned_sweep(tmp_path / "results", "big", {"a": 1000.0, "b": 2000.0, "c": 1500.0})
    first, second, third = cells_of(sweep)
    # A real record as the cell writes it, with the losses and step times of 60,000 steps: under the cap.
    record = json.loads(first.read_text())
    steps = 60_000
    write_record(
        first, {**record, "losses": [2.0 + i / 7e4 for i in range(steps)], "step_times_s": [0.123456789] * steps}
    )
    assert first.stat().st_size < MAX_RECORD_BYTES
    # Records of 40 MB each (a long unknown field): corrupt, named, never read whole.
    for path in (second, third):
        record = json.loads(path.read_text())
        write_json(path, {**record, "notes": "x" * (40 << 20)})
    started = time.monotonic()
    tracemalloc.start()
    collection = load_records(sweep)
    status = sweep_status(sweep)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - started < 20
    assert peak < 64 << 20, f"{peak >> 20} MiB held"
    assert list(collection.frame["cell_id"]) == [first.parent.name]
    for path in (second, third):
        assert f"{path}: unreadable record (larger than {MAX_RECORD_BYTES >> 20} MiB)" in collection.unreadable
        assert f"{path}: unreadable record (larger than {MAX_RECORD_BYTES >> 20} MiB)" in status.problems
    assert main(["collect", str(sweep), "--no-plots", "--no-history"]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 9: a controller that cannot be reached


@pytest.mark.slurm
def test_status_when_the_controller_cannot_be_reached_is_an_error_not_cells_not_ok(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    sweep = planned_sweep(tmp_path / "results", "unreachable", {"a": 1000.0, "b": 2000.0})
    _, second = cells_of(sweep)
    record = json.loads(second.read_text())
    second.unlink()  # queued, no record yet
    (second.parent / SPEC_NAME).write_text(
        json.dumps({"cell_id": second.parent.name, "sweep": "unreachable", "spec": record["spec"]})
    )
    entry = {"executor": "slurm", "job_id": "4242_1", "cluster": "", "submitted_at": time.time()}
    write_json(sweep / MANIFEST_NAME, {second.parent.name: {**entry, **owned_entry(sweep, "abc123")}})
    monkeypatch.setenv(
        "SLURM_CONF", client_conf(tmp_path, "stopped", SlurmctldPort=str(free_port()), MessageTimeout="2")
    )
    for argv in (["status", str(sweep)], ["status", str(sweep), "--json"]):
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert captured.err == (
            "error: squeue: slurm_load_jobs error: Unable to contact slurm controller (connect failure): "
            "the state of 1 queued cell(s) is unknown\n"
        )
    # With every cell recorded, squeue's silence hides nothing: status answers from the records.
    write_record(second, {**record, "cell_id": second.parent.name})
    assert main(["status", str(sweep)]) == 0
