"""Sources resolved once: where the sweep is loaded, a model, data or tokenizer value becomes a
typed value (preset, hub reference with its revision, absolute path), stored in the cell's
spec.json beside the user's own string, and the cell uses that form wherever it runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.sources import PRESETS_DIR
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.folder.layout import cell_dir, write_sweep_files

JOBS = """name: relative
base: {device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1}
matrix:
  model: [./models/m, tiny, acme/llm@v1]
"""
# The ids of JOBS's cells, computed with hpcfsdp at 179eea5, before sources were resolved: the
# same YAML keeps its ids, so a resubmit skips what ran and history pairs the setups.
IDS_BEFORE = {
    "./models/m": "fsdp2_zero3-b1-a1-d9e83d0d95",
    "tiny": "fsdp2_zero3-b1-a1-e48dd20b81",
    "acme/llm@v1": "fsdp2_zero3-b1-a1-f616221dfd",
}


def project(tmp_path, jobs: str = JOBS):
    """A project folder holding a local model (the tiny preset's config) and a jobs file."""
    root = tmp_path / "project"
    (root / "models" / "m").mkdir(parents=True)
    shutil.copy(PRESETS_DIR / "tiny.json", root / "models" / "m" / "config.json")
    (root / "jobs.yaml").write_text(jobs)
    return root


def test_cell_ids_stay_those_computed_before_sources_were_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(project(tmp_path))
    sweep = load_sweep("jobs.yaml")
    assert {cell.spec.model: cell.id for cell in sweep.cells} == IDS_BEFORE


def test_spec_json_carries_the_users_strings_and_their_resolved_sources(tmp_path, monkeypatch):
    root = project(tmp_path)
    monkeypatch.chdir(root)
    sweep = load_sweep("jobs.yaml")
    write_sweep_files(sweep, tmp_path / "results", sweep.cells)
    meta = {
        cell.spec.model: json.loads((cell_dir(tmp_path / "results", cell) / "spec.json").read_text())
        for cell in sweep.cells
    }
    local, preset, hub = meta["./models/m"], meta["tiny"], meta["acme/llm@v1"]
    assert local["spec"]["model"] == "./models/m"  # the user's own string, unchanged
    assert local["sources"]["model"] == {"kind": "local", "given": "./models/m", "path": str(root / "models" / "m")}
    assert local["sources"]["tokenizer"] == local["sources"]["model"]  # text would be tokenised with the model's own
    assert preset["sources"]["model"] == {"kind": "preset", "given": "tiny", "name": "tiny"}
    assert preset["sources"]["tokenizer"] is None
    assert hub["sources"]["model"] == {"kind": "hub", "given": "acme/llm@v1", "repo_id": "acme/llm", "revision": "v1"}
    assert local["sources"]["data"] == {"kind": "synthetic", "given": "synthetic"}


def test_a_hub_dataset_preset_is_resolved_to_its_repo_config_and_split(tmp_path, monkeypatch):
    jobs = "base: {device: cpu, model: acme/llm, data: tinystories@validation}\n"
    monkeypatch.chdir(project(tmp_path, jobs))
    (cell,) = load_sweep("jobs.yaml").cells
    assert cell.sources.data.dataset_ref.name == "roneneldan/TinyStories:default@validation"
    assert cell.sources.tokenizer == cell.sources.model and cell.sources.model.model_ref.name == "acme/llm"


@pytest.mark.parametrize("batch", ["1", "auto"])
def test_a_relative_model_path_is_the_folder_it_named_where_the_sweep_was_loaded(tmp_path, monkeypatch, batch):
    """The cell runs from another working directory (a compute node's), where ./models/m names
    nothing: it trains the model the login node resolved, and records that folder; with
    batch_size: auto its probe processes build that same model."""
    jobs = JOBS.replace("[./models/m, tiny, acme/llm@v1]", "[./models/m]") + "  strategy: [single]\n"
    root = project(tmp_path, jobs.replace("steps: 3,", f"steps: 3, batch_size: {batch}, max_batch_size: 1,"))
    monkeypatch.chdir(root)
    sweep = load_sweep("jobs.yaml")
    write_sweep_files(sweep, tmp_path / "results", sweep.cells)
    (cell,) = sweep.cells
    directory = cell_dir(tmp_path / "results", cell)
    elsewhere = tmp_path / "compute-node"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "hpcfsdp", "run", "--cell-dir", str(directory)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    record = json.loads((directory / "result.json").read_text())
    assert proc.returncode == 0 and record["status"] == "ok", record.get("error") or proc.stderr[-2000:]
    assert record["spec"]["model"] == "./models/m"
    assert record["model_source"] == {"kind": "local", "path": str(root / "models" / "m")}
    if batch == "auto":
        assert [p["status"] for p in record["batch_search"]["probes"]] == ["ok"]


def test_a_missing_model_path_is_one_line_naming_file_line_and_key_at_plan_time(tmp_path, monkeypatch, capsys):
    root = project(tmp_path, JOBS.replace("./models/m", "./models/gone"))
    monkeypatch.chdir(root)
    assert main(["plan", "jobs.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"error: jobs.yaml:4: matrix.model: no such folder: ./models/gone ({root / 'models' / 'gone'})"
    ), err
