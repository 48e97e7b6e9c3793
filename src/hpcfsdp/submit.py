"""Submit a sweep: one Slurm job array per resource shape (submitit), or run cells locally.

Layout of a sweep folder (results/<sweep>/):
    matrix.yaml          the matrix as submitted
    manifest.json        cell id -> executor, job id, submit time
    cells/<id>/spec.json the resolved spec of the cell
    cells/<id>/result.json   written by the cell (record.py)
    slurm/               submitit's scripts and logs
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import yaml

from .matrix import Cell, Sweep
from .record import RECORD_NAME, RecordError, read_record, write_record
from .run import CellJob, write_cell_spec
from .spec import Resources

EXECUTORS = ("slurm", "local", "print")
MANIFEST_NAME = "manifest.json"
# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class Submission:
    sweep_dir: Path
    executor: str
    submitted: list[Cell] = field(default_factory=list)
    skipped: list[Cell] = field(default_factory=list)
    job_ids: dict[str, str] = field(default_factory=dict)
    jobs: list = field(default_factory=list)  # submitit jobs, when the executor is slurm


def default_executor() -> str:
    """slurm when a Slurm controller answers here, else local (this machine's processes)."""
    if not shutil.which("sinfo"):
        return "local"
    try:
        probe = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "local"
    return "slurm" if probe.returncode == 0 else "local"


def cell_dir(sweep_dir: Path, cell: Cell) -> Path:
    return sweep_dir / "cells" / cell.id


def cell_status(sweep_dir: Path, cell: Cell) -> str:
    """ok / oom / error / timeout from the record, 'missing' without one, 'corrupt' if unreadable."""
    path = cell_dir(sweep_dir, cell) / RECORD_NAME
    if not path.exists():
        return "missing"
    try:
        return read_record(path)["status"]
    except RecordError:
        return "corrupt"


def select_cells(sweep: Sweep, sweep_dir: Path, force: bool = False, retry_failed: bool = False) -> tuple[list[Cell], list[Cell]]:
    """Cells to submit and cells skipped: by default only cells without a record run again."""
    chosen, skipped = [], []
    for cell in sweep.cells:
        status = cell_status(sweep_dir, cell)
        rerun = force or status == "missing" or (retry_failed and status != "ok")
        (chosen if rerun else skipped).append(cell)
    return chosen, skipped


def submit(
    sweep: Sweep,
    results_dir: Path,
    executor: str | None = None,
    force: bool = False,
    retry_failed: bool = False,
    log=print,
) -> Submission:
    executor = executor or default_executor()
    if executor not in EXECUTORS:
        raise ValueError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    sweep_dir = Path(results_dir) / sweep.name
    cells, skipped = select_cells(sweep, sweep_dir, force, retry_failed)
    sub = Submission(sweep_dir=sweep_dir, executor=executor, submitted=cells, skipped=skipped)
    if skipped:
        log(f"skipping {len(skipped)} cell(s) that already have a record (--retry-failed or --force to rerun)")
    if not cells:
        log("nothing to submit")
        return sub
    _write_sweep_files(sweep, sweep_dir, cells)
    if executor == "slurm":
        _submit_slurm(sweep, sub, log)
    elif executor == "local":
        _run_local(sweep, sub, log)
    else:
        for cell in cells:
            log(" ".join(map(shlex.quote, torchrun_command(cell_dir(sweep_dir, cell), cell.spec.world_size))))
    return sub


def _write_sweep_files(sweep: Sweep, sweep_dir: Path, cells: Iterable[Cell]) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "matrix.yaml").write_text(yaml.safe_dump(sweep.raw, sort_keys=False))
    for cell in cells:
        directory = cell_dir(sweep_dir, cell)
        (directory / RECORD_NAME).unlink(missing_ok=True)
        write_cell_spec(directory, cell.spec, cell.id, sweep.name)


