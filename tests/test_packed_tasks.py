"""Several one-node cells in one array task (`slurm.cells_per_task`, issue 52): each cell keeps its
own record, attempts and manifest entry; a failed cell does not stop the task's later cells; a cell
the running task has not reached reads as pending; cancel takes a task's cells along, and logs says
which cells share a task's log; a requeued run skips what an earlier run of the job recorded.

Real runs on the local Slurm cluster, the tiny model on CPU (gloo); the failing cell diverges for
real (lr 1e12)."""

from __future__ import annotations

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

from conftest import ROOT, slurm
from hpcfsdp.cell.supervise.entry import supervise_here
from hpcfsdp.cell.supervise.supervisor import FORWARDED
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.track.status import sweep_status
from test_collect import CPU_BASE, failed_record, ok_record, spec_of

PACKED = """
name: packed
base: {{model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, comm_profile_steps: 0,
       strategy: ddp, gpus_per_node: 1}}
slurm: {{time_min: 5, cells_per_task: 2, extra_sbatch: {{hold: true}}}}
matrix:
  lr: [{lrs}]
"""


def held_sweep(tmp_path: Path, lrs: str) -> tuple[list[str], list[str]]:
    """The 3-cell sweep, held when submitted, 2 cells per task: submit's argv and its cell ids in
    task order."""
    jobs = tmp_path / "packed.yaml"
    jobs.write_text(textwrap.dedent(PACKED.format(lrs=lrs)))
    submit = ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]
    return submit, [cell.id for cell in load_sweep(jobs).cells]


def manifest(sweep_dir: Path) -> dict[str, dict]:
    return json.loads((sweep_dir / "manifest.json").read_text())


def record(sweep_dir: Path, cell_id: str, name: str = "result.json") -> dict:
    return json.loads((sweep_dir / "cells" / cell_id / name).read_text())


@pytest.mark.slurm
def test_three_cells_two_per_task_run_as_two_tasks_each_cell_with_its_own_record_and_a_failure_stops_none(
    slurm_cluster, tmp_path, capsys
):
    submit, cells = held_sweep(tmp_path, "1.0e12, 1.0e-3, 2.0e-3")
    sweep_dir = tmp_path / "results" / "packed"
    assert main(submit) == 0
    (array,) = re.findall(
        r"submitted array (\d+): 3 cell\(s\) on 1 node\(s\) x 1 process\(es\), 2 per task: 2 task\(s\)",
        capsys.readouterr().out,
    )
    entries = manifest(sweep_dir)
    assert [entries[c]["job_id"] for c in cells] == [f"{array}_0", f"{array}_0", f"{array}_1"]
    assert [entries[c].get("task_cells") for c in cells] == [cells[:2], cells[:2], None]
    script = (sweep_dir / "slurm" / array / f"{array}_submission.sh").read_text()
    assert "#SBATCH --time=10\n" in script and "#SBATCH --array=0-1%2\n" in script  # 2 x time_min, 2 tasks

    slurm("scontrol", "release", array)
    deadline = time.monotonic() + 60
    while True:  # the first task running its first cell: its second reads pending, not running
        seen = {c.cell_id: c for c in sweep_status(sweep_dir, cells).cells}
        if seen[cells[0]].state == "running":
            break
        assert time.monotonic() < deadline and seen[cells[0]].state == "pending", seen[cells[0]]
        time.sleep(0.2)
    if seen[cells[1]].state == "pending":  # else the first cell ended between two reads of its record
        assert seen[cells[1]].slurm == "PENDING" and seen[cells[1]].reason == f"after {cells[0]} in its task {array}_0"

    assert main(["status", str(sweep_dir), "--watch", "1"]) == 3  # a diverged cell
    assert f"{sweep_dir}: 3 cell(s): diverged 1, ok 2" in capsys.readouterr().out
    records = [record(sweep_dir, c) for c in cells]
    assert [r["status"] for r in records] == ["diverged", "ok", "ok"]  # the failed first cell stopped nothing
    assert [(r["slurm"]["array_job_id"], r["slurm"]["array_task_id"]) for r in records] == [
        (array, "0"),
        (array, "0"),
        (array, "1"),
    ]
    assert records[0]["launch_id"] == records[1]["launch_id"] and records[0]["cell_id"] != records[1]["cell_id"]

    assert main(["logs", str(sweep_dir), cells[1]]) == 0
    out = capsys.readouterr().out
    assert f"== job {array}_0 runs 2 cells one after another ({cells[0]}, {cells[1]})" in out
    assert f"[hpcfsdp] cell {cells[1]} (2 of 2 in this task)" in out
    assert main(["collect", str(sweep_dir), "--no-plots", "--no-history"]) in (0, 3)
    rows = (sweep_dir / "report" / "results.csv").read_text().splitlines()[1:]
    assert sorted(row.split(",")[0] for row in rows) == sorted(cells)  # one row per cell


