"""`hpcfsdp export --to wandb DIR`: offline Weights & Biases runs in DIR/wandb/offline-run-<time>-<id>/,
project = the sweep (docs/history.md). Nothing leaves the machine: `wandb sync` uploads them. The
folder's time is the record's start (UTC), not the export's, and its id is the record's
(wandb_run_id): the same record is the same folder in every export.

wandb.init describes the process that calls it, so the run is told the record's host and git
commit, and neither the exporting machine's metadata, requirements nor git checkout are read. It
stamps the run with the time it is called, though, and has no setting for another: once wandb has
written a run's log (a `.wandb` file: a LevelDB-style log of wandb's protobuf records), the run's
start time and runtimes there are replaced by the record's (`_date_from_record`), and the log is
written again, framed as wandb frames it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...contracts.files import atomic_output
from .runs import STEP_SERIES, ExportedRun, ExportError, import_extra

BLOCK = 32768  # a .wandb log is written in blocks of this size; no chunk header crosses one
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # the file's first bytes: ident, magic, version
CHUNK_HEADER = 7  # checksum (CRC-32 of type and data), data length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4  # a record in one chunk, or its first, middle and last chunks


def wandb_run_id(sweep: str, run: ExportedRun) -> str:
    """One W&B run id per record (sweep, cell, attempt): a re-export finds the runs it wrote, and
    `wandb sync` of the same record twice updates one run."""
    return hashlib.sha256(f"{sweep}/{run.cell_id}/{run.attempt}".encode()).hexdigest()[:16]


def write(runs: list[ExportedRun], sweep: str, destination: str) -> tuple[int, int]:
    """Write one offline run per record not exported before; returns (written, skipped)."""
    import_extra("wandb")
    import wandb

    root = Path(destination)
    root.mkdir(parents=True, exist_ok=True)
    made: list[tuple[ExportedRun, str]] = []
    skipped = 0
    try:
        for run in runs:
            run_id = wandb_run_id(sweep, run)
            if any((root / "wandb").glob(f"offline-run-*-{run_id}")):
                skipped += 1  # this record was exported before
                continue
            _write_run(wandb, run, run_id, sweep, root)
            made.append((run, run_id))
    finally:
        wandb.teardown()  # wandb-core finishes writing the logs after finish() returns: wait for it
    for run, run_id in made:
        (log,) = (root / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        _date_from_record(log, run)
        _name_from_record(log.parent, run, run_id)
    for link in (root / "wandb").iterdir():  # latest-run, debug.log: links into the last folder by its old name
        if link.is_symlink() and not link.exists():
            link.unlink()
    return len(made), skipped


def _name_from_record(folder: Path, run: ExportedRun, run_id: str) -> None:
    """offline-run-<the record's start, UTC, as wandb writes a time>-<run id>: wandb names it
    from the time of the export."""
    started = datetime.fromtimestamp(run.started_at or 0.0, timezone.utc).strftime("%Y%m%d_%H%M%S")
    folder.rename(folder.with_name(f"offline-run-{started}-{run_id}"))


def _write_run(wandb: Any, run: ExportedRun, run_id: str, sweep: str, root: Path) -> None:
    commit = run.provenance.get("git_commit")
    settings = wandb.Settings(
        console="off",
        silent=True,
        x_disable_stats=True,  # no samples of this machine's CPU and memory
        x_disable_meta=True,  # nor its OS, Python, program and arguments
        x_save_requirements=False,  # nor its installed packages
        disable_git=True,  # nor the git checkout the export runs in
        git_commit=commit if commit and commit != "unknown" else None,
        host=",".join(run.hostnames) or None,
    )
    writer = wandb.init(
        mode="offline",
        dir=str(root),
        project=sweep,
        id=run_id,
        name=run.cell_id,
        group=run.setup,
        config=run.spec,
        settings=settings,
        reinit="create_new",
    )
    try:
        rows: dict[int, dict[str, float]] = {}
        for step, loss in run.losses:
            rows.setdefault(step, {})["loss"] = loss
        for step, seconds in run.step_times:
            rows.setdefault(step, {})[STEP_SERIES] = seconds
        for step in sorted(rows):
            writer.log({**rows[step], "_timestamp": run.wall_times[step]}, step=step)
        writer.summary.update(
            {
                **run.figures,  # the record's: step_time_s is its median, not the last step's time
                "status": run.status,
                "error": run.error or "",
                "attempt": run.attempt,
                "system": run.system or "",
                "gpu": run.gpu or "",
                "hostnames": ",".join(run.hostnames),
                # The launch's start and span (runs.launch_of), under names of their own: the
                # record's started_at and duration_s are the cell's own, later and shorter.
                "launch_started_at": run.started_at,
                "launch_span_s": run.duration_s,
                **run.provenance,
                **{f"version.{key}": value for key, value in run.versions.items()},
            }
        )
    finally:
        writer.finish(exit_code=0 if run.ok else 1)


def _date_from_record(log: Path, run: ExportedRun) -> None:
    """Put the record's start time and duration where wandb wrote the export's: the run's start,
    each history row's `_runtime` (from its `_timestamp`, the record's time of the step), the
    summary's `_runtime` and `_wandb.runtime`, and the exit record's runtime."""
    from wandb.proto import wandb_internal_pb2

    if run.started_at is None:
        return
    duration = run.duration_s or 0.0
    records = []
    for payload in read_log(log):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            record.run.start_time.FromNanoseconds(int(run.started_at * 1e9))
        elif kind == "history":
            stamps = [json.loads(item.value_json) for item in record.history.item if _key(item) == "_timestamp"]
            for item in record.history.item:
                if _key(item) == "_runtime" and stamps:
                    item.value_json = json.dumps(stamps[0] - run.started_at)
        elif kind == "summary":  # the run's total: in every update, as the last one is the summary
            for item in record.summary.update:
                if _key(item) == "_runtime":
                    item.value_json = json.dumps(duration)
                elif _key(item) == "_wandb.runtime":
                    item.value_json = json.dumps(round(duration))
        elif kind == "exit":
            record.exit.runtime = round(duration)
        records.append(record.SerializeToString())
    write_log(log, records)


def _key(item: Any) -> str:
    """An item's key (a history or summary item names it in `key`, or in `nested_key` parts)."""
    return item.key or ".".join(item.nested_key)


