"""The Slurm executor: one job array per resource shape (submitit's SlurmExecutor), split at the
most tasks an array may hold (cluster.array_size_limit) and at the room slurm.max_jobs_in_queue
leaves; each task runs one cell, or slurm.cells_per_task one-node cells one after another; the
sbatch parameters and script of an array (`plan --sbatch` prints the same)."""

from __future__ import annotations

import contextlib
import io
import math
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ...contracts.errors import UserError
from ...contracts.spec import JOB_END_ENV, LAUNCH_STARTED_ENV, MAX_REQUEUE_ENV
from ..define.matrix import Cell, Sweep, arrays, cells_on_shape, packed, tasks_of
from ..define.resources import Resources
from ..folder.layout import (
    array_comment,
    cell_dir,
    folder_uid,
    new_uid,
    owned_entry,
    records_set_aside,
    slurm_folder,
    sweep_comment,
    update_manifest,
)
from ..predict.hostmemory import requested_mem_gb
from ..track.cluster import array_size_limit, jobs_in_queue
from ..track.intent import clear_intent, new_intent, write_intent
from ..track.packed import task_entry
from . import container_command
from .crashpoint import crash_point
from .environment import (
    HF_TOKEN_ENV,
    job_environment,
    shell_part_in,
    slurm_environment_only,
    slurm_parameters_for_environment,
)
from .interrupts import interrupts_deferred

# The job's end time as Slurm scheduled it, asked once per job (not per rank): a rank that gets
# SIGTERM well before it was cancelled (scancel) or lost a node, not timed out (cell/run.py).
JOB_END_SETUP = f'export {JOB_END_ENV}="$(timeout 30 squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e 2>/dev/null)"'
# The last line before srun: the launch's start, from which each cell counts its phases (cell/measure/phases.py).
LAUNCH_STARTED_SETUP = f'export {LAUNCH_STARTED_ENV}="$(date +%s.%N)"'


class SubmitError(UserError, RuntimeError):
    """sbatch refused an array; the cells not queued keep the records they had."""


