"""The submitting shell and the sweep folder against the real local Slurm cluster (issue 44, items 6
and 8): SBATCH_* variables of the shell never change a job in silence, and a sweep folder moved
while its jobs wait keeps them: status finds them, cancel reaches them, submit does not queue them
again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, slurm
from hpcfsdp.cli import main

pytestmark = pytest.mark.slurm

CPU_CELL = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 3}
SUBMIT_LIMIT_S = 120  # sbatch returns at once; with SBATCH_WAIT it waited for a held job for ever


def jobs_file(tmp_path: Path, name: str, **fields) -> Path:
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {"name": name, "base": CPU_CELL, "slurm": {"time_min": 5, "extra_sbatch": {"hold": True}}, **fields}
        )
    )
    return jobs


def hpcfsdp(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`hpcfsdp ARGV` in a process of its own, with these variables added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "hpcfsdp", *argv],
        capture_output=True,
        text=True,
        timeout=SUBMIT_LIMIT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
    )


def queued(name: str) -> dict[str, str]:
    """job id -> `scontrol show job` of the queued jobs called hpcfsdp-<name>."""
    ids = slurm("squeue", "--noheader", "--array", f"--name=hpcfsdp-{name}", "--format=%i").split()
    return {job: slurm("scontrol", "show", "job", "--oneliner", job) for job in ids}


def cancel_all(name: str) -> None:
    subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)


def test_the_shells_sbatch_variables_never_change_the_jobs_and_plan_says_which_reach_sbatch(slurm_cluster, tmp_path):
    name = f"shell{uuid.uuid4().hex[:8]}"
    jobs = jobs_file(tmp_path, name, matrix={"gpus_per_node": [2]})
    shell = {"SBATCH_GRES": "gpu:1", "SBATCH_PARTITION": "elsewhere", "SBATCH_EXCLUSIVE": "", "SBATCH_WAIT": "1"}
    try:
        plan = hpcfsdp("plan", str(jobs), env=shell)
        assert plan.returncode == 0, plan.stderr
        assert (
            "note: SBATCH_EXCLUSIVE, SBATCH_GRES, SBATCH_PARTITION, SBATCH_WAIT from your shell do not "
            "(the YAML sets the jobs' options)" in plan.stdout
        )
        done = hpcfsdp(
            "submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results"), env=shell
        )
        assert done.returncode == 0, done.stderr
        (job,) = queued(name).values()
        assert re.search(r"\bTresPerNode=gres[:/]gpu:2\b", job), job  # not the shell's gpu:1
        assert " Partition=gpu " in job  # not the shell's partition, which does not exist
        # The shell's defaults for what the YAML leaves unset reach sbatch, and a refusal they cause says so.
        cancel_all(name)
        reservation = {"SBATCH_RESERVATION": "nosuchreservation"}
        plan = hpcfsdp("plan", str(jobs), env=reservation)
        assert "note: SBATCH_RESERVATION=nosuchreservation from your shell reach sbatch" in plan.stdout
        assert plan.returncode == 2 and "(from your shell: SBATCH_RESERVATION=nosuchreservation)" in plan.stderr
        done = hpcfsdp(
            "submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "again"), env=reservation
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "(from your shell: SBATCH_RESERVATION=nosuchreservation)" in done.stderr
    finally:
        cancel_all(name)


def test_a_sweep_folder_moved_while_its_jobs_wait_still_follows_cancels_and_never_queues_them_again(
    slurm_cluster, tmp_path, capsys
):
    name = f"moved{uuid.uuid4().hex[:8]}"
    jobs = jobs_file(tmp_path, name, matrix={"batch_size": [1, 2]})
    original, moved = tmp_path / "results" / name, tmp_path / "elsewhere" / name
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(original.parent)]) == 0
        capsys.readouterr()
        ids = set(queued(name))
        assert len(ids) == 2
        moved.parent.mkdir()
        original.rename(moved)

        assert main(["status", str(moved)]) == 4  # in flight, not missing
        out, err = capsys.readouterr()
        assert "pending 2" in out and "missing" not in out
        assert f"warning: this folder was moved from {original.resolve()} while jobs it queued there" in err
        assert main(["status", str(moved), "--json"]) == 4
        document = json.loads(capsys.readouterr().out)
        assert {cell["job_id"] for cell in document["cells"]} == ids

        # A second submit from the moved folder queues nothing beside them.
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(moved.parent)]) == 0
        assert "skipping 2 cell(s) still queued or running" in capsys.readouterr().out
        assert set(queued(name)) == ids

        assert main(["cancel", str(moved)]) == 0
        assert "2 cell(s) cancelled" in capsys.readouterr().out
        assert queued(name) == {}
    finally:
        cancel_all(name)
