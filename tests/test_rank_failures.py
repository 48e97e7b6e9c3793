"""One failing or hanging rank ends its cell in seconds, with a record that says why (issue 32).

Under NCCL a rank that failed used to wait in destroy_process_group while its peer waited on the
GPU, and neither ran its SIGTERM handler (Python runs one only between bytecodes). What the CPU
can show of that runs here for real, under torchrun with gloo: a rank that hangs (the watchdog's
`hang`), a rank blocked inside a collective that gets SIGTERM (the watchdog ends it), a launcher
SIGKILLed under its ranks, a device that cannot be set up, and the local executor's check of GPUs
that other processes hold. bench/gpu_acceptance.sh shows the same paths on two GPUs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import yaml

import hpcfsdp
from hpcfsdp.cell.stopping.watchdog import StepDeadlines
from hpcfsdp.cli import main
from hpcfsdp.sweep.launch import local

TINY = [
    "model=tiny",
    "device=cpu",
    "precision=fp32",
    "seq_len=32",
    "steps=5",
    "warmup_steps=1",
    "comm_profile_steps=0",
]


def start_cell(tmp_path: Path, *fields: str, fault: str = "", nprocs: int = 2) -> subprocess.Popen:
    """torchrun -m hpcfsdp run ... in a session of its own, its output in tmp_path/log.txt."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("HPCFSDP_FAULT", None)
    if fault:
        env["HPCFSDP_FAULT"] = fault
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    command += ["-m", "hpcfsdp", "run", "--results-dir", str(tmp_path / "results"), "--sweep", "t", *TINY, *fields]
    with open(tmp_path / "log.txt", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def the_record(tmp_path: Path) -> dict:
    (path,) = (tmp_path / "results" / "t" / "cells").glob("*/result.json")
    return json.loads(path.read_text())


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the cell's rank processes (those with RANK in their environment) under a launcher."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            values = dict(item.split("=", 1) for item in environ.read_bytes().decode().split("\0") if "=" in item)
            stat = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if values.get("TORCHELASTIC_RUN_ID") and "RANK" in values and int(stat[1]) == launcher:
            found[int(values["RANK"])] = int(environ.parent.name)
    return found


def living(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def wait_for_line(tmp_path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (tmp_path / "log.txt").read_text():
        assert time.monotonic() < deadline, f"no {text!r} in the cell's log:\n{(tmp_path / 'log.txt').read_text()}"
        time.sleep(0.2)


def wait_until_blocked(pid: int, timeout_s: float) -> None:
    """Until the process's main thread sleeps and has used no CPU for 1 s (a wait in a collective),
    rather than a fixed pause that a loaded machine may not give it time to get there in."""

    def state_and_cpu() -> tuple[str, int]:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime in clock ticks

    deadline = time.monotonic() + timeout_s
    still = 0
    state, cpu = state_and_cpu()
    while still < 4:
        assert time.monotonic() < deadline, f"process {pid} never blocked (state {state})"
        time.sleep(0.25)
        state, now = state_and_cpu()
        still = still + 1 if (state == "S" and now == cpu) else 0
        cpu = now


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_cell(tmp_path: Path, *fields: str, fault: str, timeout_s: float) -> dict:
    """start_cell, waited for up to timeout_s and its processes killed either way: the cell's record."""
    proc = start_cell(tmp_path, *fields, fault=fault)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        stop(proc)
    return the_record(tmp_path)


def test_a_step_may_run_its_timeout_past_the_slowest_step_before_it():
    deadlines = StepDeadlines(init_timeout_s=300, train_timeout_s=100)
    assert deadlines.limit_s == 300  # the first step: compile, warm-up, the first collectives
    deadlines.step_ended(40.0)
    assert deadlines.limit_s == 140
    deadlines.step_ended(5.0)
    assert deadlines.limit_s == 140  # the slowest so far, not the last
    deadlines.step_ended(70.0)
    assert deadlines.limit_s == 170


def test_a_rank_that_hangs_ends_its_cell_with_a_hang_record_that_names_it(tmp_path):
    started = time.monotonic()
    proc = start_cell(tmp_path, "strategy=fsdp2_zero3", "train_timeout_s=5", fault="train_step:hang:1")
    try:
        proc.wait(timeout=120)
    finally:
        stop(proc)
    record = the_record(tmp_path)
    assert record["status"] == "hang"
    assert record["stage"] == "train"
    assert record["failed_rank"] == 1  # the rank that stopped answering, not the one waiting for it
    assert "no step ended within" in record["error"] and "inject_fault" in record["error"]
    assert proc.returncode != 0
    assert time.monotonic() - started < 90


def test_a_rank_blocked_in_a_collective_ends_within_10_s_of_its_sigterm(tmp_path):
    """Rank 1 hangs; rank 0 waits for it inside gloo's collective, where Python runs no handler.
    Only rank 0 gets SIGTERM: the watchdog writes its record and ends it, and torchrun then ends
    rank 1. Without the watchdog rank 0 would wait until the collective's timeout (300 s)."""
    proc = start_cell(tmp_path, "strategy=fsdp2_zero3", fault="train_step:hang:1")
    try:
        wait_for_line(tmp_path, "step 1/5", timeout_s=120)
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        wait_until_blocked(ranks[0], timeout_s=120)  # inside the second step's collective, waiting for rank 1
        signalled = time.monotonic()
        os.kill(ranks[0], signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        stop(proc)
    assert took < 10, f"the cell ended {took:.1f} s after its rank's SIGTERM"
    record = the_record(tmp_path)
    assert record["failed_rank"] == 0
    assert "not ended within" in record["error"] and "by the rank itself" in record["error"]
    assert living(ranks.values()) == []


def test_ranks_whose_launcher_is_killed_leave_with_it_and_say_so(tmp_path):
    proc = start_cell(tmp_path, "strategy=fsdp2_zero3", fault="train_step:hang:1")
    try:
        wait_for_line(tmp_path, "step 1/5", timeout_s=120)
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(proc.pid, signal.SIGKILL)  # torchrun itself: none of its handlers run
        proc.wait()
        deadline = time.monotonic() + 15
        while living(ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = living(ranks.values())
    finally:
        for pid in living(ranks_of(proc.pid).values()):
            os.kill(pid, signal.SIGKILL)
    assert left == [], "ranks outlived their launcher"
    record = the_record(tmp_path)
    assert record["status"] == "cancelled"
    assert "launcher (torchrun) is gone" in record["error"]


@pytest.mark.parametrize("strategy", ["fsdp2_zero3"])  # every strategy, on GPUs: bench/gpu_acceptance.sh
def test_a_rank_that_fails_ends_the_cell_at_once_and_its_record_stands(tmp_path, strategy):
    started = time.monotonic()
    record = run_cell(tmp_path, f"strategy={strategy}", fault="train_step:error:1", timeout_s=120)
    assert (record["status"], record["failed_rank"]) == ("error", 1)
    assert "injected fault" in record["error"]
    assert time.monotonic() - started < 60
    assert f"cell {record['cell_id']} failed: RuntimeError: injected fault" in (tmp_path / "log.txt").read_text()


def test_a_device_that_cannot_be_set_up_is_a_record_at_setup_and_one_line(tmp_path):
    proc = start_cell(tmp_path, "strategy=ddp", "device=cuda", nprocs=1)
    proc.wait(timeout=120)
    record = the_record(tmp_path)
    assert (record["status"], record["stage"]) == ("error", "setup")
    assert "no GPU" in record["error"]
    log = (tmp_path / "log.txt").read_text()
    assert "failed at setup: device: cuda was asked for but torch sees no GPU" in log
    # no traceback through hpcfsdp's own code (torchrun's own is there: its child failed). The package's
    # folder, not "/hpcfsdp/": a checkout cloned as hpcfsdp has the venv's torch below that too.
    package = f"{Path(hpcfsdp.__file__).parent}/"
    assert not [line for line in log.splitlines() if line.strip().startswith("File") and package in line]


def fake_nvidia_smi(folder: Path, holder_pid: int) -> Path:
    """An nvidia-smi that reports one GPU, held by holder_pid (this machine has no GPU to hold)."""
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --query-gpu=*) echo '0, GPU-aaaa' ;;\n"
        f"  --query-compute-apps=*) kill -0 {holder_pid} 2>/dev/null &&"
        f" echo '{holder_pid}, python, 30720, GPU-aaaa' ;;\n"
        "esac\n"
    )
    script.chmod(0o755)
    return folder


def test_the_local_executor_does_not_start_a_cell_into_gpus_another_process_holds(tmp_path, monkeypatch, capsys):
    holder = subprocess.Popen(["sleep", "600"])
    try:
        monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', holder.pid)}:{os.environ['PATH']}")
        monkeypatch.setattr(local, "GPU_WAIT_S", 1.0)
        jobs = tmp_path / "held.yaml"
        jobs.write_text(
            yaml.safe_dump({"name": "held", "base": {"model": "tiny", "device": "cuda", "steps": 2, "warmup_steps": 1}})
        )
        code = main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path / "results")])
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr()
    assert code != 0
    assert f"held by pid {holder.pid} (python, 30.0 GiB) on GPU 0" in out.err + out.out
    (record_path,) = (tmp_path / "results" / "held" / "cells").glob("*/result.json")
    record = json.loads(record_path.read_text())
    assert record["status"] == "error" and "not started" in record["error"]
    assert not (record_path.parent / "log.txt").exists()  # no torchrun was started into the held GPU


