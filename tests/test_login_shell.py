"""What the login shell's own variables do to a sweep (issue 51, item 5): Slurm's clients read
SLURM_*, SRUN_* and SALLOC_* as options, and sbatch passes a job every SLURM_* of its environment
whatever --export says, so none from the shell reaches a job but SLURM_CONF and those named in
slurm.pass_env; plan says in one line what it drops. The tests' fault hook (HPCFSDP_FAULT) left set
in a shell gets a warning line from plan and submit, but not where a test sets it."""

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

from hpcfsdp.cli import main

CPU_CELL = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 3, "warmup_steps": 1}
FROM_THE_SHELL = {
    "SLURM_TIMELIMIT": "1",
    "SRUN_CPUS_PER_TASK": "7",
    "SALLOC_PARTITION": "i51",
    "SLURM_MEM_PER_CPU": "9",
}


def _jobs(tmp_path: Path, name: str, **slurm: object) -> Path:
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(yaml.safe_dump({"name": name, "base": {**CPU_CELL, "gpus_per_node": 1}, "slurm": slurm}))
    return jobs


def test_plan_names_in_one_line_the_shells_slurm_variables_the_jobs_do_not_get(tmp_path, monkeypatch, capsys):
    for name, value in FROM_THE_SHELL.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_I51_PASSED", "yes")
    assert main(["plan", str(_jobs(tmp_path, "shell", pass_env=["SLURM_I51_PASSED"]))]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "do not reach the jobs" in line]
    assert line.startswith(
        "note: SALLOC_PARTITION, SLURM_MEM_PER_CPU, SLURM_TIMELIMIT, SRUN_CPUS_PER_TASK from your shell"
    )
    assert "SLURM_I51_PASSED" not in line
    assert main(["plan", str(_jobs(tmp_path, "shell", pass_env=["SLURM_I51_PASSED"])), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_to_the_jobs"] == sorted(FROM_THE_SHELL)


def _hpcfsdp(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcfsdp", *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_the_fault_hook_left_in_a_shell_gets_a_warning_from_plan_and_submit_but_not_in_a_test(
    tmp_path, monkeypatch, capsys
):
    jobs = _jobs(tmp_path, "fault")
    results = tmp_path / "results"
    shell = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} | {"HPCFSDP_FAULT": "train:error"}
    warning = "warning: HPCFSDP_FAULT=train:error is set in your shell: it is the tests' fault hook"
    planned = _hpcfsdp(["plan", str(jobs)], shell)
    assert planned.returncode == 0 and warning in planned.stdout, planned.stderr
    submitted = _hpcfsdp(["submit", str(jobs), "--executor", "print", "--results-dir", str(results)], shell)
    assert submitted.returncode == 0 and warning in submitted.stderr, submitted.stderr
    # Where a test sets it (monkeypatch, or a subprocess of the test's environment) it is meant.
    monkeypatch.setenv("HPCFSDP_FAULT", "train:error")
    assert main(["plan", str(jobs)]) == 0
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]) == 0
    assert "HPCFSDP_FAULT" not in "".join(capsys.readouterr())
    assert "HPCFSDP_FAULT" not in _hpcfsdp(["plan", str(jobs)], dict(os.environ)).stdout


@pytest.mark.slurm
def test_a_shells_slurm_timelimit_no_longer_reaches_the_job_and_its_cell_ends_ok(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    name = f"shell{uuid.uuid4().hex[:8]}"
    dump = tmp_path / "job_environment.txt"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": {**CPU_CELL, "strategy": "ddp", "gpus_per_node": 1},
                "slurm": {"time_min": 10, "pass_env": ["SLURM_I51_PASSED"]},
                # what the batch script (and so srun in it) got, seen from inside the job
                "setup": [f"env > {dump}"],
            }
        )
    )
    for variable, value in FROM_THE_SHELL.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("SLURM_I51_PASSED", "yes")
    results = tmp_path / "results"
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        assert "SLURM_TIMELIMIT, SRUN_CPUS_PER_TASK from your shell do not reach the jobs" in capsys.readouterr().out
        assert main(["status", str(results / name), "--watch", "1"]) == 0
    finally:
        subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)
    seen = dict(
        line.split("=", 1) for line in dump.read_text().splitlines() if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", line)
    )
    assert [name for name in FROM_THE_SHELL if name in seen] == []
    assert seen["SLURM_I51_PASSED"] == "yes" and seen["SLURM_JOB_ID"]  # pass_env's, and Slurm's own
    (record_path,) = (results / name).glob("cells/*/result.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok", record.get("error")
