"""The runner (slurm.py) against the real local cluster, and against Slurm that does not answer:
a controller that accepts connections and never replies (past the runner's timeout), a
controller port where nothing listens (a stopped slurmctld, as its clients see it), and a PATH
without Slurm."""

from __future__ import annotations

import os
import time

import pytest

from conftest import client_conf, free_port, silent_controller, slurm
from hpcfsdp.slurm import SlurmError, Watcher, ask


@pytest.fixture
def jobs(slurm_cluster, tmp_path):
    """A held array of two tasks, a job that runs, and a job that ran and completed; the first two are
    cancelled at the end."""

    def sbatch(*args: str) -> str:
        common = ["--parsable", "--time=5", "--cpus-per-task=1", "--job-name=hpcfsdp-test-runner"]
        return slurm("sbatch", *common, f"--output={tmp_path}/%j.out", *args).strip().split(";")[0]

    array, running, done = (
        sbatch("--hold", "--array=0-1", "--wrap", "sleep 300"),
        sbatch("--wrap", "sleep 300"),
        sbatch("--wrap", "true"),
    )
    deadline = time.time() + 120
    while slurm("sacct", "-nPX", "--format=State", f"--jobs={running},{done}").split() != ["RUNNING", "COMPLETED"]:
        assert time.time() < deadline, slurm("squeue")
        time.sleep(0.3)
    yield array, running, done
    slurm("scancel", array, running)


@pytest.mark.slurm
def test_the_runner_asks_the_local_cluster_and_names_the_command_and_cluster_when_it_fails(slurm_cluster):
    assert "hpcfsdp-local" in ask("sacctmgr", "--noheader", "--parsable2", "show", "clusters", "format=Cluster")
    assert ask("sinfo", "--noheader", "--format=%P", cluster="hpcfsdp-local").strip()
    with pytest.raises(SlurmError) as failed:
        ask("squeue", "--noheader", cluster="nowhere")
    message = str(failed.value)
    assert message.startswith("squeue on cluster nowhere: ") and "\n" not in message, message
    assert failed.value.answered and failed.value.stderr


@pytest.mark.slurm
def test_a_watcher_asks_squeue_once_per_poll_and_sacct_never_again_about_a_settled_job(jobs):
    array, running, done = jobs
    watcher = Watcher()
    first = watcher.queue([f"{array}_0"])
    assert watcher.queue([f"{array}_1"]) == first  # the same array, the same poll: no second squeue
    assert sorted(first) == [f"{array}_0", f"{array}_1"] and "|PENDING|" in first[f"{array}_0"]
    assert watcher.calls["squeue"] == 1
    assert watcher.accounting([done])[done][0][:2] == [done, "COMPLETED"]
    assert watcher.accounting([done, running])[running][0][:2] == [running, "RUNNING"]  # only the new id asked
    assert watcher.calls["sacct"] == 2
    watcher.poll()
    assert sorted(watcher.queue([f"{array}_0"])) == [f"{array}_0", f"{array}_1"]
    assert set(watcher.accounting([done, running])) == {done, running}  # asked of the running job only
    assert watcher.calls == {"squeue": 2, "sacct": 3}
    watcher.cancel([f"{array}_1"])
    assert sorted(watcher.queue([array])) == [f"{array}_0"]  # scancel forgets what squeue said this poll
    watcher.cancel([f"{array}_1"])  # gone already: no error
    assert watcher.calls["squeue"] == 3


@pytest.mark.slurm
def test_a_controller_that_never_answers_is_a_one_line_error_after_the_runners_timeout(slurm_cluster, tmp_path):
    silent = silent_controller()
    try:
        # Slurm's own wait (MessageTimeout) is longer than the runner's: the runner's timeout ends it.
        conf = client_conf(tmp_path, "silent", SlurmctldPort=str(silent.getsockname()[1]), MessageTimeout="60")
        started = time.monotonic()
        with pytest.raises(SlurmError) as failed:
            ask("squeue", "--noheader", timeout_s=1.5, env={**os.environ, "SLURM_CONF": conf})
        assert time.monotonic() - started < 10
    finally:
        silent.close()
    assert str(failed.value) == "squeue: did not answer within 1.5 s"
    assert not failed.value.answered


@pytest.mark.slurm
def test_a_stopped_controller_and_a_missing_slurm_are_one_line_errors_of_one_kind(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(
        "SLURM_CONF", client_conf(tmp_path, "stopped", SlurmctldPort=str(free_port()), MessageTimeout="2")
    )
    with pytest.raises(SlurmError) as failed:
        Watcher().queue(["12_0"], "")
    assert str(failed.value) == "squeue: slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm client here
    with pytest.raises(SlurmError) as missing:
        ask("sacct", "--noheader", cluster="hpcfsdp-local")
    assert str(missing.value) == "sacct on cluster hpcfsdp-local: not found (no Slurm client on PATH)"