def test_the_local_executor_starts_a_cell_once_the_gpus_are_free(tmp_path, monkeypatch):
    holder = subprocess.Popen(["sleep", "600"])
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', holder.pid)}:{os.environ['PATH']}")
    env = dict(os.environ)
    assert local.gpus_held(env).startswith(f"pid {holder.pid}")
    holder.kill()
    holder.wait()
    assert local.gpus_held(env) == ""
    assert local.gpus_held({**env, "CUDA_VISIBLE_DEVICES": "1"}) == ""


TWO_NODE_CELL = """
name: {name}
base: {{model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 5, warmup_steps: 1, comm_profile_steps: 0,
       strategy: fsdp2_zero3, nodes: 2, gpus_per_node: 1, train_timeout_s: 5}}
slurm: {{partition: gpu, time_min: 10, cpus_per_task: 1}}
"""


def submit_two_node_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> tuple[int, dict, float]:
    """TWO_NODE_CELL, with `fault` on rank 1 (the second node's), through `submit --executor slurm
    --wait`: submit's exit status, the cell's record and the seconds submit took."""
    name = f"twonode{fault}"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(TWO_NODE_CELL.format(name=name))
    monkeypatch.setenv("HPCFSDP_FAULT", f"train_step:{fault}:1")
    started = time.monotonic()
    code = main(["submit", str(jobs), "--executor", "slurm", "--wait", "--results-dir", str(tmp_path / "results")])
    took = time.monotonic() - started
    (path,) = (tmp_path / "results" / name / "cells").glob("*/result.json")
    return code, json.loads(path.read_text()), took


