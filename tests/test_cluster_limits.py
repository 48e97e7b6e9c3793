"""The submitter within the cluster's limits, on a local cluster of its own (slurm/local/start.sh
with MaxArraySize=3, a partition MaxTime of 60 min, 2 nodes of 1 CPU and 4 GPUs): arrays split at
MaxArraySize and throttled by slurm.max_jobs_in_queue, the preflight that refuses a cell the
partition can never run, Slurm's pending reason in `status`, and `submit --wait` ending when every
cell left waits on a reason that cannot clear. Plus the readers of what Slurm prints."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port_block, slurm, start_slurm, stop_slurm
from hpcfsdp.cli import main
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.track.cluster import Node, Partition, gpus_in_gres, never_clears, slurm_minutes

TINY = (
    "model: tiny, device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1, comm_profile_steps: 0, "
    "strategy: ddp, gpus_per_node: 1"
)


@pytest.fixture(scope="module")
def small_cluster_env() -> Iterator[dict[str, str]]:
    """A cluster of this module's own, beside any other (its own state folder and ports), stopped
    and removed at the end."""
    knobs = {
        "HPCFSDP_SLURM_DIR": tempfile.mkdtemp(prefix="hpcfsdp-slurm-limits-"),
        "HPCFSDP_SLURM_PORT": str(free_port_block(3)),
        "HPCFSDP_SLURM_CPUS": "1",
        "HPCFSDP_SLURM_MAX_ARRAY_SIZE": "3",
        "HPCFSDP_SLURM_MAX_TIME": "60",
        "HPCFSDP_SLURM_ACCOUNTING": "0",  # as a cluster without slurmdbd; spares a database
    }
    try:
        env, _ = start_slurm(knobs)
        yield env
    finally:
        stop_slurm(knobs, "--purge")
        shutil.rmtree(knobs["HPCFSDP_SLURM_DIR"], ignore_errors=True)


@pytest.fixture
def small_cluster(small_cluster_env, monkeypatch) -> dict[str, str]:
    for key, value in small_cluster_env.items():
        monkeypatch.setenv(key, value)
    return small_cluster_env


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.slurm
def test_a_sweep_beyond_max_array_size_and_the_queue_cap_runs_whole_in_several_arrays(small_cluster, tmp_path, capsys):
    jobs = write(
        tmp_path,
        "split",
        f"""
        name: split
        base: {{{TINY}}}
        slurm: {{time_min: 10, max_jobs_in_queue: 5}}
        matrix:
          batch_size: [1, 2, 3, 4]
          seed: [0, 1]
        """,
    )
    results = tmp_path / "results"
    assert main(["plan", str(jobs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("split: 8 cell(s) in 3 array(s)\n"), out
    assert "(an array holds at most 3 cells: the cluster's MaxArraySize)" in out

    # Without --wait: what fits under slurm.max_jobs_in_queue is queued (3 + 2), the rest is named.
    submit = ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]
    assert main(submit) == 0
    out = capsys.readouterr().out
    assert re.search(r"submitted array \d+: 3 cell\(s\) on 1 node\(s\) x 1 process\(es\)", out), out
    (queued,) = re.findall(r"queued (\d+) of 8 cell\(s\): the queue is full \(slurm.max_jobs_in_queue 5\)", out)
    assert 5 <= int(queued) < 8
    # With --wait: the cells in flight are left alone, the others go out as the queue makes room.
    assert main([*submit, "--wait"]) == 0
    out = capsys.readouterr().out
    assert "waiting for room in the queue (slurm.max_jobs_in_queue 5" in out, out

    sweep_dir = results / "split"
    records = {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("cells/*/result.json")}
    assert set(records) == {cell.id for cell in load_sweep(jobs).cells}
    assert all(r["status"] == "ok" for r in records.values()), {k: r.get("error") for k, r in records.items()}
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    per_array = Counter(entry["job_id"].split("_")[0] for entry in manifest.values())
    assert len(manifest) == 8 and len(per_array) >= 3 and max(per_array.values()) <= 3, per_array
    assert per_array == Counter(r["slurm"]["array_job_id"] or r["slurm"]["job_id"] for r in records.values())


@pytest.mark.slurm
@pytest.mark.parametrize(
    "slurm_section, axis, message",
    [
        (
            "{time_min: 10}",
            "nodes: [1, 4]",
            "{jobs}:6: matrix.nodes: 1 cell(s) on 4 node(s) x 1 process(es) can never run in partition gpu: "
            "it has 2 node(s)",
        ),
        (
            "{time_min: 10}",
            "gpus_per_node: [1, 8]",
            "{jobs}:6: matrix.gpus_per_node: 1 cell(s) on 1 node(s) x 8 process(es) can never run in partition gpu: "
            "its nodes "
            "have at most 4 GPU(s) each (gres)",
        ),
        (
            "{time_min: 90}",
            "batch_size: [1]",
            "{jobs}:4: slurm.time_min: 90 min is above the MaxTime of partition gpu (01:00:00, 60 min): no cell can ever run",
        ),
        (
            "{time_min: 10, cpus_per_task: 2}",
            "batch_size: [1]",
            "{jobs}:4: slurm.cpus_per_task: 1 cell(s) on 1 node(s) x 1 process(es) can never run in partition gpu: "
            "1 task(s) x "
            "2 CPU(s) = 2 CPUs per node, and its nodes have at most 1",
        ),
        (
            "{time_min: 10, mem_gb: 100}",
            "batch_size: [1]",
            "{jobs}:4: slurm.mem_gb: 1 cell(s) on 1 node(s) x 1 process(es) can never run in partition gpu: "
            "mem_gb 100 is above "
            "the 8000 MB its nodes have at most",
        ),
        (
            "{time_min: 40, cells_per_task: 2}",
            "batch_size: [1, 2]",
            "{jobs}:4: slurm.cells_per_task: 2 cells x time_min 40 = 80 min per array task is above the MaxTime "
            "of partition gpu (60 min); set cells_per_task to at most 1",
        ),
        (
            "{time_min: 10, partition: cpu}",
            "batch_size: [1]",
            "{jobs}:4: slurm.partition: no partition 'cpu' on this cluster (partitions: gpu)",
        ),
    ],
)
def test_a_cell_the_partition_can_never_run_is_one_line_and_nothing_is_queued(
    small_cluster, tmp_path, capsys, slurm_section, axis, message
):
    jobs = write(
        tmp_path,
        "never",
        f"""
        name: never
        base: {{{TINY}}}
        slurm: {slurm_section}
        matrix:
          {axis}
        """,
    )
    expected = f"error: {message.format(jobs=jobs)}"
    assert main(["plan", str(jobs)]) == 2
    assert capsys.readouterr().err.splitlines() == [expected]
    assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [expected] and captured.out == ""
    sweep_dir = tmp_path / "results" / "never"  # holds at most submit's lock file: no cell, no manifest
    assert not (sweep_dir / "cells").exists() and not (sweep_dir / "manifest.json").exists()


def wait_for_reason(job: str, reason: str, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while slurm("squeue", "--noheader", "--format=%r", f"--jobs={job}").strip() != reason:
        assert time.time() < deadline, slurm("squeue", f"--jobs={job}")
        time.sleep(0.5)


@pytest.mark.slurm
def test_status_shows_the_pending_reason_and_wait_ends_on_one_that_cannot_clear(small_cluster, tmp_path, capsys):
    """A 2-node cell waits for its begin time; then the partition is cut to 1 node per job, so
    Slurm holds it with PartitionNodeLimit for as long as the partition stays so."""
    jobs = write(
        tmp_path,
        "held",
        f"""
        name: held
        base: {{{TINY}, nodes: 2}}
        slurm: {{time_min: 10, extra_sbatch: {{begin: now+600}}}}
        """,
    )
    results = tmp_path / "results"
    sweep_dir = results / "held"
    (cell,) = load_sweep(jobs).cells
    submit = ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]
    assert main(submit) == 0
    (job,) = re.findall(r"submitted array (\d+): 1 cell\(s\) on 2 node\(s\)", capsys.readouterr().out)
    try:
        wait_for_reason(job, "BeginTime")  # squeue says None until the scheduler has looked at the job
        assert main(["status", str(sweep_dir)]) == 4  # pending
        captured = capsys.readouterr()
        row = rf"^{cell.id} +ddp +pending +{job} +PENDING"
        assert re.search(rf"{row} \(BeginTime\)$", captured.out, flags=re.M), captured
        assert captured.err == ""  # a begin time clears by itself

        slurm("scontrol", "update", "PartitionName=gpu", "MaxNodes=1")
        slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
        wait_for_reason(job, "PartitionNodeLimit")
        assert main(["status", str(sweep_dir)]) == 4  # pending
        captured = capsys.readouterr()
        assert re.search(rf"{row} \(PartitionNodeLimit\)$", captured.out, flags=re.M), captured
        blocked = (
            f"1 cell(s) can never start as the cluster stands; Slurm holds them pending (PartitionNodeLimit: "
            f"{cell.id}); their jobs stay queued: `scancel {job}` removes them"
        )
        assert captured.err == f"warning: {blocked}\n"

        # --wait on the same sweep: nothing new to queue, and the one cell in flight can never start.
        started = time.monotonic()
        assert main([*submit, "--wait"]) == 1
        captured = capsys.readouterr()
        assert f"skipping 1 cell(s) still queued or running:\n    {cell.id} (job {job})" in captured.out
        assert captured.err.splitlines()[-1] == f"error: {blocked}"
        assert time.monotonic() - started < 60
        assert slurm("squeue", "--noheader", "--format=%T", f"--jobs={job}").strip() == "PENDING"  # left queued
    finally:
        slurm("scontrol", "update", "PartitionName=gpu", "MaxNodes=UNLIMITED")
        slurm("scancel", job)


def test_gres_and_time_limits_read_as_slurm_prints_them():
    assert [
        gpus_in_gres(g)
        for g in (
            "gpu:4",
            "gpu:a100:4(S:0-1)",
            "gpu:a100:2,gpu:v100:2(S:0)",
            "gpu:1g.5gb:7",
            "mps:100,gpu:2",
            "(null)",
            "",
        )
    ] == [4, 4, 4, 7, 2, 0, 0]
    assert [slurm_minutes(t) for t in ("01:00:00", "1-00:00:00", "00:10:30", "UNLIMITED", "INFINITE")] == [
        60,
        1440,
        11,
        None,
        None,
    ]


def test_which_pending_reasons_never_clear():
    nodes = (Node("n1", 4, 8000, 4, "down*"), Node("n2", 4, 8000, 4, "idle"), Node("n3", 4, 8000, 4, "drain"))
    partition = Partition("gpu", True, nodes, None, 0, None, "UNLIMITED", None, None)
    for reason in (
        "PartitionConfig",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "BadConstraints",
        "InvalidAccount",
        "QOSMaxWallDurationPerJobLimit",
        "AssocMaxNodesPerJobLimit",
    ):
        assert never_clears(reason, 1, partition), reason
    for reason in (
        "Priority",
        "Resources",
        "BeginTime",
        "JobHeldUser",
        "Dependency",
        "QOSMaxJobsPerUserLimit",
        "AssocGrpCpuLimit",
        "JobArrayTaskLimit",
    ):
        assert not never_clears(reason, 1, partition), reason
    # Node reasons: never, while fewer of the partition's nodes are up than the job needs.
    down = "ReqNodeNotAvail, UnavailableNodes:n[1,3]"
    assert never_clears(down, 2, partition) and not never_clears(down, 1, partition)
    assert not never_clears(down, 2, None)  # the nodes' state unknown: it may clear
    assert never_clears(
        "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions", 2, partition
    )
