"""After the sweep is queued, against the real local Slurm cluster: `submit --then-collect` (a
dependency job that really runs collect), `logs` of a failed cell, and `cancel` of exactly one
sweep's jobs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import slurm
from hpcfsdp.cli import main

pytestmark = pytest.mark.slurm

BASE = (
    "base: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, "
    "comm_profile_steps: 0, strategy: ddp}\n"
)
# Two cells: one rank (ok) and two ranks, whose rank 1 fails (HPCFSDP_FAULT=train:error:1).
DAILY = (
    "name: daily\n"
    + BASE
    + "slurm: {partition: gpu, time_min: 10, cpus_per_task: 1, mail_user: hpc@localhost, mail_type: 'END,FAIL'}\n"
    + "matrix: {gpus_per_node: [1, 2]}\n"
)


def wait_until(check: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(1)
    return value


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def squeue_state(job_id: str) -> str:
    return slurm("squeue", "--noheader", "--array", "--format=%T", f"--jobs={job_id}").strip()


@pytest.fixture(scope="module")
def daily(local_slurm, tmp_path_factory) -> dict:
    """The DAILY sweep submitted with --then-collect; what status printed right after the submit,
    and once collect_job.json holds collect's exit status."""
    tmp = tmp_path_factory.mktemp("daily")
    jobs = tmp / "daily.yaml"
    jobs.write_text(DAILY)
    with pytest.MonkeyPatch.context() as env:
        for key, value in {**local_slurm, "HPCFSDP_FAULT": "train:error:1"}.items():
            env.setenv(key, value)
        argv = ["submit", str(jobs), "--executor", "slurm", "--then-collect", "--results-dir", str(tmp / "results")]
        assert main(argv) == 0
        sweep_dir = tmp / "results" / "daily"
        queued = _status_lines(sweep_dir, (3, 4))  # 4 while both cells wait; 3 once the two-rank one failed
        collect_job = sweep_dir / "collect_job.json"
        wait_until(lambda: read(collect_job).get("exit_status") is not None, 400, "the collect job's exit status")
        done = _status_lines(sweep_dir, (3,))  # the two-rank cell failed
    return {"sweep_dir": sweep_dir, "queued": queued, "done": done}


