"""A stage under Slurm: the probes of one shape, `probes_per_job` at a time, as the tasks of one
array, each task one allocation that runs its probes one after another (job.ProbeJob); shapes
of several nodes fall back to one array task per run (the grid's CellJob), since a torchrun per
probe inside the allocation is a one-node launch. Then wait until the stage's jobs left the queue,
as `submit --wait` does."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from pathlib import Path

from ..contracts.errors import UserError
from ..slurm import SlurmError
from ..sweep.define.matrix import Cell, Sweep
from ..sweep.folder.layout import folder_uid, new_uid, owned_entry, slurm_folder, update_manifest
from ..sweep.launch import container_command
from ..sweep.launch.environment import slurm_environment_only
from ..sweep.launch.interrupts import interrupts_deferred
from ..sweep.launch.sbatch import SubmitError, slurm_parameters, submit_arrays
from ..sweep.track.scheduler import queued_states
from .probe import Planned
from .state import Stage


def submit_stage_jobs(
    sweep: Sweep,
    directory: Path,
    stage: Stage,
    runs: list[tuple[Cell, Planned]],
    probes_per_job: int,
    launches_dir: Path,
    log: Callable[[str], None],
) -> None:
    """Queue these runs of the stage; the jobs go into stage.jobs (job id -> its run ids)."""
    by_shape: dict[tuple[int, int], list[tuple[Cell, Planned]]] = {}
    for cell, planned in runs:
        by_shape.setdefault(cell.shape, []).append((cell, planned))
    for (nodes, gpus), members in by_shape.items():
        if nodes > 1:
            ids = submit_arrays(sweep, directory, [cell for cell, _ in members], log, None)[0]
            for run_id, job_id in ids.items():
                stage.jobs.setdefault(job_id, []).append(run_id)
            continue
        chunks = [members[start : start + probes_per_job] for start in range(0, len(members), probes_per_job)]
        _submit_probe_array(sweep, directory, stage, gpus, chunks, launches_dir, log)


def _submit_probe_array(
    sweep: Sweep,
    directory: Path,
    stage: Stage,
    gpus: int,
    chunks: list[list[tuple[Cell, Planned]]],
    launches_dir: Path,
    log: Callable[[str], None],
) -> None:
    import submitit
    from submitit.core.utils import FailedJobError

    from .job import ProbeJob

    res = sweep.resources
    executor = submitit.SlurmExecutor(
        folder=slurm_folder(directory), python=container_command.job_python(sweep, directory)
    )
    uid = folder_uid(directory) or new_uid()  # the folder's sweep id, as submit's arrays carry it
    params = slurm_parameters(sweep, 1, gpus, directory, uid)
    # One task holds the node's GPUs and CPUs (as every array task does); the supervisors it starts
    # start the ranks.
    params.update(job_name=f"hpcfsdp-tune-{sweep.name}")
    executor.update_parameters(**params)
    jobs_of = [
        ProbeJob(tuple(p for _, p in chunk), str(launches_dir.absolute()), res.time_min * 60) for chunk in chunks
    ]
    with interrupts_deferred(), slurm_environment_only(sweep):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.submit_array(jobs_of)
        except FailedJobError as exc:
            raise SubmitError(f"sbatch refused the probe jobs of {stage.name}: {' '.join(str(exc).split())}") from None
        entries = {}
        for job, chunk in zip(jobs, chunks):
            stage.jobs[job.job_id] = [cell.id for cell, _ in chunk]
            for cell, _ in chunk:
                entries[cell.id] = {
                    "executor": "slurm",
                    "job_id": job.job_id,
                    "cluster": res.clusters,
                    "submitted_at": time.time(),
                    **owned_entry(directory, uid),
                }
        update_manifest(directory, entries)
    log(
        f"{stage.name}: submitted array {jobs[0].job_id.split('_')[0]}: {len(chunks)} allocation(s) of 1 node x "
        f"{gpus} GPU(s), {sum(len(c) for c in chunks)} run(s), up to {max(len(c) for c in chunks)} per allocation"
    )


def wait_for_jobs(
    job_ids: list[str],
    cluster: str,
    poll_s: float,
    log: Callable[[str], None],
    probes_done: Callable[[], str] = lambda: "",
) -> None:
    """Until none of these jobs is pending or running (squeue); UserError when squeue stops answering.
    A line each time the probes done (`probes_done`: "stage1: 3 of 8 probe(s) done") or the jobs' states change."""
    said = ""
    while True:
        try:
            queued = queued_states(job_ids, cluster)
        except SlurmError as exc:
            raise UserError(
                f"cannot tell whether the probe jobs still run ({exc}); run the same command again"
            ) from None
        if not queued:
            return
        done = probes_done()
        line = f"{done}{'; ' if done else ''}waiting for {len(queued)} job(s): " + ", ".join(
            sorted({q.state.lower() for q in queued.values()})
        )
        if line != said:
            log(line)
            said = line
        time.sleep(poll_s)
