"""`hpcfsdp tune`: the pruning, a probe that stops once stable, the stages with a probe's OOM as a
result, the spend counted per launch, resuming after a kill, and the probe jobs under the real
local Slurm cluster (several probes per allocation)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_torchrun_cell
from hpcfsdp.cli import main
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.track.processes import processes_under
from test_faults import alive

# 20 steps a cell, 7 a first-rung probe: probing 2 cells or more, then running 1 of them, can save.
CPU = "model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 20, warmup_steps: 1, comm_profile_steps: 0"


def write(tmp_path: Path, text: str, name: str = "tt") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def ddp_batch_sweep(tmp_path: Path, name: str, batch_sizes: list[int]) -> Path:
    """The jobs YAML of a CPU sweep `name` of ddp on 2 processes, one cell per batch size."""
    return write(
        tmp_path,
        f"""
        name: {name}
        base: {{{CPU}, gpus_per_node: 2, strategy: ddp}}
        slurm: {{time_min: 5}}
        matrix:
          batch_size: {batch_sizes}
        """,
    )


def launches(sweep_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (sweep_dir / "tune" / "launches").glob("*.json")}


def test_pruning_leaves_out_only_cells_that_do_not_fit_even_at_the_predictions_error(tmp_path):
    from hpcfsdp.contracts.sources import model_source
    from hpcfsdp.sweep.predict.memory import predict, usable_gib
    from hpcfsdp.sweep.predict.modelshape import load_shape
    from hpcfsdp.tune.prune import PREDICTION_ERROR, prune

    jobs = write(
        tmp_path,
        """
        name: pr
        base: {model: qwen2.5-1.5b, device: cuda, seq_len: 4096, gpus_per_node: 2}
        slurm: {gpu_memory_gib: 80}
        matrix:
          strategy: [fsdp2_zero2, fsdp2_zero3]
          batch_size: [1, 8, 32]
          grad_accum: [1, 4]
        """,
    )
    sweep = load_sweep(jobs)
    pruning = prune(sweep)
    shape = load_shape(model_source("qwen2.5-1.5b"))
    for cell in sweep.cells:
        required = predict(cell.spec, shape).required_gib
        left_out = required / (1 + PREDICTION_ERROR) > usable_gib(80)
        assert (cell.id in pruning.pruned) == left_out, (cell.id, required)
    assert pruning.pruned and len(pruning.candidates) + len(pruning.pruned) == len(sweep.cells)
    assert any("3.3%" in note for note in pruning.notes)
    # Accumulation: each setup probed at accum 1, its accum 4 computed from that probe.
    for cell in pruning.candidates:
        if cell.spec.grad_accum == 4:
            source = next(c for c in sweep.cells if c.spec == cell.spec.replace(grad_accum=1))
            assert pruning.computed[cell.id] == source.id
    assert set(pruning.computed) == {c.id for c in pruning.candidates if c.spec.grad_accum == 4}
    assert any(note.startswith(f"grad_accum: {len(pruning.computed)} cell(s) not probed") for note in pruning.notes)
    # A cell predicted just above the usable memory, but within the error, is probed, not left out.
    cell = sweep.cells[0]
    required = predict(cell.spec, shape).required_gib
    capacity = required / (1 + PREDICTION_ERROR / 2) + 2.0  # usable: the prediction less half the error
    tight = dataclasses.replace(
        sweep, cells=(cell,), resources=dataclasses.replace(sweep.resources, gpu_memory_gib=capacity)
    )
    assert required > usable_gib(capacity) and prune(tight).pruned == {}


def test_a_probe_stops_at_its_first_stable_window_or_runs_its_whole_budget(tmp_path):
    from hpcfsdp.cell.train import STABLE_MIN_STEPS, STABLE_SPREAD

    record = run_torchrun_cell(
        tmp_path, 1, strategy="single", seq_len=128, batch_size=4, steps=14, warmup_steps=2, stop_when_stable=True
    )
    assert record["status"] == "ok" and record["spec"]["stop_when_stable"] is True
    times = record["step_times_s"]  # each timed step on its slowest rank: what the loop judged
    window = max(STABLE_MIN_STEPS, (14 - 2) // 2)

    def stable(upto: int) -> bool:
        last = sorted(times[upto - window : upto])
        return (last[-1] - last[0]) / last[len(last) // 2] <= STABLE_SPREAD

    assert not any(stable(n) for n in range(window, len(times)))  # never stable before it stopped
    assert len(times) == 12 or stable(len(times))  # stopped when stable, or at the end of its budget


def test_tune_probes_maps_the_oom_frontier_and_runs_the_winner_as_the_grids_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>2")  # batch 4 runs out of memory
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs = ddp_batch_sweep(tmp_path, "tt", [1, 2, 4])
    argv = ["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[\w+\] stage0: 3 run\(s\)$", out, re.M) and re.search(
        r"^\[\w+\] \[3/3\] stage0 ", out, re.M
    ), out
    sweep_dir = tmp_path / "tt"
    grid = {cell.spec.batch_size: cell.id for cell in load_sweep(jobs).cells}
    found = json.loads((sweep_dir / "tune.json").read_text())
    assert found["best"]["cell_id"] in (grid[1], grid[2])  # the grid's own id for the pick
    assert [row["cell_id"] for row in found["oom_frontier"]] == [grid[4]]
    assert found["oom_frontier"][0]["stage"] == "stage0" and not found["failed"]
    best = json.loads((sweep_dir / "cells" / found["best"]["cell_id"] / "result.json").read_text())
    assert best["status"] == "ok" and best["spec"]["steps"] == 20 and best["spec"]["stop_when_stable"] is False
    state = json.loads((sweep_dir / "tune" / "state.json").read_text())
    assert [len(stage["runs"]) for stage in state["stages"]] == [3, 1]
    # Spend: every launch, from the launcher's start to its end, times its 2 processes.
    seen = launches(sweep_dir)
    assert len(seen) == 4 and all(launch["gpus"] == 2 for launch in seen.values())
    spent = sum((launch["ended"] - launch["started"]) * 2 / 3600 for launch in seen.values())
    assert found["spend"]["tune_gpu_hours"] == pytest.approx(spent)
    final_launch = seen[f"final-{found['best']['cell_id']}"]
    assert final_launch["ended"] - final_launch["started"] > best["duration_s"]  # start-up counted too
    assert "OOM frontier (ran out of memory): " + grid[4] in out and f"chosen: {found['best']['cell_id']}" in out
    assert found["rank"] == "process" and "tokens/s per process" in out and "process-hours in" in out  # a CPU sweep
    assert "## Tune" in (sweep_dir / "report" / "summary.md").read_text()
    # submit --only-best runs the pick, and nothing else (--force: the final stage ran it already).
    submit = ["submit", str(jobs), "--only-best", "--force", "--executor", "print", "--results-dir", str(tmp_path)]
    assert main(submit) == 0
    printed = capsys.readouterr()
    assert printed.out.count("torch.distributed.run") == 1 and found["best"]["cell_id"] in printed.out


def test_other_accumulations_are_computed_from_one_probes_optimizer_share(tmp_path, monkeypatch, capsys):
    from hpcfsdp.tune.accumulation import computed_speed

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs = write(
        tmp_path,
        f"""
        name: ta
        base: {{{CPU}, gpus_per_node: 2, strategy: ddp, batch_size: 2}}
        slurm: {{time_min: 5}}
        matrix:
          grad_accum: [1, 3]
        """,
    )
    assert main(["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "1"]) == 0
    sweep_dir = tmp_path / "ta"
    one, three = (cell.id for cell in load_sweep(jobs).cells)
    state = json.loads((sweep_dir / "tune" / "state.json").read_text())
    assert state["computed"] == {three: one} and list(state["stages"][0]["runs"].values()) == [one]
    probe = json.loads(next((sweep_dir / "tune" / "stage0" / "cells").glob("*/result.json")).read_text())
    # The probe's step is its timed window's mean, the figure its tokens/s is from.
    assert 0 < probe["optimizer_step_s"] < probe["window_step_time_s"]
    micro = (probe["window_step_time_s"] - probe["optimizer_step_s"]) / 1
    expected = 3 * 2 * 32 / (3 * micro + probe["optimizer_step_s"])
    assert computed_speed(probe, 3) == pytest.approx(expected)
    found = json.loads((sweep_dir / "tune.json").read_text())
    rows = {row["cell_id"]: row for row in found["ranking"]}
    if found["best"]["cell_id"] == one:  # the computed setup was not promoted: its row is the computed one
        assert rows[three]["computed_from"] == one and rows[three]["tokens_per_s_per_gpu"] == pytest.approx(expected)
        assert "(computed from " + one in capsys.readouterr().out
    else:  # promoted, it ran as the grid's cell itself, at its own accumulation
        assert rows[three]["stage"] == "final" and "computed_from" not in rows[three]
    assert len(launches(sweep_dir)) == 2  # one probe, one final cell: accum 3 never probed on the first stage
    # What the grid would have spent, estimated from those two launches, against the grid itself
    # (the local executor's manifest times each cell's launch): the same order of GPU-hours. Here a
    # launch is mostly start-up, which moves by half with the machine's load between the two runs;
    # the estimate's accuracy is measured on GPUs (bench/tune_vs_grid_table.py: +3.7% over the whole
    # 64-cell grid on H200s).
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path / "grid")]) == 0
    manifest = json.loads((tmp_path / "grid" / "ta" / "manifest.json").read_text())
    grid_h = sum((entry["ended_at"] - entry["submitted_at"]) * 2 / 3600 for entry in manifest.values())
    estimate = found["spend"]["grid_estimate_gpu_hours"]
    assert len(manifest) == 2 and 0.5 < estimate / grid_h < 2.0, (estimate, grid_h)
    assert "cell by cell" in found["spend"]["grid_estimate_basis"]


def test_tune_runs_the_grids_cells_themselves_where_probing_cannot_save_and_says_so(tmp_path, monkeypatch, capsys):
    """No more cells than the final stage runs, or probes as long as the cells (5 steps a cell, a
    probe's warm-up and budget as many): no probe runs, each grid cell runs once, and tune spends
    what the grid spends."""
    from hpcfsdp.tune.gridcost import probing_cannot_save

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cells = load_sweep(
        write(tmp_path, f"name: g\nbase: {{{CPU}, gpus_per_node: 2}}\nmatrix: {{batch_size: [1, 2, 3]}}\n")
    ).cells
    assert probing_cannot_save(list(cells), list(cells), 1, 3) == ""  # 3 x 7 + 20 steps against 60
    assert "no more than the final stage's 3" in probing_cannot_save(list(cells), list(cells), 3, 3)
    short = [dataclasses.replace(c, spec=c.spec.replace(steps=5)) for c in cells]
    assert probing_cannot_save(short, short, 1, 3).startswith("probes as long as the cells: 20 steps")

    jobs = ddp_batch_sweep(tmp_path, "tg", [1, 2])
    assert main(["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "3"]) == 0
    out = capsys.readouterr()
    assert "running the grid's 2 cell(s) themselves, no probes: 2 cell(s) to run" in out.err + out.out
    sweep_dir = tmp_path / "tg"
    state = json.loads((sweep_dir / "tune" / "state.json").read_text())
    assert [stage["name"] for stage in state["stages"]] == ["final"]
    grid = {cell.id for cell in load_sweep(jobs).cells}
    assert set(launches(sweep_dir)) == {f"final-{cell_id}" for cell_id in grid}
    found = json.loads((sweep_dir / "tune.json").read_text())
    assert found["best"]["cell_id"] in grid and "no probes: the grid's 2 cell(s) ran themselves" in found["notes"][-1]
    assert found["spend"]["fraction_of_grid"] == pytest.approx(1.0)

    # Run again: the search reads the state it wrote (a lone final stage) and launches nothing.
    assert main(["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "3"]) == 0
    again = capsys.readouterr()
    assert "not a state this search wrote" not in again.err and found["best"]["cell_id"] in again.out
    assert set(launches(sweep_dir)) == {f"final-{cell_id}" for cell_id in grid}


def test_tunes_final_stage_measures_the_batch_its_probe_found_without_a_second_search_and_prints_it(
    tmp_path, monkeypatch, capsys
):
    """Two `batch_size: auto` setups (batch 4 out of memory): each probe's search starts at the
    predicted batch 3 and ends at 3; the pick runs at 3 as the probe found it (no search of its
    own), and the chosen line says batch_size=3, not the 1 the matrix starts its search from."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs = write(
        tmp_path,
        f"""
        name: tb
        base: {{{CPU}, gpus_per_node: 2, batch_size: auto, max_batch_size: 8}}
        slurm: {{time_min: 5, gpu_memory_gib: 2.0025}}
        matrix:
          strategy: [ddp, fsdp2_zero3]
        """,
    )
    assert main(["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    sweep_dir = tmp_path / "tb"
    found = json.loads((sweep_dir / "tune.json").read_text())
    best = found["best"]
    probe = json.loads(next((sweep_dir / "tune" / "stage0" / "cells").glob("*/result.json")).read_text())
    assert [p["batch_size"] for p in probe["batch_search"]["probes"]] == [3, 4]
    final = sweep_dir / "cells" / best["cell_id"]
    record = json.loads((final / "result.json").read_text())
    assert record["status"] == "ok" and record["spec"]["batch_size"] == 3 and record["spec"]["auto_batch"]
    assert record["batch_search"]["reused_from"].startswith("stage0/")
    assert record["phases"].get("batch_search", 0.0) < 1.0 and not (final / "batch_search").exists()
    assert best["setup"]["batch_size"] == 3
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert "batch_size=3" in chosen and "batch_size=1" not in chosen


def test_a_killed_tune_resumes_without_repeating_a_finished_probe_nor_starting_one_beside_the_killed_ones(tmp_path):
    jobs = ddp_batch_sweep(tmp_path, "kk", [1, 2, 3])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "hpcfsdp", "tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]
    argv += ["--top", "1"]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sweep_dir = tmp_path / "kk"
    deadline = time.time() + 300
    while not list((sweep_dir / "tune" / "launches").glob("*.json")):
        assert time.time() < deadline and first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.5)
    # Into the second probe: its torchrun and its 2 ranks. They outlive the kill for a while (10+ s
    # on GPUs, where ranks blocked in NCCL act on no SIGTERM); stopped here, they stay until the
    # resumed tune has looked at them.
    while len(left := processes_under(first.pid)) < 3:
        assert time.time() < deadline and first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGSTOP)
    first.send_signal(signal.SIGKILL)  # no handler runs: the probe's torchrun gets the kernel's death signal
    first.wait()
    before = launches(sweep_dir)
    assert len(before) == 1 and left
    env_unbuffered = {**env, "PYTHONUNBUFFERED": "1"}
    second = subprocess.Popen(argv, env=env_unbuffered, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not (seen and ("waiting for" in seen[-1] or seen[-1].lstrip().startswith("[1/"))):
            line = second.stdout.readline()
            assert line, "".join(seen)[-3000:]
            seen.append(line)
        # One line says it waits for them, before any probe of the resumed tune starts.
        assert "process(es) of a launch a killed run left in" in seen[-1], "".join(seen)[-3000:]
    finally:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # they go on: torchrun passes its SIGTERM to the ranks
    left_until = until_ended(left)
    out, err = second.communicate(timeout=600)
    out = "".join(seen) + out
    assert second.returncode == 0, out[-3000:] + err[-3000:]
    assert "resuming the search" in out and "1 done before (not repeated)" in out
    after = launches(sweep_dir)
    name, launch = next(iter(before.items()))
    assert after[name] == launch  # the probe finished before the kill was not launched again
    assert len([n for n in after if n.startswith("stage0-")]) == 3 and len(after) == 4
    resumed = min(entry["started"] for n, entry in after.items() if n not in before)
    assert resumed >= left_until - 0.5, (resumed, left_until)  # no probe beside the killed one's processes


def test_a_tune_killed_just_after_it_begins_each_stage_resumes_there_and_gives_the_same_answer_again(tmp_path):
    """tune SIGKILLed (HPCFSDP_FAULT's crash point) right after it wrote each stage to its state and
    before any run of it started: stage0, final and, where the final stage's two cells are within
    noise of each other (seeds of one setup on a CPU: nearly always), repeat. Each next tune reads
    the state it left (issue 51, item 7: the repeat stage's state was refused), runs nothing twice,
    and a tune after the last gives the same tune.json and launches nothing."""
    jobs = write(
        tmp_path,
        f"""
        name: kr
        base: {{{CPU}, gpus_per_node: 1, strategy: ddp}}
        slurm: {{time_min: 5}}
        matrix:
          seed: [1, 2, 3, 4]
        """,
    )
    sweep_dir = tmp_path / "kr"
    argv = [sys.executable, "-m", "hpcfsdp", "tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]
    argv += ["--top", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("HPCFSDP_FAULT", None)
    env.pop("PYTHONUNBUFFERED", None)  # the killed tune's lines reach the pipe without it (progress.py)

    def tune(fault: str = "") -> subprocess.CompletedProcess:
        faulted = {**env, "HPCFSDP_FAULT": f"tune_begun_{fault}:sigkill"} if fault else env
        return subprocess.run(argv, env=faulted, capture_output=True, text=True, timeout=600)

    seen: dict[str, dict] = {}
    for stage in ("stage0", "final", "repeat"):
        done = tune(stage)
        state = json.loads((sweep_dir / "tune" / "state.json").read_text())
        if stage == "repeat" and done.returncode == 0:  # the final stage's cells were not within noise
            assert [s["name"] for s in state["stages"]] == ["stage0", "final"], done.stdout
            break
        assert done.returncode == -signal.SIGKILL, done.stdout[-2000:] + done.stderr[-2000:]
        assert state["stages"][-1]["name"] == stage and not (sweep_dir / "tune.json").exists()
        assert stage == "stage0" or "resuming the search" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
        now = launches(sweep_dir)
        assert {name: now[name] for name in seen} == seen  # no run launched twice
        assert not [name for name in now if name.startswith(f"{stage}-")]  # killed before its first run
        seen = now
    else:
        last = tune()
        assert last.returncode == 0 and "resuming the search" in last.stdout, last.stdout[-2000:] + last.stderr[-2000:]
    found = json.loads((sweep_dir / "tune.json").read_text())
    ran = launches(sweep_dir)
    assert {name: ran[name] for name in seen} == seen and len([n for n in ran if n.startswith("stage0-")]) == 4
    again = tune()
    assert again.returncode == 0 and "resuming the search" in again.stdout, again.stderr[-2000:]
    assert json.loads((sweep_dir / "tune.json").read_text())["best"] == found["best"] and launches(sweep_dir) == ran


def until_ended(processes: dict[int, str]) -> float:
    """The time the last of the processes ended (a zombie counts as ended), looked at every 0.1 s."""
    deadline = time.time() + 120
    while alive(processes):
        assert time.time() < deadline, "the killed tune's processes outlived 120 s"
        time.sleep(0.1)
    return time.time()


@pytest.mark.slurm
def test_tune_under_slurm_runs_several_probes_per_allocation(slurm_cluster, tmp_path, capsys):
    jobs = write(
        tmp_path,
        f"""
        name: ts
        base: {{{CPU}, gpus_per_node: 2}}
        slurm: {{time_min: 10, cpus_per_task: 1}}
        matrix:
          strategy: [ddp, fsdp2_zero3]
          batch_size: [1, 2]
        exclude:
          - {{strategy: fsdp2_zero3, batch_size: 2}}
        """,
    )
    argv = ["tune", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path), "--top", "1"]
    assert main([*argv, "--probes-per-job", "2"]) == 0
    out = capsys.readouterr().out  # each line says how long tune has run; a wait, how many probes are done
    assert re.search(r"^\[\w+\] stage0: 3 run\(s\)$", out, re.M), out
    assert re.search(r"^\[\w+\] stage0: [0-2] of 3 probe\(s\) done; waiting for [12] job\(s\): ", out, re.M), out
    sweep_dir = tmp_path / "ts"
    state = json.loads((sweep_dir / "tune" / "state.json").read_text())
    probe_jobs = state["stages"][0]["jobs"]
    assert sorted(len(runs) for runs in probe_jobs.values()) == [1, 2]  # 3 probes in 2 allocations
    seen = launches(sweep_dir)
    assert len(seen) == 4 and all(launch["executor"] == "slurm" for launch in seen.values())
    by_job = {}
    for launch in seen.values():
        by_job.setdefault(launch["job_id"], []).append(launch)
    assert sorted(len(v) for v in by_job.values()) == [1, 1, 2]  # one allocation ran two probes, one after another
    two = sorted(next(v for v in by_job.values() if len(v) == 2), key=lambda launch: launch["started"])
    assert two[0]["ended"] <= two[1]["started"]
    found = json.loads((sweep_dir / "tune.json").read_text())
    assert found["best"]["cell_id"] in {cell.id for cell in load_sweep(jobs).cells}
    assert (sweep_dir / "cells" / found["best"]["cell_id"] / "result.json").is_file()
    # Run again: everything is done, nothing is queued.
    capsys.readouterr()
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert "resuming the search" in again and "submitted array" not in again
    assert launches(sweep_dir) == seen


@pytest.mark.slurm
def test_a_killed_tune_under_slurm_waits_for_its_queued_probe_jobs_instead_of_queueing_again(
    slurm_cluster, tmp_path, capsys
):
    jobs = write(
        tmp_path,
        f"""
        name: tk
        base: {{{CPU}, gpus_per_node: 2, strategy: ddp}}
        slurm: {{time_min: 10, cpus_per_task: 1}}
        matrix:
          batch_size: [1, 2]
        """,
    )
    argv = ["tune", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path), "--top", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    first = subprocess.Popen([sys.executable, "-m", "hpcfsdp", *argv], env=env, stdout=subprocess.PIPE, text=True)
    state_file = tmp_path / "tk" / "tune" / "state.json"
    deadline = time.time() + 120

    def first_stage_queued() -> bool:  # the state is written before its first stage is added
        stages = json.loads(state_file.read_text())["stages"] if state_file.is_file() else []
        return bool(stages and stages[0]["jobs"])

    while not first_stage_queued():
        assert time.time() < deadline and first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # while it waits for the probe job: the job runs on
    first.wait()
    queued = json.loads(state_file.read_text())["stages"][0]["jobs"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resuming the search" in out and "stage0: submitted" not in out
    state = json.loads(state_file.read_text())
    assert state["stages"][0]["jobs"] == queued  # the same probe job, not a second one
    assert {
        launch["job_id"] for name, launch in launches(tmp_path / "tk").items() if name.startswith("stage0-")
    } == set(queued)