@pytest.mark.slurm
@pytest.mark.parametrize(("fault", "status"), [("error", "error"), ("hang", "hang")])
def test_a_rank_failing_on_the_second_node_ends_its_two_node_job_in_seconds(
    slurm_cluster, tmp_path, monkeypatch, fault, status
):
    """srun's --kill-on-bad-exit ends the first node's rank once the second node's rank leaves;
    before the watchdog, the hang ran until the job's 10 min limit."""
    code, record, took = submit_two_node_cell(tmp_path, monkeypatch, fault)
    assert code != 0
    assert (record["status"], record["failed_rank"]) == (status, 1), record.get("error")
    assert record["hostnames"] == ["hpcfsdp-n2"]  # written by the failing rank, on the second node
    assert took < 180, f"the two-node job took {took:.0f} s"
    job = record["slurm"]["job_id"]
    state, elapsed = subprocess.run(
        ["sacct", "-nPX", "--format=State,ElapsedRaw", f"--jobs={job}"], capture_output=True, text=True, timeout=60
    ).stdout.split("|")
    assert state.startswith("FAILED") and int(elapsed) < 120, (state, elapsed)


@pytest.mark.parametrize(
    ("strategy", "fault", "signal_name"), [("ddp", "sigkill", "SIGKILL"), ("fsdp2_zero3", "sigsegv", "SIGSEGV")]
)
def test_a_rank_killed_by_a_signal_is_named_with_its_signal_not_recorded_as_its_peers_failure(
    tmp_path, strategy, fault, signal_name
):
    """Rank 1 dies by a signal that leaves no record of its own (the OOM killer's SIGKILL, a crash);
    rank 0 met only its effect (gloo's "Connection reset by peer", or torchrun's SIGTERM) and once
    recorded that under its own rank, or as a time limit."""
    record = run_cell(tmp_path, f"strategy={strategy}", fault=f"train_step:{fault}:1", timeout_s=120)
    assert (record["status"], record["failed_rank"], record.get("failed_signal")) == ("error", 1, signal_name)
    assert record["error"].startswith("rank 1 (pid "), record["error"]
    assert signal_name in record["error"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2_zero3"])
def test_a_rank_that_stops_answering_is_named_not_the_rank_that_waits_for_it(tmp_path, strategy):
    """Rank 1 is stopped (SIGSTOP): its own watchdog stops with it, and rank 0, which waits for it
    inside a collective, once recorded the hang under its own rank."""
    started = time.monotonic()
    record = run_cell(
        tmp_path, f"strategy={strategy}", "train_timeout_s=5", fault="train_step:sigstop:1", timeout_s=150
    )
    assert (record["status"], record["failed_rank"], record.get("failed_signal")) == ("hang", 1, "SIGSTOP")
    assert "rank 1 (pid" in record["error"] and "stopped answering" in record["error"]
    assert time.monotonic() - started < 120


def test_a_rank_waiting_in_ddps_forward_waits_on_its_peers_also_in_a_checkout_cloned_as_hpcfsdp():
    """DDP's forward waits on the peers in torch/nn/parallel/, not torch/distributed/: the training
    step, hpcfsdp's train(), tells. With the venv in a checkout cloned as hpcfsdp (env/setup.sh's
    .venv in ~/hpcfsdp, as in bench/debian13_suite.sh's root) torch's frames are below a folder
    named hpcfsdp too: the rank that waits blamed itself for its stopped peer there."""
    from hpcfsdp.cell.stopping.watchdog import PACKAGE_DIR, _waits_on_peers, _where

    torch_dir = "/home/u/hpcfsdp/.venv/lib/python3.13/site-packages/torch/nn/parallel/distributed.py"
    stack = traceback.StackSummary.from_list(
        [(f"{PACKAGE_DIR}cell/train.py", 120, "train", None), (torch_dir, 1775, "_pre_forward", None)]
    )
    assert _waits_on_peers(stack)
    assert _where(stack) == "waits at distributed.py:1775 in _pre_forward (from train.py:120 in train)"


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("fault", "status", "signals"), [("sigkill", "error", {None, "SIGKILL"}), ("sigstop", "hang", {"SIGSTOP"})]
)
def test_a_rank_killed_or_stopped_on_the_second_node_is_named_under_srun(
    slurm_cluster, tmp_path, monkeypatch, fault, status, signals
):
    """Under srun (--kill-on-bad-exit) the first node's rank met only the effect: a connection reset
    (SIGKILL; where slurmstepd has reaped rank 1 by then, its signal is not known there) or a step
    past its deadline (SIGSTOP). Its heartbeat names rank 1."""
    code, record, took = submit_two_node_cell(tmp_path, monkeypatch, fault)
    assert code != 0
    assert (record["status"], record["failed_rank"]) == (status, 1), record.get("error")
    assert record.get("failed_signal") in signals
    assert record["error"].startswith("rank 1 (pid ") and "on hpcfsdp-n2)" in record["error"], record["error"]
    assert [r["host"] for r in record["ranks"]] == ["hpcfsdp-n1", "hpcfsdp-n2"]
    assert took < 180, f"the two-node job took {took:.0f} s"


