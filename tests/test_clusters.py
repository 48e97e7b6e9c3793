"""A sweep on a second cluster (`slurm.clusters`, sbatch -M): two local clusters share one
slurmdbd, as -M needs. The sweep runs on the second; `status`, `cancel` and `collect` find its jobs
there through the manifest alone, with an explicit -M in each Slurm command: the first cluster
holds a job of the same id (both clusters count job ids from the same FirstJobId), which a command
that asked the wrong cluster would take for the sweep's."""

from __future__ import annotations

import json
import shutil
import tempfile
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port_block, slurm, start_slurm, stop_slurm
from hpcfsdp.cli import main
from hpcfsdp.sweep.folder.layout import read_manifest

TINY = (
    "model: tiny, device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1, comm_profile_steps: 0, "
    "strategy: ddp, gpus_per_node: 1"
)
FIRST, SECOND = "hpcfsdp-first", "hpcfsdp-second"


@pytest.fixture(scope="module")
def two_clusters() -> Iterator[dict[str, str]]:
    """The first cluster (its own slurmdbd and MariaDB) and a second that keeps its accounting in
    the first one's slurmdbd, one node each, with the same job ids; yields the first's environment
    (the login node's cluster). Both stopped at the end."""
    first_dir = tempfile.mkdtemp(prefix="hpcfsdp-slurm-first-")
    first_job_id = str(1_200_000 + (zlib.crc32(first_dir.encode()) % 11 + 1) * 1_000 + 501)
    first = {
        "HPCFSDP_SLURM_DIR": first_dir,
        "HPCFSDP_SLURM_PORT": str(free_port_block(4)),  # slurmctld, slurmd, slurmdbd, MariaDB
        "HPCFSDP_SLURM_NODES": "1",
        "HPCFSDP_SLURM_CLUSTER_NAME": FIRST,
        "HPCFSDP_SLURM_FIRST_JOB_ID": first_job_id,
    }
    second = {
        "HPCFSDP_SLURM_DIR": tempfile.mkdtemp(prefix="hpcfsdp-slurm-second-"),
        "HPCFSDP_SLURM_PORT": str(free_port_block(2)),
        "HPCFSDP_SLURM_NODES": "1",
        "HPCFSDP_SLURM_CLUSTER_NAME": SECOND,
        "HPCFSDP_SLURM_FIRST_JOB_ID": first_job_id,
    }
    try:
        env, _ = start_slurm(first)
        conf = (Path(first_dir) / "conf" / "slurm.conf").read_text()
        second["HPCFSDP_SLURM_DBD_PORT"] = conf.split("AccountingStoragePort=", 1)[1].split()[0]
        start_slurm(second)
        yield env
    finally:
        for knobs in (second, first):  # the first's slurmdbd last
            stop_slurm(knobs, "--purge")
            shutil.rmtree(knobs["HPCFSDP_SLURM_DIR"], ignore_errors=True)


def write(tmp_path: Path, name: str, slurm_section: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"name: {name}\nbase: {{{TINY}}}\nslurm: {{time_min: 5, {slurm_section}}}\n"))
    return path


def sacct_names(cluster: str, name: str) -> list[str]:
    """The states sacct keeps of jobs called `name` on `cluster`."""
    out = slurm("sacct", f"--clusters={cluster}", "--noheader", "--parsable2", "--allocations",
                "--starttime=now-1hour", f"--name={name}", "--format=State")  # fmt: skip
    return out.split()


def decoy(job_id: str) -> None:
    """Queue jobs on the first cluster until one holds `job_id` (ids count up from the same
    FirstJobId on both): a pending job that a command asking the wrong cluster would find."""
    for _ in range(20):
        out = slurm(
            "sbatch", "--parsable", "--job-name=decoy", "--begin=now+1hour", "--output=/dev/null", "--wrap=true"
        )
        got = out.strip().split(";")[0]
        if int(got) >= int(job_id):
            assert got == job_id, "the first cluster passed the id by"
            return
    raise AssertionError(f"the first cluster never reached job id {job_id}")


