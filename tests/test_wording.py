"""What a command says is true (issue 51, item 15): a refused lock is not called a manifest of
queued jobs, an interrupt before any cell ran does not say a running cell was stopped, cancel
counts the planned cells that had no queued job, and a cache folder that is a FIFO is not "a
cache with no items"."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import yaml

from hpcfsdp.cli import main
from hpcfsdp.contracts.files import open_lock

CPU_CELL = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 2, "warmup_steps": 1}


def two_cell_jobs(tmp_path):
    jobs = tmp_path / "words.yaml"
    jobs.write_text(yaml.safe_dump({"name": "words", "base": CPU_CELL, "matrix": {"batch_size": [1, 2]}}))
    return jobs


def test_a_refused_lock_file_is_named_as_a_lock_not_as_the_sweeps_queued_jobs(tmp_path, capsys):
    jobs, results = two_cell_jobs(tmp_path), tmp_path / "results"
    (results / "words").mkdir(parents=True)
    (results / "words" / ".submit.lock").write_text("someone else's notes\n")
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a lock file of hpcfsdp" in err and "nothing submitted" in err, err
    assert "queued jobs" not in err and "squeue" not in err


def test_a_local_submit_interrupted_before_any_cell_ran_does_not_say_a_running_cell_was_stopped(tmp_path):
    jobs, results = two_cell_jobs(tmp_path), tmp_path / "results"
    (results / "words").mkdir(parents=True)
    fd = open_lock(results / "words" / ".submit.lock")
    fcntl.flock(fd, fcntl.LOCK_EX)  # another submit holds the sweep: this one waits for it
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpcfsdp",
                "submit",
                str(jobs),
                "--executor",
                "local",
                "--results-dir",
                str(results),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stderr is not None
        waiting = proc.stderr.readline()
        assert "waiting for it to finish" in waiting, waiting
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "interrupted (SIGTERM): no cell had started; run the same command again to go on"


def test_cancel_counts_the_planned_cells_that_had_no_queued_job(tmp_path, capsys):
    jobs, results = two_cell_jobs(tmp_path), tmp_path / "results"
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]) == 0
    (results / "words" / "manifest.json").unlink(missing_ok=True)  # as a submit killed before writing it
    capsys.readouterr()
    assert main(["cancel", str(results / "words")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "0 cell(s) cancelled; 2 had no queued job"


def test_download_verify_of_a_cache_dir_that_is_a_fifo_says_it_is_no_folder(tmp_path, capsys):
    fifo = tmp_path / "cache"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert main(["download", "--verify", "--model", "org/model", "--cache-dir", str(fifo)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --cache-dir: {fifo}: a FIFO, device or socket, not a folder; give the cache's folder\n"
    assert time.monotonic() - started < 30
