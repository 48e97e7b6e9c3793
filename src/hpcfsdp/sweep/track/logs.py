"""`hpcfsdp logs SWEEP [CELL]`: a cell's Slurm logs, found from the sweep folder.

A cell's jobs are its latest one (the manifest) and those of its earlier records (attempts/<n>.json,
their `slurm` object), newest first; a requeued job writes on in the same files. Each job has one
stdout and one stderr file per task, where submitit's SlurmJob puts them
(slurm/<job>/<job>_<task>_log.out|err). A task is a node (its supervisor, cell/supervise/, and every
rank it starts write there), so the logs are labelled by node. A task of several cells
(slurm.cells_per_task) writes them all into its logs, one after another, each part beginning with
a `[hpcfsdp] cell <id>` line: logs says so above them. For a cell whose record is not ok,
the lines that say why come first: the record's error, then the error lines of every node's logs
of its newest job.

The folder is the user's, but not everything in it is: a log is read only where it is a regular
file inside the sweep folder (a link to /etc/shadow or /dev/zero is named, not read), only its
last LOG_TAIL_BYTES, and a job id from the manifest or a record becomes a path only when it is one.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from ...contracts.files import RecordError, read_json_object
from ...contracts.fs.beneath import matching, open_file
from ...contracts.names import is_job_id, slurm_job_of
from ...contracts.record import ATTEMPTS_DIR, MAX_RECORD_BYTES, RECORD_NAME
from ...contracts.spec import SpecError
from ..folder.layout import (
    LOG_NAME,
    LOG_TAIL_BYTES,
    cell_dir,
    job_log_files,
    log_out_of_folder,
    manifest_cluster,
    planned_cell_ids,
    read_log,
    read_manifest,
    slurm_folder,
)
from .packed import all_task_mates
from .scheduler import queued_states
from .status import cell_state, sweep_status

Stream = Literal["stdout", "stderr"]
# Lines of a failed rank's log that say why: Python's exceptions, Slurm's and srun's own words.
TELLING = re.compile(
    r"Traceback \(most recent call last\)|^\w*(Error|Exception)\b|Error: |error:|"
    r"CANCELLED|DUE TO TIME LIMIT|DUE TO NODE FAILURE|out of memory|OutOfMemory|Killed|oom-kill|"
    r"exited with exit code|Exited with exit code",
    re.IGNORECASE,
)
TELLING_LINES = 20  # at most this many of them, per job
FOLLOW_POLL_S = 1.0


@dataclass(frozen=True)
class RankLog:
    job_id: str
    rank: int
    path: Path


def find_cell(sweep_dir: Path, name: str) -> str:
    """The cell id `name` names: an id of the sweep, or the beginning of exactly one."""
    cells = planned_cell_ids(sweep_dir)
    if name in cells:
        return name
    matches = [cid for cid in cells if cid.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    what = f"{len(matches)} cells begin with it ({', '.join(matches[:3])}...)" if matches else "no such cell"
    raise SpecError(f"logs: {name}: {what} in {sweep_dir} (`hpcfsdp logs {sweep_dir}` lists them)")


def cell_jobs(sweep_dir: Path, cell_id: str) -> list[str]:
    """The Slurm jobs the cell ran as, newest first: its latest submit's, then its earlier records'."""
    entry = read_manifest(sweep_dir).get(cell_id, {})
    latest = entry.get("job_id")
    jobs = (
        [str(latest)]
        if entry.get("executor") == "slurm" and isinstance(latest, (str, int)) and is_job_id(str(latest))
        else []
    )
    directory = cell_dir(sweep_dir, cell_id)
    attempts = sorted(
        matching(directory / ATTEMPTS_DIR, "*.json"),
        key=lambda p: int(p.stem) if p.stem.isdigit() else -1,
        reverse=True,
    )
    for path in [directory / RECORD_NAME, *attempts]:
        try:
            job = slurm_job_of(read_json_object(path, root=sweep_dir, limit=MAX_RECORD_BYTES).get("slurm"))
        except (FileNotFoundError, RecordError):
            continue
        if job and job not in jobs:
            jobs.append(job)
    return jobs


def rank_logs(sweep_dir: Path, cell_id: str, job_id: str, stream: Stream) -> list[RankLog]:
    """The job's log file of each rank that wrote one, in rank order."""
    return [RankLog(job_id, rank, path) for rank, path in job_log_files(sweep_dir, job_id, stream)]


def telling_lines(sweep_dir: Path, logs: list[RankLog]) -> list[str]:
    """The lines of these logs that say why a rank failed, each once, rank-labelled; the last
    TELLING_LINES of them (the end of a log is where a failure shows)."""
    seen: dict[str, None] = {}
    for log in logs:
        text, _ = read_log(sweep_dir, log.path)
        for line in text.splitlines():
            if TELLING.search(line):
                seen.setdefault(f"[node {log.rank}] {line.strip()}", None)
    return list(seen)[-TELLING_LINES:]


