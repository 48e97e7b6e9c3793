"""`hpcfsdp plan` and the submitter: the bad-YAML corpus, the plan table, the sbatch scripts, the
print executor; in-flight detection, status and lost cells against real jobs of the local Slurm
cluster (held, running, failed, cancelled), and a controller or slurmdbd that does not answer."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, client_conf, free_port, silent_controller, slurm
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.sweep.define.matrix import load_sweep
from hpcfsdp.sweep.launch.submit import select_cells
from hpcfsdp.sweep.track.status import record_lost_cells, sweep_status
from hpcfsdp.sweep.track.watch import watch

BAD_YAML = sorted((ROOT / "tests" / "bad_yaml").glob("*.yaml"))
EXPECT = re.compile(r"^# expect(?: line (\d+))?: (.+)$")


def write(tmp_path: Path, text: str, name: str = "jobs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_bad_yaml_corpus_is_large_enough():
    assert len(BAD_YAML) >= 15


@pytest.mark.parametrize("path", BAD_YAML, ids=[p.stem for p in BAD_YAML])
def test_bad_yaml_gives_one_line_naming_file_line_and_key(path, capsys):
    line, fragment = EXPECT.match(path.read_text().splitlines()[0]).groups()
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.rstrip("\n")
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}{f':{line}: ' if line else ': '}"), err
    assert fragment in err, err


def test_plan_adds_a_column_for_every_field_that_varies(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        name: t
        base: {model: tiny, device: cpu, lr: 0.001}
        matrix:
          strategy: [ddp, fsdp2_zero3]
          seq_len: [64, 128]
          compile: [false, true]
        include:
          - {strategy: fsdp2_hsdp, nodes: 2, gpus_per_node: 2}
        slurm: {time_min: 20, max_requeue: 1}
        """,
    )
    assert main(["plan", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "t: 9 cell(s) in 2 array(s)"
    header = lines[1].split()
    assert header[-2:] == ["seq_len", "compile"] and "lr" not in header and "device" not in header
    rows = {line.split()[0]: line.split() for line in lines[2:11]}
    sweep = load_sweep(path)
    assert set(rows) == {cell.id for cell in sweep.cells}
    for cell in sweep.cells:
        assert rows[cell.id][-2:] == [str(cell.spec.seq_len), str(cell.spec.compile).lower()]
    assert (  # device: cpu: processes, not GPUs
        "array 0: 8 cell(s) on 1 node(s) x 1 process(es)" in lines
        and "array 1: 1 cell(s) on 2 node(s) x 2 process(es)" in lines
    )
    # (8 x 1 + 1 x 4) processes x 20 min x (1 run + 1 requeue)
    assert lines[-1] == "upper bound: 8.0 process-hours at a 20 min limit per cell, 1 requeue(s)"


def test_plan_into_a_closed_pipe_is_quiet(tmp_path):
    path = write(
        tmp_path,
        """
        matrix:
          batch_size: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
          grad_accum: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
          seed: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcfsdp", "plan", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline().startswith(b"jobs: 1000 cell(s)")
    proc.stdout.close()  # like `| head -1`: 1000 rows do not fit in the pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == ""


SBATCH_SWEEP = """
    name: resources
    base: {model: tiny, gpus_per_node: 4}
    matrix:
      strategy: [ddp, fsdp2_zero2, fsdp2_zero3]
    include:
      - {strategy: fsdp2_hsdp, nodes: 2}
    slurm:
      partition: h100
      time_min: 45
      cpus_per_task: 8
      mem_gb: 64
      account: proj42
      qos: high
      constraint: h100&ib
      exclusive: true
      array_parallelism: 2
      gpu_request: {gpu_request}
      max_requeue: 2
      signal_delay_s: 120
      cache_dir: /shared/hpcfsdp-cache
      extra_sbatch: {{reservation: maint, hold: true, mail_type: FAIL}}
    setup:
      - module load cuda/12.4
"""


def sbatch_scripts(capsys, path: Path, results: Path) -> list[str]:
    assert main(["plan", str(path), "--sbatch", "--results-dir", str(results)]) == 0
    return re.split(r"^# ===== array \d+: .*=====\n", capsys.readouterr().out, flags=re.M)[1:]


def test_sbatch_script_carries_every_resource(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    path = write(tmp_path, SBATCH_SWEEP.replace("{gpu_request}", "gpus_per_node").replace("{{", "{").replace("}}", "}"))
    one_node, two_nodes = sbatch_scripts(capsys, path, tmp_path / "results")
    folder = (tmp_path / "results" / "resources" / "slurm").absolute()
    for script in (one_node, two_nodes):
        flags = set(re.findall(r"^#SBATCH (\S+)$", script, flags=re.M))
        assert {
            "--partition=h100",
            "--time=45",
            "--cpus-per-task=32",  # the node's one task: 8 CPUs for each of its 4 GPUs' ranks
            "--mem=64G",
            "--account=proj42",
            "--qos=high",
            "--constraint='h100&ib'",
            "--exclusive",
            "--gpus-per-node=4",
            "--ntasks-per-node=1",
            "--signal=USR2@120",
            "--requeue",
            "--reservation=maint",
            "--hold",
            "--mail-type=FAIL",
        } <= flags, flags
        assert not any(flag.startswith("--gres") for flag in flags)
        setup = script[script.index("# setup") : script.index("# command")].splitlines()[1:]
        assert any(flag.startswith("--export=") and "HF_TOKEN" not in flag for flag in flags)
        assert setup[:9] == [
            "export SLURM_EXPORT_ENV=ALL",
            "export HF_HUB_OFFLINE=1",
            "export HF_DATASETS_OFFLINE=1",
            "export TRANSFORMERS_OFFLINE=1",
            "export HPCFSDP_CACHE=/shared/hpcfsdp-cache",
            "export HPCFSDP_MAX_REQUEUE=2",
            "unset HF_TOKEN HUGGING_FACE_HUB_TOKEN",
            'export HPCFSDP_JOB_END_TIME="$(timeout 30 squeue --noheader --jobs="$SLURM_JOB_ID" '
            '--format=%e 2>/dev/null)"',
            "module load cuda/12.4",
        ]
        assert "hf_secret_value" not in script
        assert f"-m hpcfsdp.sweep.launch.digested {folder}/%j" in script
        assert "srun --unbuffered" in script and "--cpus-per-task=32" in script.split("srun", 1)[1]
    assert "#SBATCH --array=0-2%2" in one_node and "#SBATCH --nodes=1" in one_node
    assert "--array" not in two_nodes and "#SBATCH --nodes=2" in two_nodes  # one cell: a plain job


def test_plan_sbatch_shows_under_each_script_the_srun_and_torchrun_one_cell_runs(tmp_path, capsys):
    path = write(tmp_path, SBATCH_SWEEP.replace("{gpu_request}", "gpus_per_node").replace("{{", "{").replace("}}", "}"))
    one_node, two_nodes = sbatch_scripts(capsys, path, tmp_path / "results")
    assert main(["submit", str(path), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out.splitlines()  # the print executor's torchrun of every cell
    for script, nodes in ((one_node, 1), (two_nodes, 2)):
        hand_run = script[script.index("# Its cell ") :].splitlines()
        cell = hand_run[0].split()[3]
        srun = next(line for line in hand_run if line.startswith("srun "))
        prefix = f"srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task=32 --kill-on-bad-exit=1 "
        assert srun.startswith(prefix) and srun.removeprefix(prefix) in printed
        assert srun.endswith(f"--cell-dir {(tmp_path / 'results' / 'resources' / 'cells' / cell).absolute()}")
        assert "--nproc-per-node=4 -m hpcfsdp run" in srun
    assert "--standalone" in one_node and "--rdzv-endpoint=${MASTER_ADDR:?}:29500" in two_nodes
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in two_nodes
    assert two_nodes.rstrip().splitlines()[-1].startswith("# Without hpcfsdp: slurm/fsdp_job.sbatch, ")


@pytest.mark.parametrize("gpu_request, flag", [("gres", "#SBATCH --gres=gpu:4"), ("none", None)])
def test_sbatch_gpu_request_and_cache_from_the_environment(tmp_path, capsys, monkeypatch, gpu_request, flag):
    monkeypatch.setenv("HPCFSDP_CACHE", "/scratch/me/cache")
    path = write(
        tmp_path,
        f"""
        base: {{gpus_per_node: 4}}
        slurm: {{gpu_request: {gpu_request}}}
        """,
    )
    (script,) = sbatch_scripts(capsys, path, tmp_path)
    gpu_flags = [line for line in script.splitlines() if line.startswith(("#SBATCH --gres", "#SBATCH --gpus"))]
    assert gpu_flags == ([flag] if flag else [])
    assert "export HPCFSDP_CACHE=/scratch/me/cache" in script and "--requeue" not in script


def test_print_executor_prints_one_runnable_line_per_cell(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        name: printed
        base: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, comm_profile_steps: 0}
        matrix:
          strategy: [ddp, fsdp2_zero3]
        include:
          - {strategy: fsdp2_hsdp, nodes: 2, gpus_per_node: 2}
        """,
    )
    results = tmp_path / "results"
    assert main(["submit", str(path), "--executor", "print", "--results-dir", str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    sweep = load_sweep(path)
    assert len(out) == len(sweep.cells) == 3
    for line, cell in zip(out, sweep.cells):
        assert line.startswith(
            "env -u HF_TOKEN -u HUGGING_FACE_HUB_TOKEN HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "
        )
        assert line.endswith(f"--cell-dir {(results / 'printed' / 'cells' / cell.id).absolute()}")
    assert "--standalone --nproc-per-node=1" in out[0]
    assert '--nnodes=2 --rdzv-backend=c10d "--rdzv-endpoint=${MASTER_ADDR:?}:29500"' in out[2]
    assert "--nproc-per-node=2" in out[2]
    # The line runs as printed and the cell writes its record.
    proc = subprocess.run(
        ["bash", "-c", out[0]], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    record = json.loads((results / "printed" / "cells" / sweep.cells[0].id / "result.json").read_text())
    assert proc.returncode == 0 and record["status"] == "ok", proc.stderr[-2000:]


def unanswering_controller(tmp_path: Path) -> str:
    """slurm.conf for clients whose slurmctld does not answer: nothing listens at its port. The
    short MessageTimeout keeps each unanswered squeue at about a second."""
    return client_conf(tmp_path, "no-slurmctld", SlurmctldPort=str(free_port()), MessageTimeout="1")


def unanswering_slurmdbd(tmp_path: Path) -> str:
    """slurm.conf for clients whose slurmdbd does not answer (sacct fails); squeue still works."""
    return client_conf(tmp_path, "no-slurmdbd", AccountingStoragePort=str(free_port()))


@pytest.fixture
def array(slurm_cluster, tmp_path) -> Iterator[str]:
    """A real array job of four tasks on the local cluster, held in the queue: task 3 fails at once
    when released (a cell that crashed before it could write a record), the others sleep for 5
    minutes. The whole array is cancelled at the end."""
    script = 'if [ "$SLURM_ARRAY_TASK_ID" = 3 ]; then echo crashed >&2; exit 1; fi; exec sleep 300'
    job = slurm(
        "sbatch", "--parsable", "--hold", "--array=0-3", "--time=10", "--cpus-per-task=1",
        f"--output={tmp_path}/slurm-%A_%a.out", "--job-name=hpcfsdp-test-plan", "--wrap", script,
    )  # fmt: skip
    array_id = job.strip().split(";")[0]
    yield array_id
    subprocess.run(["scancel", array_id], capture_output=True, timeout=60)


def arrange(array: str, cancel: tuple[int, ...] = (), release: tuple[int, ...] = (), running: tuple[int, ...] = ()):
    """Cancel some tasks of the held array and release others; wait until the queue holds just the
    `running` ones, running, and accounting knows how the others ended (a task cancelled before it
    started never reaches accounting)."""
    if cancel:
        slurm("scancel", *(f"{array}_{task}" for task in cancel))
    if release:
        slurm("scontrol", "release", *(f"{array}_{task}" for task in release))
    tasks = {f"{array}_{task}": task for task in (*cancel, *release, *running)}
    queued = known = None
    for _ in range(300):
        queued = slurm("squeue", "--noheader", "--array", "--format=%i %T", f"--jobs={array}").split()
        listed = slurm("sacct", "-nPX", "--format=JobID,State", f"--jobs={','.join(tasks)}").splitlines()
        known = {line.split("|")[0]: line.split("|")[1].split()[0] for line in listed}

        if queued == [word for task in sorted(running) for word in (f"{array}_{task}", "RUNNING")] and all(
            settled(known.get(job), task, running, release) for job, task in tasks.items()
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"array {array}: queue {queued}, accounting {known}")


def settled(state: str | None, task: int, running: tuple[int, ...], release: tuple[int, ...]) -> bool:
    """Accounting's state of a task (None: not listed) is the one arrange waits for."""
    if task in running:
        return state == "RUNNING"
    if task in release:
        return state is not None and state not in IN_QUEUE
    return state not in IN_QUEUE  # cancelled: CANCELLED, or not listed if it never started


IN_QUEUE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED")


def four_cell_sweep(tmp_path: Path, array: str = "71"):
    """ok, timeout, missing but still running, missing and gone: one cell each, queued as tasks
    0..3 of `array`."""
    path = write(
        tmp_path,
        """
        name: flight
        base: {model: tiny, device: cpu, gpus_per_node: 2}
        matrix:
          batch_size: [1, 2, 3, 4]
        """,
    )
    sweep = load_sweep(path)
    sweep_dir = tmp_path / "results" / "flight"
    manifest = {}
    for index, (cell, status) in enumerate(zip(sweep.cells, ("ok", "timeout", None, None))):
        directory = sweep_dir / "cells" / cell.id
        directory.mkdir(parents=True)
        (directory / "spec.json").write_text(
            json.dumps({"cell_id": cell.id, "sweep": "flight", "spec": cell.spec.to_dict()})
        )
        if status:
            write_record(directory / "result.json", {"status": status, "spec": cell.spec.to_dict()})
        manifest[cell.id] = {"executor": "slurm", "job_id": f"{array}_{index}", "submitted_at": 0}
    (sweep_dir / "manifest.json").write_text(json.dumps(manifest))
    return path, sweep, sweep_dir


@pytest.fixture
def flight(array, tmp_path):
    """The four-cell sweep as Slurm has it: the recorded cells' tasks (0, 1) left the queue, task 2
    runs, task 3 failed without a record. Returns the jobs file, the sweep, its folder and the array."""
    path, sweep, sweep_dir = four_cell_sweep(tmp_path, array)
    arrange(array, cancel=(0, 1), release=(2, 3), running=(2,))
    return path, sweep, sweep_dir, array


@pytest.mark.slurm
def test_cells_still_in_squeue_are_never_resubmitted(flight):
    _path, sweep, sweep_dir, array = flight
    ok, timed_out, running, gone = sweep.cells
    chosen, done, flying = select_cells(sweep, sweep_dir)
    assert chosen == [gone] and done == [ok, timed_out] and flying == {running.id: f"{array}_2"}
    chosen, done, flying = select_cells(sweep, sweep_dir, retry_failed=True)
    assert chosen == [timed_out, gone] and done == [ok] and list(flying) == [running.id]
    chosen, done, flying = select_cells(sweep, sweep_dir, force=True)
    assert chosen == [ok, timed_out, gone] and done == [] and list(flying) == [running.id]


@pytest.mark.slurm
def test_status_counts_states_and_lists_unfinished_cells(flight, tmp_path, monkeypatch, capsys):
    _, sweep, sweep_dir, array = flight
    _ok, timed_out, running, gone = sweep.cells
    assert main(["status", str(sweep_dir)]) == 3  # cells not ok (a timeout outranks the running cell)
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0] == f"{sweep_dir}: 4 cell(s): missing 1, ok 1, running 1, timeout 1"
    rows = {line.split()[0]: line.split()[1:] for line in out[2:-1]}
    assert rows == {
        timed_out.id: ["fsdp2_zero3", "timeout", f"{array}_1", "-"],
        running.id: ["fsdp2_zero3", "running", f"{array}_2", "RUNNING"],
        gone.id: ["fsdp2_zero3", "missing", f"{array}_3", "FAILED"],  # sacct's final state
    }
    assert out[-1] == f"logs: `hpcfsdp logs {sweep_dir} CELL` ({sweep_dir}/slurm/<job>/<job>_<rank>_log.err)"
    assert "no Slurm accounting" not in captured.err, captured.err
    # --watch redraws until nothing is pending or running (here: the running task is cancelled after
    # a few looks); the bar goes to stderr, one line per change when stderr is not a terminal.
    # slurmdbd does not answer this time: status says so in one line at the end.
    monkeypatch.setenv("SLURM_CONF", unanswering_slurmdbd(tmp_path))
    cancel = threading.Timer(2.0, slurm, ("scancel", f"{array}_2"))
    cancel.start()
    try:
        assert main(["status", str(sweep_dir), "--watch", "0.1"]) == 3
    finally:
        cancel.cancel()
    captured = capsys.readouterr()
    bars, note = captured.err.splitlines()[:-1], captured.err.splitlines()[-1]
    assert [re.sub(r", \w+ elapsed$", "", bar) for bar in bars] == [
        "[######################........] 3/4 finished (missing 1, ok 1, running 1, timeout 1)",
        "[##############################] 4/4 finished (missing 2, ok 1, timeout 1)",
    ]
    assert note.startswith("note: no Slurm accounting (sacct: error: ") and "Connection refused" in note, note
    assert captured.out.startswith(f"{sweep_dir}: 4 cell(s): missing 2, ok 1, timeout 1")


@pytest.mark.slurm
def test_unanswered_squeue_stops_a_submit_but_not_status(slurm_cluster, tmp_path, monkeypatch, capsys):
    path, _, sweep_dir = four_cell_sweep(tmp_path)
    monkeypatch.setenv("SLURM_CONF", unanswering_controller(tmp_path))
    assert main(["submit", str(path), "--executor", "local", "--results-dir", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err
    assert "cannot tell which cells are still queued (squeue: slurm_load_jobs error: Unable to contact" in err
    # status cannot tell the queued cells' state either: an error, not "cells not ok" (issue 44, item 9)
    assert main(["status", str(sweep_dir)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: squeue: slurm_load_jobs error") and "queued cell(s) is unknown" in line


def logged_clients(tmp_path: Path, *programs: str) -> tuple[Path, Path]:
    """A folder for the front of PATH whose `programs` write each call (the program and its
    arguments) as a line of a log, then run the real program; the folder and the log."""
    folder, log = tmp_path / "logged", tmp_path / "calls.log"
    folder.mkdir()
    for program in programs:
        script = folder / program
        script.write_text(f'#!/bin/sh\necho "{program} $*" >> {log}\nexec {shutil.which(program)} "$@"\n')
        script.chmod(0o755)
    return folder, log


@pytest.mark.slurm
def test_watch_asks_squeue_and_sacct_once_per_look_for_the_whole_sweep(flight, tmp_path, monkeypatch):
    """Each look asks squeue once about the sweep's array; sacct is asked about a job that left the
    queue without a record until it has settled, never again (the failed task 3 on the first look,
    the running task 2 once it is cancelled)."""
    _, _sweep, sweep_dir, array = flight
    folder, log = logged_clients(tmp_path, "squeue", "sacct")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    cancel = threading.Timer(2.0, slurm, ("scancel", f"{array}_2"))
    cancel.start()
    try:
        report = watch(sweep_dir, 0.1, stream=io.StringIO())
    finally:
        cancel.cancel()
    assert not report.in_flight and not report.note
    calls = log.read_text().splitlines()
    looks = [call for call in calls if call.startswith("squeue ")]
    assert len(looks) >= 5 and all(call.endswith(f" --jobs={array}") for call in looks), calls
    asked = [call.rsplit("--jobs=", 1)[1] for call in calls if call.startswith("sacct ")]
    assert asked == [f"{array}_3", f"{array}_2"], calls


def cell_status_of(sweep_dir: Path, cell) -> str:
    return json.loads((sweep_dir / "cells" / cell.id / "result.json").read_text())["status"]


@pytest.mark.slurm
def test_watch_asks_a_timed_out_squeue_again_instead_of_ending_the_wait(flight, tmp_path, monkeypatch):
    """A busy slurmctld times out one squeue: the cell still runs, so the wait must go on."""
    _, sweep, sweep_dir, array = flight
    running = sweep.cells[2]
    # A controller that accepts connections and never answers: squeue times out.
    stalled = silent_controller()
    cluster_conf = os.environ["SLURM_CONF"]
    monkeypatch.setenv(
        "SLURM_CONF", client_conf(tmp_path, "stalled", SlurmctldPort=str(stalled.getsockname()[1]), MessageTimeout="1")
    )

    class Scheduler(io.StringIO):
        """What the test does to the cluster as watch reports: the controller answers again after
        the first warning; the running task is cancelled, and gone, once a bar showed it running."""

        def write(self, text: str) -> int:
            if text.startswith("warning:"):
                monkeypatch.setenv("SLURM_CONF", cluster_conf)
            elif "(running 1)" in text:
                arrange(array, cancel=(2,))
            return super().write(text)

    err = Scheduler()
    try:
        report = watch(sweep_dir, 0.01, [running.id], stream=err)
    finally:
        stalled.close()
    assert not report.note and [c.state for c in report.cells] == ["missing"]
    lines = err.getvalue().splitlines()
    assert (
        lines[0].startswith("warning: squeue: slurm_load_jobs error: Socket timed out") and "asking again" in lines[0]
    ), lines
    assert [re.sub(r", \w+ elapsed$", "", line) for line in lines[1:]] == [
        "[..............................] 0/1 finished (running 1)",
        "[##############################] 1/1 finished (missing 1)",
    ]
    # A scheduler that never answers: watch gives up after its patience, note and all.
    monkeypatch.setenv("SLURM_CONF", unanswering_controller(tmp_path))
    report = watch(sweep_dir, 0.01, [running.id], stream=io.StringIO(), patience_s=0.05)
    assert report.note.startswith("squeue: slurm_load_jobs error: Unable to contact slurm controller"), report.note


@pytest.mark.slurm
def test_watch_shows_elapsed_time_and_each_running_cells_step_from_its_progress_file(flight):
    _, sweep, sweep_dir, array = flight
    running = sweep.cells[2]
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    manifest[running.id]["submitted_at"] = time.time() - 125  # queued two minutes ago
    (sweep_dir / "manifest.json").write_text(json.dumps(manifest))
    progress = {"stage": "train", "step": 3, "steps": 6, "at": time.time()}  # what rank 0 writes (cell/run.py)
    (sweep_dir / "cells" / running.id / "progress.json").write_text(json.dumps(progress))

    class Scheduler(io.StringIO):
        def write(self, text: str) -> int:
            if "(running 1)" in text:
                arrange(array, cancel=(2,))
            return super().write(text)

    err = Scheduler()
    watch(sweep_dir, 0.01, [running.id], stream=err)
    first, last = err.getvalue().splitlines()
    assert re.fullmatch(rf"\[\.{{30}}\] 0/1 finished \(running 1\), 2m0[5-9]s elapsed; {running.id} step 3/6", first), (
        first
    )
    assert re.fullmatch(r"\[#{30}\] 1/1 finished \(missing 1\), 2m\d\ds elapsed", last), last


@pytest.mark.slurm
def test_submit_without_wait_ends_with_the_commands_to_run_next(slurm_cluster, tmp_path, capsys):
    jobs = write(
        tmp_path,
        """
        name: later
        base: {model: tiny, device: cpu, gpus_per_node: 1, steps: 2, warmup_steps: 1}
        slurm: {time_min: 5, cpus_per_task: 1, extra_sbatch: {hold: true}}
        """,
    )
    results = tmp_path / "results"
    try:
        assert main(["submit", str(jobs), "--results-dir", str(results)]) == 0
    finally:
        slurm("scancel", "--name=hpcfsdp-later")
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        f"next: `hpcfsdp status {results / 'later'} --watch` (progress until the cells end), "
        f"then `hpcfsdp collect {results / 'later'}`"
    )


@pytest.mark.slurm
def test_cells_whose_job_left_the_queue_without_a_record_get_an_error_record(flight):
    _, sweep, sweep_dir, array = flight
    gone = sweep.cells[3]
    logs = sweep_dir / "slurm" / f"{array}_3"
    logs.mkdir(parents=True)
    (logs / f"{array}_3_0_log.err").write_text("ok so far\n")
    (logs / f"{array}_3_1_log.err").write_text("torch.distributed.DistNetworkError: address already in use\n")
    lost = record_lost_cells(sweep_status(sweep_dir))
    assert [c.cell_id for c in lost] == [gone.id]  # not the running one, nor those with a record
    record = json.loads((sweep_dir / "cells" / gone.id / "result.json").read_text())
    assert record["status"] == "error" and record["stage"] == "launch" and record["cell_id"] == gone.id
    assert record["error"] == f"Slurm job {array}_3 ended (FAILED) without a record"
    assert record["traceback"].index("ok so far") < record["traceback"].index("address already in use")
    assert record["world_size"] == gone.spec.world_size and record["spec"] == gone.spec.to_dict()
    assert not (sweep_dir / "cells" / sweep.cells[2].id / "result.json").exists()


def test_time_limit_signals_with_and_without_requeues_left(monkeypatch):
    from hpcfsdp.cell.stopping import signals

    calls = []

    def submitit_handler(signum, frame):  # stands in for submitit's checkpoint-and-requeue handler
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        monkeypatch.setenv("HPCFSDP_MAX_REQUEUE", "1")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
        saved = signals.handle_time_limit()
        os.kill(os.getpid(), signal.SIGUSR2)  # a requeue is left: submitit's handler, training goes on
        assert calls == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)  # the same signal again (podman's proxy and its shell): once only
        assert calls == [signal.SIGUSR2]
        with pytest.raises(SystemExit, match="requeued after SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)  # the requeue ends this rank without a record
        signals.restore_handlers(saved)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        saved = signals.handle_time_limit()
        with pytest.raises(signals.CellTimeout, match="SIGUSR2"):
            os.kill(os.getpid(), signal.SIGUSR2)  # requeues used up: a timeout record
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while that record is written: ignored
        os.kill(os.getpid(), signal.SIGUSR2)  # and a second SIGUSR2
        signals.restore_handlers(saved)
        assert calls == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) is submitit_handler
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_cancel_that_lands_inside_a_logging_call_still_ends_the_rank(monkeypatch):
    """The handler raises wherever the main thread is. Slurm sends SIGCONT just before a cancel's
    SIGTERM, submitit logs the SIGCONT, and a SIGTERM that landed in that log line's write was
    swallowed by logging's `except Exception` (the rank trained on until SIGKILL and left no record:
    2 of 31 scancels, 2026-11-27). An ending is no Exception, so logging lets it through."""
    import logging

    from hpcfsdp.cell.stopping import signals

    class SignalledWhileWriting(io.StringIO):
        def write(self, text: str) -> int:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs inside this write
            return super().write(text)

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("HPCFSDP_JOB_END_TIME", str(time.time() + 600))
    logger = logging.getLogger("hpcfsdp-test-signalled")
    stream = SignalledWhileWriting()
    logger.addHandler(logging.StreamHandler(stream))
    saved = signals.handle_time_limit()
    try:
        with pytest.raises(signals.CellCancelled, match=r"received SIGTERM \d+ s before the time limit"):
            logger.warning("Bypassing signal SIGCONT")
    finally:
        signals.restore_handlers(saved)
        logger.handlers.clear()


def test_plan_and_submit_check_the_cache_for_hub_items_and_plan_sbatch_notes_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPCFSDP_CACHE", str(tmp_path / "empty-cache"))
    jobs = tmp_path / "hub.yaml"
    jobs.write_text("name: hub\nbase: {model: acme/not-downloaded, device: cpu}\n")
    assert main(["plan", str(jobs)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if not line.startswith("note:")] == [  # its line; one command
        f"error: {jobs}:2: model 'acme/not-downloaded' is not in the cache {tmp_path / 'empty-cache'}",
        f"error: on a machine with internet, `python download_models.py {jobs}` fetches all of them",
    ]
    # The scripts need no weights: --sbatch writes them, each miss a note (issue 54, item 3).
    assert main(["plan", "--sbatch", str(jobs)]) == 0
    sbatch = capsys.readouterr()
    assert "#SBATCH" in sbatch.out and "error:" not in sbatch.err
    assert err.replace("error: ", "note: ").splitlines()[-1] in sbatch.err
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 2
    assert "acme/not-downloaded" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists()  # nothing written, nothing run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--cell-dir", "{tmp}/nope"], "{tmp}/nope: no spec.json here"),
        (["status", "{tmp}"], "{tmp}: not a sweep folder"),
        (["collect", "{tmp}/nope"], "{tmp}/nope: no such sweep folder"),
    ],
)
def test_a_wrong_folder_is_one_line(tmp_path, capsys, argv, message):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(tmp=tmp_path)}") and err.count("\n") == 1, err
    # `run` holds Slurm's signals for its cell (cell/stopping/early_signals.py): a refusal holds none after it
    assert handlers == {sig: signal.getsignal(sig) for sig in handlers}
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask


def test_default_executor_is_local_where_slurm_is_not_installed(tmp_path, monkeypatch):
    from hpcfsdp.sweep.launch.submit import default_executor

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no Slurm client on it
    assert default_executor() == ("local", "no Slurm here (sbatch is not on PATH)")


@pytest.mark.slurm
def test_default_executor_is_slurm_where_a_controller_answers_and_refused_where_none_does(
    slurm_cluster, tmp_path, monkeypatch
):
    from hpcfsdp.sweep.launch.submit import NoController, default_executor

    assert default_executor() == ("slurm", "")
    monkeypatch.setenv("SLURM_CONF", unanswering_controller(tmp_path))
    with pytest.raises(NoController) as refused:
        default_executor()
    why = str(refused.value)
    assert why.startswith("sbatch is installed but no Slurm controller answers (sinfo: "), why
    assert "; is SLURM_CONF set?); nothing submitted and nothing run on this login node" in why
    assert "Unable to contact slurm controller" in why and "\n" not in why


@pytest.mark.slurm
def test_submit_refuses_to_train_on_the_login_node_when_the_controller_does_not_answer(
    slurm_cluster, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SLURM_CONF", unanswering_controller(tmp_path))
    jobs = write(
        tmp_path, "name: outage\nbase: {device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1}\n"
    )
    results = tmp_path / "results"
    assert main(["submit", str(jobs), "--results-dir", str(results)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("error: sbatch is installed but no Slurm controller answers (sinfo: ")
    assert "nothing submitted and nothing run on this login node" in captured.err
    assert not results.exists()  # no cell ran here, nothing was written
    # Training here is the user's explicit choice.
    assert main(["submit", str(jobs), "--results-dir", str(results), "--executor", "local"]) == 0
    assert json.loads(next((results / "outage" / "cells").glob("*/result.json")).read_text())["status"] == "ok"


@pytest.mark.slurm
def test_collect_names_the_slurm_state_of_cells_without_a_record(flight, tmp_path, monkeypatch):
    _, sweep, sweep_dir, array = flight
    _, _, running, _gone = sweep.cells
    main(["collect", str(sweep_dir), "--no-plots"])
    summary = (sweep_dir / "report" / "summary.md").read_text()
    assert f"| {running.id} | missing | {array}_2 |" in summary
    assert f"no result.json (Slurm job {array}_2: RUNNING)" in summary
    assert f"no result.json (Slurm job {array}_3: FAILED)" in summary  # from sacct
    # slurmdbd does not answer: the state of a job that left the queue is unknown.
    monkeypatch.setenv("SLURM_CONF", unanswering_slurmdbd(tmp_path))
    main(["collect", str(sweep_dir), "--no-plots"])
    summary = (sweep_dir / "report" / "summary.md").read_text()
    assert f"no result.json (Slurm job {array}_3: not in the queue, state unknown without accounting)" in summary
    # A controller that does not answer: collect says it does not know, rather than guessing.
    monkeypatch.setenv("SLURM_CONF", unanswering_controller(tmp_path))
    main(["collect", str(sweep_dir), "--no-plots"])
    assert (
        f"(Slurm job {array}_3: pending, running or lost; \\`hpcfsdp status\\` asks Slurm)"  # Markdown: as written
        in (sweep_dir / "report" / "summary.md").read_text()
    )


@pytest.mark.slurm
def test_status_takes_the_final_state_of_a_job_that_left_the_queue_from_sacct(array, tmp_path, capsys):
    _, sweep, sweep_dir = four_cell_sweep(tmp_path, array)
    cancelled, failed = sweep.cells[2:]
    arrange(array, cancel=(0, 1), release=(2, 3), running=(2,))
    arrange(array, cancel=(2,))  # cancelled while it runs
    assert main(["status", str(sweep_dir)]) == 3
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:-1]}
    # Slurm's word, then what to do about it (src/hpcfsdp/contracts/endings.py)
    assert rows[cancelled.id][:4] == ["fsdp2_zero3", "missing", f"{array}_2", "CANCELLED:"]
    assert rows[failed.id][:4] in (
        ["fsdp2_zero3", "missing", f"{array}_3", "FAILED"],
        ["fsdp2_zero3", "missing", f"{array}_3", "FAILED:"],
    )
    # Their records say why they ended: cancelled, and error (FAILED has no status of its own).
    record_lost_cells(sweep_status(sweep_dir))
    assert [cell_status_of(sweep_dir, c) for c in (cancelled, failed)] == ["cancelled", "error"]


@pytest.mark.slurm
def test_a_record_made_with_another_default_is_rerun_and_an_older_one_is_kept(array, tmp_path, capsys):
    path, sweep, sweep_dir = four_cell_sweep(tmp_path, array)
    ok, timed_out, _, _ = sweep.cells
    arrange(array, cancel=(0, 1, 2, 3))  # nothing of the sweep is queued
    older = {k: v for k, v in ok.spec.to_dict().items() if k != "record_param_norm"}  # before that field existed
    write_record(sweep_dir / "cells" / ok.id / "result.json", {"status": "ok", "spec": older})
    changed = {**timed_out.spec.to_dict(), "warmup_steps": timed_out.spec.warmup_steps + 1}  # a default since changed
    write_record(sweep_dir / "cells" / timed_out.id / "result.json", {"status": "ok", "spec": changed})
    chosen, done, _ = select_cells(sweep, sweep_dir)
    assert timed_out in chosen and done == [ok]
    assert main(["submit", str(path), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    assert "rerunning 1 cell(s) whose record was made with other values of their fields" in capsys.readouterr().err


def test_a_jobs_file_with_only_include_makes_only_its_includes(tmp_path):
    path = write(
        tmp_path,
        """
        base: {model: tiny, device: cpu, strategy: ddp, gpus_per_node: 2}
        include:
          - {batch_size: 2}
          - {batch_size: 3}
        """,
    )
    assert sorted(cell.spec.batch_size for cell in load_sweep(path).cells) == [2, 3]  # no base cell (batch 1)
    with_base = write(tmp_path, "base: {model: tiny, device: cpu}\ninclude: [{}, {batch_size: 2}]\n", "base.yaml")
    assert sorted(cell.spec.batch_size for cell in load_sweep(with_base).cells) == [1, 2]


def test_plan_notes_a_hybrid_strategy_with_one_replica_as_the_strategy_it_is(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        base: {model: tiny, device: cpu, gpus_per_node: 2}
        matrix:
          strategy: [fsdp2_hsdp, fsdp2_zero3]
          nodes: [1, 2]
        """,
    )
    assert main(["plan", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: 1 fsdp2_hsdp cell(s) shard over all their ranks (one shard group, one replica): that is fsdp2_zero3 "
        "under another name; a hybrid needs nodes >= 2 or an hsdp_shard_size below the ranks"
    ]


def test_watch_eta_comes_from_how_fast_the_cells_in_flight_at_its_first_look_finished(tmp_path):
    from hpcfsdp.sweep.track.status import CellStatus, StatusReport
    from hpcfsdp.sweep.track.watch import _Clock

    def report(*states: str) -> StatusReport:
        return StatusReport(tmp_path, [CellStatus(f"c{i}", "ddp", state) for i, state in enumerate(states)])

    clock = _Clock(time.time() - 120, {"c0", "c1", "c2"})
    assert clock.timing(report("ok", "running", "pending")) == "2m00s elapsed, ETA 4m00s"
    assert clock.timing(report("running", "running", "pending")) == "2m00s elapsed"  # none finished: no ETA yet
    assert clock.timing(report("ok", "oom", "error")) == "2m00s elapsed"


def test_states_are_coloured_on_a_terminal_only_and_never_with_no_color(monkeypatch):
    import pty

    from hpcfsdp.progress import coloured

    leader, follower = pty.openpty()
    with open(follower, "w") as terminal:
        assert coloured("ok", "ok", terminal) == "\033[32mok\033[0m"
        assert coloured("oom     ", "oom", terminal) == "\033[31moom     \033[0m"
        assert coloured("hang", "hang", terminal) == "\033[31mhang\033[0m"
        monkeypatch.setenv("NO_COLOR", "1")
        assert coloured("oom", "oom", terminal) == "oom"
    os.close(leader)
    monkeypatch.delenv("NO_COLOR")
    assert coloured("oom", "oom", io.StringIO()) == "oom"  # a log or a pipe


def test_error_lines_are_red_on_a_terminal_and_plain_with_no_color_or_in_a_pipe(tmp_path, monkeypatch, capsys):
    import pty

    path = write(tmp_path, "base: {model: tiny, devize: cpu}\nmatrix:\n  strategy: [ddp]\n")
    said = {}
    for case, no_color in (("terminal", ""), ("no_color", "1")):
        monkeypatch.setenv("NO_COLOR", no_color)
        leader, follower = pty.openpty()
        with open(follower, "w") as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            assert main(["plan", str(path)]) == 2
            terminal.flush()
        said[case] = os.read(leader, 4096).decode()
        os.close(leader)
    monkeypatch.undo()
    assert said["terminal"].startswith("\033[31;1merror:\033[0m " + f"{path}:1: base.devize: unknown key")
    assert said["no_color"].startswith(f"error: {path}:1: base.devize") and "\033[" not in said["no_color"]
    assert main(["plan", str(path)]) == 2  # stderr captured: a pipe
    assert capsys.readouterr().err.startswith(f"error: {path}:1:")


def test_a_global_batch_that_a_matrix_batch_does_not_divide_blames_the_matrix_value(tmp_path, capsys):
    path = write(tmp_path, "base: {model: tiny, global_batch_size: 8}\nmatrix:\n  batch_size: [2, 3]\n")
    assert main(["plan", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}:3: matrix.batch_size: 3 does not fit global_batch_size: 8 is not a multiple of "
        "batch_size x world size = 3 x 1 = 3 (cell batch_size=3)"
    ]


def test_every_mistyped_key_of_a_jobs_file_is_named_in_one_run(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        name: typos
        base: {model: tiny, devize: cpu}
        slurm:
          partitin: gpu
          time_mn: 10
          cpus_per_tsk: 1
        matrix:
          strategy: [ddp]
        """,
    )
    assert main(["plan", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}:3: base.devize: unknown key; did you mean 'device'?",
        f"error: {path}:5: slurm.partitin: unknown key; did you mean 'partition'?",
        f"error: {path}:6: slurm.time_mn: unknown key; did you mean 'time_min'?",
        f"error: {path}:7: slurm.cpus_per_tsk: unknown key; did you mean 'cpus_per_task'?",
    ]


def test_sbatch_words_under_slurm_point_to_the_cells_shape_not_to_every_slurm_key(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        base: {model: tiny}
        slurm:
          gpus: 4
          nodes: 2
          gres: gpu:4
          ntasks_per_node: 4
          time: 10
        matrix:
          strategy: [ddp]
        """,
    )
    assert main(["plan", str(path)]) == 2
    layout = "(or a matrix axis), from which hpcfsdp writes sbatch's task layout"
    gpus = f"the cells' gpus per node is `base.gpus_per_node` {layout}"
    nodes = f"the cells' nodes is `base.nodes` {layout}"
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}:4: slurm.gpus: unknown key; {gpus}",
        f"error: {path}:5: slurm.nodes: unknown key; {nodes}",
        f"error: {path}:6: slurm.gres: unknown key; {gpus}",
        f"error: {path}:7: slurm.ntasks_per_node: unknown key; {gpus}",
        f"error: {path}:8: slurm.time: unknown key; sbatch's --time is set by `slurm.time_min`",
    ]


def test_a_file_of_many_bad_cells_shows_its_first_twenty_problems_and_how_many_more(tmp_path, capsys):
    entries = "".join(f"  - {{strategy: ddp, batch_size: {n}, warmup_steps: 9, steps: 2}}\n" for n in range(1, 26))
    path = write(tmp_path, f"include:\n{entries}")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 21 and err[-1] == "error: ... and 5 more", err
    assert err[0].startswith(f"error: {path}:2: include[0].warmup_steps: expected fewer than steps (2), got 9"), err
    assert err[19].startswith(f"error: {path}:21: include[19].warmup_steps: "), err


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("name: x\nbase:\n  model: tiny\n   device: cpu\n", 4, "a key indented deeper than the keys above it"),
        ("base:\n  model: tiny\n device: cpu\n", 3, "a line indented differently from the lines above it"),
        ("base:\n\tmodel: tiny\n", 2, "a tab: YAML indents with spaces only"),
        ("name: x\nbase\n  model: tiny\n", 2, "a key without its ':'"),
    ],
    ids=["indented_deeper", "indented_less", "tab", "no_colon"],
)
def test_a_yaml_syntax_error_is_one_line_at_the_line_to_fix_in_words(tmp_path, capsys, text, line, words):
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    assert main(["plan", str(path)]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert err.startswith(f"error: {path}:{line}: not valid YAML (column ") and words in err, err
    assert "mapping values" not in err and "<block end>" not in err and "could not find" not in err


def test_plan_says_in_one_line_that_the_clusters_checks_were_skipped_without_a_controller(tmp_path, capsys):
    # The autouse fixture leaves no SLURM_CONF: sinfo finds no controller (or is not installed).
    assert main(["plan", "jobs/smoke.yaml"]) == 0
    (note,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"note: no Slurm (here \(sinfo is not on PATH\)|controller answered): the partition, QOS, host-memory "
        r"and sbatch --test-only checks were skipped; plan on a machine whose Slurm answers runs them",
        note,
    ), note
    assert main(["plan", "jobs/smoke.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster_checks_skipped"] == note.removeprefix("note: ")
