"""Attempts: a rerun keeps the record it replaces, in the cell folder's attempts/<n>.json.

Apart from record.py, the record's contract, since only the cell (before it runs) and the sweep
folder's rerun handling (sweep/folder/layout.py) move records, where every reader reads them.
Both names are reached through the cell folder's descriptor (beneath.py): an attempts/ that is a
link is refused, never followed, so no record is moved out of the sweep folder (issue 51, item 13)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UserError
from .fs.beneath import DIR_FLAGS, folder, names_of, rename
from .record import ATTEMPTS_DIR, RECORD_NAME


def keep_as_attempt(cell_dir: str | Path) -> Path | None:
    """Move the cell's current record to attempts/<n>.json (n one past the highest there), never
    over an attempt kept before; returns where it went, or None when there was no record. An
    attempts/ that is not a folder (a link) is a UserError, and the record stays."""
    cell_dir = Path(cell_dir)
    try:
        with folder(cell_dir) as cell:
            try:
                os.lstat(RECORD_NAME, dir_fd=cell)
            except FileNotFoundError:
                return None
            try:
                os.mkdir(ATTEMPTS_DIR, dir_fd=cell)
            except FileExistsError:
                pass
            try:
                attempts = os.open(ATTEMPTS_DIR, DIR_FLAGS, dir_fd=cell)
            except NotADirectoryError:
                raise UserError(
                    f"{cell_dir / ATTEMPTS_DIR}: not a folder (a symbolic link?); not followed, the record "
                    f"{RECORD_NAME} stays where it is (remove it)"
                ) from None
            try:
                return _moved(cell, attempts, cell_dir / ATTEMPTS_DIR)
            finally:
                os.close(attempts)
    except FileNotFoundError:
        return None


def _moved(cell: int, attempts: int, where: Path) -> Path | None:
    names = names_of(attempts)
    number = 1 + max((int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit()), default=0)
    while True:
        target = f"{number}.json"
        try:  # fails where target exists: nothing is overwritten
            os.link(RECORD_NAME, target, src_dir_fd=cell, dst_dir_fd=attempts, follow_symlinks=False)
        except FileExistsError:
            number += 1
            continue
        except FileNotFoundError:  # another process moved it first
            return None
        except OSError:  # a file system without hard links; submit holds the sweep's lock
            try:
                os.lstat(target, dir_fd=attempts)
                number += 1
                continue
            except FileNotFoundError:
                os.rename(RECORD_NAME, target, src_dir_fd=cell, dst_dir_fd=attempts)
                return where / target
        os.unlink(RECORD_NAME, dir_fd=cell)
        return where / target


def restore_attempt(cell_dir: str | Path, kept: Path) -> None:
    """Make a record set aside by keep_as_attempt current again (a rerun that did not happen, or
    was interrupted); a record written since, the interrupted run's, is kept as an attempt first."""
    keep_as_attempt(cell_dir)
    rename(kept, Path(cell_dir) / RECORD_NAME, root=cell_dir)
