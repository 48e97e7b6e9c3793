"""Faults that lost data, duplicated work or leaked (issue 12, item 8), each reproduced: a rerun
never destroys an ok record; two submits at once queue each cell once; a bad file is one line to
status, submit and collect, and `--retry-failed` reruns it; an extra_sbatch key cannot add a line
to the batch script; tokens never reach Slurm; scancel records `cancelled`; an interrupted submit
leaves no process and no record set aside; unwritable folders are one line; collect stays in the
sweep folder, escapes summary.md, and records are 0644.

The local executor runs real torchrun cells (gloo, CPU); the Slurm tests submit to the local
cluster (slurm/local/start.sh), with held jobs wherever the cells need not run.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from conftest import slurm
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.track.processes import processes_under

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
TRACEBACK = "Traceback (most recent call last)"


def jobs_file(tmp_path: Path, name: str, base: dict | None = None, **sections) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "base": {**CPU_CELL, **(base or {})}, **sections}))
    return path


def unique(prefix: str) -> str:
    """A sweep name no other test or helper on the shared cluster uses (Slurm job names)."""
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def cell_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((sweep_dir / "cells").iterdir())


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def hpcfsdp(*args: str, **env: str) -> subprocess.Popen:
    """`python -m hpcfsdp ...` as a user runs it: its own process, output unbuffered into pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpcfsdp", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
    )


def wait_until(condition, timeout_s: float, what: str, logs: tuple[Path, ...] = ()) -> None:
    """Poll condition; past timeout_s fail, naming what was awaited and showing the end of `logs`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            shown = "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            pytest.fail(f"timed out waiting for {what}{shown}")
        time.sleep(0.2)


def alive(processes: dict[int, str]) -> list[int]:
    """Those of the processes (pid -> start time) that still run (a zombie has ended)."""
    living = []
    for pid, started in processes.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == started and fields[0] != "Z":
            living.append(pid)
    return living


def cancel_sweep_jobs(name: str) -> None:
    subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)


def queued_job_ids(name: str) -> list[str]:
    """The sweep's jobs in squeue, array tasks one by one, that have not ended."""
    out = slurm("squeue", "--noheader", "--array", f"--name=hpcfsdp-{name}", "--format=%i %T")
    return sorted(line.split()[0] for line in out.splitlines() if line.split()[1] in ("PENDING", "RUNNING"))


# ---------------------------------------------------------------------------------------------
# A rerun never destroys a record (local executor, real torchrun cells)


@pytest.fixture(scope="module")
def ok_sweep(tmp_path_factory) -> tuple[Path, Path]:
    """A one-cell sweep run once with the local executor: its jobs file and results folder (copy it)."""
    root = tmp_path_factory.mktemp("ok")
    jobs = jobs_file(root, "kept")
    results = root / "results"
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(results)]) == 0
    (cell,) = cell_dirs(results / "kept")
    assert read(cell / "result.json")["status"] == "ok"
    return jobs, results


