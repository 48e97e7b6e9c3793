"""The result record: the contract between `hpcfsdp run` and the collector.

One JSON file per cell, written atomically (temp file + rename) so a reader never sees half a
record. Depends on nothing else in the package.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "error", "timeout", "diverged")
RECORD_NAME = "result.json"
PREVIOUS_RECORD_NAME = "result.previous.json"  # the record a rerun replaces, kept until it has a new one
SPEC_NAME = "spec.json"  # beside the record: {cell_id, sweep, spec}, written by submit


class RecordError(ValueError):
    """A record file that cannot be read: names the path and what is wrong."""


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    path = Path(path)
    if record.get("status") not in STATUSES:
        raise ValueError(f"record status must be one of {STATUSES}, got {record.get('status')!r}")
    payload = {"schema_version": SCHEMA_VERSION, **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_record(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: unreadable record ({exc})") from None
    if not isinstance(record, dict):
        raise RecordError(f"{path}: a record must be a JSON object")
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    if record.get("status") not in STATUSES:
        raise RecordError(f"{path}: status {record.get('status')!r} is not one of {', '.join(STATUSES)}")
    return record
