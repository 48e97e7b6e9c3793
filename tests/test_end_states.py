"""Every way Slurm ends a job gets its own status, on a cluster of this module's own
(slurm/local/start.sh with preemption tiers, memory as a consumable with OverMemoryKill, and
accounting): a preempted cell records `preempted` and is requeued by Slurm up to slurm.max_requeue
times, a node taken down under a cell records `node_fail`, a cell over its memory `host_oom` with
the mem_gb to ask for, and a job past its deadline `deadline`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import free_port_block, slurm, start_slurm, stop_slurm
from hpcfsdp.cell.stopping.requeue import JobView
from hpcfsdp.cli import main
from hpcfsdp.contracts.endings import ended_by, memory_to_ask
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.track.preemptions import preemption_note
from hpcfsdp.sweep.track.status import record_lost_cells, sweep_status

TINY = (
    "model: tiny, device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1, comm_profile_steps: 0, "
    "strategy: ddp"
)


def hang_while(flag: Path) -> str:
    """A setup line: while `flag` exists the cell trains until a signal ends it (a run still
    training when Slurm ends the job); once the test removes it, the next run trains to the end."""
    flag.touch()
    return f"if [ -e {flag} ]; then export HPCFSDP_FAULT=train_step:hang; fi"


@pytest.fixture(scope="module")
def site_knobs() -> dict[str, str]:
    return {
        "HPCFSDP_SLURM_DIR": tempfile.mkdtemp(prefix="hpcfsdp-slurm-ends-"),
        "HPCFSDP_SLURM_PORT": str(free_port_block(5)),
        "HPCFSDP_SLURM_CPUS": "4",
        "HPCFSDP_SLURM_PREEMPT": "1",
        "HPCFSDP_SLURM_MEMORY_LIMIT": "1",
        "HPCFSDP_SLURM_POWER_SAVE": "1",
    }


@pytest.fixture(scope="module")
def site_cluster_env(site_knobs) -> Iterator[dict[str, str]]:
    try:
        env, _ = start_slurm(site_knobs)
        yield env
    finally:
        stop_slurm(site_knobs, "--purge")
        shutil.rmtree(site_knobs["HPCFSDP_SLURM_DIR"], ignore_errors=True)


@pytest.fixture
def site_cluster(site_cluster_env, monkeypatch) -> dict[str, str]:
    for key, value in site_cluster_env.items():
        monkeypatch.setenv(key, value)
    return site_cluster_env


def submit(tmp_path: Path, name: str, text: str, capsys) -> tuple[Path, str, str]:
    """Submit a sweep of one cell: its folder, cell id and job id."""
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(textwrap.dedent(text))
    results = tmp_path / "results"
    assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
    (job,) = re.findall(r"submitted array (\d+)", capsys.readouterr().out)
    (cell,) = load_sweep(jobs).cells
    return results / name, cell.id, job


def job_field(job: str, name: str) -> str:
    """A field of `scontrol show job` ("" once the job is gone)."""
    try:
        info = slurm("scontrol", "--oneliner", "show", "job", job)
    except Exception:
        return ""
    found = re.search(rf"\b{name}=(\S*)", info)
    return found.group(1) if found else ""


def node_state(node: str) -> str:
    """sinfo's state of the node: idle, idle~ (powered down), idle# (powering up), down~, ..."""
    return slurm("sinfo", "--noheader", "--Node", "--nodes", node, "--partition=gpu", "--format=%T").strip()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, f"{what}: not after {timeout_s} s\n{slurm('squeue')}{slurm('sinfo', '-N')}"
        time.sleep(1)


def training(job_dir: Path, runs: int = 1) -> Callable[[], bool]:
    """The job's rank 0 has reached training in its `runs`-th run (its submitit log says so)."""
    return lambda: sum(p.read_text(errors="replace").count(": training ") for p in job_dir.glob("*_0_log.out")) >= runs