def copy_of(ok_sweep: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    jobs, results = ok_sweep
    shutil.copytree(results, tmp_path / "results")
    (cell,) = cell_dirs(tmp_path / "results" / "kept")
    (cell / "log.txt").unlink()  # the next run's log
    return jobs, tmp_path / "results", cell


def test_an_ok_record_survives_two_failed_reruns_and_a_failed_local_submit_exits_1(
    ok_sweep, tmp_path, monkeypatch, capsys
):
    jobs, results, cell = copy_of(ok_sweep, tmp_path)
    ok = read(cell / "result.json")
    capsys.readouterr()
    monkeypatch.setenv("HPCFSDP_FAULT", "train:error")
    submit = ["submit", str(jobs), "--executor", "local", "--results-dir", str(results)]
    assert main([*submit, "--force"]) == 3  # a cell not ok
    assert main([*submit, "--retry-failed"]) == 3
    assert capsys.readouterr().err.count("1 cell(s) did not finish ok") == 2
    # result.json is the current (latest) attempt; attempts/ keeps the earlier ones, oldest first.
    assert sorted(p.name for p in (cell / "attempts").iterdir()) == ["1.json", "2.json"]
    assert read(cell / "attempts" / "1.json") == ok
    first_failure, current = read(cell / "attempts" / "2.json"), read(cell / "result.json")
    for failed in (first_failure, current):
        assert failed["status"] == "error" and failed["stage"] == "train" and "injected fault" in failed["error"]
    assert first_failure["launch_id"] != current["launch_id"]
    assert oct((cell / "result.json").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def local_submit_in_a_hanging_cell(jobs: Path, results: Path, cell: Path) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`submit --force` with the local executor, once its cell hangs after its first step: the
    submit process and the cell's processes (torchrun and its rank, in a session of its own).
    Afterwards none of them is left running, whatever the test did."""
    proc = hpcfsdp(
        "submit",
        str(jobs),
        "--executor",
        "local",
        "--force",
        "--results-dir",
        str(results),
        HPCFSDP_FAULT="train_step:hang",
    )
    cell_processes: dict[int, str] = {}
    try:
        wait_until(
            lambda: "training" in (cell / "log.txt").read_text() if (cell / "log.txt").exists() else False,
            120,
            "the cell to train",
        )
        time.sleep(1)  # into the hang after the first step
        cell_processes = processes_under(proc.pid)
        assert len(cell_processes) >= 2, cell_processes
        yield proc, cell_processes
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in alive(cell_processes):
            os.kill(pid, signal.SIGKILL)  # a failed test leaves no orphan behind


def test_a_local_submit_killed_by_sigkill_leaves_no_cell_running_and_keeps_the_ok_record(ok_sweep, tmp_path):
    """SIGKILL runs none of submit's handlers; Linux's parent-death signal still gives torchrun
    SIGTERM, which it passes to its rank: nothing is left training, the rank records `cancelled`,
    and the earlier ok record is kept in attempts/ (submit cannot put it back: --retry-failed or
    --force reruns the cell)."""
    jobs, results, cell = copy_of(ok_sweep, tmp_path)
    ok = read(cell / "result.json")
    with local_submit_in_a_hanging_cell(jobs, results, cell) as (proc, cell_processes):
        proc.kill()
        proc.communicate(timeout=30)
        wait_until(lambda: not alive(cell_processes), 60, "torchrun and its rank to end")
    assert read(cell / "result.json")["status"] == "cancelled"
    assert [read(path) for path in (cell / "attempts").iterdir()] == [ok]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_an_interrupted_local_submit_ends_its_cell_and_restores_the_ok_record(ok_sweep, tmp_path, sig):
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP to `submit --force` while its cell trains: torchrun and
    its rank end (none is left orphaned), the rank records `cancelled`, and that record becomes an
    attempt while the ok record is current again. Exit status 128 + the signal, one line."""
    jobs, results, cell = copy_of(ok_sweep, tmp_path)
    ok = read(cell / "result.json")
    with local_submit_in_a_hanging_cell(jobs, results, cell) as (proc, cell_processes):
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
        still_running = alive(cell_processes)
    assert proc.returncode == 128 + sig, err
    assert TRACEBACK not in err
    assert err.splitlines()[-1].startswith(f"interrupted ({sig.name}): the running cell was stopped")
    assert still_running == []
    assert read(cell / "result.json") == ok
    (attempt,) = (cell / "attempts").iterdir()
    cancelled = read(attempt)
    assert cancelled["status"] == "cancelled" and cancelled["stage"] == "train", cancelled.get("error")
    assert "before the time limit" in cancelled["error"]


def test_a_cell_first_run_by_an_interrupted_local_submit_runs_again_with_the_same_command(ok_sweep, tmp_path):
    """A cell that had no record before a local submit cut short by SIGTERM has none after it (its
    `cancelled` record is kept in attempts/): the same command, without --retry-failed, runs it."""
    jobs, results, cell = copy_of(ok_sweep, tmp_path)
    (cell / "result.json").unlink()
    with local_submit_in_a_hanging_cell(jobs, results, cell) as (proc, _):
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1].startswith("interrupted (SIGTERM): the running cell was stopped, its record kept")
    assert not (cell / "result.json").exists()
    (attempt,) = (cell / "attempts").iterdir()
    assert read(attempt)["status"] == "cancelled"
    assert "ended_at" not in read(results / "kept" / "manifest.json")[cell.name]  # a launch cut short
    done = hpcfsdp("submit", str(jobs), "--executor", "local", "--results-dir", str(results))
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    assert "skipping" not in out + err
    assert read(cell / "result.json")["status"] == "ok"


def test_a_cell_run_again_by_hand_keeps_its_earlier_record(tmp_path):
    """`hpcfsdp run` into a folder that has a record (a command --executor print printed, or a
    by-hand run of the same fields): the earlier record becomes an attempt, not overwritten."""
    fields = [f"{key}={value}" for key, value in CPU_CELL.items()]
    command = [sys.executable, "-m", "hpcfsdp", "run", "--results-dir", str(tmp_path), "--sweep", "manual", *fields]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    (cell,) = cell_dirs(tmp_path / "manual")
    assert first.returncode == 0 and read(cell / "result.json")["status"] == "ok", first.stderr[-2000:]
    ok = read(cell / "result.json")
    again = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**env, "HPCFSDP_FAULT": "data:error"}
    )
    assert again.returncode != 0
    assert read(cell / "result.json")["status"] == "error" and read(cell / "attempts" / "1.json") == ok


