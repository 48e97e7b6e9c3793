"""slurm.container: the command lines of each runtime as `plan --sbatch` shows them, and cells run
inside a podman container on the local Slurm cluster (podman from Debian's packages, an image made
from this machine's files: tests/container_image.py): the smoke matrix, a time limit and scancel."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, slurm
from container_image import build_image, install_podman, podman_config
from hpcfsdp.cli import main

IMAGE = "localhost/hpcfsdp-test:latest"
CPU_CELL = {
    "model": "tiny",
    "device": "cpu",
    "precision": "fp32",
    "seq_len": 32,
    "steps": 3,
    "warmup_steps": 1,
    "comm_profile_steps": 0,
    "gpus_per_node": 1,
}


def srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


def plan_sbatch(tmp_path: Path, capsys, container: str) -> tuple[str, Path]:
    """The one array's sbatch script of a one-cell sweep with this `container:` mapping (flow YAML)."""
    jobs = tmp_path / "c.yaml"
    jobs.write_text(
        textwrap.dedent(
            f"""
            name: c
            base: {json.dumps(CPU_CELL)}
            slurm:
              cache_dir: /shared/hf-cache
              container: {container}
            """
        )
    )
    assert main(["plan", str(jobs), "--sbatch", "--results-dir", str(tmp_path / "results")]) == 0
    return capsys.readouterr().out, (tmp_path / "results" / "c").absolute()


SRUN = (
    "srun --unbuffered --output {sweep}/slurm/%j/%j_%t_log.out --error {sweep}/slurm/%j/%j_%t_log.err "
    "--kill-on-bad-exit=1"
)
SUBMIT = "-u -m submitit.core._submit {sweep}/slurm/%j"


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_plan_sbatch_shows_apptainer_exec_with_nv_binds_and_env_around_the_python_of_each_task(
    runtime, tmp_path, capsys
):
    script, sweep = plan_sbatch(
        tmp_path,
        capsys,
        f"{{runtime: {runtime}, image: /images/pytorch-24.05.sif, mounts: ['/scratch/data:/data:ro'], "
        "env: {NCCL_DEBUG: INFO}, python: /opt/venv/bin/python, options: [--writable-tmpfs]}",
    )
    assert srun_line(script) == " ".join(
        [
            SRUN.format(sweep=sweep),
            f"{runtime} exec --bind={sweep} --bind=/shared/hf-cache --bind=/scratch/data:/data:ro",
            "--env=NCCL_DEBUG=INFO --nv --writable-tmpfs /images/pytorch-24.05.sif /opt/venv/bin/python",
            SUBMIT.format(sweep=sweep),
        ]
    )


def test_plan_sbatch_shows_podman_run_with_the_hosts_network_ipc_pids_and_environment(tmp_path, capsys):
    script, sweep = plan_sbatch(
        tmp_path, capsys, "{runtime: podman, image: 'localhost/train:1', mounts: [/scratch], gpus: true}"
    )
    assert srun_line(script) == " ".join(
        [
            SRUN.format(sweep=sweep),
            "podman run --rm --network=host --ipc=host --pid=host --uts=host --env-host",
            f"--workdir={os.getcwd()} --volume={sweep}:{sweep} --volume=/shared/hf-cache:/shared/hf-cache",
            "--volume=/scratch:/scratch",
            f"--device=nvidia.com/gpu=all localhost/train:1 {shlex.quote(sys.executable)}",
            SUBMIT.format(sweep=sweep),
        ]
    )


def test_plan_sbatch_shows_pyxis_as_srun_flags_and_exports_its_variables(tmp_path, capsys):
    script, sweep = plan_sbatch(
        tmp_path,
        capsys,
        "{runtime: pyxis, image: 'nvcr.io#nvidia/pytorch:24.05-py3', mounts: ['/scratch:/scratch:ro'], "
        "env: {NCCL_DEBUG: INFO, OMP_NUM_THREADS: 4}, python: python3}",
    )
    assert srun_line(script) == " ".join(
        [
            SRUN.format(sweep=sweep),
            "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3'",
            f"--container-mounts={sweep}:{sweep},/shared/hf-cache:/shared/hf-cache,/scratch:/scratch:ro",
            f"--container-workdir={os.getcwd()} --container-env=NCCL_DEBUG,OMP_NUM_THREADS python3",
            SUBMIT.format(sweep=sweep),
        ]
    )
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup[-2:] == ["export NCCL_DEBUG=INFO", "export OMP_NUM_THREADS=4"]