def preempt() -> None:
    """A job of the higher partition that needs every CPU of both nodes: Slurm requeues (or ends)
    the gpu partition's jobs there."""
    slurm(
        "sbatch",
        "--partition=urgent",
        "--nodes=2",
        "--cpus-per-task=4",
        "--mem=100M",
        "--time=1",
        "--output=/dev/null",
        "--wrap=true",
    )


def record(sweep_dir: Path, cell_id: str, name: str = "result.json") -> dict:
    return json.loads((sweep_dir / "cells" / cell_id / name).read_text())


def status_of(sweep_dir: Path, cell_id: str) -> str:
    """The status of the cell's record, "" while it has none (a requeued run moved it to attempts/)."""
    try:
        return record(sweep_dir, cell_id)["status"]
    except (FileNotFoundError, json.JSONDecodeError):
        return ""


def restart_now(job: str, restarts: int) -> None:
    """Slurm holds a requeued job about 2 minutes (BeginTime): start it now."""
    wait_for(f"job {job} requeued", lambda: job_field(job, "Restarts") == str(restarts))
    wait_for(f"job {job} pending", lambda: job_field(job, "JobState") == "PENDING")
    slurm("scontrol", "update", f"JobId={job}", "StartTime=now")


@pytest.mark.slurm
def test_a_preempted_cell_without_requeues_and_a_node_taken_down_each_record_their_ending(
    site_cluster, tmp_path, capsys
):
    flag = tmp_path / "hang"
    preempted_dir, preempted, preempted_job = submit(
        tmp_path,
        "preempted",
        f"""
        name: preempted
        base: {{{TINY}, gpus_per_node: 1}}
        slurm: {{time_min: 10}}
        setup: ["{hang_while(flag)}"]
        """,
        capsys,
    )
    wait_for("training", training(preempted_dir / "slurm" / preempted_job))
    preempt()
    wait_for("record", lambda: (preempted_dir / "cells" / preempted / "result.json").exists())
    # The ranks ask squeue why they got SIGTERM (PreemptTime); where it does not answer them in time
    # (a busy machine) they record `cancelled`, and status corrects that from sacct's PREEMPTED.
    wait_for("job ends", lambda: job_field(preempted_job, "JobState") not in ("RUNNING", "COMPLETING"))
    assert main(["status", str(preempted_dir)]) == 3  # a cell not ok
    assert f"{preempted_dir}: 1 cell(s): preempted 1" in capsys.readouterr().out
    got = record(preempted_dir, preempted)
    assert got["status"] == "preempted" and "max_requeue" in got["advice"], got.get("error")
    # Not requeued by Slurm (max_requeue 0): --retry-failed reruns it, and it trains to the end.
    flag.unlink()
    command = ["submit", str(tmp_path / "preempted.yaml"), "--executor", "slurm", "--retry-failed", "--wait"]
    assert main([*command, "--results-dir", str(tmp_path / "results")]) == 0
    assert record(preempted_dir, preempted)["status"] == "ok"
    assert record(preempted_dir, preempted, "attempts/1.json")["status"] == "preempted"
    assert main(["status", str(preempted_dir)]) == 0
    assert f"{preempted_dir}: 1 cell(s): ok 1; preempted 1 time(s) in 1 cell(s)" in capsys.readouterr().out

    down_dir, down, down_job = submit(
        tmp_path,
        "down",
        f"""
        name: down
        base: {{{TINY}, gpus_per_node: 1}}
        slurm: {{time_min: 10}}
        setup: ["{hang_while(tmp_path / "hang-down")}"]
        """,
        capsys,
    )
    wait_for("training", training(down_dir / "slurm" / down_job))
    node = job_field(down_job, "NodeList")
    try:
        slurm("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test")
        wait_for("record", lambda: (down_dir / "cells" / down / "result.json").exists())
    finally:  # ReturnToService=2 may have put it back already: then RESUME is refused
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=60)
    # The ranks ask squeue why they got SIGTERM (NodeDown); where it does not answer them in time
    # they record `cancelled`, and status (like collect) corrects that from sacct's NODE_FAIL.
    wait_for("job ends", lambda: job_field(down_job, "JobState") not in ("RUNNING", "COMPLETING"))
    assert main(["status", str(down_dir)]) == 3
    assert f"{down_dir}: 1 cell(s): node_fail 1" in capsys.readouterr().out
    got = record(down_dir, down)
    assert got["status"] == "node_fail" and got["slurm_state"] == "NODE_FAIL", got.get("error")
    assert got["slurm_accounting"]["state"] == "NODE_FAIL" and "max_requeue" in got["advice"]


