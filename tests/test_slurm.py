"""End to end against the real local Slurm cluster (slurm/local/start.sh): arrays, two nodes, sbatch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import duckdb
import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.names import slurm_job_of
from hpcfsdp.sweep.define.matrix import load_sweep

pytestmark = pytest.mark.slurm

SWEEP = """
name: slurm_e2e
base: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, comm_profile_steps: 0,
       gpus_per_node: 2}
slurm: {partition: gpu, time_min: 10, cpus_per_task: 1}
matrix:
  strategy: [ddp, fsdp2_zero2, fsdp2_zero3]
include:
  - {strategy: fsdp2_zero3, grad_accum: 2}
  - {strategy: fsdp2_zero3, activation_checkpointing: full}
  - {strategy: ddp, gpus_per_node: 1}
  - {strategy: fsdp2_hsdp, nodes: 2, gpus_per_node: 2}
  - {strategy: fsdp2_zero3, nodes: 2, gpus_per_node: 1}
  - {strategy: ddp, lr: 1.0e+12, steps: 4}
"""


def wait_for_ended(job_ids, timeout_s: float = 60) -> dict[str, list[str]]:
    """job id -> ElapsedRaw, Submit, Start, ConsumedEnergyRaw, as `sacct` prints them, once sacct
    gives every one of the jobs an end."""
    job_ids = sorted(set(job_ids))
    command = [
        "sacct",
        "-nPX",
        "--format=JobID,End,ElapsedRaw,Submit,Start,ConsumedEnergyRaw",
        f"--jobs={','.join(job_ids)}",
    ]
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
        rows = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines()}
        if all(rows.get(job, ["Unknown"])[0] != "Unknown" for job in job_ids) or time.monotonic() > deadline:
            return {job: row[1:] for job, row in rows.items()}
        time.sleep(0.5)


def records(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("cells/*/result.json")}


def test_sweep_runs_as_arrays_including_two_node_cells(slurm_cluster, tmp_path, capsys):
    jobs = tmp_path / "e2e.yaml"
    jobs.write_text(SWEEP)
    # Exit status 3: one cell (lr 1e12) diverges, and --wait says so when a cell did not finish ok.
    assert main(["submit", str(jobs), "--executor", "slurm", "--wait", "--results-dir", str(tmp_path / "results")]) == 3
    out, err = capsys.readouterr()
    for shape in (
        "6 cell(s) on 1 node(s) x 2 process(es)",
        "1 cell(s) on 1 node(s) x 1 process(es)",
        "1 cell(s) on 2 node(s) x 2 process(es)",
        "1 cell(s) on 2 node(s) x 1 process(es)",
    ):
        assert re.search(rf"submitted array \d+: {re.escape(shape)}", out), out

    sweep_dir = tmp_path / "results" / "slurm_e2e"
    sweep = load_sweep(jobs)
    got = records(sweep_dir)
    assert set(got) == {cell.id for cell in sweep.cells}
    (diverged,) = [r for r in got.values() if r["spec"]["lr"] > 1]
    assert diverged["status"] == "diverged" and len(diverged["losses"]) == diverged["diverged_step"] >= 2
    failed = {k: (r.get("error"), r.get("traceback", "")[-1500:]) for k, r in got.items() if r["status"] != "ok"}
    assert list(failed) == [diverged["cell_id"]], failed
    # Rank 0 of every cell ends its log with the summary line.
    logs = {p.read_text() for p in sweep_dir.glob("slurm/*/*_0_log.out")}
    for record in got.values():
        path = sweep_dir / "cells" / record["cell_id"] / "result.json"
        assert any(
            re.search(
                rf"\[hpcfsdp\] {record['cell_id']}: {record['status']}.* \| record \S*{re.escape(str(path))}\n", log
            )
            for log in logs
        ), record["cell_id"]
    # Each task's span counts from the job script's line before srun (HPCFSDP_LAUNCH_STARTED).
    for record in got.values():
        phases = record["phases"]
        assert phases["launcher_start"] >= 0 and record["launch_span_s"] > record["duration_s"] + phases["imports"] / 2
    single = [r for r in got.values() if r["nodes"] == 1 and r["world_size"] == 2]
    assert len({r["slurm"]["array_job_id"] for r in single}) == 1  # one array for the 1-node shape
    assert sorted(int(r["slurm"]["array_task_id"]) for r in single) == [0, 1, 2, 3, 4, 5]
    two_node = sorted((r for r in got.values() if r["nodes"] == 2), key=lambda r: r["world_size"])
    assert [r["world_size"] for r in two_node] == [2, 4]
    assert all(r["hostnames"] == ["hpcfsdp-n1", "hpcfsdp-n2"] for r in two_node)
    # The rendezvous port comes from the job id, below the kernel's ports for outgoing connections.
    for record in two_node:
        port = 20_000 + int(record["slurm"]["job_id"]) % 12_000
        assert any(
            f"training 3 steps on {record['world_size']} x cpu (rendezvous hpcfsdp-n1:{port})" in log for log in logs
        )
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert set(manifest) == set(got) and all(entry["job_id"] for entry in manifest.values())
    # Where it ran, for the history: the cluster's name and partition from the job's environment.
    systems = {(r["slurm"]["cluster_name"], r["slurm"]["job_partition"]) for r in got.values()}
    assert systems == {("hpcfsdp-local", "gpu")}
    with duckdb.connect(str(tmp_path / "results" / "history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT DISTINCT cluster, count(*) OVER () FROM runs").fetchall() == [("hpcfsdp-local", 9)]
    # Slurm accounting (the cluster's slurmdbd): each record, and its row of the history, carries
    # the elapsed time and queue wait that sacct reports for its job; the cluster gathers no
    # energy, so energy is unknown (null), never 0 J.
    assert "no Slurm accounting" not in err, err
    job_of = {cell_id: slurm_job_of(record["slurm"]) for cell_id, record in got.items()}
    # slurmctld hands a job's end to slurmdbd within seconds, so sacct may have been a little behind
    # the collect that ended submit --wait: a record without accounting gets it from the next one.
    reported = wait_for_ended(job_of.values())
    main(["collect", str(sweep_dir), "--no-plots"])
    assert "no Slurm accounting" not in capsys.readouterr().err
    accounted = {cell_id: records(sweep_dir)[cell_id]["slurm_accounting"] for cell_id in got}
    for cell_id, job in job_of.items():
        elapsed, submit, start, energy = reported[job]
        accounting = accounted[cell_id]
        assert accounting["elapsed_s"] == int(elapsed) >= 1, (job, accounting)
        queue_wait = (datetime.fromisoformat(start) - datetime.fromisoformat(submit)).total_seconds()
        assert accounting["queue_wait_s"] == queue_wait >= 0, (job, accounting)
        assert energy in ("", "0") and accounting["consumed_energy_j"] is None, (job, energy)
    with duckdb.connect(str(tmp_path / "results" / "history.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT cell_id, elapsed_s, queue_wait_s, energy_j FROM runs").fetchall()
    assert {row[0]: row[1:] for row in rows} == {
        cell_id: (accounting["elapsed_s"], accounting["queue_wait_s"], None)
        for cell_id, accounting in accounted.items()
    }
    # Resubmitting the same YAML finds every record and queues nothing.
    assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]) == 0
    assert "skipping 9 cell(s)" in capsys.readouterr().out
    # An empty jobs file is refused before anything reaches the cluster.
    empty = tmp_path / "empty.yaml"
    empty.write_text("# name: forgotten\n\n")
    assert main(["submit", str(empty), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]) == 2
    assert capsys.readouterr().err == f"error: {empty}: empty jobs file\n"


def test_plain_sbatch_template_trains_across_two_nodes(slurm_cluster, tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TOTAL_BATCH_SIZE": "4",
        "BATCH_SIZE_PER_DEVICE": "1",
        "HPCFSDP_RESULTS": str(tmp_path / "results"),
        "PYTHONPATH": str(ROOT / "src"),
    }
    cmd = [
        "sbatch",
        "--wait",
        "--nodes=2",
        "--gres=gpu:1",
        "--cpus-per-task=2",
        f"--output={tmp_path}/job.out",
        str(ROOT / "slurm/fsdp_job.sbatch"),
        "strategy=fsdp2_zero3",
        "model=tiny",
        "device=cpu",
        "precision=fp32",
        "seq_len=32",
        "steps=3",
        "warmup_steps=1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, textwrap.shorten(proc.stderr + log[-3000:], 4000)
    assert "grad accum=2" in log
    (record_path,) = (tmp_path / "results" / "sbatch" / "cells").glob("*/result.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok" and record["world_size"] == 2 and record["spec"]["grad_accum"] == 2
    assert record["hostnames"] == ["hpcfsdp-n1", "hpcfsdp-n2"]
