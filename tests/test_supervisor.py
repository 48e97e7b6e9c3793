"""One supervisor per node (issue 52): a lone rank that dies or stops has its record written by its
node's supervisor, naming the cause, the rank, its pid and its node, under `--executor local` and
under Slurm (one task per node, which starts the node's ranks); a node that vanishes is named by the
survivors; each rank runs with its share of the task's CPUs as OMP_NUM_THREADS.

Real runs: the local executor and the local Slurm cluster, the tiny model on CPU (gloo), the
faults of HPCFSDP_FAULT (a SIGKILL, a SIGSTOP the rank sends itself)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcfsdp.cell.supervise.cgroup import oom_kills
from hpcfsdp.cell.supervise.layout import NodeLayout
from hpcfsdp.cell.supervise.start import start_rank
from hpcfsdp.cell.supervise.watch import RankProcess
from hpcfsdp.cli import main
from hpcfsdp.sweep.track.processes import launched_in, processes_under

LONE_CELL = """
name: {name}
base: {{model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: {steps}, warmup_steps: 1,
       comm_profile_steps: 0, strategy: ddp, nodes: {nodes}, gpus_per_node: 1, train_timeout_s: 5}}
slurm: {{partition: gpu, time_min: 10, cpus_per_task: {cpus}}}
"""
FAULT_LINE = re.compile(r"\[hpcfsdp\] fault \w+ at \w+ on rank \d+ at (\d+\.\d+)")


def submit_cell(
    tmp_path: Path, executor: str, fault: str = "", nodes: int = 1, steps: int = 5, cpus: int = 1, wait: bool = True
) -> tuple[int, Path]:
    """One tiny DDP cell of `nodes` x 1 rank submitted with `fault` on rank 0; submit's exit status
    and the cell's folder."""
    name = f"lone{fault}{executor}{nodes}"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(LONE_CELL.format(name=name, nodes=nodes, steps=steps, cpus=cpus))
    os.environ.pop("HPCFSDP_FAULT", None)
    if fault:
        os.environ["HPCFSDP_FAULT"] = f"train_step:{fault}:0"
    try:
        args = ["submit", str(jobs), "--executor", executor, "--results-dir", str(tmp_path / "results")]
        code = main([*args, "--wait"] if wait and executor == "slurm" else args)
    finally:
        os.environ.pop("HPCFSDP_FAULT", None)
    (cell,) = (tmp_path / "results" / name / "cells").iterdir()
    return code, cell


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def fault_to_record_s(cell: Path, logs: list[Path]) -> float:
    """Seconds from the fault (the line inject_fault prints, with its time) to the record's write."""
    text = "\n".join(path.read_text(errors="replace") for path in logs if path.is_file())
    found = FAULT_LINE.search(text)
    assert found, f"no fault line in {logs}:\n{text[-3000:]}"
    return (cell / "result.json").stat().st_mtime - float(found.group(1))


def slurm_logs(cell: Path) -> list[Path]:
    return sorted((cell.parents[1] / "slurm").glob("*/*_log.*"))


def test_a_lone_rank_sigkilled_under_the_local_executor_is_recorded_with_its_signal_and_rank_within_10_s(tmp_path):
    code, cell = submit_cell(tmp_path, "local", "sigkill")
    record = json.loads((cell / "result.json").read_text())
    assert code != 0
    assert (record["status"], record["failed_rank"], record["failed_signal"]) == ("error", 0, "SIGKILL")
    assert record["error"].startswith(f"rank 0 (pid {record['failed_pid']} on ") and "SIGKILL" in record["error"]
    assert record["failed_node"] and record["recorded_by"].startswith("supervisor (pid ")
    assert fault_to_record_s(cell, [cell / "log.txt"]) < 10
    assert launched_in(tmp_path) == {}


