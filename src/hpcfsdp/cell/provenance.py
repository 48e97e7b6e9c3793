"""Which hpcfsdp source a record was made with: the git commit of its own checkout, if it runs from one."""

from __future__ import annotations

import subprocess
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../hpcfsdp
UNKNOWN = "unknown"


def git_commit(package_dir: Path = PACKAGE_DIR) -> str:
    """HEAD of the git checkout the package runs from, else "unknown".

    Asked of the package's own folder, never of the working directory, and only believed when that
    folder is `src/<package>` of the work tree git finds: a copy installed into site-packages
    inside some other project's checkout is in that project's work tree too, and must not be
    credited with its commit.
    """
    package_dir = package_dir.resolve()
    try:
        out = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != 2:
        return UNKNOWN
    top, commit = lines
    if Path(top).resolve() / "src" / package_dir.name != package_dir:
        return UNKNOWN
    return commit if len(commit) in (40, 64) else UNKNOWN  # SHA-1 or SHA-256 repositories