# ---------------------------------------------------------------------------------------------
# One reader: a bad file is one line to status, submit and collect, and --retry-failed reruns it


BAD_RECORDS = {
    "random-bytes": (lambda spec: b"\xff\xfe" + random.Random(0).randbytes(510), "not UTF-8 text"),
    "5000-digit-integer": (
        lambda spec: b'{"schema_version": 1, "status": "ok", "x": ' + b"7" * 5000 + b"}",
        "Exceeds the limit",
    ),
    "100000-deep-json": (lambda spec: b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    "spec-value-of-the-wrong-type": (
        lambda spec: record_bytes({**spec, "batch_size": "1"}),
        'spec.batch_size: expected an integer, got "1"',
    ),
    "no-spec": (lambda spec: record_bytes(None), "spec: expected an object"),
}


def record_bytes(spec: dict | None) -> bytes:
    record = {"schema_version": 1, "status": "ok", "tokens_per_s_per_gpu": 1000.0}
    return json.dumps(record if spec is None else {**record, "spec": spec}).encode()


def printed_sweep(tmp_path: Path) -> tuple[Path, Path, list]:
    """A two-cell sweep folder as `submit --executor print` leaves it (spec.json, manifest-less)."""
    jobs = jobs_file(tmp_path, "bad", matrix={"batch_size": [1, 2]})
    results = tmp_path / "results"
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]) == 0
    return jobs, results, load_sweep(jobs).cells


@pytest.mark.parametrize("kind", BAD_RECORDS)
def test_a_bad_record_is_one_line_to_status_submit_and_collect_and_rerun_by_retry_failed(tmp_path, capsys, kind):
    jobs, results, (bad, good) = printed_sweep(tmp_path)
    sweep_dir = results / "bad"
    content, fragment = BAD_RECORDS[kind]
    bad_path = sweep_dir / "cells" / bad.id / "result.json"
    bad_path.write_bytes(content(bad.spec.to_dict()))
    write_record(sweep_dir / "cells" / good.id / "result.json", {"status": "ok", "spec": good.spec.to_dict()})
    capsys.readouterr()

    assert main(["status", str(sweep_dir)]) == 3  # a cell not ok
    out, err = capsys.readouterr()
    assert out.startswith(f"{sweep_dir}: 2 cell(s): corrupt 1, ok 1")
    (warning,) = err.splitlines()
    assert warning.startswith(f"warning: {bad_path}: ") and fragment in warning, warning

    assert main(["collect", str(sweep_dir), "--no-plots"]) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: skipped {bad_path}: ") and fragment in warning, warning

    printing = ["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]
    assert main(printing) == 0
    out, err = capsys.readouterr()
    assert out == "" and f"corrupt record: {bad_path}: " in err and "--retry-failed reruns them" in err
    assert main([*printing, "--retry-failed"]) == 0
    (command,) = capsys.readouterr().out.splitlines()
    assert command.endswith(f"--cell-dir {(sweep_dir / 'cells' / bad.id).absolute()}")


def test_a_broken_manifest_is_one_line_to_status_and_collect_and_stops_submit(tmp_path, capsys):
    jobs, results, (first, _) = printed_sweep(tmp_path)
    sweep_dir = results / "bad"
    (sweep_dir / "manifest.json").write_text('{"' + first.id + '": {"executor": "slurm", "job_id": "71_0"')
    capsys.readouterr()
    assert main(["status", str(sweep_dir)]) == 3  # missing cells
    out, err = capsys.readouterr()
    (warning,) = err.splitlines()
    assert warning.startswith(f"warning: {sweep_dir / 'manifest.json'}: unreadable manifest (")
    assert out.startswith(f"{sweep_dir}: 2 cell(s): missing 2")
    assert main(["collect", str(sweep_dir), "--no-plots"]) == 0
    assert capsys.readouterr().err.startswith(f"warning: skipped {sweep_dir / 'manifest.json'}: unreadable manifest (")
    # submit cannot tell which cells are queued: it queues nothing, and keeps the file as it is.
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(results)]) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith(f"error: {sweep_dir / 'manifest.json'}: unreadable manifest (")
    assert error.endswith("nothing submitted")
    assert not list(sweep_dir.glob("cells/*/log.txt"))