def test_a_lone_rank_sigstopped_under_the_local_executor_is_a_hang_within_train_timeout_and_10_s(tmp_path):
    code, cell = submit_cell(tmp_path, "local", "sigstop")
    record = json.loads((cell / "result.json").read_text())
    assert code != 0
    assert (record["status"], record["failed_rank"], record["failed_signal"]) == ("hang", 0, "SIGSTOP"), record
    assert "stopped" in record["error"] and record["stage"] == "train"
    assert fault_to_record_s(cell, [cell / "log.txt"]) < 5 + 10
    assert launched_in(tmp_path) == {}


def test_a_local_submits_supervisor_killed_mid_cell_leaves_that_cell_a_record_and_the_next_a_fresh_one(tmp_path):
    """The local executor keeps one supervisor process for all the cells of a submit. SIGKILLed
    while it runs the first cell: that cell's record says so (error, the supervisor's exit), the
    ranks it left are ended, and the second cell runs under a new supervisor and records ok."""
    jobs = tmp_path / "killed.yaml"
    jobs.write_text(LONE_CELL.format(name="killed", nodes=1, steps=100_000, cpus=1) + "matrix: {steps: [100000, 3]}\n")
    results = tmp_path / "results"
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "local", "--results-dir"]
    env = {k: v for k, v in os.environ.items() if k != "HPCFSDP_FAULT"}
    submit = subprocess.Popen([*command, str(results)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    logs: list[Path] = []
    while not any("forked after" in log.read_text(errors="replace") for log in logs) and time.monotonic() < deadline:
        time.sleep(0.2)
        logs = list(results.glob("killed/cells/*/log.txt"))
    # submit's child (its forked ranks show the same command line, one level below)
    (supervisor,) = [pid for pid in processes_under(submit.pid) if _parent(pid) == submit.pid]
    os.kill(supervisor, signal.SIGKILL)
    output, _ = submit.communicate(timeout=180)
    assert submit.returncode == 3, output.decode(errors="replace")
    records = [json.loads(path.read_text()) for path in results.glob("killed/cells/*/result.json")]
    by_steps = {record["spec"]["steps"]: record for record in records}
    killed, after = by_steps[100_000], by_steps[3]
    # Whichever writes first: the rank, told by its parent-death signal, or the local executor.
    said = {"cancelled": "the rank's launcher (the node's supervisor) is gone", "error": "its supervisor exited -9"}
    assert killed["status"] in said and said[killed["status"]] in killed["error"], killed
    assert after["status"] == "ok", after.get("error")
    after_log = (results / "killed/cells" / after["cell_id"] / "log.txt").read_text()
    assert f"supervisor (pid {supervisor})" not in after_log and "supervisor (pid " in after_log
    assert launched_in(results) == {}


@pytest.mark.slurm
@pytest.mark.parametrize(("fault", "status", "within_s"), [("sigkill", "error", 10), ("sigstop", "hang", 5 + 10)])
def test_a_lone_rank_killed_or_stopped_under_srun_is_recorded_by_its_supervisor_and_the_job_leaves_the_queue(
    slurm_cluster, tmp_path, fault, status, within_s
):
    """Before the supervisor, the SIGKILLed lone rank left no record (status `missing`), and the
    stopped one held its node until the time limit: its watchdog stopped with it."""
    started = time.monotonic()
    code, cell = submit_cell(tmp_path, "slurm", fault)
    record = json.loads((cell / "result.json").read_text())
    assert code != 0
    assert (record["status"], record["failed_rank"], record["failed_signal"]) == (status, 0, fault.upper())
    assert record["failed_node"] == "hpcfsdp-n1" and "on hpcfsdp-n1)" in record["error"]
    assert fault_to_record_s(cell, slurm_logs(cell)) < within_s
    job = record["slurm"]["job_id"]
    queued = subprocess.run(["squeue", "-h", f"--jobs={job}"], capture_output=True, text=True, timeout=60).stdout
    assert queued.strip() == "" and time.monotonic() - started < 180


@pytest.mark.slurm
def test_a_two_node_cell_whose_second_node_vanishes_is_recorded_naming_that_node(slurm_cluster, tmp_path, monkeypatch):
    """The second node's supervisor and its rank are SIGKILLed (a node lost); the first node's rank
    meets the dropped connection and names the second node's rank from its heartbeat."""
    monkeypatch.delenv("OMP_NUM_THREADS")  # each rank's share of its task's one CPU
    code, cell = submit_cell(tmp_path, "slurm", nodes=2, steps=100_000, wait=False)
    assert code == 0
    heartbeat = cell / "heartbeats" / "rank1.json"
    deadline = time.monotonic() + 240
    while not (heartbeat.is_file() and (cell / "progress.json").is_file()):
        assert time.monotonic() < deadline, "the second node's rank never started"
        time.sleep(0.5)
    time.sleep(2)  # into its steps
    rank = json.loads(heartbeat.read_text())["pid"]
    supervisor = int(Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(supervisor, signal.SIGKILL)
    os.killpg(rank, signal.SIGKILL)
    record_path = cell / "result.json"
    while not record_path.is_file() or json.loads(record_path.read_text()).get("status") == "ok":
        assert time.monotonic() < deadline + 60, "no record after the second node vanished"
        time.sleep(0.5)
    time.sleep(1)  # the first ending stands; a later write would show here
    record = json.loads(record_path.read_text())
    assert record["failed_rank"] == 1 and "on hpcfsdp-n2)" in record["error"], record["error"]
    assert record["environment"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.slurm
def test_each_rank_under_srun_runs_with_the_cpus_of_its_task_as_omp_num_threads(slurm_cluster, tmp_path, monkeypatch):
    """Slurm gave the task 2 CPUs (srun's --cpus-per-task given again: 22.05 does not inherit
    sbatch's); before the supervisor the rank ran without OMP_NUM_THREADS."""
    monkeypatch.delenv("OMP_NUM_THREADS")  # the local cluster's fixture sets it, as a user may
    code, cell = submit_cell(tmp_path, "slurm", cpus=2)
    record = json.loads((cell / "result.json").read_text())
    assert code == 0 and record["status"] == "ok", record.get("error")
    assert record["environment"]["OMP_NUM_THREADS"] == "2"


def test_a_nodes_cpus_are_shared_among_its_ranks_unless_the_user_set_the_threads():
    layout = NodeLayout(node=1, nodes=2, per_node=2, master_addr="n1", master_port=29500, cpus=8)
    second = layout.rank_environment(1, "launch", {})
    assert (second["RANK"], second["LOCAL_RANK"], second["WORLD_SIZE"]) == ("3", "1", "4")
    assert (second["OMP_NUM_THREADS"], second["MASTER_ADDR"], second["HPCFSDP_LAUNCH_ID"]) == ("4", "n1", "launch")
    assert layout.rank_environment(0, "launch", {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_the_oom_killers_count_is_read_from_this_machines_cgroup():
    assert isinstance(oom_kills(), int)


@pytest.mark.parametrize(
    ("cgroup", "shown", "folder", "kind"),
    [
        # a podman container on cgroup v1 (a fresh Debian 12 one here, 2026-11-29): the host's path,
        # and a mount that shows only the container's own cgroup; before, no count was found there
        ("4:memory:/libpod_parent/libpod-ab12\n0::/\n", "/libpod_parent/libpod-ab12", "", "cgroup"),
        ("4:memory:/process_api/job 7\n0::/\n", "/", "process_api/job 7", "cgroup"),  # this machine's layout
        ("0::/slurm/uid_0/job_9/step_0\n", "/slurm", "uid_0/job_9/step_0", "cgroup2"),  # v2, mounted below its root
    ],
)
def test_the_oom_killers_count_is_found_through_the_mount_that_shows_the_processs_cgroup(
    tmp_path, cgroup, shown, folder, kind
):
    """The process's cgroup path is read below the mount of its hierarchy that shows it, as
    /proc/PID/mountinfo says (its fourth field), with the mount point's escapes undone."""
    point = tmp_path / "sys fs" / "memory"
    (point / folder).mkdir(parents=True)
    events = "memory.events" if kind == "cgroup2" else "memory.oom_control"
    (point / folder / events).write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(cgroup)
    escaped = str(point).replace(" ", "\\040")
    (tmp_path / "4242" / "mountinfo").write_text(
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 {shown.replace(' ', chr(92) + '040')} {escaped} rw,relatime - {kind} {kind} rw,memory\n"
    )
    assert oom_kills(4242, proc=tmp_path) == 3


# Two cells, one after another, in one process that has not imported torch: as tune's probes run in
# their Slurm job (sweep/launch/job.launch_here), and a CellJob of several cells.
TWO_CELLS = """
import json, os, signal, sys, time
from hpcfsdp.cell.supervise.entry import supervise_here
def mine(signum, frame): pass
signal.signal(signal.SIGTERM, mine)
seen = {"torch_before": "torch" in sys.modules, "pid": os.getpid()}
for name, cell in zip(("first", "second"), sys.argv[1:]):
    os.environ["HPCFSDP_LAUNCH_STARTED"] = repr(time.time())
    seen[name] = supervise_here(cell, 1)
    seen[name + "_handler_kept"] = signal.getsignal(signal.SIGTERM) is mine
print(json.dumps(seen))
"""


def test_one_supervisor_process_imports_the_ranks_code_once_and_forks_the_ranks_of_each_of_its_cells(tmp_path):
    """The first cell's launch pays the imports (in the supervisor, before its rank is forked: the
    rank's own `imports` phase is nothing); the second cell's launch pays none, and its fixed cost
    (launch span less the timed window) is smaller by at least a second. The supervisor had one
    thread when it forked (without OMP_NUM_THREADS in its environment, torch's import would start a
    second), and its signal handlers are its own again after each cell. Before: every rank a new
    interpreter importing torch, and the supervisor's handlers left in place."""
    jobs = tmp_path / "two.yaml"
    jobs.write_text(LONE_CELL.format(name="two", nodes=1, steps=3, cpus=1) + "matrix: {seed: [1, 2]}\n")
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    cells = sorted((tmp_path / "results" / "two" / "cells").iterdir())
    env = {**os.environ}
    for name in ("HPCFSDP_RANK_START", "OMP_NUM_THREADS"):  # as a Slurm task's: torch's import starts no threads
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", TWO_CELLS, *map(str, cells)], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["torch_before"] is False and (seen["first"], seen["second"]) == (0, 0), proc.stdout[-3000:]
    assert seen["first_handler_kept"] and seen["second_handler_kept"]
    said = rf"supervisor \(pid {seen['pid']}\): rank\(s\) forked after (\d+\.\d) s of imports"
    forked = re.findall(said, proc.stdout)
    assert len(forked) == 2 and float(forked[0]) > 0.5 and float(forked[1]) < 0.5, proc.stdout[-3000:]
    first, second = (json.loads((cell / "result.json").read_text()) for cell in cells)
    assert first["status"] == second["status"] == "ok"
    assert first["phases"]["imports"] < 0.5 and second["phases"]["imports"] < 0.5, (first["phases"], second["phases"])

    def fixed(record: dict) -> float:
        return record["launch_span_s"] - record["phases"]["timed_window"]

    assert fixed(second) < fixed(first) - 1.0, (first["phases"], second["phases"])


@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_rank_started_either_way_exits_as_hpcfsdp_run_does_and_is_read_by_its_pid(tmp_path, capfd, how):
    """A folder without spec.json: `hpcfsdp run --cell-dir` refuses it in one line with exit status
    2, before it imports torch; the forked rank leaves with that status, never returning here."""
    rank = RankProcess(0, start_rank(how, tmp_path, {**os.environ}), "here")
    while rank.poll() is None:
        time.sleep(0.05)
    assert rank.returncode == 2 and rank.poll() == 2
    assert f"{tmp_path}: no spec.json here" in capfd.readouterr().err
