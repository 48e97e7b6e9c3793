"""Whether a path may be used as a sweep folder: it is one (cells/ inside), it is the user's and
writable by no one else (as ssh's StrictModes: docs/security.md), and its path is UTF-8 text."""

from __future__ import annotations

from pathlib import Path

from ...contracts.fields import SpecError
from ...contracts.files import check_folder_tree
from ...contracts.names import has_surrogate, readable
from .layout import CELLS_DIR, SLURM_DIR


def require_sweep_folder(sweep_dir: Path) -> None:
    """SpecError unless sweep_dir holds cells/ (status and export of a wrong path); an
    OwnershipError unless it is the user's (check_sweep_folder)."""
    if not (Path(sweep_dir) / CELLS_DIR).is_dir():
        raise SpecError(f"{sweep_dir}: not a sweep folder (no {CELLS_DIR}/ inside; e.g. results/<name> of a jobs YAML)")
    check_sweep_folder(sweep_dir)


# The folders of a sweep folder that hpcfsdp writes and runs from: the user's own, and writable by
# no one else (ownership.check_owned), as the folder itself.
OWNED_PARTS = (CELLS_DIR, SLURM_DIR, "report", "tune")


def check_sweep_folder(sweep_dir: Path) -> None:
    """OwnershipError (one line: the path, its owner and mode, the fix) unless the sweep folder and
    its cells/, slurm/, report/ and tune/ are the user's and writable by no one else, or a
    group's that shares them on purpose (HPCFSDP_SHARED_GROUP); a link at one of those is refused."""
    check_folder_tree(sweep_dir, OWNED_PARTS)


def require_utf8_path(sweep_dir: Path) -> None:
    """SpecError when the sweep folder's path is not UTF-8 text (a byte of a folder's name that is
    not): the report's Parquet file, the history (DuckDB) and the batch scripts cannot be written
    under it, and raised a traceback (issue 51)."""
    if has_surrogate(str(sweep_dir)):
        raise SpecError(
            f"{readable(str(sweep_dir))}: the sweep folder's path is not UTF-8 text (a byte of a folder's name "
            "is not), which its report, the history and Slurm's scripts cannot be written under; rename that folder"
        )
