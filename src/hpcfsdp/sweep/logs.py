"""`hpcfsdp logs SWEEP [CELL]`: a cell's Slurm logs, found from the sweep folder.

A cell's jobs are its latest one (the manifest) and those of its earlier records (attempts/<n>.json,
their `slurm` object), newest first; a requeued job writes on in the same files. Each job has one
stdout and one stderr file per task (rank), where submitit's SlurmJob puts them
(slurm/<job>/<job>_<rank>_log.out|err). For a cell whose record is not ok, the lines that say why
come first: the record's error, then the error lines of every rank's logs of its newest job.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from ..files import RecordError, read_json_object
from ..record import ATTEMPTS_DIR, RECORD_NAME, SPEC_NAME, slurm_job_of
from ..spec import SpecError
from .layout import LOG_NAME, cell_dir, manifest_cluster, planned_cell_ids, read_manifest, slurm_folder
from .scheduler import queued_states
from .status import cell_state

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
    jobs = [str(entry["job_id"])] if entry.get("executor") == "slurm" and entry.get("job_id") else []
    directory = cell_dir(sweep_dir, cell_id)
    attempts = sorted(
        (directory / ATTEMPTS_DIR).glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1, reverse=True
    )
    for path in [directory / RECORD_NAME, *attempts]:
        try:
            job = slurm_job_of(read_json_object(path, kind="record").get("slurm"))
        except (FileNotFoundError, RecordError):
            continue
        if job and job not in jobs:
            jobs.append(job)
    return jobs


def rank_logs(sweep_dir: Path, cell_id: str, job_id: str, stream: Stream) -> list[RankLog]:
    """The job's log file of each rank that wrote one, in rank order."""
    import submitit

    spec = read_json_object(cell_dir(sweep_dir, cell_id) / SPEC_NAME, kind="cell spec")["spec"]
    ranks = int(spec.get("nodes", 1)) * int(spec.get("gpus_per_node", 1))
    folder = slurm_folder(sweep_dir)
    paths = (getattr(submitit.SlurmJob(folder, job_id, tasks=(rank,)).paths, stream) for rank in range(ranks))
    return [RankLog(job_id, rank, path) for rank, path in enumerate(paths) if path.exists()]


def telling_lines(logs: list[RankLog]) -> list[str]:
    """The lines of these logs that say why a rank failed, each once, rank-labelled; the last
    TELLING_LINES of them (the end of a log is where a failure shows)."""
    seen: dict[str, None] = {}
    for log in logs:
        for line in log.path.read_text(errors="replace").splitlines():
            if TELLING.search(line):
                seen.setdefault(f"[rank {log.rank}] {line.strip()}", None)
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
        return _print_local_log(sweep_dir, cell_id, state.status, out)
    if state.status != "ok" and record:
        newest = rank_logs(sweep_dir, cell_id, jobs[0], "stderr") + rank_logs(sweep_dir, cell_id, jobs[0], "stdout")
        for line in telling_lines(newest):
            print(line, file=out)
        print(file=out)
    shown = 0
    for job_id in jobs:
        for log in rank_logs(sweep_dir, cell_id, job_id, stream):
            print(f"==> job {job_id}, rank {log.rank}: {log.path} <==", file=out)
            text = log.path.read_text(errors="replace")
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
    print(f"==> local run: {path} (stdout and stderr of every rank) <==", file=out)
    text = path.read_text(errors="replace")
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
        for log, chunk in _new_output(rank_logs(sweep_dir, cell_id, job_id, stream), offsets):
            if log.path != last:
                print(f"==> job {job_id}, rank {log.rank} <==", file=out)
                last = log.path
            out.write(chunk)
        out.flush()
        if not queued:
            return 0
        time.sleep(poll_s)


def _new_output(logs: list[RankLog], offsets: dict[Path, int]) -> Iterator[tuple[RankLog, str]]:
    for log in logs:
        with log.path.open("rb") as handle:
            handle.seek(offsets.get(log.path, 0))
            data = handle.read()
        if data:
            offsets[log.path] = offsets.get(log.path, 0) + len(data)
            yield log, data.decode(errors="replace")


def cell_index(sweep_dir: Path) -> list[str]:
    """Without a cell: one line per cell with its state and jobs, not-ok cells first."""
    cells = planned_cell_ids(sweep_dir)
    rows = [(cid, cell_state(sweep_dir, cid).status, cell_jobs(sweep_dir, cid)) for cid in cells]
    rows.sort(key=lambda row: row[1] == "ok")
    width = max(4, *(len(cid) for cid, _, _ in rows)) if rows else 4
    lines = [f"{'cell':{width}} {'state':9} jobs (newest first)"]
    lines += [f"{cid:{width}} {status:9} {' '.join(jobs) or '-'}" for cid, status, jobs in rows]
    return [*lines, f"`hpcfsdp logs {sweep_dir} CELL` prints a cell's logs (a unique beginning of its id will do)"]


def _first_line(text: object) -> str:
    return str(text).strip().splitlines()[0] if isinstance(text, str) and text.strip() else "-"