def srun_cell(tmp_path: Path, gres: int) -> dict:
    """A CPU cell of gpus_per_node=2, planned by `submit --executor print` and run as srun's two
    tasks on one node given `gres` GPUs (the local cluster's fake ones: Slurm sets
    CUDA_VISIBLE_DEVICES); its record."""
    jobs = tmp_path / "t.yaml"
    base = {key: yaml.safe_load(value) for key, value in (field.split("=", 1) for field in TINY)}
    jobs.write_text(yaml.safe_dump({"name": "t", "base": base | {"strategy": "ddp", "gpus_per_node": 2}}))
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    (cell,) = (tmp_path / "results" / "t" / "cells").iterdir()
    command = ["srun", "-p", "gpu", "-N1", "-n2", f"--gres=gpu:{gres}", "--time=5", "--kill-on-bad-exit=1"]
    env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("HPCFSDP_FAULT", None)
    done = subprocess.run(
        [*command, sys.executable, "-m", "hpcfsdp", "run", "--cell-dir", str(cell)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return the_record(tmp_path)


@pytest.mark.slurm
def test_a_cell_given_fewer_gpus_than_it_asked_says_so_in_its_record_status_and_collect(
    slurm_cluster, tmp_path, capsys
):
    """Two ranks on a node that Slurm gave one GPU (as an SBATCH_GRES=gpu:1 in the submitting shell
    did): the cell trains, and once recorded plain `ok` as if it ran on two GPUs."""
    record = srun_cell(tmp_path, 1)
    assert record["status"] == "ok"
    assert record["resource_problems"] == [
        "2 GPUs per node asked, 1 visible on hpcfsdp-n1",
        "ranks 0 and 1 share GPU 0 on hpcfsdp-n1",
    ]
    assert [(r["rank"], r["host"], r["device"], r["gpu_uuid"]) for r in record["ranks"]] == [
        (0, "hpcfsdp-n1", "cpu", None),
        (1, "hpcfsdp-n1", "cpu", None),
    ]
    assert all(isinstance(r["cpus"], int) and r["cpus"] >= 1 for r in record["ranks"])
    capsys.readouterr()
    for command in ("status", "collect"):
        main([command, str(tmp_path / "results" / "t"), *(["--no-history"] if command == "collect" else [])])
        said = capsys.readouterr().err
        assert "did not run on the resources it asked for (2 GPUs per node asked, 1 visible" in said, command


@pytest.mark.slurm
def test_a_cell_given_the_gpus_it_asked_for_has_no_resource_problems(slurm_cluster, tmp_path):
    record = srun_cell(tmp_path, 2)
    assert (record["status"], record["resource_problems"]) == ("ok", [])


def test_a_peer_killed_while_this_rank_is_busy_is_named_with_its_signal_though_torchrun_reaped_it_first(tmp_path):
    """Rank 0 is busy outside any collective (`hang` sleeps in Python) when rank 1 is SIGKILLed:
    torchrun reaps rank 1 within its 0.1 s poll and only then sends rank 0 SIGTERM, and writes its
    "failed (exitcode: -9)" line once rank 0 has ended. Rank 0's handler found rank 1 gone from /proc
    and no line to read: "died without a record", no signal (a ddp row, once, on a loaded machine).
    Its watchdog thread now holds a pidfd of rank 1 and reads the exit code as rank 1 exits."""
    proc = start_cell(tmp_path, "strategy=ddp", "train_timeout_s=300", fault="train_step:hang:0")
    try:
        wait_for_line(tmp_path, "fault hang", timeout_s=120)
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        wait_until_blocked(ranks[1], timeout_s=120)  # rank 1 waits for rank 0 in the step's collective
        os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=90)
    finally:
        stop(proc)
    record = the_record(tmp_path)
    assert (record["status"], record["failed_rank"], record.get("failed_signal")) == ("error", 1, "SIGKILL"), record[
        "error"
    ]
    assert record["error"].startswith(f"rank 1 (pid {ranks[1]} "), record["error"]


def test_a_watched_process_killed_and_reaped_at_once_still_has_its_exit_code():
    """PeerExits: the pidfd wakes the watcher as the process exits, before its parent reaps it."""
    from hpcfsdp.cell.stopping.processes import PeerExits, process_start

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exits = PeerExits()
    exits.watch(child.pid, process_start(child.pid))
    assert len(exits.fds()) == 1
    exits.watch(child.pid, "0")  # a start time that is not the process's: a reused pid, not watched
    assert len(exits.fds()) == 1
    child.kill()
    ready, _, _ = select.select(exits.fds(), [], [], 10)
    exits.exited(ready)
    child.wait()  # reaped: /proc no longer knows it
    assert not Path(f"/proc/{child.pid}").exists()
    assert (exits.code(child.pid), exits.fds()) == (signal.SIGKILL, [])


def test_a_peer_on_this_node_is_watched_once_its_heartbeat_is_read_and_a_lost_folder_stops_nothing(tmp_path):
    """Heartbeat.beat (the watchdog thread's) reads the peers' files until every peer on this node
    is watched; a folder gone under it is no exception in that thread, which would end its watch."""
    import socket

    from hpcfsdp.cell.stopping.heartbeats import HEARTBEATS_DIR, Heartbeat
    from hpcfsdp.cell.stopping.processes import process_start
    from hpcfsdp.contracts.files import write_json

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        heartbeat = Heartbeat(tmp_path, "launch", 0, "n1", world_size=3, local_peers=1)
        heartbeat.beat()
        assert heartbeat.exits.fds() == []  # no peer has written its file yet
        fields = {"launch_id": "launch", "node": "n1", "machine": socket.gethostname(), "left": False}
        write_json(
            tmp_path / HEARTBEATS_DIR / "rank1.json",
            {**fields, "rank": 1, "pid": peer.pid, "start": process_start(peer.pid)},
        )
        heartbeat.beat()
        assert len(heartbeat.exits.fds()) == 1
        peer.kill()
        ready, _, _ = select.select(heartbeat.exits.fds(), [], [], 10)
        heartbeat.exits.exited(ready)
        peer.wait()
        trouble = heartbeat.peer_trouble("error")
        assert trouble is not None and (trouble.rank, trouble.signal) == (1, "SIGKILL"), trouble
    finally:
        peer.kill()
        peer.wait()
    lost = Heartbeat(tmp_path / "lost", "launch", 0, "n1", world_size=2, local_peers=1)
    (tmp_path / "lost" / HEARTBEATS_DIR / "rank0.json").unlink()
    (tmp_path / "lost" / HEARTBEATS_DIR / "rank0.fault").unlink()
    (tmp_path / "lost" / HEARTBEATS_DIR).rmdir()
    lost.beat()
    assert lost.exits.fds() == []


def test_a_rank_whose_output_shares_its_launchers_file_reads_there_the_signal_that_ended_a_reaped_peer(tmp_path):
    """torchrun writes "failed (exitcode: -9) ... (pid: N)" as it reaps a rank, before it sends the
    others SIGTERM, and srun "task N: Segmentation fault": a peer gone from /proc still gets its
    signal named."""
    log = tmp_path / "log.txt"
    log.write_text(
        "E1127 04:53:07.293000 8272 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: /usr/bin/python\n"
        "srun: error: hpcfsdp-n2: task 3: Segmentation fault\n"
    )
    said = "launcher_said(4242, 1), launcher_said(5151, 3), launcher_said(4243, 2)"
    code = f"from hpcfsdp.cell.stopping.heartbeats import launcher_said; print({said})"
    with open(log, "a") as output:
        said = subprocess.run(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=output, text=True, timeout=60
        )
    assert said.stdout.split() == ["SIGKILL", "SIGSEGV", "None"]


def test_the_sigterm_a_rank_gets_after_its_peer_stopped_is_no_time_limit(tmp_path):
    """Rank 1 stops (SIGSTOP); rank 0 waits for it inside gloo's collective, where Python runs no
    handler, and then gets the SIGTERM a launcher sends (torchrun's, once a peer died; on GPUs rank 0
    sits in NCCL the same way). Its watchdog once recorded "received SIGTERM (time limit)" there."""
    proc = start_cell(tmp_path, "strategy=fsdp2_zero3", "train_timeout_s=300", fault="train_step:sigstop:1")
    try:
        wait_for_line(tmp_path, "fault sigstop", timeout_s=120)
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        wait_until_blocked(ranks[0], timeout_s=120)
        os.kill(ranks[0], signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        stop(proc)
    record = the_record(tmp_path)
    assert (record["status"], record["failed_rank"], record.get("failed_signal")) == ("hang", 1, "SIGSTOP")
    assert "rank 1 (pid" in record["error"] and "received SIGTERM" in record["error"]
    assert "time limit" not in record["error"]


def test_a_sigcont_before_srun_ends_a_step_is_no_time_limit_for_a_rank_blocked_in_a_collective():
    """srun ends a step whose task died with SIGCONT, then SIGTERM. A rank blocked in NCCL leaves
    through its watchdog, which asks signal_outcome what each signal means: on 2 x H100 under Slurm
    the SIGCONT read as the time limit ("received SIGCONT (time limit)"), before the SIGTERM that
    names the dead peer. Only the ending signals end a rank."""
    from hpcfsdp.cell.stopping.signals import LAUNCHER_GONE, signal_outcome

    assert signal_outcome(signal.SIGCONT, requeue=False) is None
    assert signal_outcome(signal.SIGUSR1, requeue=False) is None
    assert signal_outcome(signal.SIGUSR2, requeue=False) == ("timeout", "received SIGUSR2 (time limit)")
    assert signal_outcome(LAUNCHER_GONE, requeue=False)[0] == "cancelled"