def read_log(path: Path) -> list[bytes]:
    """The records of a .wandb log, each as its serialised protobuf; ExportError when a chunk's
    checksum does not match (a log wandb did not finish writing)."""
    data = path.read_bytes()
    if data[: len(HEADER)] != HEADER:
        raise ExportError(f"{path}: not a W&B run log (it starts {data[: len(HEADER)]!r})")
    records, pending, pos = [], b"", len(HEADER)
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if zlib.crc32(bytes([kind]) + chunk) != checksum:
            raise ExportError(f"{path}: chunk at byte {pos} does not match its checksum")
        pending += chunk
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def write_log(path: Path, records: list[bytes]) -> None:
    """Write records as a .wandb log, framed as wandb (and LevelDB) frame one: a record that does
    not fit the rest of its block is cut into chunks, and a block's tail too short for a chunk
    header is zeros."""
    out = bytearray(HEADER)
    for record in records:
        rest, first = record, True
        while True:
            room = BLOCK - len(out) % BLOCK
            if room < CHUNK_HEADER:
                out += bytes(room)
                continue
            chunk, rest = rest[: room - CHUNK_HEADER], rest[room - CHUNK_HEADER :]
            kind = (FULL if first else LAST) if not rest else (FIRST if first else MIDDLE)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk), len(chunk), kind) + chunk
            first = False
            if not rest:
                break
    with atomic_output(path) as tmp:
        tmp.write_bytes(bytes(out))
