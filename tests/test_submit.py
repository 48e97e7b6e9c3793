"""The submitter against the real local Slurm cluster (slurm/local/start.sh): in-flight cells are
left alone, a cancelled task is rerun by --retry-failed, the sbatch script is the one plan prints,
an array sbatch refuses is one line and keeps the records, and the time limit ends a cell with a
`timeout` record, after a requeue when one is allowed.

The 8-cell sweep on 1 and 2 nodes is tests/test_slurm.py's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, slurm
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.folder.layout import array_comment

pytestmark = pytest.mark.slurm

CPU_CELL = "model: tiny, device: cpu, precision: fp32, seq_len: 32, warmup_steps: 1, comm_profile_steps: 0"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def manifest_jobs(sweep_dir: Path) -> dict[str, str]:
    return {cid: entry["job_id"] for cid, entry in json.loads((sweep_dir / "manifest.json").read_text()).items()}


def record(sweep_dir: Path, cell_id: str) -> dict:
    return json.loads((sweep_dir / "cells" / cell_id / "result.json").read_text())


def test_cancelled_task_is_rerun_by_retry_failed_and_queued_cells_are_left_alone(slurm_cluster, tmp_path, capsys):
    # Submitted held (extra_sbatch passes --hold through), so that cancelling task 1 is deterministic.
    jobs = write(
        tmp_path,
        "held",
        f"""
        name: held
        base: {{{CPU_CELL}, steps: 3, gpus_per_node: 1}}
        slurm: {{time_min: 10, extra_sbatch: {{hold: true}}}}
        matrix:
          strategy: [ddp, fsdp2_zero2, fsdp2_zero3]
        """,
    )
    results = tmp_path / "results"
    sweep_dir = results / "held"
    submit = ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]
    assert main(submit) == 0
    queued = capsys.readouterr().out
    (array,) = re.findall(r"submitted array (\d+): 3 cell\(s\) on 1 node\(s\) x 1 process\(es\)", queued)
    job_ids = manifest_jobs(sweep_dir)
    assert sorted(job_ids.values()) == [f"{array}_{i}" for i in range(3)]

    # What `plan --sbatch` prints is the script that was submitted, less the digests of the job
    # pickles (sweep/launch/digested.py), which exist only once submit has written them.
    assert main(["plan", str(jobs), "--sbatch", "--results-dir", str(results)]) == 0
    planned = capsys.readouterr().out.split("=====\n", 1)[1].split("\n# Its cell ", 1)[0]  # then one cell by hand
    submitted = (sweep_dir / "slurm" / array / f"{array}_submission.sh").read_text().splitlines()
    digests = [line for line in submitted if line.startswith(("hpcfsdp_pickle_sha256=(", "hpcfsdp_pickle_cell=("))]
    assert len(digests) == 2 and len(digests[0].split()) == 3
    assert planned.rstrip("\n") == "\n".join(line for line in submitted if line not in digests)

    # Queued cells are never submitted twice, not even with --force.
    assert main([*submit, "--force"]) == 0
    out = capsys.readouterr().out
    assert "skipping 3 cell(s) still queued or running" in out and "nothing to submit" in out
    assert all(f"(job {jid})" in out for jid in job_ids.values())

    cancelled = next(cid for cid, jid in job_ids.items() if jid == f"{array}_1")
    slurm("scancel", f"{array}_1")
    slurm("scontrol", "release", array)
    assert main(["status", str(sweep_dir), "--watch", "1"]) == 3  # a missing cell
    out = capsys.readouterr().out
    assert f"{sweep_dir}: 3 cell(s): missing 1, ok 2" in out
    assert re.search(rf"^{cancelled} +\S+ +missing +{array}_1 ", out, flags=re.M)

    # Without a flag a missing cell runs again too; --retry-failed is the documented way. Either
    # way only that cell is queued; it is held like the first array, so release it.
    assert main([*submit, "--retry-failed"]) == 0
    out = capsys.readouterr().out
    assert "skipping 2 cell(s) that already have a record" in out
    (rerun,) = re.findall(r"submitted array (\d+): 1 cell\(s\)", out)
    assert manifest_jobs(sweep_dir)[cancelled] == rerun  # one cell: a plain job, not an array
    slurm("scontrol", "release", rerun)
    assert main(["status", str(sweep_dir), "--watch", "1"]) == 0
    assert f"{sweep_dir}: 3 cell(s): ok 3" in capsys.readouterr().out
    assert record(sweep_dir, cancelled)["slurm"]["job_id"] == rerun


def test_a_submit_sigkilled_between_sbatch_and_the_manifest_leaves_no_array_untracked_nor_queued_twice(
    slurm_cluster, tmp_path, capsys
):
    """issue 51, item 8: submit SIGKILLed (HPCFSDP_FAULT's crash point) after sbatch queued the array
    and before the manifest named it. Its intent, written before sbatch, is settled by the next
    status (the cells are pending, not missing), submit (nothing queued twice) or cancel (it finds
    and cancels them); the array carries a token of its cells in its comment."""
    jobs = write(
        tmp_path,
        "killed",
        f"""
        name: killed
        base: {{{CPU_CELL}, steps: 3, gpus_per_node: 1}}
        slurm: {{time_min: 10, extra_sbatch: {{hold: true}}}}
        matrix:
          strategy: [ddp, fsdp2_zero2]
        """,
    )
    results = tmp_path / "results"
    sweep_dir = results / "killed"
    cells = [cell.id for cell in load_sweep(jobs).cells]
    argv = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCFSDP_FAULT": "submit_queued:sigkill"}

    def killed_submit(*flags: str) -> str:
        """A submit SIGKILLed at the crash point: the array it queued."""
        before = set(queued_arrays())
        done = subprocess.run([*argv, *flags], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        intent = json.loads((sweep_dir / ".submit_intent.json").read_text())
        assert intent["cells"] == cells
        (array,) = set(queued_arrays()) - before
        assert queued_arrays()[array] == array_comment(intent["uid"], cells)  # hpcfsdp:<sweep id>:<token>
        return array

    def queued_arrays() -> dict[str, str]:
        """array id -> its comment, of the sweep's jobs in the queue."""
        lines = slurm("squeue", "--noheader", "--array", "--name=hpcfsdp-killed", "--format=%i|%k").split()
        return {line.split("|")[0].split("_")[0]: line.split("|")[1] for line in lines}

    array = killed_submit()
    assert not (sweep_dir / "manifest.json").exists()
    assert main(["status", str(sweep_dir)]) == 4  # in flight: pending, not missing
    out = capsys.readouterr().out
    assert f"{sweep_dir}: 2 cell(s): pending 2" in out, out
    assert manifest_jobs(sweep_dir) == {cid: f"{array}_{index}" for index, cid in enumerate(cells)}
    assert not (sweep_dir / ".submit_intent.json").exists()
    submit = ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]
    assert main([*submit, "--force"]) == 0
    out = capsys.readouterr().out
    assert "skipping 2 cell(s) still queued or running" in out and "nothing to submit" in out
    assert list(queued_arrays()) == [array]

    # Killed again (the first array cancelled): the next submit itself, then cancel, settle it.
    assert main(["cancel", str(sweep_dir)]) == 0
    capsys.readouterr()
    again = killed_submit("--retry-failed")
    assert main([*submit, "--retry-failed"]) == 0
    out = capsys.readouterr().out
    assert f"array {again} of 2 cell(s) was queued by a submit stopped before it wrote manifest.json" in out, out
    assert "skipping 2 cell(s) still queued or running" in out and list(queued_arrays()) == [again]
    assert main(["cancel", str(sweep_dir)]) == 0
    assert not queued_arrays()
    capsys.readouterr()
    third = killed_submit("--retry-failed")
    assert main(["cancel", str(sweep_dir)]) == 0
    assert not queued_arrays() and manifest_jobs(sweep_dir) == {cid: f"{third}_{i}" for i, cid in enumerate(cells)}
    assert all(record(sweep_dir, cid)["status"] == "cancelled" for cid in cells)


