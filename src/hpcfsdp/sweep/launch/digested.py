"""The job pickle's digest: nothing another user could have written is unpickled as you.

submitit pickles each array task's CellJob into `slurm/<job>_submitted.pkl`, and its job script
unpickles that file when the task starts. In a folder others may write (HPCFSDP_SHARED_GROUP),
anyone of the group could replace it while the array waits. So submit writes the pickles itself
(0600, fs/pickles.py), and the sbatch script carries each task's sha256 and cell folders, in two
bash arrays indexed by SLURM_ARRAY_TASK_ID: Slurm copies the script at submission, so no later
change of any file reaches them. The task runs this module's main instead of submitit's: it reads
the pickle once, unpickles those bytes only where their sha256 is the script's, and otherwise
records `error` in the cell's record ("digest mismatch") and unpickles nothing.

A requeue (submitit's checkpoint at the time limit) dumps the job again: into a private folder of
the node here, never over the submitted pickle, whose digest the requeued run checks again.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import submitit
from submitit.core import utils
from submitit.core.logger import get_logger
from submitit.slurm.slurm import SlurmJob

from ...contracts.fs.pickles import DigestMismatch, load_pickle, write_pickle

DIGESTS, CELLS = "hpcfsdp_pickle_sha256", "hpcfsdp_pickle_cell"  # the script's bash arrays
TASK = "${SLURM_ARRAY_TASK_ID:-0}"  # a lone cell is a plain job, without an array index
PICKLE_WAIT_S = 60  # submit renames the pickles just after sbatch answers (submitit waits as long)


def job_command(python: str, folder: Path) -> str:
    """The srun command of every array: this module's main, given its task's digest and cell."""
    task = [f'"${{{name}[{TASK}]}}"' for name in (DIGESTS, CELLS)]
    return " ".join([python, "-u -m", __name__, shlex.quote(str(folder)), *task])


def digest_lines(digests: Sequence[str], task_dirs: Sequence[Sequence[str]]) -> list[str]:
    """The script's setup lines that hold each task's digest and cell folders (one per line), in
    task order."""
    return [
        f"{DIGESTS}=({' '.join(digests)})",
        f"{CELLS}=({' '.join(shlex.quote(chr(10).join(cells)) for cells in task_dirs)})",
    ]


class DigestedSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor, whose job script carries each task's pickle digest (and cell
    folders, for the records of a mismatch) and runs main; task_dirs in the order of the jobs."""

    def __init__(self, folder: Path, task_dirs: Sequence[Sequence[str]], max_num_timeout: int, python: str) -> None:
        super().__init__(folder=folder, max_num_timeout=max_num_timeout, python=python)
        self.task_dirs = list(task_dirs)

    @property
    def _submitit_command_str(self) -> str:
        return job_command(self.python, self.folder)

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]) -> list[Any]:
        """submitit's own (SlurmExecutor's array, PicklingExecutor's lone job), with the pickles
        written here and their digests added to the script's setup."""
        if len(delayed_submissions) != len(self.task_dirs):
            raise ValueError(f"{len(delayed_submissions)} jobs for {len(self.task_dirs)} tasks' cell folders")
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        pickles, digests = [], []
        for delayed in delayed_submissions:
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
            digests.append(write_pickle(pickles[-1], cloudpickle.dumps(delayed)))
        executor = submitit.SlurmExecutor(self.folder, self.max_num_timeout, python=self.python)
        setup = [*self.parameters.get("setup", []), *digest_lines(digests, self.task_dirs)]
        executor.update_parameters(**{**self.parameters, "setup": setup})
        if len(pickles) > 1:
            executor.parameters["map_count"] = len(pickles)
        self._throttle()
        first = executor._submit_command(self._submitit_command_str)
        jobs = (
            [
                SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{a}", tasks=list(range(first.num_tasks)))
                for a in range(len(pickles))
            ]
            if len(pickles) > 1
            else [first]
        )
        for job, path in zip(jobs, pickles):
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


def main(folder: str, digest: str, cell_dirs: str) -> None:
    """submitit's process_job (core/submission.py), but for the pickle: read once, checked
    against the script's digest, unpickled from the bytes checked; cell_dirs: the task's cell
    folders, one per line."""
    os.environ["SUBMITIT_FOLDER"] = folder
    env = submitit.JobEnvironment()
    paths = env.paths
    logger = get_logger()  # submitit's own lines, as its process_job logs them
    logger.info(f"Starting with {env}")
    logger.info(f"Loading pickle: {paths.submitted_pickle}")
    deadline = time.monotonic() + PICKLE_WAIT_S
    while not paths.submitted_pickle.exists() and time.monotonic() < deadline:
        time.sleep(1)
    try:
        delayed = load_pickle(paths.submitted_pickle, digest)
    except (DigestMismatch, OSError) as exc:  # OSError: a link, a FIFO, no file (never followed or waited on)
        refusal = str(exc) if isinstance(exc, DigestMismatch) else f"{exc.filename}: {exc.strerror}; not unpickled"
        for cell_dir in cell_dirs.split("\n") if env.global_rank == 0 else []:
            _record_refusal(Path(cell_dir), refusal)
        raise SystemExit(refusal) from None
    if not isinstance(delayed, utils.DelayedSubmission):
        raise SystemExit(f"{paths.submitted_pickle}: not a submitit job")
    # submitit counts the requeues left in the pickle; the pickle is never written again here.
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    delayed.set_timeout(delayed._timeout_min, max(delayed._timeout_countdown - restarts, 0))
    with tempfile.TemporaryDirectory(prefix="hpcfsdp-checkpoint-") as scratch:
        env._handle_signals(utils.JobPaths(scratch, env.job_id, env.global_rank), delayed)
        try:
            result = delayed.result()
            with utils.temporary_save_path(paths.result_pickle) as tmp:
                utils.cloudpickle_dump(("success", result), tmp)
        except Exception:
            with utils.temporary_save_path(paths.result_pickle) as tmp:
                utils.cloudpickle_dump(("error", traceback.format_exc()), tmp)
            raise


def _record_refusal(cell_dir: Path, error: str) -> None:
    """The cell's `error` record of a refused pickle (the project's writer of a launch failure)."""
    from ..track.lost import record_launch_failure

    try:
        record_launch_failure(cell_dir, error, "")
    except (OSError, ValueError) as exc:
        print(f"[hpcfsdp] {cell_dir}: no record written ({exc})", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:4])
