"""tune's own files spoiled as a hand (or a teammate) in a shared folder would (issue 44, items 2, 3
and 12): tune/state.json checked as records are before anything is trained, tune.json checked
before the report or `submit --only-best` reads it, and `--eta 1` refused on the command line.

The states are made by tune's own code (new_state, the first stage's probe folders) and then
spoiled; every command is the real `hpcfsdp` one.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from hpcfsdp.cli import main
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.tune.stages import _probe_stage, new_state
from hpcfsdp.tune.state import save_state
from test_history import EARLIER, write_sweep

CPU = "model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 5, warmup_steps: 1, comm_profile_steps: 0"
AGAIN = "remove tune/ to start again"


def jobs_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "tf.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            name: tf
            base: {{{CPU}, gpus_per_node: 1, strategy: ddp}}
            slurm: {{time_min: 5}}
            matrix:
              batch_size: [1, 2]
            """
        )
    )
    return path


def begun_search(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A search whose first stage was written (its probes' folders and spec.json) and not run:
    the jobs YAML, the sweep folder, and the state as tune saved it."""
    jobs = jobs_yaml(tmp_path)
    sweep = load_sweep(jobs)
    sweep_dir = tmp_path / "results" / "tf"
    state, _ = new_state(sweep, lambda line: None)
    state.stages.append(_probe_stage(sweep_dir, sweep, list(sweep.cells), 0, 3))
    save_state(sweep_dir, state)
    return jobs, sweep_dir, json.loads((sweep_dir / "tune" / "state.json").read_text())


def outside_spec(tmp_path: Path, sweep_dir: Path, state: dict) -> Path:
    """A probe's folder copied out of the sweep folder: what an absolute run id would train."""
    run = next(iter(state["stages"][0]["runs"]))
    outside = tmp_path / "outside" / "cell"
    outside.mkdir(parents=True)
    (outside / "spec.json").write_bytes((sweep_dir / "tune" / "stage0" / "cells" / run / "spec.json").read_bytes())
    return outside


def spoiled(state: dict, how: str, outside: Path) -> dict:
    stage0 = state["stages"][0]
    grid_id = state["grid"][0]
    if how == "absolute_run_id":
        stage0["runs"] = {str(outside): grid_id, **stage0["runs"]}
    elif how == "dotted_run_id":
        stage0["runs"] = {"../../../outside/cell": grid_id}
    elif how == "pruned_not_an_object":
        state["pruned"] = "abc"
    elif how == "unknown_stage_name":
        stage0["name"] = "stage7"
    elif how == "final_id_no_cell":
        state["stages"].append({"name": "final", "runs": {"ddp-b9-a1-0123456789": "ddp-b9-a1-0123456789"}})
    elif how == "job_id_of_two_jobs":
        stage0["jobs"] = {"1,2": list(stage0["runs"])}
    elif how == "grid_of_numbers":
        state["grid"] = [1, 2]
    elif how == "stages_not_a_list":
        state["stages"] = {"name": "stage0"}
    return state


SPOILS = [
    "absolute_run_id",
    "dotted_run_id",
    "pruned_not_an_object",
    "unknown_stage_name",
    "final_id_no_cell",
    "job_id_of_two_jobs",
    "grid_of_numbers",
    "stages_not_a_list",
]


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoiled_tune_state_is_one_line_and_nothing_is_trained_or_written_outside(tmp_path, capsys, how):
    jobs, sweep_dir, state = begun_search(tmp_path)
    outside = outside_spec(tmp_path, sweep_dir, state)
    (sweep_dir / "tune" / "state.json").write_text(json.dumps(spoiled(state, how, outside)))
    capsys.readouterr()
    argv = ["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith(f"error: {sweep_dir / 'tune' / 'state.json'}: ") and line.endswith(AGAIN), line
    assert sorted(p.name for p in outside.iterdir()) == ["spec.json"]  # no record, no log: not trained
    assert not (sweep_dir / "tune" / "launches").exists() and not (sweep_dir / "tune.json").exists()


def test_tune_eta_1_is_refused_on_the_command_line_before_anything_runs(tmp_path, capsys):
    jobs = jobs_yaml(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path / "results"), "--eta", "1"])
    assert stop.value.code == 2
    assert "argument --eta: expected an integer of 2 or more" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


# ---------------------------------------------------------------------------------------------
# tune.json


def tune_outcome(best_id: str) -> dict:
    """A tune.json as tune writes it, naming best_id as the pick."""
    row = {
        "cell_id": best_id,
        "stage": "final",
        "depth": 1,
        "run": best_id,
        "setup": {"strategy": "ddp", "batch_size": 2},
        "status": "ok",
        "tokens_per_s_per_gpu": 1234.5,
        "timed_steps": 4,
        "peak_memory_gib": 1.5,
        "runs_tokens_per_s_per_gpu": [1230.0, 1239.0],
    }
    return {
        "sweep": "tf",
        "best": row,
        "ranking": [row],
        "oom_frontier": [],
        "failed": [],
        "pruned": {},
        "notes": [],
        "spend": {
            "tune_gpu_hours": 0.01,
            "by_stage": {"stage0": 0.004, "final": 0.006},
            "launches": 3,
            "grid_cells": 2,
            "grid_estimate_gpu_hours": 0.02,
            "grid_estimate_basis": "cell by cell",
            "fraction_of_grid": 0.5,
        },
        "stages": [{"name": "stage0", "runs": 2, "jobs": []}, {"name": "final", "runs": 1, "jobs": []}],
    }


TUNE_SPOILS = {
    "best_not_an_object": (lambda doc: doc.update(best="abc"), 'best: expected an object, got "abc"'),
    "made_up_pick": (
        lambda doc: doc["best"].update(tokens_per_s_per_gpu=1e308),
        "best.tokens_per_s_per_gpu: expected a number from 0 to 1e+15, got 1e+308",
    ),
    "spend_of_text": (lambda doc: doc["spend"].update(tune_gpu_hours="a lot"), "spend.tune_gpu_hours: expected"),
    "ranking_of_numbers": (lambda doc: doc.update(ranking=[1, 2]), "ranking[0]: expected an object, got 1"),
    "pruned_a_list": (lambda doc: doc.update(pruned=["x"]), 'pruned: expected an object, got ["x"]'),
    "by_stage_negative": (
        lambda doc: doc["spend"]["by_stage"].update(stage0=-5),
        "spend.by_stage.stage0: expected a number from 0 to 1e+15, got -5",
    ),
}


@pytest.mark.parametrize("how", sorted(TUNE_SPOILS))
def test_a_spoiled_tune_json_is_a_report_section_that_says_so_and_collect_goes_on(tmp_path, capsys, how):
    sweep = write_sweep(tmp_path / "results", "s0", 0, {name: values[0] for name, values in EARLIER.items()})
    document = tune_outcome("ddp-b2-a1-0123456789")
    spoil, problem = TUNE_SPOILS[how]
    spoil(document)
    (sweep / "tune.json").write_text(json.dumps(document))
    assert main(["collect", str(sweep), "--no-plots", "--no-history"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    summary = (sweep / "report" / "summary.md").read_text()
    section = summary[summary.index("## Tune") :].replace("\\[", "[").replace("\\]", "]")  # Markdown's escapes
    assert f"{sweep / 'tune.json'}: unusable tune outcome ({problem}" in section, section[:500]
    assert "1e+308" not in summary.replace("got 1e+308", "") and "inf" not in section.split("\n", 3)[2]


def test_submit_only_best_with_a_best_that_is_no_object_is_one_line(tmp_path, capsys):
    jobs = jobs_yaml(tmp_path)
    sweep_dir = tmp_path / "results" / "tf"
    sweep_dir.mkdir(parents=True)
    document = tune_outcome(load_sweep(jobs).cells[0].id)
    document["best"] = ["not", "an", "object"]
    (sweep_dir / "tune.json").write_text(json.dumps(document))
    argv = ["submit", str(jobs), "--only-best", "--executor", "print", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"error: {sweep_dir / 'tune.json'}: unusable tune outcome (best: expected an object, "
        'got ["not", "an", "object"])'
    )
    # A sound tune.json: the pick, and nothing else, is submitted.
    document["best"] = document["ranking"][0]
    (sweep_dir / "tune.json").write_text(json.dumps(document))
    assert main(argv) == 0
    assert capsys.readouterr().out.count("torch.distributed.run") == 1


@pytest.mark.parametrize(
    "names, problem",
    [
        (["stage0", "final", "repeat"], ""),
        (["stage0", "stage1", "final", "repeat"], ""),
        (["final"], ""),
        (["stage0", "final"], ""),
        (["stage0", "repeat"], 'stages[1].name: expected stage1 or final, got "repeat"'),
        (["stage0", "final", "final"], 'stages[1].name: expected stage1, got "final"'),
        (["stage0", "final", "repeat", "repeat"], 'stages[1].name: expected stage1, got "final"'),
    ],
)
def test_a_state_with_its_stages_in_the_order_tune_begins_them_is_its_own_and_no_other(tmp_path, names, problem):
    """A search that ran its repeat stage wrote [stage0, final, repeat]: the next tune must read it
    (issue 51, item 7: it refused it with "stages[1].name: expected stage1, got final")."""
    from hpcfsdp.tune.state import state_problem

    _, _, state = begun_search(tmp_path)
    grid = state["grid"]
    runs = {name: state["stages"][0]["runs"] if name.startswith("stage") else {grid[0]: grid[0]} for name in names}
    state["stages"] = [{"name": name, "runs": runs[name], "jobs": {}} for name in names]
    assert state_problem(state) == problem