def test_an_array_sbatch_would_refuse_is_one_line_before_anything_is_queued_and_keeps_the_records(
    slurm_cluster, tmp_path, capsys
):
    # The cluster has no reservation of that name: `sbatch --test-only` in the preflight refuses the
    # array before --force sets any record aside or anything is queued.
    jobs = write(
        tmp_path,
        "refused",
        f"""
        name: refused
        base: {{{CPU_CELL}, steps: 3}}
        slurm: {{time_min: 10, extra_sbatch: {{reservation: no-such-reservation}}}}
        matrix:
          batch_size: [1, 2, 3, 4]
        """,
    )
    sweep_dir = tmp_path / "results" / "refused"
    ok, timed_out, *_ = load_sweep(jobs).cells
    for cell, status in ((ok, "ok"), (timed_out, "timeout")):
        (sweep_dir / "cells" / cell.id).mkdir(parents=True)
        write_record(sweep_dir / "cells" / cell.id / "result.json", {"status": status})
    assert (
        main(["submit", str(jobs), "--executor", "slurm", "--force", "--results-dir", str(tmp_path / "results")]) == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {jobs}:4: slurm.extra_sbatch: Slurm refuses the array of 4"), err
    assert err[0].endswith("(sbatch --test-only): Requested reservation is invalid")
    # --force set the records aside for the rerun; nothing was queued, so they are back.
    assert [record(sweep_dir, c.id)["status"] for c in (ok, timed_out)] == ["ok", "timeout"]
    assert not list(sweep_dir.glob("cells/*/attempts/*.json"))
    assert not (sweep_dir / "manifest.json").exists()


def test_time_limit_ends_in_timeout_after_the_allowed_requeues(slurm_cluster, tmp_path, capsys):
    """time_min 1 with the signal 10 s before: Slurm sends SIGUSR2 10-40 s into the run (it checks
    time limits every 30 s). max_requeue 0: the cell records timeout. max_requeue 1: submitit
    requeues it once (its record is then written by the second run, restart count 1)."""
    endless = f"{{{CPU_CELL}, steps: 100000000, gpus_per_node: 2, strategy: ddp}}"
    results = tmp_path / "results"
    arrays = {}
    for name, requeues in (("timeout", 0), ("requeue", 1)):
        jobs = write(
            tmp_path,
            name,
            f"""
            name: {name}
            base: {endless}
            slurm: {{time_min: 1, signal_delay_s: 10, max_requeue: {requeues}}}
            """,
        )
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (arrays[name],) = re.findall(r"submitted array (\d+)", capsys.readouterr().out)
    requeued = arrays["requeue"]
    released = False
    deadline = time.time() + 300
    while slurm("squeue", "--noheader", "--format=%i", f"--jobs={','.join(arrays.values())}").strip():
        assert time.time() < deadline, slurm("squeue")
        # A requeued job waits 2 minutes (Slurm's BeginTime after a requeue); start it now.
        info = slurm("scontrol", "show", "job", requeued)
        if not released and "JobState=PENDING" in info and "Restarts=1" in info:
            slurm("scontrol", "update", f"JobId={requeued}", "StartTime=now")
            released = True
        time.sleep(2)
    assert released, "the requeue sweep was never requeued"

    for name, restarts in (("timeout", 0), ("requeue", 1)):
        sweep_dir = results / name
        (cell,) = load_sweep(tmp_path / f"{name}.yaml").cells
        got = record(sweep_dir, cell.id)
        # On a loaded machine the signal may come before the loop: at stage launch while the node's
        # supervisor still imported the ranks' code (it then starts no rank and records the signal),
        # at setup (held until the rank's handlers were in place: cell/stopping/early_signals.py),
        # or while it built the model or sharded it.
        stages = ("launch", "setup", "data", "model", "shard", "train")
        assert got["status"] == "timeout" and got["stage"] in stages, got.get("traceback", "")[-2000:]
        assert "SIGUSR2 (time limit)" in got["error"]
        assert got["launch_id"] == f"slurm-{arrays[name]}-{restarts}"
        assert main(["status", str(sweep_dir)]) == 3  # timeout
        assert f"{sweep_dir}: 1 cell(s): timeout 1" in capsys.readouterr().out
    # Rank 0's submitit handler called CellJob.checkpoint, then `scontrol requeue` (whose SIGTERM may
    # end the rank before submitit logs "Requeued job").
    log = (results / "requeue" / "slurm" / requeued / f"{requeued}_0_log.out").read_text()
    assert log.count("Calling checkpoint method") == 1 and log.count("Starting with JobEnvironment") == 2