def test_a_cells_local_data_folder_is_bound_into_the_container(tmp_path, capsys, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text " * 100)
    monkeypatch.chdir(tmp_path)
    script, sweep = plan_sbatch(tmp_path, capsys, "{runtime: apptainer, image: x.sif, gpus: false}")
    assert f"--bind={tmp_path / 'corpus'} " not in srun_line(script)  # synthetic data: no bind
    jobs = tmp_path / "c.yaml"
    jobs.write_text(
        jobs.read_text().replace(
            '"model": "tiny"', '"model": "tiny", "data": "./corpus", "tokenizer": "openai-community/gpt2"'
        )
    )
    assert main(["plan", str(jobs), "--sbatch", "--results-dir", str(tmp_path / "results")]) == 0
    assert f"--bind={sweep} --bind=/shared/hf-cache --bind={tmp_path / 'corpus'} x.sif" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("container", "message"),
    [
        ("[podman]", "slurm.container: expected a mapping (runtime, image, mounts, ...), got ['podman']"),
        (
            "{image: x, runtime: docker}",
            "slurm.container.runtime: expected one of apptainer, singularity, podman, pyxis",
        ),
        ("{runtime: podman}", "slurm.container.image: expected the image to run the cells in (podman)"),
        ("{image: x, mounts: /data}", "slurm.container.mounts: expected a list of strings, got '/data'"),
        (
            "{image: x, mounts: ['/a,/b']}",
            "slurm.container.mounts: expected SRC, SRC:DST or SRC:DST:OPTIONS without ','",
        ),
        (
            "{image: x, mounts: ['/a:/b:r o']}",
            "slurm.container.mounts: expected options such as ro or rw, got '/a:/b:r o'",
        ),
        ("{image: x, env: {1X: a}}", "slurm.container.env: expected variable names (A-Z, 0-9, _), got '1X'"),
        ("{image: x, env: {A: [1]}}", "slurm.container.env.A: expected a string or a number, got [1]"),
        ("{image: x, gpu: true}", "slurm.container.gpu: unknown key; did you mean 'gpus'?"),
        ('{image: "x\\ny"}', "slurm.container.image: expected no control characters"),
    ],
)
def test_a_bad_container_section_is_one_line_naming_its_key(container, message, tmp_path, capsys):
    jobs = tmp_path / "c.yaml"
    jobs.write_text(f"name: c\nslurm:\n  container: {container}\n")
    assert main(["plan", str(jobs)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {jobs}:3: {message}") and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# podman on the local cluster


@pytest.fixture(scope="session")
def podman_image(tmp_path_factory) -> Iterator[dict[str, str]]:
    """podman installed and configured for this machine, and the image built once per session:
    the environment that points podman (here and in the jobs) at its configuration."""
    install_podman()
    env = podman_config(tmp_path_factory.mktemp("podman"))
    build_image(IMAGE, Path(sys.prefix), env)
    yield env
    subprocess.run(
        ["podman", "system", "reset", "--force"], env={**os.environ, **env}, capture_output=True, timeout=300
    )


@pytest.fixture
def podman(podman_image, monkeypatch) -> dict[str, str]:
    for key, value in podman_image.items():
        monkeypatch.setenv(key, value)
    return podman_image


def podman_out(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True, timeout=60).stdout


def in_podman(**container) -> dict:
    """slurm.container for the test image: the checkout and its virtualenv bound read-only, as a
    site binds shared software; no GPUs here."""
    mounts = [f"{ROOT}:{ROOT}:ro"] + (
        [] if Path(sys.prefix).is_relative_to(ROOT) else [f"{sys.prefix}:{sys.prefix}:ro"]
    )
    return {"runtime": "podman", "image": IMAGE, "mounts": mounts, "gpus": False, **container}


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def records(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("cells/*/result.json")}


def started_containers(since: float) -> list[str]:
    """The image of every container podman started since then (its events log)."""
    out = podman_out("events", "--stream=false", f"--since={since:.0f}", "--filter=event=start", "--format={{.Image}}")
    return out.split()


@pytest.mark.slurm
def test_the_smoke_matrix_runs_in_podman_containers_and_writes_its_records_on_the_host(
    slurm_cluster, podman, tmp_path, capsys
):
    raw = yaml.safe_load((ROOT / "jobs" / "smoke.yaml").read_text())
    raw["name"] = unique("csmoke")
    raw["slurm"]["container"] = in_podman(env={"NCCL_DEBUG": "INFO"})
    jobs = tmp_path / "smoke.yaml"
    jobs.write_text(yaml.safe_dump(raw))
    since = time.time() - 1
    assert main(["submit", str(jobs), "--executor", "slurm", "--wait", "--results-dir", str(tmp_path / "results")]) == 0
    got = records(tmp_path / "results" / raw["name"])
    assert len(got) == 8 and {r["status"] for r in got.values()} == {"ok"}, capsys.readouterr()
    # Each rank (2 per cell) ran in a container of the image, with the variables of container.env.
    assert started_containers(since).count(IMAGE) == 16
    assert all(r["environment"].get("NCCL_DEBUG") == "INFO" for r in got.values())
    assert podman_out("ps", "--all", "--quiet") == ""  # each removed when its task ended


@pytest.mark.slurm
def test_a_cell_in_a_container_records_timeout_at_its_time_limit_and_cancelled_when_scancelled(
    slurm_cluster, podman, tmp_path, capsys
):
    """time_min 2 with the signal 60 s before: Slurm sends SIGUSR2 60-90 s into the run (it checks
    time limits every 30 s), once the cell trains, and it reaches the cell through podman run's
    signal proxy; scancel's SIGTERM the same way, well before the time limit."""
    results = tmp_path / "results"
    names = {"timeout": unique("ctime"), "cancelled": unique("ccancel")}
    arrays = {}
    for status, name in names.items():
        jobs = tmp_path / f"{status}.yaml"
        limits = {"time_min": 2, "signal_delay_s": 60} if status == "timeout" else {"time_min": 10}
        raw = {"name": name, "base": {**CPU_CELL, "steps": 100_000_000}, "slurm": {**limits, "container": in_podman()}}
        jobs.write_text(yaml.safe_dump(raw))
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (arrays[status],) = re.findall(r"submitted array (\d+)", capsys.readouterr().out)
    try:
        job = arrays["cancelled"]
        log = results / names["cancelled"] / "slurm" / job / f"{job}_0_log.out"
        deadline = time.monotonic() + 240
        while not (log.exists() and "training" in log.read_text()):
            assert time.monotonic() < deadline, "the cell to cancel never trained"
            time.sleep(1)
        slurm("scancel", job)
        deadline = time.monotonic() + 240
        while slurm("squeue", "--noheader", "--format=%i", f"--jobs={','.join(arrays.values())}").strip():
            assert time.monotonic() < deadline, slurm("squeue")
            time.sleep(2)
    finally:
        for name in names.values():
            subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)
    for status, name in names.items():
        (record,) = records(results / name).values()  # written in the bound sweep folder
        assert record["status"] == status and record["stage"] == "train", record.get("error")
    timed_out, cancelled = (next(iter(records(results / names[s]).values())) for s in ("timeout", "cancelled"))
    assert "SIGUSR2 (time limit)" in timed_out["error"]
    assert "received SIGTERM" in cancelled["error"] and "before the time limit" in cancelled["error"]
    deadline = time.monotonic() + 60
    while podman_out("ps", "--all", "--quiet"):
        assert time.monotonic() < deadline, podman_out("ps", "--all")
        time.sleep(1)
