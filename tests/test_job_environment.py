"""What a Slurm job gets from the shell it is submitted from (issue 33, item 1): an allowlist and
the names of slurm.pass_env, never the rest; checked where slurmctld keeps it (its state folder:
the job's saved environment and script), in the sweep folder (the *_submission.sh, records,
logs, pickles) and the cluster's logs, on a cell that trains across two nodes of the local
cluster (srun inside the job still gets what the script sets up: SLURM_EXPORT_ENV). And the
local executor's side of it: the shell's environment, less what has a secret's shape."""

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

from conftest import skip_where_root_is_no_mount_point
from container_image import build_image, install_podman, podman_config
from hpcfsdp.cli import main
from hpcfsdp.sweep.define.sbatch_options import release_of
from hpcfsdp.sweep.define.secret_shapes import is_secret
from hpcfsdp.sweep.launch.environment import SLURM_LAUNCHER_NAMES, is_allowed

MARK = "i33secret"
# Secret-like names and values in the submitting shell, each value holding MARK so that one grep
# finds any of them. The shapes the scrub of issue 21 missed, then more; the last few have no
# shape of a secret at all, or sit in an allowlisted family: the allowlist keeps every one out.
SECRETS = {
    "SSHPASS": f"ssh-{MARK}",
    "DB_PW": f"db-{MARK}",
    "LDAP_BIND_PW": f"ldap-{MARK}",
    "PGPASS": f"pg-{MARK}",
    "SECRETKEY": f"sk-{MARK}",
    "AWS_ACCESSKEY": f"AKIA{MARK.upper()}",
    "PRIVATEKEY": f"-----BEGIN RSA PRIVATE KEY-----\n{MARK}\n-----END RSA PRIVATE KEY-----",
    "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={MARK}==;x=y",
    "JWT": f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3In0.{MARK}",
    "HTTPS_PROXY": f"HTTP://u:{MARK}@proxy:3128",
    "DATABASE_URL": f"postgres://me:{MARK}/x@db:5432/app",
    "SLACK_HOOK": f"https://hooks.slack.com/services/T000/B000/{MARK}",
    "STRIPE": f"sk_live_{MARK}ABCDEFGH",
    "PYPI": f"pypi-{MARK}AAAAAAAAAAAAAAAAAAAA",
    "NPM": f"npm_{MARK}AAAAAAAAAAAAAAAAAAAA",
    "HF_TOKEN": f"hf_{MARK}",
    "HUGGING_FACE_HUB_TOKEN": f"hf_{MARK}",
    "WANDB_API_KEY": f"wandb-{MARK}",
    "GITHUB_TOKEN": f"ghp_{MARK}",
    "PGPASSWORD": f"pgpw-{MARK}",
    "MYSQL_PWD": f"my-{MARK}",
    "AWS_SECRET_ACCESS_KEY": f"aws-{MARK}",
    "AWS_SESSION_TOKEN": f"awss-{MARK}",
    "GOOGLE_APPLICATION_CREDENTIALS": f"/keys/{MARK}.json",
    "SENTRY_DSN": f"https://{MARK}@o1.ingest.sentry.io/1",
    "TWINE_PASSWORD": f"twine-{MARK}",
    "deploy_password": f"lower-{MARK}",
    "OPENAI_API_KEY": f"sk-{MARK}",
    "VAULT_TOKEN": f"hvs.{MARK}",
    "CI_JOB_JWT": f"jwt-{MARK}",
    "MLFLOW_TRACKING_PASSWORD": f"mlf-{MARK}",
    "I33_APP_SETTING": f"plain-{MARK}",  # no shape of a secret: not allowlisted either
    "OTHER_TEAMS_CONFIG": f"{MARK}-value",
    "HPCFSDP_API_TOKEN": f"ours-{MARK}",  # an allowlisted family, a secret's name
    "NCCL_PASSWORD": f"nccl-{MARK}",
    "TORCH_HUB_TOKEN": f"th-{MARK}",
}
CPU_CELL = {
    "model": "tiny",
    "device": "cpu",
    "precision": "fp32",
    "seq_len": 32,
    "steps": 3,
    "warmup_steps": 1,
    "comm_profile_steps": 0,
}