def _update_manifest(sweep_dir: Path, entries: dict[str, dict]) -> None:
    path = sweep_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text()) if path.exists() else {}
    manifest.update(entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_manifest(sweep_dir: Path) -> dict[str, dict]:
    path = Path(sweep_dir) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def slurm_parameters(sweep: Sweep, nodes: int, gpus_per_node: int) -> dict:
    """submitit SlurmExecutor parameters for one array: resources, setup lines, offline switches."""
    res: Resources = sweep.resources
    params: dict = dict(
        job_name=f"hpcfsdp-{sweep.name}",
        partition=res.partition or None,
        time=res.time_min,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        cpus_per_task=res.cpus_per_task,
        array_parallelism=res.array_parallelism,
        setup=[*(f"export {k}={v}" for k, v in OFFLINE_ENV.items()), *sweep.setup],
        # One failed rank must end the whole step, never leave the others hanging in a collective.
        srun_args=["--kill-on-bad-exit=1"],
        additional_parameters=dict(res.extra_sbatch),
    )
    if res.gpu_request == "gres":
        params["gres"] = f"gpu:{gpus_per_node}"
    elif res.gpu_request == "gpus_per_node":
        params["gpus_per_node"] = gpus_per_node
    for key in ("account", "qos", "constraint"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    if res.mem_gb:
        params["mem"] = f"{res.mem_gb}G"
    if res.exclusive:
        params["exclusive"] = True
    return params


def _submit_slurm(sweep: Sweep, sub: Submission, log) -> None:
    import submitit

    by_shape: dict[tuple[int, int], list[Cell]] = {}
    for cell in sub.submitted:
        by_shape.setdefault(cell.shape, []).append(cell)
    for (nodes, gpus), cells in by_shape.items():
        executor = submitit.SlurmExecutor(folder=sub.sweep_dir / "slurm" / "%j", max_num_timeout=sweep.resources.max_requeue)
        executor.update_parameters(**slurm_parameters(sweep, nodes, gpus))
        jobs = executor.map_array(_call, [CellJob(str(cell_dir(sub.sweep_dir, c))) for c in cells])
        sub.jobs.extend(jobs)
        entries = {}
        for cell, job in zip(cells, jobs):
            sub.job_ids[cell.id] = job.job_id
            entries[cell.id] = {"executor": "slurm", "job_id": job.job_id, "submitted_at": time.time()}
        _update_manifest(sub.sweep_dir, entries)
        log(f"submitted array {jobs[0].job_id.split('_')[0]}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s)")


def _call(job: CellJob) -> str:
    return job()


def wait_slurm(sub: Submission, log=print, poll_s: float = 5.0) -> dict[str, str]:
    """Wait for every job; return cell id -> Slurm state. Prints progress while waiting."""
    import submitit  # noqa: F401 - jobs are submitit objects

    ids = {job.job_id: cell_id for cell_id, job in zip(sub.job_ids, sub.jobs)}
    last = ""
    while True:
        done = sum(job.done() for job in sub.jobs)
        line = f"waiting: {done}/{len(sub.jobs)} array task(s) finished"
        if line != last:
            log(line)
            last = line
        if done == len(sub.jobs):
            break
        time.sleep(poll_s)
    return {ids[job.job_id]: job.state for job in sub.jobs}


def torchrun_command(directory: Path, nprocs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
            "-m", "hpcfsdp", "run", "--cell-dir", str(directory)]


def _run_local(sweep: Sweep, sub: Submission, log) -> None:
    """One cell at a time on this machine, each as a torchrun with the cell's world size."""
    env = {**os.environ, **OFFLINE_ENV}
    for index, cell in enumerate(sub.submitted, 1):
        directory = cell_dir(sub.sweep_dir, cell)
        if cell.spec.nodes > 1:
            log(f"note: {cell.id} asks for {cell.spec.nodes} nodes; the local executor runs its {cell.spec.world_size} ranks on this machine")
        log(f"[{index}/{len(sub.submitted)}] {cell.id} ({cell.spec.world_size} process(es))")
        _update_manifest(sub.sweep_dir, {cell.id: {"executor": "local", "job_id": None, "submitted_at": time.time()}})
        with open(directory / "log.txt", "w") as out:
            proc = subprocess.run(torchrun_command(directory, cell.spec.world_size), stdout=out, stderr=subprocess.STDOUT, env=env)
        status = cell_status(sub.sweep_dir, cell)
        if status == "missing":
            _record_launch_failure(sweep, cell, directory, proc.returncode)
            status = f"error (exited {proc.returncode} without a record; see {directory / 'log.txt'})"
        log(f"    {status}")


def _record_launch_failure(sweep: Sweep, cell: Cell, directory: Path, returncode: int) -> None:
    """A cell that died before it could write its record (killed, import error) still gets one."""
    tail = (directory / "log.txt").read_text(errors="replace")[-4000:]
    write_record(directory / RECORD_NAME, {
        "status": "error", "stage": "launch", "error": f"torchrun exited {returncode} without a record",
        "traceback": tail, "cell_id": cell.id, "sweep": sweep.name, "spec": cell.spec.to_dict(),
        "world_size": cell.spec.world_size, "nodes": cell.spec.nodes,
    })
