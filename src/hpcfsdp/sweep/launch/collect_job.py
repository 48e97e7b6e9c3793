"""`submit --then-collect`: one small CPU job that runs `hpcfsdp collect` when the sweep's arrays end.

The job depends on the arrays (`--dependency=afterany:<array>:...`: whatever way their tasks end),
so no login-node process has to wait. It runs `hpcfsdp collect SWEEP --fail-on-regression` (the
report in report/, the history appended to, each cell checked against its references), then writes
collect's exit status into the sweep folder's collect_job.json: 0 all well, 1 a regression (or,
with an error line kept beside it, collect failed), 3 a history it could not update and check,
else collect failed. A status other than 0 also fails the Slurm job, so that `slurm.mail_type: FAIL`
mails about it. `hpcfsdp status` shows the job (collect_line). With `slurm.clusters` it goes to
that cluster too: a dependency names jobs of its own cluster only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...contracts.errors import COLLECT_ENDINGS, COLLECT_UNCHECKED
from ...contracts.files import RecordError, read_json_object, write_json
from ...slurm import SlurmError
from ..define.matrix import Sweep
from ..folder.layout import slurm_folder
from ..track.scheduler import finished_states, queued_states

COLLECT_JOB_NAME = "collect_job.json"  # in the sweep folder: the job, then collect's exit status
COLLECT_TIME_MIN = 30  # collect of 10,000 records with plots takes minutes, not half an hour


@dataclass(frozen=True)
class CollectJob:
    """What the collect job runs on its node: collect of the sweep folder, its exit status saved."""

    sweep_dir: str

    def __call__(self) -> int:
        command = [sys.executable, "-m", "hpcfsdp", "collect", self.sweep_dir, "--fail-on-regression"]
        ran = subprocess.run(command, check=False, stderr=subprocess.PIPE, text=True, errors="replace")
        sys.stderr.write(ran.stderr)  # into the job's log, as it was
        code = ran.returncode
        path = Path(self.sweep_dir) / COLLECT_JOB_NAME
        entry = _read(path) or {}
        job = os.environ.get("SLURM_JOB_ID", "")
        errors = [line for line in ran.stderr.splitlines() if line.startswith("error: ")]
        # An error line with 1 is a UserError's, not a regression's (which prints none); with 3, the history's.
        failed = errors[-1].removeprefix("error: ")[:500] if errors and code not in (0, COLLECT_UNCHECKED) else None
        write_json(
            path,
            {
                **entry,
                "job_id": entry.get("job_id") or job,
                "exit_status": code,
                "error": failed,
                "ended_at": time.time(),
            },
        )
        if code:
            raise RuntimeError(
                f"hpcfsdp collect exited {code} ({ending(code, failed)}); see {Path(self.sweep_dir) / 'report'}"
            )
        return code


def ending(code: int, error: str | None = None) -> str:
    """What collect's exit status says (errors.COLLECT_ENDINGS); a UserError exits 1 as a
    regression does, so the collect job keeps its error line and a failure is never read as one."""
    if error:
        return f"collect failed: {error}"
    return COLLECT_ENDINGS.get(code, "collect failed")


def collect_parameters(sweep: Sweep, arrays: list[str]) -> dict:
    """submitit SlurmExecutor parameters of the collect job: one CPU task on the sweep's partition
    (or slurm.collect_partition), after the arrays, with the sweep's setup lines, mail settings and
    allowlisted environment (environment.py)."""
    from .environment import slurm_parameters_for_environment

    res = sweep.resources
    export, export_setup = slurm_parameters_for_environment(sweep)
    params: dict = dict(
        job_name=f"hpcfsdp-{sweep.name}-collect",
        partition=res.collect_partition or res.partition or None,
        time=COLLECT_TIME_MIN,
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=1,
        setup=[*export_setup, *sweep.setup],
        additional_parameters=export | ({"clusters": res.clusters} if res.clusters else {}),
    )
    if arrays:
        params["dependency"] = "afterany:" + ":".join(arrays)
    for key in ("account", "qos", "mail_user", "mail_type"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    return params


def queue_collect(sweep: Sweep, sweep_dir: Path, job_ids: list[str], log=print) -> str:
    """Queue the collect job after the arrays of these jobs (array tasks); returns its job id."""
    import submitit

    from .environment import slurm_environment_only

    arrays = sorted({jid.split("_")[0] for jid in job_ids}, key=lambda j: (len(j), j))
    executor = submitit.SlurmExecutor(folder=slurm_folder(sweep_dir))
    executor.update_parameters(**collect_parameters(sweep, arrays))
    with slurm_environment_only(sweep):
        job = executor.submit(CollectJob(str(Path(sweep_dir).absolute())))
    entry = {"job_id": job.job_id, "cluster": sweep.resources.clusters, "after": arrays, "submitted_at": time.time()}
    write_json(Path(sweep_dir) / COLLECT_JOB_NAME, {**entry, "exit_status": None, "ended_at": None})
    after = f" after array(s) {', '.join(arrays)}" if arrays else " (no array in flight: it runs now)"
    log(f"submitted collect job {job.job_id}{after}: report and exit status in {sweep_dir}")
    return job.job_id


def collect_line(sweep_dir: Path) -> str | None:
    """The collect job as `hpcfsdp status` shows it; None when the sweep has none."""
    path = Path(sweep_dir) / COLLECT_JOB_NAME
    entry = _read(path)
    if entry is None:
        return None
    job = str(entry.get("job_id", "?"))
    cluster = str(entry.get("cluster") or "")
    code = entry.get("exit_status")
    if isinstance(code, int) and not isinstance(code, bool):
        error = entry.get("error")
        what = ending(code, error if isinstance(error, str) else None)
        return f"collect job {job}: exit status {code} ({what}): {Path(sweep_dir) / 'report' / 'summary.md'}"
    try:
        queued = queued_states([job], cluster).get(job)
    except SlurmError as exc:
        return f"collect job {job}: unknown ({exc})"
    if queued is not None:
        reason = f" ({queued.reason})" if queued.reason else ""
        return f"collect job {job}: {queued.state}{reason}"
    final = finished_states([job], cluster).get(job, "")
    return (
        f"collect job {job}: left the queue{f' ({final})' if final else ''} without an exit status; "
        f"logs in {slurm_folder(sweep_dir).parent / job}"
    )


def _read(path: Path) -> dict | None:
    try:
        return read_json_object(path, kind="collect job")
    except (FileNotFoundError, RecordError):
        return None