# ---------------------------------------------------------------------------------------------
# extra_sbatch keys


@pytest.mark.parametrize(
    "key", ["reservation\ntouch /tmp/injected", "hold\r", "mail type", "x=y", "#x", "x;y", "x\x00y", "x\u2028y", "-x"]
)
def test_an_extra_sbatch_key_cannot_add_a_line_to_the_batch_script(tmp_path, capsys, key):
    jobs = jobs_file(tmp_path, "inject", slurm={"extra_sbatch": {key: 1}})
    assert main(["plan", str(jobs), "--sbatch"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert f"slurm.extra_sbatch.{key!r}: expected an sbatch option name" in line


def test_an_accepted_extra_sbatch_key_is_one_sbatch_line(tmp_path, capsys):
    jobs = jobs_file(tmp_path, "mail", slurm={"extra_sbatch": {"mail_type": "FAIL", "reservation": "maint"}})
    assert main(["plan", str(jobs), "--sbatch"]) == 0
    script = capsys.readouterr().out
    header = script[: script.index("# setup")].splitlines()
    assert "#SBATCH --mail-type=FAIL" in header and "#SBATCH --reservation=maint" in header
    assert all(line.startswith("#") or not line.strip() for line in header)  # nothing but directives


# ---------------------------------------------------------------------------------------------
# Tokens and the local cluster; scancel; the lock; Ctrl-C in --wait


def test_a_printed_command_runs_without_the_tokens_of_its_shell(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb_i12c_secret")
    jobs = jobs_file(tmp_path, "printed")
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert "secret" not in line
    # The line's environment part, run with `env` in place of torchrun, in a shell holding tokens.
    prefix = line.split(f" {shlex.quote(sys.executable)} ")[0]
    tokens = {"HF_TOKEN": "hf_i12c_secret", "HUGGING_FACE_HUB_TOKEN": "hf_i12c_secret"}
    shown = subprocess.run(
        ["bash", "-c", f"{prefix} env"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, **tokens},
    ).stdout
    assert "HF_HUB_OFFLINE=1" in shown and "secret" not in shown


def saved_job_environment(job_id: str) -> bytes:
    """slurmctld's saved copy of a job's environment (StateSaveLocation/hash.N/job.ID/environment)."""
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    state = Path(re.search(r"^StateSaveLocation=(\S+)", conf, flags=re.M).group(1))
    return (state / f"hash.{int(job_id) % 10}" / f"job.{job_id}" / "environment").read_bytes()


def environments_of_job(job_id: str) -> list[bytes]:
    """/proc/<pid>/environ of every process of the job on this machine."""
    found = []
    for path in Path("/proc").glob("[0-9]*/environ"):
        try:
            environ = path.read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}\0".encode() in environ:
            found.append(environ)
    return found


@pytest.mark.slurm
def test_a_running_cell_holds_no_token_and_scancel_records_cancelled(slurm_cluster, tmp_path, monkeypatch, capsys):
    name = unique("token")
    jobs = jobs_file(tmp_path, name, base={"steps": 100_000_000}, slurm={"time_min": 10, "pass_env": ["I12C_CANARY"]})
    results = tmp_path / "results"
    for token in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY"):
        monkeypatch.setenv(token, f"i12c_secret_{token}")
    monkeypatch.setenv("I12C_CANARY", "visible")  # shows that the right environments are looked at
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (job,) = re.findall(r"submitted array (\d+): 1 cell", capsys.readouterr().out)
        sweep_dir = results / name
        log = sweep_dir / "slurm" / job / f"{job}_0_log.out"
        wait_until(lambda: log.exists() and "training" in log.read_text(), 180, "the cell to train")
        saved = saved_job_environment(job)
        running = environments_of_job(job)
        assert b"I12C_CANARY=visible" in saved and running and all(b"I12C_CANARY=visible" in env for env in running)
        assert b"i12c_secret" not in saved and not any(b"i12c_secret" in env for env in running)
        assert any(b"HPCFSDP_JOB_END_TIME=20" in env for env in running)  # squeue's %e, for the ranks

        slurm("scancel", job)
        (cell,) = cell_dirs(sweep_dir)
        logs = (log, log.with_suffix(".err"))
        wait_until(lambda: (cell / "result.json").exists(), 60, "the cancelled cell's record", logs)
    finally:
        cancel_sweep_jobs(name)
    record = read(cell / "result.json")
    assert record["status"] == "cancelled" and record["stage"] == "train", record.get("error")
    assert "received SIGTERM" in record["error"] and "before the time limit" in record["error"]
    assert main(["status", str(sweep_dir), "--watch", "1"]) == 3  # until the job has left COMPLETING
    assert f"{sweep_dir}: 1 cell(s): cancelled 1" in capsys.readouterr().out


# Secrets of every common shape: by name (any prefix, any case) or by value. Each value holds
# "i21secret" so that one grep finds any of them.
SECRETS = {
    "PGPASSWORD": "pg-i21secret",
    "MYSQL_PWD": "my-i21secret",
    "MYAPP_KEY": "app-i21secret",
    "GITHUB_PAT": "pat-i21secret",
    "API_TOKENS": "a,b-i21secret",
    "AWS_SESSION_TOKEN": "aws-i21secret",
    "AZURE_CLIENT_SECRET": "az-i21secret",
    "SENTRY_DSN": "https://i21secret@o1.ingest.sentry.io/1",
    "DATABASE_URL": "postgres://me:i21secret@db:5432/x",
    "https_proxy": "http://me:i21secret@proxy:3128",
    "deploy_password": "lower-i21secret",
    "SOMETHING": "ghp_i21secretI21secretI21secretAAAA",
    "TWINE_PASSWORD": "twine-i21secret",
}
# Look alike, but are none: named in slurm.pass_env, they reach the job.
NOT_SECRETS = {
    "I21_CANARY": "visible",
    "KEYBOARD_LAYOUT": "visible-us",
    "PASSAGE_COUNT": "visible-3",
    "GOOGLE_APPLICATION_CREDENTIALS": "/keys/app.json",  # a path to a credentials file: no secret (issue 44)
}


def test_every_common_shape_of_secret_is_told_from_ordinary_variables():
    from hpcfsdp.sweep.launch.environment import is_secret

    assert all(is_secret(name, value) for name, value in SECRETS.items())
    ordinary = {**NOT_SECRETS, "PATH": "/usr/bin", "PWD": "/home/me", "OLDPWD": "/", "LD_LIBRARY_PATH": "/opt/lib"}
    ordinary |= {
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HTTPS_PROXY": "http://proxy:3128",
    }
    assert not [name for name, value in ordinary.items() if is_secret(name, value)]


@pytest.mark.slurm
def test_slurmctlds_saved_job_environment_holds_no_secret_of_any_common_shape(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    name = unique("secrets")
    jobs = jobs_file(tmp_path, name, slurm={"extra_sbatch": {"hold": True}, "pass_env": sorted(NOT_SECRETS)})
    for variable, value in {**SECRETS, **NOT_SECRETS}.items():
        monkeypatch.setenv(variable, value)
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]) == 0
        (job,) = re.findall(r"submitted array (\d+): 1 cell", capsys.readouterr().out)
        saved = saved_job_environment(job)
    finally:
        cancel_sweep_jobs(name)
    assert all(f"{k}={v}".encode() in saved for k, v in NOT_SECRETS.items())  # the right file is read
    assert b"i21secret" not in saved, [k for k, v in SECRETS.items() if v.encode() in saved]


@pytest.mark.slurm
def test_two_submits_of_one_sweep_at_once_queue_each_cell_once(slurm_cluster, tmp_path):
    name = unique("lock")
    jobs = jobs_file(tmp_path, name, slurm={"extra_sbatch": {"hold": True}}, matrix={"batch_size": [1, 2, 3]})
    results = tmp_path / "results"
    sweep_dir = results / name
    sweep_dir.mkdir(parents=True)
    submits, logs = [], [tmp_path / f"submit{i}.txt" for i in range(2)]
    command = [
        sys.executable,
        "-m",
        "hpcfsdp",
        "submit",
        str(jobs),
        "--executor",
        "slurm",
        "--results-dir",
        str(results),
    ]
    try:
        # The test holds the lock while both start, so that neither has read the sweep when it opens.
        with open(sweep_dir / ".submit.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for log in logs:
                with open(log, "w") as out:
                    submits.append(
                        subprocess.Popen(
                            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                        )
                    )
            wait_until(
                lambda: all("waiting for it to finish" in log.read_text() for log in logs),
                60,
                "both submits to wait for the lock",
            )
            assert all(proc.poll() is None for proc in submits)
            fcntl.flock(lock, fcntl.LOCK_UN)
        for proc in submits:
            proc.wait(timeout=120)
        text = "\n".join(log.read_text() for log in logs)
        assert [proc.returncode for proc in submits] == [0, 0], text
        (array,) = re.findall(r"submitted array (\d+): 3 cell\(s\)", text)
        assert "skipping 3 cell(s) still queued or running" in text
        manifest = read(sweep_dir / "manifest.json")
        assert sorted(entry["job_id"] for entry in manifest.values()) == [f"{array}_{i}" for i in range(3)]
        assert queued_job_ids(name) == [f"{array}_{i}" for i in range(3)]
    finally:
        for proc in submits:
            if proc.poll() is None:
                proc.kill()
        cancel_sweep_jobs(name)


@pytest.mark.slurm
def test_ctrl_c_in_submit_wait_says_how_many_cells_are_still_queued(slurm_cluster, tmp_path):
    name = unique("wait")
    jobs = jobs_file(tmp_path, name, slurm={"extra_sbatch": {"hold": True}}, matrix={"batch_size": [1, 2]})
    results = tmp_path / "results"
    out_file = tmp_path / "out.txt"
    try:
        with open(out_file, "w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hpcfsdp",
                    "submit",
                    str(jobs),
                    "--executor",
                    "slurm",
                    "--wait",
                    "--results-dir",
                    str(results),
                ],
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            wait_until(lambda: "sweep folder:" in out_file.read_text(), 60, "submit to queue the array")
            time.sleep(1)  # watching now
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130
        assert TRACEBACK not in err
        assert err.splitlines()[-1] == f"stopped waiting; 2 cells still queued; `hpcfsdp status {results / name}`"
        assert len(queued_job_ids(name)) == 2  # the jobs keep their place
    finally:
        cancel_sweep_jobs(name)


@pytest.mark.slurm
def test_ctrl_c_while_sbatch_runs_still_records_the_queued_array(slurm_cluster, tmp_path):
    """SIGINT to `submit --force` while sbatch is queueing: the array is queued and the manifest
    names it (never a job the manifest does not know), and the record it replaces stays an attempt:
    the queued cell will write result.json. (sbatch is the real one, started 3 s late by a wrapper;
    the preflight's --test-only is not delayed.)"""
    name = unique("defer")
    jobs = jobs_file(tmp_path, name, slurm={"extra_sbatch": {"hold": True}})
    results = tmp_path / "results"
    (cell,) = load_sweep(jobs).cells
    write_record(results / name / "cells" / cell.id / "result.json", {"status": "ok", "spec": cell.spec.to_dict()})
    wrappers, started = tmp_path / "bin", tmp_path / "sbatch-started"
    wrappers.mkdir()
    sbatch = shutil.which("sbatch")
    # The preflight's `sbatch --test-only` queues nothing, nor does plan's `sbatch --help` (its options): not delayed.
    script = ["#!/bin/sh", f'case "$*" in *--test-only*|--help|--usage|--version) exec {sbatch} "$@";; esac']
    script += [f"touch {started}", "sleep 3"]
    (wrappers / "sbatch").write_text("\n".join([*script, f'exec {sbatch} "$@"', ""]))
    (wrappers / "sbatch").chmod(0o755)
    proc = hpcfsdp(
        "submit",
        str(jobs),
        "--executor",
        "slurm",
        "--force",
        "--results-dir",
        str(results),
        PATH=f"{wrappers}:{os.environ['PATH']}",
    )
    try:
        wait_until(started.exists, 60, "sbatch to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and TRACEBACK not in err, err
        assert err.splitlines()[-1].startswith("interrupted (SIGINT): arrays queued before it are in manifest.json"), (
            err
        )
        (job,) = queued_job_ids(name)
        assert read(results / name / "manifest.json")[cell.id]["job_id"] == job
        folder = results / name / "cells" / cell.id
        assert not (folder / "result.json").exists() and read(folder / "attempts" / "1.json")["status"] == "ok"
    finally:
        if proc.poll() is None:
            proc.kill()
        cancel_sweep_jobs(name)


# ---------------------------------------------------------------------------------------------
# Folders that cannot be written (a file where a folder should be: root is refused too)


def test_a_cell_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    jobs, results, (first, _) = printed_sweep(tmp_path)
    cell = results / "bad" / "cells" / first.id
    shutil.rmtree(cell)
    cell.write_text("a file where the cell's folder should be")
    capsys.readouterr()
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(results)]) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error == f"error: {cell}: a file is where a folder is needed"


def test_a_report_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    _, results, _ = printed_sweep(tmp_path)
    report = results / "bad" / "report"
    report.write_text("a file")
    capsys.readouterr()
    assert main(["collect", str(results / "bad"), "--no-plots"]) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error == f"error: {report}: a file is where a folder is needed"


def test_a_download_cache_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.write_text("a file")
    assert main(["download", "--model", "org/model", "--cache-dir", str(cache)]) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error == f"error: --cache-dir: {cache}: a regular file, not a folder; give the cache's folder"


# ---------------------------------------------------------------------------------------------
# collect: links out of the sweep folder, Markdown from user strings


def record_of(cell, **fields) -> dict:
    return {
        "status": "ok",
        "cell_id": cell.id,
        "sweep": "bad",
        "spec": cell.spec.to_dict(),
        "world_size": 1,
        "nodes": 1,
        "tokens_per_s_per_gpu": 1000.0,
        "peak_memory_gib": 1.0,
        **fields,
    }


def test_collect_neither_reads_nor_writes_through_links_out_of_the_sweep_folder(tmp_path, capsys):
    _, results, (first, second) = printed_sweep(tmp_path)
    sweep_dir = results / "bad"
    write_record(sweep_dir / "cells" / first.id / "result.json", record_of(first))
    outside = tmp_path / "outside"
    write_record(outside / "cell" / "result.json", record_of(second))
    (sweep_dir / "cells" / "linked").symlink_to(outside / "cell")
    victim = outside / "victim.txt"
    victim.write_text("not collect's to write")
    (sweep_dir / "report").mkdir()
    (sweep_dir / "report" / "results.csv").symlink_to(victim)
    capsys.readouterr()
    assert main(["collect", str(sweep_dir), "--no-plots"]) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"warning: skipped {sweep_dir / 'cells' / 'linked'}: a symbolic link where a cell folder belongs "
        "(hpcfsdp follows none); not read"
    )
    assert victim.read_text() == "not collect's to write"
    csv = sweep_dir / "report" / "results.csv"
    assert not csv.is_symlink() and first.id in csv.read_text()
    # A report folder that is itself a link out of the sweep folder is refused, in one line.
    shutil.rmtree(sweep_dir / "report")
    (sweep_dir / "report").symlink_to(outside)
    assert main(["collect", str(sweep_dir), "--no-plots"]) == 1  # the ownership rule: no link at report/
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith(f"error: {sweep_dir / 'report'}: a symbolic link where hpcfsdp keeps a folder of its own")
    assert sorted(p.name for p in outside.iterdir()) == ["cell", "victim.txt"]