@pytest.mark.slurm
def test_cancelling_one_cell_of_a_packed_task_takes_its_task_mates_along_and_each_keeps_its_attempts(
    slurm_cluster, tmp_path, capsys
):
    """All held: nothing trains. A rerun sets each cell's record aside as its own attempt."""
    submit, cells = held_sweep(tmp_path, "1.0e-3, 2.0e-3, 3.0e-3")
    sweep_dir = tmp_path / "results" / "packed"
    assert main(submit) == 0
    capsys.readouterr()
    array = manifest(sweep_dir)[cells[0]]["job_id"].split("_")[0]
    assert main(["cancel", str(sweep_dir), "--cells", cells[1]]) == 0
    out = capsys.readouterr().out
    assert f"cancelled {cells[1]} (job {array}_0, pending)" in out
    assert f"cancelled {cells[0]} (job {array}_0, pending, not named: in the task of a cell named)" in out
    assert "2 cell(s) cancelled" in out
    assert [record(sweep_dir, c)["status"] for c in cells[:2]] == ["cancelled", "cancelled"]
    assert {c.cell_id: c.state for c in sweep_status(sweep_dir, cells).cells}[cells[2]] == "pending"

    assert main([*submit, "--retry-failed"]) == 0
    out = capsys.readouterr().out
    assert "skipping 1 cell(s) still queued or running" in out
    (rerun,) = re.findall(r"submitted array (\d+): 2 cell\(s\) on 1 node\(s\) x 1 process\(es\), 2 per task", out)
    entries = manifest(sweep_dir)
    assert [entries[c]["job_id"] for c in cells[:2]] == [rerun, rerun]  # one task: a plain job
    for cell in cells[:2]:
        assert record(sweep_dir, cell, "attempts/1.json")["status"] == "cancelled"
        assert not (sweep_dir / "cells" / cell / "result.json").exists()
    assert main(["cancel", str(sweep_dir)]) == 0
    assert "3 cell(s) cancelled" in capsys.readouterr().out


@pytest.mark.slurm
def test_a_packed_array_queued_by_a_submit_sigkilled_before_the_manifest_is_tracked_task_by_task(
    slurm_cluster, tmp_path, capsys
):
    """The intent of a killed submit (issue 51, item 8) names the cells per task: the next status
    writes each cell's own task into the manifest, with its task's cells."""
    submit, cells = held_sweep(tmp_path, "1.0e-3, 2.0e-3, 3.0e-3")
    sweep_dir = tmp_path / "results" / "packed"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCFSDP_FAULT": "submit_queued:sigkill"}
    done = subprocess.run([sys.executable, "-m", "hpcfsdp", *submit], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and not (sweep_dir / "manifest.json").exists()
    assert json.loads((sweep_dir / ".submit_intent.json").read_text())["cells_per_task"] == 2
    assert main(["status", str(sweep_dir)]) == 4  # in flight: pending, not missing
    assert f"{sweep_dir}: 3 cell(s): pending 3" in capsys.readouterr().out
    entries = manifest(sweep_dir)
    array = entries[cells[0]]["job_id"].split("_")[0]
    assert [entries[c]["job_id"] for c in cells] == [f"{array}_0", f"{array}_0", f"{array}_1"]
    assert [entries[c].get("task_cells") for c in cells] == [cells[:2], cells[:2], None]
    assert main(["cancel", str(sweep_dir)]) == 0
    assert "3 cell(s) cancelled" in capsys.readouterr().out


def test_a_supervisor_puts_back_the_signal_handlers_it_found_so_the_next_cell_of_its_task_finds_submitits(
    tmp_path, capsys, monkeypatch
):
    """A task of several cells runs a supervisor per cell in one process: each must leave SIGTERM,
    SIGUSR2 and SIGINT as it found them (submitit's), else the next cell's time limit went to the
    first cell's ended supervisor. Its rank is a Python that exits 1 at once (/bin/false)."""
    jobs = tmp_path / "one.yaml"
    jobs.write_text(textwrap.dedent(PACKED.format(lrs="1.0e-3")))
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    capsys.readouterr()
    (cell,) = (tmp_path / "results" / "packed" / "cells").iterdir()
    monkeypatch.setattr(sys, "executable", "/bin/false")

    def found(signum: int, frame: object) -> None:
        raise AssertionError(f"signal {signum} reached the handler found before the supervisor")

    before = {sig: signal.signal(sig, found) for sig in FORWARDED}
    try:
        assert supervise_here(str(cell), 1) == 1
        assert {sig: signal.getsignal(sig) for sig in FORWARDED} == dict.fromkeys(FORWARDED, found)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert "exited with status 1" in record(tmp_path / "results" / "packed", cell.name)["error"]


def test_plan_shows_the_packing_keeps_multi_node_cells_one_per_task_and_refuses_cells_per_task_0(tmp_path, capsys):
    jobs = tmp_path / "mixed.yaml"
    jobs.write_text(textwrap.dedent(PACKED.format(lrs="1.0e-3, 2.0e-3, 3.0e-3")) + "  nodes: [1, 2]\n")
    assert main(["plan", str(jobs)]) == 0
    out = capsys.readouterr().out
    assert "array 0: 3 cell(s) on 1 node(s) x 1 process(es), 2 per task: 2 task(s) of 10 min\n" in out
    assert "array 1: 3 cell(s) on 2 node(s) x 1 process(es)\n" in out  # srun must end a failed cell's every node
    jobs.write_text(textwrap.dedent(PACKED.format(lrs="1.0e-3")).replace("cells_per_task: 2", "cells_per_task: 0"))
    assert main(["plan", str(jobs)]) == 2
    assert capsys.readouterr().err == f"error: {jobs}:5: slurm.cells_per_task: expected a positive integer, got 0\n"


@pytest.mark.parametrize(("earlier", "skipped"), [("ok", True), ("diverged", True), ("cancelled", False)])
def test_a_requeued_task_skips_a_cell_an_earlier_run_of_its_job_recorded_unless_the_job_ended_it(
    tmp_path, monkeypatch, earlier, skipped
):
    from hpcfsdp.cell.stopping.requeue import settled_before

    spec = spec_of(CPU_BASE)
    written = ok_record(spec, 100.0, 1.0) if earlier == "ok" else failed_record(spec, earlier, "train", "it ended")
    cell = tmp_path / "cell"
    write_record(cell / "result.json", {**written, "launch_id": "slurm-77-0"})
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not settled_before(cell)  # this run's own record: no earlier run
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert settled_before(cell) is skipped
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert not settled_before(cell)  # another job's record
