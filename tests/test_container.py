"""slurm.container: the command lines of each runtime as `plan --sbatch` shows them, and cells run
inside a podman container on the local Slurm cluster (podman from Debian's packages, an image made
from this machine's files: tests/container_image.py): a smoke cell of each strategy, a time limit
and scancel."""

from __future__ import annotations

import contextlib
import io
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
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, skip_where_root_is_no_mount_point, slurm
from container_image import build_image, install_podman, podman_config
from hpcfsdp.cli import main
from hpcfsdp.sweep.launch.container_command import PODMAN_TASK

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
    """The script's srun line (not the hand-run srun + torchrun plan --sbatch prints after it)."""
    (line,) = [line for line in script.splitlines() if line.startswith("srun ") and "launch.digested" in line]
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
    "--kill-on-bad-exit=1 --cpus-per-task=1"
)
SUBMIT = (
    "-u -m hpcfsdp.sweep.launch.digested {sweep}/slurm/%j"
    ' "${{hpcfsdp_pickle_sha256[${{SLURM_ARRAY_TASK_ID:-0}}]}}" "${{hpcfsdp_pickle_cell[${{SLURM_ARRAY_TASK_ID:-0}}]}}"'
)


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


def test_plan_sbatch_shows_podman_run_in_a_named_shell_with_the_hosts_network_ipc_and_pids(tmp_path, capsys):
    script, sweep = plan_sbatch(
        tmp_path, capsys, "{runtime: podman, image: 'localhost/train:1', mounts: [/scratch], gpus: true}"
    )
    assert srun_line(script) == " ".join(
        [
            SRUN.format(sweep=sweep),
            f"sh -c {shlex.quote(PODMAN_TASK)} hpcfsdp-podman",
            "--rm --network=host --ipc=host --pid=host --uts=host --env-host",
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
    # the YAML's setup lines, then the launch's start (the cell's phases count from it: h45a)
    assert setup[-3:-1] == ["export NCCL_DEBUG=INFO", "export OMP_NUM_THREADS=4"]
    assert setup[-1].startswith("export HPCFSDP_LAUNCH_STARTED=")


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
    the environment that points podman (here and in the jobs) at its configuration. Its storage
    (image, containers) is removed at the end. Skipped where podman cannot run (a chroot)."""
    skip_where_root_is_no_mount_point("podman")
    install_podman()
    env = podman_config(tmp_path_factory.mktemp("podman"))
    build_image(IMAGE, Path(sys.prefix), env)
    yield env
    subprocess.run(
        ["podman", "system", "reset", "--force"], env={**os.environ, **env}, capture_output=True, timeout=300
    )


def podman_out(env: dict[str, str], *args: str) -> str:
    """podman's output, run with the test's configuration (env)."""
    return subprocess.run(
        ["podman", *args], check=True, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    ).stdout


def in_podman(**container) -> dict:
    """slurm.container for the test image: the checkout and its virtualenv bound read-only, as a
    site binds shared software; no GPUs here."""
    mounts = [f"{ROOT}:{ROOT}:ro"] + (
        [] if Path(sys.prefix).is_relative_to(ROOT) else [f"{sys.prefix}:{sys.prefix}:ro"]
    )
    return {"runtime": "podman", "image": IMAGE, "mounts": mounts, "gpus": False, **container}


def records(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("cells/*/result.json")}


def started_containers(env: dict[str, str], since: float) -> list[str]:
    """The image of every container podman started since then (its events log)."""
    out = podman_out(
        env, "events", "--stream=false", f"--since={since:.0f}", "--filter=event=start", "--format={{.Image}}"
    )
    return out.split()


# A cell that reaches its training loop and waits there (cell/stopping/faults.py) for Slurm's signal, set
# through container.env: it holds a CPU of the cluster but burns none while the smoke cells run.
HANGS = {"HPCFSDP_FAULT": "train_step:hang"}


# In the submitting shell: an allowlisted variable, which reaches the containers, and two that
# must not reach the jobs (issue 33: the job's environment is an allowlist).
SHELL = {"NCCL_I33_FROM_SHELL": "yes", "I33_SETTING": "i33secret-plain", "DB_PW": "i33secret-pw"}


@dataclass
class PodmanRuns:
    results: Path
    names: dict[str, str]  # smoke, timeout, cancelled -> sweep name
    containers: list[str]  # the image of each container started meanwhile
    podman: dict[str, str]  # the environment of podman's configuration


@pytest.fixture(scope="module")
def podman_runs(local_slurm, podman_image, tmp_path_factory) -> Iterator[PodmanRuns]:
    """Three sweeps in podman containers on the local cluster: two cells that wait in their
    training loop for Slurm's signal, one with a time limit of 3 min and SIGUSR2 60 s before it
    (Slurm sends it 60-120 s into the run), one scancel'd; once both train (their imports done,
    before the time-limit signal can come), a smoke cell of each strategy (with container.env) runs
    while the time-limited cell waits out its limit. Returns when every job has left the queue."""
    tmp = tmp_path_factory.mktemp("podman-runs")
    results = tmp / "results"
    tag = uuid.uuid4().hex[:8]
    names = {status: f"c{status}{tag}" for status in ("timeout", "cancelled", "smoke")}
    smoke = yaml.safe_load((ROOT / "jobs" / "smoke.yaml").read_text())
    # One cell per strategy: what a container changes is the same for every cell, and the whole
    # smoke matrix (8 cells) took three waves of the local cluster's slots, 3 of this fixture's 4.5 min.
    smoke["matrix"]["batch_size"], smoke["include"] = [1], []
    smoke["slurm"]["container"] = in_podman(env={"NCCL_DEBUG": "INFO"})
    smoke["setup"] = [*smoke.get("setup", []), "export TORCH_I33_FROM_SETUP=yes"]  # srun passes it on
    # They wait for Slurm's signal, which may come 120 s in: no hang is declared before (train_timeout_s).
    hanging = {"base": {**CPU_CELL, "steps": 1000, "train_timeout_s": 600}}
    sweeps = {
        "timeout": {**hanging, "slurm": {"time_min": 3, "signal_delay_s": 60, "container": in_podman(env=HANGS)}},
        "cancelled": {**hanging, "slurm": {"time_min": 10, "container": in_podman(env=HANGS)}},
        "smoke": smoke,
    }
    since = time.time() - 1
    jobs: dict[str, str] = {}

    def submit(status: str) -> None:
        path = tmp / f"{status}.yaml"
        path.write_text(yaml.safe_dump({**sweeps[status], "name": names[status]}))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["submit", str(path), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (jobs[status],) = re.findall(r"submitted array (\d+)", out.getvalue())

    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**local_slurm, **podman_image, **SHELL}.items():
            patch.setenv(key, value)
        try:
            submit("timeout")
            submit("cancelled")
            for status in ("timeout", "cancelled"):
                log = results / names[status] / "slurm" / jobs[status] / f"{jobs[status]}_0_log.out"
                deadline = time.monotonic() + 240
                while not (log.exists() and "training" in log.read_text()):
                    assert time.monotonic() < deadline, f"the {status} cell never trained"
                    time.sleep(1)
            slurm("scancel", jobs["cancelled"])
            submit("smoke")
            deadline = time.monotonic() + 420
            while slurm("squeue", "--noheader", "--format=%i", f"--jobs={','.join(jobs.values())}").strip():
                assert time.monotonic() < deadline, slurm("squeue")
                time.sleep(2)
        finally:
            for name in names.values():
                subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)
        yield PodmanRuns(results, names, started_containers(podman_image, since), podman_image)


@pytest.mark.slurm
def test_a_cell_of_each_strategy_runs_in_podman_containers_and_writes_its_record_on_the_host(podman_runs):
    got = records(podman_runs.results / podman_runs.names["smoke"])
    assert {r["spec"]["strategy"] for r in got.values()} == {"ddp", "fsdp2_zero2", "fsdp2_zero3"}
    assert len(got) == 3 and {r["status"] for r in got.values()} == {"ok"}, {r.get("error") for r in got.values()}
    # Each cell's node ran one container of the image (one Slurm task per node: its supervisor
    # starts the node's ranks inside it), with the variables of container.env.
    assert podman_runs.containers.count(IMAGE) == 3 + 2
    assert all(r["environment"].get("NCCL_DEBUG") == "INFO" for r in got.values())


@pytest.mark.slurm
def test_a_cell_in_a_container_gets_the_allowlisted_environment_and_what_the_setup_lines_set(podman_runs):
    got = records(podman_runs.results / podman_runs.names["smoke"])
    assert all(r["environment"].get("NCCL_I33_FROM_SHELL") == "yes" for r in got.values())
    assert all(r["environment"].get("TORCH_I33_FROM_SETUP") == "yes" for r in got.values())
    folder = podman_runs.results / podman_runs.names["smoke"]
    assert [str(p) for p in folder.rglob("*") if p.is_file() and b"i33secret" in p.read_bytes()] == []


@pytest.mark.slurm
def test_a_cell_in_a_container_records_timeout_when_slurms_time_limit_signal_reaches_it(podman_runs):
    """SIGUSR2 reaches the cell through podman run's signal proxy, and the record is written in the
    bound sweep folder."""
    (record,) = records(podman_runs.results / podman_runs.names["timeout"]).values()
    assert record["status"] == "timeout" and record["stage"] == "train", record.get("error")
    assert "SIGUSR2 (time limit)" in record["error"]


@pytest.mark.slurm
def test_a_cell_in_a_container_records_cancelled_when_scancelled(podman_runs):
    (record,) = records(podman_runs.results / podman_runs.names["cancelled"]).values()
    assert record["status"] == "cancelled" and record["stage"] == "train", record.get("error")
    assert "received SIGTERM" in record["error"] and "before the time limit" in record["error"]


@pytest.mark.slurm
def test_no_container_is_left_behind_once_the_jobs_ended(podman_runs):
    deadline = time.monotonic() + 60
    while podman_out(podman_runs.podman, "ps", "--all", "--quiet"):
        assert time.monotonic() < deadline, podman_out(podman_runs.podman, "ps", "--all")
        time.sleep(1)