def _status_lines(sweep_dir: Path, exit_statuses: tuple[int, ...]) -> list[str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", str(sweep_dir)]) in exit_statuses
    return out.getvalue().splitlines()


def cell_of(sweep_dir: Path, ranks: int) -> str:
    (cell,) = [p.parent.name for p in sweep_dir.glob("cells/*/spec.json") if read(p)["spec"]["gpus_per_node"] == ranks]
    return cell


def test_then_collect_runs_collect_in_a_job_after_the_arrays_and_leaves_report_and_exit_status(daily, slurm_cluster):
    sweep_dir = daily["sweep_dir"]
    entry = read(sweep_dir / "collect_job.json")
    manifest = read(sweep_dir / "manifest.json")
    arrays = {e["job_id"].split("_")[0] for e in manifest.values()}
    assert set(entry["after"]) == arrays and entry["exit_status"] == 0
    job = entry["job_id"]
    # Queued behind the arrays, status said so; once it ran, status names the report.
    assert daily["queued"][-1] == f"collect job {job}: PENDING (Dependency)"
    assert daily["done"][-1] == (
        f"collect job {job}: exit status 0 (report written): {sweep_dir / 'report' / 'summary.md'}"
    )
    script = (sweep_dir / "slurm" / job / f"{job}_submission.sh").read_text()
    after = ":".join(sorted(arrays, key=int))
    for line in (
        f"--dependency=afterany:{after}",
        "--mail-type=END,FAIL",
        "--mail-user=hpc@localhost",
        "--ntasks-per-node=1",
    ):
        assert f"#SBATCH {line}\n" in script
    assert "gres" not in script  # a CPU job
    summary = (sweep_dir / "report" / "summary.md").read_text()
    ok = cell_of(sweep_dir, 1)
    assert summary.split("\n## ")[1].startswith("Recommendation") and f"(cell {ok})" in summary
    # The collect ran in the job, after every cell had a record: its log holds collect's output.
    log = (sweep_dir / "slurm" / job / f"{job}_0_log.out").read_text()
    assert f"wrote {sweep_dir / 'report'}/" in log
    ended = max((sweep_dir / "cells" / cell / "result.json").stat().st_mtime for cell in manifest)
    assert (sweep_dir / "report" / "summary.md").stat().st_mtime > ended
    accounted = wait_until(
        lambda: (
            "|COMPLETED|" in (out := slurm("sacct", "-nPX", "--format=JobID,State,ExitCode", f"--jobs={job}"))
            and out.split()
        ),
        60,
        "sacct to see the collect job end",
    )
    assert accounted == [f"{job}|COMPLETED|0:0"]


def test_logs_of_a_failed_cell_open_with_its_error_then_every_ranks_log(daily, slurm_cluster, capsys):
    sweep_dir = daily["sweep_dir"]
    failed = cell_of(sweep_dir, 2)
    job = read(sweep_dir / "manifest.json")[failed]["job_id"]
    capsys.readouterr()
    assert main(["logs", str(sweep_dir), failed[:14]]) == 0  # a beginning of its id will do (ddp-b1-a1-<hash>)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"== {failed}: error at train: RuntimeError: injected fault at train"
    telling = lines[1 : lines.index("")]
    # One Slurm task per node (its supervisor starts the ranks): rank 1's stderr is in node 0's log.
    assert f"[node 0] cell {failed} failed: RuntimeError: injected fault at train" in telling  # its stderr
    assert any(line.startswith("[node 0] srun: error:") for line in telling)  # srun's word, in task 0's log
    assert any("rank 1 failed at train: RuntimeError: injected fault at train" in line for line in lines)
    headers = [line for line in lines if line.startswith("==> ")]
    assert headers == [f"==> job {job}, node 0: {sweep_dir.resolve() / 'slurm' / job / f'{job}_0_log.out'} <=="]
    assert main(["logs", str(sweep_dir), failed, "--stderr"]) == 0
    out = capsys.readouterr().out
    assert f"{job}_0_log.err <==" in out and f"cell {failed} failed: RuntimeError: injected fault at train\n" in out
    # --follow of a job that has ended: what each node wrote, then it returns.
    assert main(["logs", str(sweep_dir), failed, "--follow", "--stderr"]) == 0
    out = capsys.readouterr().out
    assert f"==> job {job}, node 0 <==" in out and "RuntimeError: injected fault at train" in out


def test_logs_without_a_cell_lists_the_cells_not_ok_first(daily, capsys):
    sweep_dir = daily["sweep_dir"]
    manifest = read(sweep_dir / "manifest.json")
    failed, ok = cell_of(sweep_dir, 2), cell_of(sweep_dir, 1)
    capsys.readouterr()
    assert main(["logs", str(sweep_dir)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:3]]
    assert rows == [[failed, "error", manifest[failed]["job_id"]], [ok, "ok", manifest[ok]["job_id"]]]


def test_cancel_ends_exactly_this_sweeps_jobs_pending_ones_first(slurm_cluster, tmp_path, monkeypatch, capsys):
    """Sweep `busy`: two cells that hang in training, one array task at a time (the second waits);
    sweep `later`, of the same user, waits for its begin time. cancel --pending-only ends only
    busy's waiting task, cancel the running one; `later` stays queued throughout."""
    results = tmp_path / "results"
    busy, later = tmp_path / "busy.yaml", tmp_path / "later.yaml"
    slurm_keys = "partition: gpu, time_min: 10, cpus_per_task: 1"
    busy.write_text(
        "name: busy\n" + BASE + f"slurm: {{{slurm_keys}, array_parallelism: 1}}\nmatrix: {{seed: [0, 1]}}\n"
    )
    later.write_text("name: later\n" + BASE + f"slurm: {{{slurm_keys}, extra_sbatch: {{begin: now+3600}}}}\n")
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:hang")
    for jobs in (busy, later):
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
    busy_dir, later_dir = results / "busy", results / "later"
    (later_job,) = (e["job_id"] for e in read(later_dir / "manifest.json").values())
    try:
        tasks = read(busy_dir / "manifest.json")
        running = wait_until(
            lambda: next((cid for cid, e in tasks.items() if squeue_state(e["job_id"]) == "RUNNING"), None),
            120,
            "a task of busy to run",
        )
        (pending,) = set(tasks) - {running}
        log = busy_dir / "slurm" / tasks[running]["job_id"] / f"{tasks[running]['job_id']}_0_log.out"
        wait_until(lambda: log.exists() and "training" in log.read_text(), 180, "the running cell to train")
        time.sleep(2)  # into the hang after its first step
        capsys.readouterr()

        assert main(["cancel", str(busy_dir), "--pending-only"]) == 0
        out = capsys.readouterr().out
        assert f"cancelled {pending} (job {tasks[pending]['job_id']}, pending)" in out
        assert "left 1 running cell(s) as they are (--pending-only)" in out
        assert read(busy_dir / "cells" / pending / "result.json")["status"] == "cancelled"
        assert squeue_state(tasks[running]["job_id"]) == "RUNNING" and squeue_state(later_job) == "PENDING"
        # logs and status name the running cell as running, and the cancelled one with its cause
        assert main(["logs", str(busy_dir)]) == 0
        listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:3]}
        assert listed == {running: "running", pending: "cancelled"}
        assert main(["status", str(busy_dir)]) == 3  # a cell not ok (the other still runs)
        table = capsys.readouterr().out.splitlines()
        assert " cause " in table[1]
        assert re.search(rf"^{pending} .*cancelled .* Slurm job \S+ cancelled by", "\n".join(table), re.M)
        # a plain submit reruns nothing, and says what --retry-failed would
        assert main(["submit", str(busy), "--executor", "slurm", "--results-dir", str(results)]) == 0
        said = capsys.readouterr().out
        assert "skipping 1 cell(s) that already have a record (cancelled 1): --retry-failed reruns the 1 not ok" in said

        assert main(["cancel", str(busy_dir)]) == 0
        assert f"cancelled {running} (job {tasks[running]['job_id']}, running)" in capsys.readouterr().out
        record = read(busy_dir / "cells" / running / "result.json")
        assert record["status"] == "cancelled", record.get("error")
        assert squeue_state(tasks[running]["job_id"]) == "" and squeue_state(later_job) == "PENDING"
        assert main(["status", str(busy_dir)]) == 3  # cells not ok
        assert re.search(r"2 cell\(s\): cancelled 2$", capsys.readouterr().out.splitlines()[0])
    finally:
        (later_cell,) = read(later_dir / "manifest.json")
        assert main(["cancel", str(later_dir), "--cells", later_cell]) == 0
        assert main(["cancel", str(busy_dir)]) == 0  # nothing left, or what a failed test left hanging
    assert read(later_dir / "cells" / later_cell / "result.json")["status"] == "cancelled"
    assert squeue_state(later_job) == ""