def slurm_parameters(
    sweep: Sweep,
    nodes: int,
    gpus_per_node: int,
    sweep_dir: Path,
    uid: str = "",
    cell_ids: Sequence[str] = (),
    cells_per_task: int = 1,
) -> dict:
    """submitit SlurmExecutor parameters for one array of tasks of `cells_per_task` cells (the time
    limit is theirs together): resources, the allowlisted environment
    (environment.py), setup lines, offline switches, pyxis's srun flags (the other container
    runtimes wrap the job's Python: job_python), and the sweep id as the jobs' comment (with the
    token of the array's cells where they are given: layout.array_comment)."""
    res: Resources = sweep.resources
    env = {**job_environment(sweep), MAX_REQUEUE_ENV: str(res.max_requeue)}
    export, export_setup = slurm_parameters_for_environment(sweep)
    additional = {**res.extra_sbatch, **export}
    # Clusters with JobRequeue=0 refuse `scontrol requeue` without --requeue; with JobRequeue=1 (the
    # default) Slurm would requeue a preempted job, or one whose node failed, without end.
    additional["requeue" if res.max_requeue else "no_requeue"] = True
    if res.clusters:  # sbatch -M; status, cancel and collect ask the cluster the manifest names
        additional["clusters"] = res.clusters
    params: dict = dict(
        job_name=f"hpcfsdp-{sweep.name}",
        partition=res.partition or None,
        time=res.time_min * cells_per_task,
        nodes=nodes,
        # One task per node, the node's supervisor, which starts its gpus_per_node ranks with their
        # share of the task's CPUs (cell/supervise/).
        ntasks_per_node=1,
        cpus_per_task=res.cpus_per_task * gpus_per_node,
        array_parallelism=res.array_parallelism,
        signal_delay_s=res.signal_delay_s,
        # The unset is for a script submitted by hand (plan --sbatch): submit's sbatch never has them.
        setup=[
            *export_setup,
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            f"unset {' '.join(HF_TOKEN_ENV)}",
            JOB_END_SETUP,
            *sweep.setup,
            *container_command.env_lines(sweep),
            LAUNCH_STARTED_SETUP,
        ],
        # One failed rank must end the whole step, never leave the others hanging in a collective.
        # srun does not inherit sbatch's --cpus-per-task since Slurm 22.05: given again.
        srun_args=[
            "--kill-on-bad-exit=1",
            f"--cpus-per-task={res.cpus_per_task * gpus_per_node}",
            *container_command.srun_args(sweep, sweep_dir),
        ],
        additional_parameters=additional,
    )
    if uid:
        params["comment"] = array_comment(uid, cell_ids) if cell_ids else sweep_comment(uid)
    if res.gpu_request == "gres":
        params["gres"] = f"gpu:{gpus_per_node}"
    elif res.gpu_request == "gpus_per_node":
        params["gpus_per_node"] = gpus_per_node
    for key in ("account", "qos", "constraint"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    mem_gb = requested_mem_gb(sweep, nodes, gpus_per_node)
    if mem_gb:
        params["mem"] = f"{mem_gb}G"
    if res.exclusive:
        params["exclusive"] = True
    return params


def sbatch_script(
    sweep: Sweep,
    sweep_dir: Path,
    nodes: int,
    gpus_per_node: int,
    count: int,
    uid: str = "",
    cell_ids: Sequence[str] = (),
) -> str:
    """The sbatch script submit writes for an array of `count` cells of one shape (a plain job for
    one task), packed as slurm.cells_per_task says; without the sweep id (its comment) before the
    folder's first submit."""
    # submitit has no public call for the script text; SlurmExecutor builds it with this helper,
    # from the same parameters and the command of digested.py's executor (without the digests of
    # the pickles, which submit writes only when it queues the array).
    from submitit.slurm.slurm import _make_sbatch_string

    from .digested import job_command

    folder = slurm_folder(sweep_dir)
    per_task = min(packed(nodes, sweep.resources.cells_per_task), max(count, 1))
    return _make_sbatch_string(
        command=job_command(container_command.job_python(sweep, sweep_dir), folder),
        folder=folder,
        map_count=task_count(count, per_task) if task_count(count, per_task) > 1 else None,
        **slurm_parameters(sweep, nodes, gpus_per_node, sweep_dir, uid, cell_ids, per_task),
    )


def submit_arrays(
    sweep: Sweep, sweep_dir: Path, cells: list[Cell], log: Callable[[str], None], room_poll_s: float | None
) -> tuple[dict[str, str], list[Cell]]:
    """Queue the cells, one array per shape, split at the most cells an array may hold; returns
    cell id -> job id of those queued, and the cells left out. Under slurm.max_jobs_in_queue only
    as many cells go out as there is room for: the rest wait for room (room_poll_s seconds between
    looks) or, without room_poll_s, stay out."""
    cap = sweep.resources.max_jobs_in_queue
    uid = folder_uid(sweep_dir) or new_uid()  # made at the folder's first Slurm submit
    res = sweep.resources
    todo = arrays(cells, array_size_limit(res.max_array_size, res.clusters), res.cells_per_task)
    job_ids: dict[str, str] = {}
    last_note = ""
    while todo:
        (nodes, gpus), shape_cells = todo[0]
        room = _queue_room(cap, sweep.resources.clusters)
        if room is not None and room < 1:
            if room_poll_s is None:
                break
            note = (
                f"waiting for room in the queue (slurm.max_jobs_in_queue {cap}, {cap - room} of your jobs queued): "
                f"{sum(len(c) for _, c in todo)} of {len(cells)} cell(s) still to submit"
            )
            if note != last_note:
                log(note)
                last_note = note
            time.sleep(room_poll_s)
            continue
        per_task = packed(nodes, res.cells_per_task)  # the queue's room is counted in tasks
        take = len(shape_cells) if room is None else min(room * per_task, len(shape_cells))
        todo[0:1] = [((nodes, gpus), shape_cells[take:])] if take < len(shape_cells) else []
        job_ids.update(_submit_array(sweep, sweep_dir, nodes, gpus, shape_cells[:take], uid, log))
    not_queued = [cell for _, left in todo for cell in left]
    if not_queued:
        log(
            f"queued {len(job_ids)} of {len(cells)} cell(s): the queue is full (slurm.max_jobs_in_queue {cap}); "
            f"submit the same YAML again once jobs have finished to queue the other {len(not_queued)} "
            "(it skips cells with a record or in flight), or add --wait to wait for room"
        )
    return job_ids, not_queued


def task_count(cells: int, per_task: int) -> int:
    """The array tasks that run this many cells, per_task at a time."""
    return math.ceil(cells / per_task)


def _queue_room(cap: int, cluster: str) -> int | None:
    """How many more jobs (array tasks) slurm.max_jobs_in_queue lets into the queue now; None: no cap."""
    if not cap:
        return None
    queued = jobs_in_queue(cluster)
    if queued is None:
        raise SubmitError(
            f"squeue did not answer, so your queued jobs cannot be counted against slurm.max_jobs_in_queue {cap}"
        )
    return cap - queued


def _submit_array(
    sweep: Sweep, sweep_dir: Path, nodes: int, gpus: int, cells: list[Cell], uid: str, log: Callable[[str], None]
) -> dict[str, str]:
    from submitit.core.utils import FailedJobError

    from .digested import DigestedSlurmExecutor
    from .job import CellJob

    tasks = tasks_of(cells, packed(nodes, sweep.resources.cells_per_task))
    task_dirs = [tuple(str(cell_dir(sweep_dir, cell).absolute()) for cell in task) for task in tasks]
    executor = DigestedSlurmExecutor(
        slurm_folder(sweep_dir),
        task_dirs,
        max_num_timeout=sweep.resources.max_requeue,
        python=container_command.job_python(sweep, sweep_dir),
    )
    per_task = len(tasks[0])
    params = slurm_parameters(sweep, nodes, gpus, sweep_dir, uid, [cell.id for cell in cells], per_task)
    intent = new_intent(uid, sweep.resources.clusters, params["job_name"], [cell.id for cell in cells], per_task)
    executor.update_parameters(**params)
    # The CellJob itself is the submitted function, so that submitit finds its checkpoint().
    # sbatch queues the array and the manifest names it, or neither happens: signals wait until
    # then (outermost, so that a signal during a queueing that worked restores no record). A refusal
    # is reported once, by SubmitError, with sbatch's message: submitit's own echo of it is dropped.
    # A SIGKILL between the two leaves the intent, which the next submit, status or cancel settles.
    with interrupts_deferred(), records_set_aside(sweep_dir, cells), slurm_environment_only(sweep):
        write_intent(sweep_dir, intent)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.submit_array([CellJob(dirs) for dirs in task_dirs])
        except FailedJobError as exc:
            clear_intent(sweep_dir)
            reason = " ".join(str(exc).split()) or "no message"
            raise SubmitError(
                f"sbatch refused the array of {cells_on_shape(cells, nodes, gpus)}: {reason}"
                + shell_part_in(reason, sweep)
            ) from None
        job_ids = {cell.id: job.job_id for task, job in zip(tasks, jobs) for cell in task}
        crash_point("submit_queued")
        update_manifest(
            sweep_dir,
            {
                cell.id: {
                    "executor": "slurm",
                    "job_id": job.job_id,
                    "cluster": sweep.resources.clusters,
                    "submitted_at": time.time(),
                    **owned_entry(sweep_dir, uid),
                    **task_entry([member.id for member in task]),
                }
                for task, job in zip(tasks, jobs)
                for cell in task
            },
        )
        clear_intent(sweep_dir)
    where = f" on cluster {sweep.resources.clusters}" if sweep.resources.clusters else ""
    packing = f", {per_task} per task: {len(tasks)} task(s)" if per_task > 1 else ""
    log(f"submitted array {jobs[0].job_id.split('_')[0]}{where}: {cells_on_shape(cells, nodes, gpus)}{packing}")
    return job_ids
