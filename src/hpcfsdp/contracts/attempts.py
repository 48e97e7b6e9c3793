"""Attempts: a rerun keeps the record it replaces, in the cell folder's attempts/<n>.json.

Apart from record.py, the record's contract, since only the cell (before it runs) and the sweep
folder's rerun handling (sweep/folder/layout.py) move records, where every reader reads them."""

from __future__ import annotations

import os
from pathlib import Path

from .record import ATTEMPTS_DIR, RECORD_NAME


def keep_as_attempt(cell_dir: str | Path) -> Path | None:
    """Move the cell's current record to attempts/<n>.json (n one past the highest there), never
    over an attempt kept before; returns where it went, or None when there was no record."""
    current = Path(cell_dir) / RECORD_NAME
    if not os.path.lexists(current):
        return None
    folder = current.parent / ATTEMPTS_DIR
    folder.mkdir(exist_ok=True)
    number = 1 + max((int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()), default=0)
    while True:
        target = folder / f"{number}.json"
        try:
            os.link(current, target, follow_symlinks=False)  # fails where target exists: nothing is overwritten
        except FileExistsError:
            number += 1
            continue
        except FileNotFoundError:  # another process moved it first
            return None
        except OSError:  # a file system without hard links; submit holds the sweep's lock
            if target.exists():
                number += 1
                continue
            os.replace(current, target)
            return target
        current.unlink()
        return target


def restore_attempt(cell_dir: str | Path, kept: Path) -> None:
    """Make a record set aside by keep_as_attempt current again (a rerun that did not happen, or
    was interrupted); a record written since, the interrupted run's, is kept as an attempt first."""
    keep_as_attempt(cell_dir)
    os.replace(kept, Path(cell_dir) / RECORD_NAME)
