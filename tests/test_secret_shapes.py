"""Secrets in `setup` lines (issue 44, item 7): a secret-shaped name may be given only a value read
on the node (a file only the user can read, a variable of slurm.pass_env); every other way of
writing its value into the batch script is refused at plan, in one line; and settings that merely
look like secrets (a token's path, a switch, a count of tokens, an agent's socket, a credentials
file, an image pinned by digest on a registry with a port) pass into the script as written."""

from __future__ import annotations

import pytest
import yaml

from hpcfsdp.cli import main

DIGEST = "sha256:" + "0123456789abcdef" * 4

LEAKS = {
    "export DB_PASSWORD2=hunter2": "DB_PASSWORD2",
    "export SECRET1=hunter2": "SECRET1",
    "export DB_PASSWORD=${X:-hunter2}": "DB_PASSWORD",
    "export DB_PASSWORD=$(echo hunter2)": "DB_PASSWORD",
    'export DB_PASSWORD="$(echo hunter2)"': "DB_PASSWORD",
    "export DB_PASSWORD=${HOME}hunter2": "DB_PASSWORD",
    'export "DB_PASSWORD"=hunter2': "DB_PASSWORD",
    "export 'API_KEY=hunter2'": "API_KEY",
    'export DB_PASS""WORD=hunter2': "DB_PASSWORD",
    "read -r DB_PASSWORD <<< hunter2": "DB_PASSWORD (read from the line itself)",
    "printf -v DB_PASSWORD '%s' hunter2": "DB_PASSWORD (printf -v)",
    "export API_KEY=$(cat /etc/hostname; echo hunter2)": "API_KEY",
    "export DB_PASSWORD=/hunter2": "DB_PASSWORD",  # a password is no path, even one that starts with '/'
    # A `$` the shell takes as itself is no variable read on the node (issue 51, item 14).
    "export DB_PASSWORD='$ecret99'": "DB_PASSWORD",
    "export API_KEY=$'hunter2'": "API_KEY",
    'export API_KEY=$"hunter2"': "API_KEY",
    "export DB_PASSWORD=\\$ecret99": "DB_PASSWORD",
    "export DB_PASSWORD=$'\\x24ecret99'": "DB_PASSWORD",
}
HARMLESS = [
    "export HF_TOKEN_PATH=$HOME/.cache/huggingface/token",
    "export HF_HUB_DISABLE_IMPLICIT_TOKEN=1",
    "export MAX_TOKENS=4096",
    "export SSH_AUTH_SOCK=/tmp/ssh-agent/agent.1",
    "export GOOGLE_APPLICATION_CREDENTIALS=/home/me/keys/app.json",
    f"export IMAGE=registry.example.org:5000/team/train@{DIGEST}",
    f"podman pull docker://registry.example.org:5000/team/train@{DIGEST}",
    # The safe ways: a file only you can read, read at job start; a variable named in slurm.pass_env.
    "export HF_TOKEN=$(cat ~/.secrets/hf_token)",
    "export WANDB_API_KEY=$(< ~/.secrets/wandb)",
    "read -r DB_PASSWORD < ~/.secrets/db",
    "export DB_PASSWORD=$TEAM_DB_PASSWORD",
    'export DB_PASSWORD="$TEAM_DB_PASSWORD"',
    "export DB_PASSWORD=${TEAM_DB_PASSWORD}",
]


def jobs_file(tmp_path, line: str):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"name": "s", "base": {"device": "cpu"}, "setup": ["module load cuda", line]}))
    return jobs


@pytest.mark.parametrize("line", sorted(LEAKS))
def test_a_setup_line_that_writes_a_secrets_value_is_refused_at_plan_in_one_line(line, tmp_path, capsys):
    jobs = jobs_file(tmp_path, line)
    for argv in (["plan", str(jobs)], ["plan", str(jobs), "--sbatch"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"error: {jobs}:4: setup[1]: holds a value for {LEAKS[line]}, which would be written")
        assert "from a file only you can read" in err and "slurm.pass_env" in err
        assert "hunter2" not in err


@pytest.mark.parametrize("line", HARMLESS)
def test_a_setup_line_that_only_looks_like_a_secret_reaches_the_batch_script_as_written(line, tmp_path, capsys):
    jobs = jobs_file(tmp_path, line)
    assert main(["plan", str(jobs), "--sbatch"]) == 0, capsys.readouterr().err
    assert f"\n{line}\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}, {"GOOGLE_APPLICATION_CREDENTIALS": "/keys/app.json"}],
)
def test_a_container_env_entry_that_only_looks_like_a_secret_is_accepted(env, tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    container = {"runtime": "apptainer", "image": f"docker://registry.example.org:5000/t/img@{DIGEST}", "env": env}
    jobs.write_text(yaml.safe_dump({"name": "s", "base": {"device": "cpu"}, "slurm": {"container": container}}))
    assert main(["plan", str(jobs)]) == 0, capsys.readouterr().err