def test_summary_md_shows_strings_from_records_as_text(tmp_path):
    """An error (its first line goes to the failures table) and a device name (the environment
    table) holding HTML, a pipe, an image link and a line break."""
    _, results, (first, second) = printed_sweep(tmp_path)
    sweep_dir = results / "bad"
    error = "<script>alert(1)</script> | ![x](http://tracker.example/x.png)\nsecond line of the traceback"
    device = "<img src=x onerror=alert(1)> | GPU\n| injected | row |"
    write_record(sweep_dir / "cells" / first.id / "result.json", record_of(first, device_name=device))
    write_record(
        sweep_dir / "cells" / second.id / "result.json",
        {**record_of(second), "status": "error", "stage": "train", "error": error},
    )
    assert main(["collect", str(sweep_dir), "--no-plots"]) == 0
    summary = (sweep_dir / "report" / "summary.md").read_text()
    assert not re.search(r"(?<!\\)<|(?<!\\)\]\(http", summary)  # no tag, no link: each one escaped
    assert "\n| injected" not in summary
    for escaped in (
        r"\<script>alert(1)\</script> \| !\[x\](http://tracker.example/x.png)",
        r"\<img src=x onerror=alert(1)> \| GPU \| injected \| row \|",
    ):
        (row,) = [line for line in summary.splitlines() if escaped in line]
        assert row.startswith("| ") and row.endswith(" |")  # one table row, its cells intact