@pytest.fixture(scope="module")
def podman_image(tmp_path_factory):
    """podman configured for this machine and the test image (tests/container_image.py), removed at the end."""
    from test_container import IMAGE

    skip_where_root_is_no_mount_point("podman")
    install_podman()
    env = podman_config(tmp_path_factory.mktemp("podman"))
    build_image(IMAGE, Path(sys.prefix), env)
    yield env
    subprocess.run(
        ["podman", "system", "reset", "--force"], env={**os.environ, **env}, capture_output=True, timeout=300
    )


def state_folder(job_id: str) -> Path:
    """slurmctld's saved copy of a job: StateSaveLocation/hash.N/job.ID/{environment,script}."""
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    state = Path(re.search(r"^StateSaveLocation=(\S+)", conf, flags=re.M).group(1))
    return state / f"hash.{int(job_id) % 10}" / f"job.{job_id}"


def files_holding(root: Path, mark: bytes) -> list[str]:
    return [str(path) for path in root.rglob("*") if path.is_file() and mark in path.read_bytes()]


def test_the_allowlist_and_the_secret_shapes_tell_every_secret_from_what_a_cell_needs():
    assert len(SECRETS) >= 30
    assert not [name for name in SECRETS if is_allowed(name) and not is_secret(name, SECRETS[name])]
    needed = ["PATH", "HOME", "USER", "LANG", "LC_ALL", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV"]
    needed += ["CONDA_PREFIX", "MODULEPATH", "LMOD_CMD", "BASH_FUNC_module%%", "CUDA_HOME", "NCCL_DEBUG"]
    needed += ["TORCH_LOGS", "HPCFSDP_CACHE", "HF_HUB_OFFLINE", "HF_HOME", "SLURM_CONF", "GLOO_SOCKET_IFNAME"]
    assert [name for name in needed if not is_allowed(name)] == []


def test_the_mpi_launcher_settings_slurm_24_11_puts_in_every_job_are_allowlisted():
    # Seen in a 24.11.5 job's saved environment under --export=<names>; 22.05 sets none of them.
    launchers = ["HYDRA_BOOTSTRAP", "HYDRA_LAUNCHER_EXTRA_ARGS", "I_MPI_HYDRA_BOOTSTRAP"]
    launchers += ["I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS", "OMPI_MCA_plm_slurm_args", "PRTE_MCA_plm_slurm_args"]
    assert [name for name in launchers if not is_allowed(name)] == []
    assert not [name for name in launchers if is_secret(name, "--external-launcher")]


@pytest.mark.slurm
def test_a_slurm_job_gets_the_allowlist_and_pass_env_only_and_trains_across_two_nodes(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    name = f"env{uuid.uuid4().hex[:8]}"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": {**CPU_CELL, "strategy": "ddp", "nodes": 2, "gpus_per_node": 1},
                "slurm": {"time_min": 10, "pass_env": ["AWS_PROFILE"], "extra_sbatch": {"hold": True}},
                # set up by the script: srun must pass it to the ranks (SLURM_EXPORT_ENV=ALL)
                "setup": ["export TORCH_I33_FROM_SETUP=yes"],
            }
        )
    )
    for variable, value in SECRETS.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AWS_PROFILE", "i33-profile")  # named in pass_env
    monkeypatch.setenv("HPCFSDP_I33_CANARY", "visible")  # allowlisted: shows the right files are read
    monkeypatch.setenv("NCCL_I33_FROM_SHELL", "yes")

    assert main(["plan", str(jobs)]) == 0
    assert "note: slurm.pass_env: AWS_PROFILE go to the Slurm jobs as set where you submit, and slurmctld saves" in (
        capsys.readouterr().out
    )
    results = tmp_path / "results"
    sweep_dir = results / name
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (job,) = re.findall(r"submitted array (\d+): 1 cell", capsys.readouterr().out)
        saved_environment = (state_folder(job) / "environment").read_bytes()
        saved_script = (state_folder(job) / "script").read_bytes()
        subprocess.run(["scontrol", "release", job], check=True, capture_output=True, timeout=60)
        assert main(["status", str(sweep_dir), "--watch", "1"]) == 0
    finally:
        subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)
    saved = dict(item.split(b"=", 1) for item in saved_environment.split(b"\0") if b"=" in item)
    assert saved.get(b"HPCFSDP_I33_CANARY") == b"visible" and saved.get(b"AWS_PROFILE") == b"i33-profile"
    assert MARK.encode() not in saved_environment, [k for k, v in SECRETS.items() if v.encode() in saved_environment]
    assert MARK.encode() not in saved_script
    names = [key.decode(errors="replace") for key in saved]
    # and the SLURM_* that sbatch itself sets for the job (SLURM_JOB_NAME, SLURM_SUBMIT_DIR, ...)
    assert [name for name in names if not is_allowed(name) and name != "AWS_PROFILE" and name[:6] != "SLURM_"] == []
    version = subprocess.run(["sbatch", "--version"], capture_output=True, text=True, timeout=30).stdout
    if (release_of(version) or (0, 0)) >= (24, 11):  # Slurm's own MPI launcher settings, --export or not
        assert set(SLURM_LAUNCHER_NAMES) <= set(names)

    (record_path,) = sweep_dir.glob("cells/*/result.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok", record.get("error")
    assert record["hostnames"] == ["hpcfsdp-n1", "hpcfsdp-n2"] and record["world_size"] == 2
    assert record["versions"]["slurm"] == version.split()[-1].split("-")[0]  # the release it ran under
    # Both ranks, on both nodes, got what the shell passed and what the setup lines set.
    assert record["environment"]["TORCH_I33_FROM_SETUP"] == "yes"
    assert record["environment"]["NCCL_I33_FROM_SHELL"] == "yes"
    (submission,) = sweep_dir.glob("slurm/*/*_submission.sh")
    assert "#SBATCH --export=" in submission.read_text() and "export SLURM_EXPORT_ENV=ALL" in submission.read_text()
    assert files_holding(sweep_dir, MARK.encode()) == []  # records, logs, the script, pickles, manifest
    logs = Path(os.environ["SLURM_CONF"]).parent.parent / "log"
    assert files_holding(logs, MARK.encode()) == []


def test_the_local_executor_keeps_the_shells_environment_less_its_secrets(tmp_path, monkeypatch, capsys):
    jobs = tmp_path / "local.yaml"
    jobs.write_text(yaml.safe_dump({"name": "local", "base": {**CPU_CELL, "gpus_per_node": 1}}))
    monkeypatch.setenv("I33_LOCAL_SETTING", "kept")
    monkeypatch.setenv("SSHPASS", f"ssh-{MARK}")
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    line = capsys.readouterr().out
    assert "-u SSHPASS" in line and MARK not in line and "-u I33_LOCAL_SETTING" not in line


def test_download_refuses_a_cache_dir_with_a_newline(tmp_path, capsys):
    assert main(["download", "--model", "org/name", "--cache-dir", f"{tmp_path}/a\nb"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --cache-dir: holds U+000A") and err.count("\n") == 1, err
    assert not (tmp_path / "a\nb").exists()


def test_download_verify_of_a_jobs_yaml_checks_its_slurm_cache_dir(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "yaml-cache"
    cache.mkdir()
    monkeypatch.setenv("HPCFSDP_CACHE", str(tmp_path / "shell-cache"))
    jobs = tmp_path / "hub.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {"name": "hub", "base": {"model": "org/model", "device": "cpu"}, "slurm": {"cache_dir": str(cache)}}
        )
    )
    assert main(["download", str(jobs), "--verify"]) == 1
    out = capsys.readouterr().out
    assert str(cache) in out and "shell-cache" not in out, out


@pytest.mark.slurm
def test_a_cell_in_a_podman_container_gets_the_allowlist_and_the_setup_lines_but_no_secret(
    slurm_cluster, podman_image, tmp_path, monkeypatch, capsys
):
    from test_container import in_podman

    name = f"envpod{uuid.uuid4().hex[:8]}"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": {**CPU_CELL, "gpus_per_node": 1},
                "slurm": {"time_min": 10, "container": in_podman()},
                "setup": ["export TORCH_I33_FROM_SETUP=yes"],
            }
        )
    )
    for variable, value in {**podman_image, **SECRETS, "NCCL_I33_FROM_SHELL": "yes"}.items():
        monkeypatch.setenv(variable, value)
    results = tmp_path / "results"
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--wait", "--results-dir", str(results)]) == 0
    finally:
        subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)
    (record_path,) = (results / name).glob("cells/*/result.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "ok", record.get("error")
    # podman ran (CONTAINERS_CONF is allowlisted), and the rank got the shell's and the script's variables.
    assert record["environment"]["NCCL_I33_FROM_SHELL"] == "yes"
    assert record["environment"]["TORCH_I33_FROM_SETUP"] == "yes"
    assert files_holding(results / name, MARK.encode()) == []