@pytest.mark.slurm
def test_a_preempted_cell_is_requeued_by_slurm_until_its_max_requeue_is_used_up(site_cluster, tmp_path, capsys):
    """Two sweeps with slurm.max_requeue 1, both preempted: the one whose requeued run may train
    ends ok; the other, preempted again, ends `preempted` (its third run does not train). Each
    preempted run records `preempted`, whether or not the controller answered its ranks in time:
    the requeued run names it from sacct's earlier runs (cell/stopping/requeue.py)."""
    sweeps = {}
    # The second sweep's ranks get no answer from the controller at SIGTERM (as on a busy machine):
    # they record `cancelled`, and the next run names it.
    deaf = {"requeued": "true", "again": "export HPCFSDP_SLURM_ASK_S=0"}
    for name in ("requeued", "again"):
        flag = tmp_path / f"hang-{name}"
        sweeps[name] = (
            *submit(
                tmp_path,
                name,
                f"""
                name: {name}
                base: {{{TINY}, gpus_per_node: 1}}
                slurm: {{time_min: 10, max_requeue: 1}}
                setup: ["{hang_while(flag)}", "{deaf[name]}"]
                """,
                capsys,
            ),
            flag,
        )
    for sweep_dir, _, job, _ in sweeps.values():
        wait_for("training", training(sweep_dir / "slurm" / job))
    preempt()  # both
    (requeued_dir, requeued, requeued_job, flag) = sweeps["requeued"]
    flag.unlink()  # its requeued run trains to the end
    (again_dir, again, again_job, _) = sweeps["again"]
    for _, _, job, _ in sweeps.values():
        restart_now(job, 1)
    wait_for("requeued run ends", lambda: job_field(requeued_job, "JobState") in ("", "COMPLETED"))
    assert status_of(requeued_dir, requeued) == "ok"
    wait_for("training again", training(again_dir / "slurm" / again_job, runs=2))
    preempt()  # the second time: its one requeue is used up
    restart_now(again_job, 2)
    wait_for("third run ends", lambda: job_field(again_job, "JobState") in ("", "COMPLETED"))

    first = record(requeued_dir, requeued, "attempts/1.json")
    assert first["status"] == "preempted" and first["slurm_state"] == "PREEMPTED", first["error"]
    for got in (record(again_dir, again, "attempts/1.json"), record(again_dir, again)):
        assert got["error"].endswith("(Slurm requeued the job; sacct: PREEMPTED)"), got["error"]
    assert main(["status", str(requeued_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{requeued_dir}: 1 cell(s): ok 1; preempted 1 time(s) in 1 cell(s)" in out
    assert re.search(rf"^{requeued} +ddp +ok +{requeued_job} .*\[preempted 1 time\(s\)\]", out, re.M), out

    assert record(again_dir, again, "attempts/1.json")["status"] == "preempted"
    got = record(again_dir, again)
    assert got["status"] == "preempted" and got["slurm_state"] == "PREEMPTED", got["error"]
    assert not (again_dir / "cells" / again / "attempts" / "2.json").exists()  # the third run did not train
    logs = "".join(p.read_text() for p in (again_dir / "slurm" / again_job).glob("*_0_log.out"))
    assert "Slurm requeued the job 2 time(s), above slurm.max_requeue 1: not run again" in logs
    assert main(["status", str(again_dir)]) == 3
    out = capsys.readouterr().out
    assert f"{again_dir}: 1 cell(s): preempted 1; preempted 2 time(s) in 1 cell(s)" in out
    assert re.search(rf"^{again} +ddp +preempted +{again_job} .*\[preempted 2 time\(s\)\]", out, re.M), out


@pytest.mark.slurm
def test_a_cell_over_its_memory_gets_a_host_oom_record_with_the_mem_gb_to_ask_for(
    site_cluster, tmp_path, capsys, monkeypatch
):
    """The cell passes the preflight (mem_gb: auto, the prediction and its margin); rank 0 then takes
    3 GiB that no prediction sees (HPCFSDP_FAULT=train_step:hostmem:0), and Slurm's OverMemoryKill
    ends the step. The prediction depends on the torch installed (a fixed mem_gb 2 fits 4 ranks of
    torch's CPU build, 1.7 GiB predicted, and the preflight rightly refuses it under the CUDA build
    that Python 3.13 gets from PyPI in the Debian 13 root, 2.8 GiB: sweep/predict/hostmemory.py)."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:hostmem:0")
    oom_dir, oom, _ = submit(
        tmp_path,
        "memory",
        f"""
        name: memory
        base: {{{TINY}, gpus_per_node: 4}}
        slurm: {{time_min: 10, mem_gb: auto}}
        """,
        capsys,
    )
    # submit --wait finds the memory cell in flight, waits for it, and records how its job ended.
    command = ["submit", str(tmp_path / "memory.yaml"), "--executor", "slurm", "--wait"]
    assert main([*command, "--results-dir", str(tmp_path / "results")]) == 3  # the cell is not ok
    got = record(oom_dir, oom)
    assert got["status"] == "host_oom" and got["slurm_state"] == "OUT_OF_MEMORY", got.get("error")
    (needed,) = re.findall(r"raise slurm.mem_gb to at least (\d+)", got["advice"])
    assert int(needed) >= 3 and got["advice"] in got["error"]
    assert "exceeded memory limit" in got["traceback"]


@pytest.mark.slurm
def test_a_job_past_its_deadline_gets_a_deadline_record_from_sacct_on_22_05_and_24_11(site_cluster, tmp_path, capsys):
    # Held past its deadline: Slurm ends it DEADLINE once it may be scheduled; it never starts.
    # The deadline is later than the time limit (75 s against 1 min), which Slurm 24.11 requires
    # ("Requested time limit is invalid" for a sooner one; 22.05 takes both): 15 s after the
    # submission the job can no longer end before it, and 22.05 and 24.11 alike end it DEADLINE.
    submitted = time.monotonic()
    late_dir, late, late_job = submit(
        tmp_path,
        "late",
        f"""
        name: late
        base: {{{TINY}, gpus_per_node: 1}}
        slurm: {{time_min: 1, signal_delay_s: 10, extra_sbatch: {{hold: true, deadline: now+75}}}}
        """,
        capsys,
    )
    time.sleep(max(0.0, submitted + 17 - time.monotonic()))
    subprocess.run(["scontrol", "release", late_job], capture_output=True, timeout=60)  # if not ended yet
    wait_for("deadline", lambda: job_field(late_job, "JobState") in ("", "DEADLINE"))
    assert main(["status", str(late_dir)]) == 3  # before any record (missing): sacct's word and the advice
    assert re.search(rf"^{late} +ddp +missing +{late_job} +DEADLINE: set a later", capsys.readouterr().out, re.M)
    assert [c.cell_id for c in record_lost_cells(sweep_status(late_dir))] == [late]  # as submit --wait does
    got = record(late_dir, late)
    assert got["status"] == "deadline" and got["slurm_state"] == "DEADLINE", got.get("error")
    assert "set a later slurm.extra_sbatch.deadline" in got["advice"]
    assert main(["status", str(late_dir)]) == 3
    assert f"{late_dir}: 1 cell(s): deadline 1" in capsys.readouterr().out


@pytest.mark.slurm
def test_a_cell_whose_node_fails_to_boot_gets_a_boot_fail_record(site_cluster, site_knobs, tmp_path, capsys):
    """Power saving (HPCFSDP_SLURM_POWER_SAVE): node 2 is powered down and its slurmd stopped (the
    machine is off); the cell's job, pinned there, makes Slurm run the ResumeProgram, which fails
    it as a site's does when the boot fails, and Slurm ends the job BOOT_FAIL (--no-requeue)."""
    node = "hpcfsdp-n2"
    # Slurm refuses to power down a node where an earlier test's job is still completing.
    wait_for("node idle", lambda: node_state(node) == "idle", 120)
    slurm("scontrol", "update", f"NodeName={node}", "State=POWER_DOWN_FORCE")
    try:
        wait_for("powered down", lambda: node_state(node) == "idle~", 60)
        pid = Path(site_knobs["HPCFSDP_SLURM_DIR"], "run", f"slurmd-{node}.pid").read_text().strip()
        subprocess.run(["kill", pid], check=True, timeout=60)  # this cluster's own slurmd of the node
        boot_dir, cell, job = submit(
            tmp_path,
            "boot",
            f"""
            name: boot
            base: {{{TINY}, gpus_per_node: 1}}
            slurm: {{time_min: 10, extra_sbatch: {{nodelist: {node}}}}}
            """,
            capsys,
        )
        wait_for("boot fails", lambda: job_field(job, "JobState") in ("", "BOOT_FAIL"), 60)
    finally:
        # The node back: Slurm marks it down at ResumeTimeout (10 s; a slurmd that registers before
        # that does not count as booted); its slurmd started again (start.sh) then registers, and
        # ReturnToService=2 puts it back.
        wait_for("down at ResumeTimeout", lambda: node_state(node) in ("down~", "idle~", "idle"), 60)
        start_slurm(site_knobs)
    assert [c.cell_id for c in record_lost_cells(sweep_status(boot_dir))] == [cell]  # as submit --wait does
    got = record(boot_dir, cell)
    assert got["status"] == "boot_fail" and got["slurm_state"] == "BOOT_FAIL", got.get("error")
    assert "tell the cluster's administrators" in got["advice"]
    assert main(["status", str(boot_dir)]) == 3
    assert f"{boot_dir}: 1 cell(s): boot_fail 1" in capsys.readouterr().out


def test_endings_are_read_from_sacct_states_and_slurmstepd_memory_kills():
    kill = "slurmstepd-n1: error: StepId=10.0 exceeded memory limit (1275496960 > 1073741824), being killed"
    assert ended_by(["COMPLETED", "COMPLETED", "CANCELLED"], kill)[0] == "OUT_OF_MEMORY"
    assert ended_by(["FAILED", "OUT_OF_MEMORY"])[0] == "OUT_OF_MEMORY"  # a cgroup site
    assert ended_by(["CANCELLED", "CANCELLED"])[0] == "CANCELLED"
    assert ended_by(["FAILED", "CANCELLED"]) is None  # an error: the other ranks were ended with it
    for state in ("NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL", "TIMEOUT"):
        assert ended_by([state])[0] == state
    assert memory_to_ask(kill, 1) == 2  # used 1.19 GiB over a 1 GiB limit
    assert memory_to_ask("", 4, max_rss_bytes=6 * 1024**3 + 1) == 7


def test_a_sigterm_is_named_from_the_controllers_word_on_the_job(monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert JobView(restarts=2).ending() == ("PREEMPTED", "Slurm requeues the job (restart 2)")  # counted first
    assert JobView(restarts=1).ending() is None  # no requeue: scancel
    assert JobView(preempt_time="2026-11-23T23:17:24").ending()[0] == "PREEMPTED"  # not requeued
    assert JobView(reason="NodeDown", restarts=2).ending()[0] == "NODE_FAIL"
    assert preemption_note([0, 1, 3]) == "; preempted 4 time(s) in 2 cell(s)" and preemption_note([0]) == ""