@pytest.mark.slurm
def test_a_sweep_on_a_second_cluster_runs_there_and_status_cancel_and_collect_follow_it(
    two_clusters, tmp_path, capsys, monkeypatch
):
    for key, value in two_clusters.items():
        monkeypatch.setenv(key, value)
    results = tmp_path / "results"
    there = write(tmp_path, "there", f"clusters: {SECOND}")

    assert main(["plan", "--sbatch", str(there), "--results-dir", str(results)]) == 0
    assert f"#SBATCH --clusters={SECOND}" in capsys.readouterr().out
    assert main(["plan", str(write(tmp_path, "nowhere", "clusters: nowhere"))]) == 2
    err = capsys.readouterr().err
    assert "nowhere.yaml:3: slurm.clusters: no cluster 'nowhere' answers here" in err
    assert f"(`sacctmgr show clusters` knows {FIRST}, {SECOND})" in err  # asked before -M is ever given

    assert main(["submit", str(there), "--results-dir", str(results), "--wait", "--then-collect"]) == 0
    out = capsys.readouterr().out
    assert f"on cluster {SECOND}" in out, out
    (entry,) = read_manifest(results / "there").values()
    assert entry["cluster"] == SECOND
    assert entry["job_id"].isdigit()  # submitit's job id, without sbatch's "on cluster ..."
    deadline = time.time() + 30  # slurmdbd hears of the end shortly after
    while "COMPLETED" not in sacct_names(SECOND, "hpcfsdp-there") and time.time() < deadline:
        time.sleep(1)
    assert sacct_names(SECOND, "hpcfsdp-there") == ["COMPLETED"]
    assert sacct_names(FIRST, "hpcfsdp-there") == []
    # The --then-collect job went to the same cluster (its dependency names jobs there).
    collect_job = json.loads((results / "there" / "collect_job.json").read_text())
    assert collect_job["cluster"] == SECOND
    assert slurm("squeue", "--noheader", "--name=hpcfsdp-there-collect", "--format=%i") == ""
    assert sacct_names(FIRST, "hpcfsdp-there-collect") == []

    decoy(entry["job_id"])  # the first cluster now holds a pending job of the sweep's job id
    assert main(["status", str(results / "there")]) == 0
    out = capsys.readouterr().out
    assert f"1 cell(s) on cluster {SECOND}: ok 1" in out and "pending" not in out, out
    # collect adds sacct's accounting of the job on the second cluster to its record.
    assert main(["collect", str(results / "there")]) == 0
    record = json.loads(next((results / "there" / "cells").glob("*/result.json")).read_text())
    assert record["slurm"]["cluster_name"] == SECOND
    assert record["slurm_accounting"]["state"] == "COMPLETED"

    # The same folder on another cluster is refused in one line: its jobs are tracked on one.
    assert main(["submit", str(write(tmp_path, "there", "")), "--results-dir", str(results), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"there.yaml: slurm.clusters: {results / 'there'}'s cells were queued on cluster '{SECOND}'" in err, err

    # A job that waits an hour to begin: queued on the second cluster, found and cancelled there.
    later = write(tmp_path, "later", f"clusters: {SECOND}, extra_sbatch: {{begin: now+1hour}}")
    assert main(["submit", str(later), "--results-dir", str(results)]) == 0
    (job,) = (e["job_id"] for e in read_manifest(results / "later").values())
    assert slurm("squeue", f"--clusters={SECOND}", "--noheader", f"--jobs={job}", "--format=%T").split() == ["PENDING"]
    decoy(job)
    capsys.readouterr()
    assert main(["status", str(results / "later")]) == 4  # pending
    assert f"1 cell(s) on cluster {SECOND}: pending 1" in capsys.readouterr().out
    assert main(["cancel", str(results / "later")]) == 0
    assert "1 cell(s) cancelled" in capsys.readouterr().out
    assert slurm("squeue", f"--clusters={SECOND}", "--noheader", "--name=hpcfsdp-later", "--format=%T").strip() in (
        "",
        "CANCELLED",
        "COMPLETING",
    )
    # The decoy of the cancelled job's id on the first cluster was never touched.
    assert slurm("squeue", "--noheader", f"--jobs={job}", "--format=%j %T").split() == ["decoy", "PENDING"]
