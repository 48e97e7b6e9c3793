"""A record's git_commit names the checkout hpcfsdp runs from, never some other repository around it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "init.defaultBranch=main"]


def git_repo(path: Path, ignore: str = "") -> str:
    """A repository at `path` with everything in it committed; returns its HEAD."""
    path.mkdir(parents=True, exist_ok=True)
    (path / ".gitignore").write_text(ignore)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "c"]):
        subprocess.run([*GIT, "-C", str(path), *args], check=True, capture_output=True)
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def copy_package(to: Path) -> None:
    shutil.copytree(ROOT / "src" / "hpcfsdp", to / "hpcfsdp", ignore=shutil.ignore_patterns("__pycache__"))


def recorded_commit(import_root: Path, cwd: Path) -> str:
    """What run.py's provenance would record, for the package imported from `import_root`."""
    code = (
        "import hpcfsdp; from hpcfsdp.cell.measure.provenance import git_commit; print(hpcfsdp.__file__, git_commit())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(import_root), "PATH": "/usr/bin:/bin"},
    ).stdout.split()
    assert out[0] == str(import_root / "hpcfsdp" / "__init__.py")  # the copy, not the package under test
    return out[1]


def test_git_commit_is_the_packages_own_checkout_whatever_the_working_directory(tmp_path):
    other_head = git_repo(tmp_path / "other", ignore=".venv/\n")
    checkout = tmp_path / "hpcfsdp-checkout"
    copy_package(checkout / "src")
    head = git_repo(checkout)
    assert head != other_head
    assert recorded_commit(checkout / "src", cwd=tmp_path / "other") == head


def test_a_copy_installed_inside_another_projects_checkout_records_unknown(tmp_path):
    other = tmp_path / "other"
    site_packages = other / ".venv" / "lib" / "python3" / "site-packages"
    copy_package(site_packages)
    git_repo(other, ignore=".venv/\n")
    # git itself would name the other project's commit from inside its .venv:
    assert (
        subprocess.run(
            ["git", "-C", str(site_packages / "hpcfsdp"), "rev-parse", "HEAD"], capture_output=True
        ).returncode
        == 0
    )
    assert recorded_commit(site_packages, cwd=other) == "unknown"