def print_logs(sweep_dir: Path, cell_id: str, stream: Stream, out: TextIO | None = None) -> int:
    """Every job's logs of the cell, newest first, the lines that matter first for a failed cell;
    exit status 1 when there is no log to show."""
    out = out or sys.stdout  # looked up now: a default bound at import would keep a replaced stream
    state = cell_state(sweep_dir, cell_id)
    jobs = cell_jobs(sweep_dir, cell_id)
    record = state.record or {}
    if state.status != "ok" and record:
        print(
            f"== {cell_id}: {state.status} at {record.get('stage', '?')}: {_first_line(record.get('error'))}", file=out
        )
    if not jobs:
        return _print_local_log(sweep_dir, cell_id, sweep_status(sweep_dir, [cell_id]).cells[0].state, out)
    if mates := all_task_mates(sweep_dir, [cell_id]).get(cell_id):
        print(
            f"== job {jobs[0]} runs {len(mates)} cells one after another ({', '.join(mates)}): its logs hold them "
            f"all; {cell_id}'s part begins at the line `[hpcfsdp] cell {cell_id}`",
            file=out,
        )
    if state.status != "ok" and record:
        newest = rank_logs(sweep_dir, cell_id, jobs[0], "stderr") + rank_logs(sweep_dir, cell_id, jobs[0], "stdout")
        for line in telling_lines(sweep_dir, newest):
            print(line, file=out)
        print(file=out)
    shown = 0
    for job_id in jobs:
        for log in rank_logs(sweep_dir, cell_id, job_id, stream):
            text, why = read_log(sweep_dir, log.path)
            print(f"==> job {job_id}, node {log.rank}: {log.path} <=={f' {why}' if why else ''}", file=out)
            out.write(text if text.endswith("\n") or not text else text + "\n")
            shown += 1
    if not shown:
        print(
            f"{cell_id}: no {stream} log yet of job(s) {', '.join(jobs)} in {slurm_folder(sweep_dir).parent}", file=out
        )
        return 1
    return 0


def _print_local_log(sweep_dir: Path, cell_id: str, status: str, out: TextIO) -> int:
    """A cell the local executor ran: its one log (stdout and stderr of every rank, as torchrun
    wrote them); exit status 1 when there is none."""
    path = cell_dir(sweep_dir, cell_id) / LOG_NAME
    if not path.is_file():
        print(f"{cell_id}: no Slurm job and no local run's log (state {status}; {path} is absent)", file=out)
        return 1
    text, why = read_log(sweep_dir, path)  # a regular file inside the sweep folder, its last 8 MiB
    print(f"==> local run: {path} (stdout and stderr of every rank) <=={f' {why}' if why else ''}", file=out)
    out.write(text if text.endswith("\n") or not text else text + "\n")
    return 0


def follow(
    sweep_dir: Path, cell_id: str, stream: Stream, out: TextIO | None = None, poll_s: float = FOLLOW_POLL_S
) -> int:
    """Print what the newest job's ranks write, as they write it, until the job leaves the queue
    and its files stop growing (Ctrl-C stops sooner)."""
    out = out or sys.stdout
    jobs = cell_jobs(sweep_dir, cell_id)
    if not jobs:
        print(f"{cell_id}: no Slurm job to follow", file=out)
        return 1
    job_id = jobs[0]
    cluster = manifest_cluster(sweep_dir) or ""
    offsets: dict[Path, int] = {}
    last: Path | None = None
    while True:
        queued = job_id in queued_states([job_id], cluster)
        for log, chunk in _new_output(sweep_dir, rank_logs(sweep_dir, cell_id, job_id, stream), offsets):
            if log.path != last:
                print(f"==> job {job_id}, node {log.rank} <==", file=out)
                last = log.path
            out.write(chunk)
        out.flush()
        if not queued:
            return 0
        time.sleep(poll_s)


def _new_output(sweep_dir: Path, logs: list[RankLog], offsets: dict[Path, int]) -> Iterator[tuple[RankLog, str]]:
    """What each log gained since the last poll (at most LOG_TAIL_BYTES of it); a log that
    read_log would not show is skipped."""
    for log in logs:
        if log_out_of_folder(sweep_dir, log.path):
            continue
        try:
            fd = open_file(log.path)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            size = os.fstat(fd).st_size
            start = max(offsets.get(log.path, 0), size - LOG_TAIL_BYTES)
            data = os.pread(fd, size - start, start) if size > start else b""
            offsets[log.path] = start
        finally:
            os.close(fd)
        if data:
            offsets[log.path] = offsets.get(log.path, 0) + len(data)
            yield log, data.decode(errors="replace")


def cell_index(sweep_dir: Path) -> list[str]:
    """Without a cell: one line per cell with its state and jobs, not-ok cells first."""
    states = {c.cell_id: str(c.state) for c in sweep_status(sweep_dir, planned_cell_ids(sweep_dir)).cells}
    rows = [(cid, state, cell_jobs(sweep_dir, cid)) for cid, state in states.items()]
    rows.sort(key=lambda row: row[1] == "ok")  # pending and running as the scheduler (or a local submit) says
    width = max(4, *(len(cid) for cid, _, _ in rows)) if rows else 4
    lines = [f"{'cell':{width}} {'state':9} jobs (newest first)"]
    lines += [f"{cid:{width}} {status:9} {' '.join(jobs) or '-'}" for cid, status, jobs in rows]
    return [*lines, f"`hpcfsdp logs {sweep_dir} CELL` prints a cell's logs (a unique beginning of its id will do)"]


def _first_line(text: object) -> str:
    return str(text).strip().splitlines()[0] if isinstance(text, str) and text.strip() else "-"
