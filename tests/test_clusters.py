"""A sweep on a second cluster (`slurm.clusters`, sbatch -M): two local clusters share one
slurmdbd, as -M needs; the sweep runs on the second, `status` and `cancel` find its jobs there
through the manifest alone, and the first cluster never sees them."""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port_block, slurm, start_slurm, stop_slurm
from hpcfsdp.cli import main
from hpcfsdp.sweep.layout import read_manifest

TINY = (
    "model: tiny, device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1, comm_profile_steps: 0, "
    "strategy: ddp, gpus_per_node: 1"
)
SECOND = "hpcfsdp-second"


@pytest.fixture(scope="module")
def two_clusters() -> Iterator[dict[str, str]]:
    """The first cluster (its own slurmdbd and MariaDB) and a second of one node that keeps its
    accounting in the first one's slurmdbd; yields the first's environment. Both stopped at the end."""
    first_port = free_port_block(5)  # slurmctld, 2 slurmd, slurmdbd, MariaDB
    first = {
        "HPCFSDP_SLURM_DIR": tempfile.mkdtemp(prefix="hpcfsdp-slurm-first-"),
        "HPCFSDP_SLURM_PORT": str(first_port),
        "HPCFSDP_SLURM_CLUSTER_NAME": "hpcfsdp-first",
    }
    second = {
        "HPCFSDP_SLURM_DIR": tempfile.mkdtemp(prefix="hpcfsdp-slurm-second-"),
        "HPCFSDP_SLURM_PORT": str(free_port_block(2)),
        "HPCFSDP_SLURM_NODES": "1",
        "HPCFSDP_SLURM_CLUSTER_NAME": SECOND,
        "HPCFSDP_SLURM_DBD_PORT": str(first_port + 3),
    }
    try:
        env, _ = start_slurm(first)
        start_slurm(second)
        yield env
    finally:
        for knobs in (second, first):  # the first's slurmdbd last
            stop_slurm(knobs, "--purge")
            shutil.rmtree(knobs["HPCFSDP_SLURM_DIR"], ignore_errors=True)


def write(tmp_path: Path, name: str, slurm_section: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    text = f"name: {name}\nbase: {{{TINY}}}\nslurm: {{clusters: {SECOND}, time_min: 5, {slurm_section}}}\n"
    path.write_text(textwrap.dedent(text))
    return path


def sacct_states(cluster: str, name: str) -> list[str]:
    out = slurm("sacct", f"--clusters={cluster}", "--noheader", "--parsable2", "--allocations",
                "--starttime=now-1hour", f"--name={name}", "--format=State")  # fmt: skip
    return out.split()


@pytest.mark.slurm
def test_a_sweep_on_a_second_cluster_runs_there_and_status_and_cancel_follow_it(
    two_clusters, tmp_path, capsys, monkeypatch
):
    for key, value in two_clusters.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_CLUSTERS", raising=False)  # hpcfsdp sets it from the YAML / manifest
    results = tmp_path / "results"

    assert main(["plan", "--sbatch", str(write(tmp_path, "there", "")), "--results-dir", str(results)]) == 0
    assert f"#SBATCH --clusters={SECOND}" in capsys.readouterr().out

    assert (
        main(["submit", str(write(tmp_path, "there", "")), "--results-dir", str(results), "--wait", "--then-collect"])
        == 0
    )
    monkeypatch.delenv("SLURM_CLUSTERS", raising=False)
    entry = next(iter(read_manifest(results / "there").values()))
    assert entry["cluster"] == SECOND
    deadline = time.time() + 30  # slurmdbd hears of the end shortly after
    while "COMPLETED" not in sacct_states(SECOND, "hpcfsdp-there") and time.time() < deadline:
        time.sleep(1)
    assert sacct_states(SECOND, "hpcfsdp-there") == ["COMPLETED"]
    assert sacct_states("hpcfsdp-first", "hpcfsdp-there") == []
    # The --then-collect job went to the same cluster (its dependency names jobs there).
    collect_job = "--name=hpcfsdp-there-collect"
    assert slurm("squeue", f"--clusters={SECOND}", "--noheader", collect_job, "--format=%i") or sacct_states(
        SECOND, "hpcfsdp-there-collect"
    )
    assert slurm("squeue", "--noheader", collect_job, "--format=%i") == ""
    assert sacct_states("hpcfsdp-first", "hpcfsdp-there-collect") == []
    capsys.readouterr()
    assert main(["status", str(results / "there")]) == 0
    assert "ok" in capsys.readouterr().out

    # A job that waits an hour to begin: queued on the second cluster, found and cancelled there.
    later = write(tmp_path, "later", "extra_sbatch: {begin: now+1hour}")
    assert main(["submit", str(later), "--results-dir", str(results)]) == 0
    monkeypatch.delenv("SLURM_CLUSTERS", raising=False)
    job = next(iter(read_manifest(results / "later").values()))["job_id"]
    assert job.split("_")[0].isdigit()  # submitit's job id, without sbatch --parsable's ';cluster'
    assert slurm("squeue", f"--clusters={SECOND}", "--noheader", f"--jobs={job}", "--format=%T").split() == ["PENDING"]
    assert slurm("squeue", "--noheader", "--name=hpcfsdp-later", "--format=%i") == ""  # not on the first
    capsys.readouterr()
    assert main(["status", str(results / "later")]) == 0
    assert "pending" in capsys.readouterr().out
    assert "SLURM_CLUSTERS" in os.environ  # status pointed its commands at the manifest's cluster
    monkeypatch.delenv("SLURM_CLUSTERS", raising=False)
    assert main(["cancel", str(results / "later")]) == 0
    assert "1 cell(s) cancelled" in capsys.readouterr().out
    out = slurm("squeue", f"--clusters={SECOND}", "--noheader", "--name=hpcfsdp-later", "--format=%T")
    assert out.strip() in ("", "CANCELLED", "COMPLETING")