def blocks(pid: int, sig: signal.Signals) -> bool:
    """Whether the process's main thread blocks `sig` (the SigBlk mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM], ids=["SIGUSR2", "SIGTERM"])
def test_a_signal_that_comes_before_torch_is_imported_still_ends_in_a_record(tmp_path, sig):
    """Sent as soon as `hpcfsdp run` blocks it, while libtorch is not yet loaded: the cell holds
    it until its own handlers are in place and then records it, at stage setup (by
    default the signal would end the process, and a submitit task's handler would raise in the
    middle of an import: no record either way). Without JOB_END, SIGTERM counts as the time limit."""
    fields = [f"{key}={value}" for key, value in {**CPU_CELL, "strategy": "single", "steps": 1000}.items()]
    command = [sys.executable, "-m", "hpcfsdp", "run", "--results-dir", str(tmp_path), "--sweep", "early", *fields]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.monotonic() + 60
    while not blocks(proc.pid, sig):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    (path,) = tmp_path.glob("early/cells/*/result.json")
    record = json.loads(path.read_text())
    assert record["status"] == "timeout" and record["stage"] == "setup", record.get("traceback")
    assert f"received {sig.name} (time limit)" in record["error"]


def test_status_of_a_local_submit_still_running_calls_its_cell_running_and_exits_4(ok_sweep, tmp_path, capsys):
    """No scheduler knows a local submit's cells: while it runs one (its earlier record set aside),
    `status` says `running` and exits 4 (in flight), not `missing` and 3; once the submit is gone,
    the cell is what its record says."""
    jobs, results, cell = copy_of(ok_sweep, tmp_path)
    with local_submit_in_a_hanging_cell(jobs, results, cell) as (proc, cell_processes):
        capsys.readouterr()
        assert main(["status", str(results / "kept")]) == 4
        out = capsys.readouterr().out
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=90)
        wait_until(lambda: not alive(cell_processes), 60, "torchrun and its rank to end")
    assert "running" in out and "missing" not in out, out
    assert main(["status", str(results / "kept")]) == 0  # the ok record current again
