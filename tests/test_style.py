"""The tree stays as the linter, the formatter and the type checker want it (pyproject.toml's
[tool.ruff] and [tool.mypy]); CI runs this with the other tests, so none of them drifts."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcfsdp.contracts.names import has_surrogate

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("check", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff_finds_nothing_to_change(check):
    proc = run(str(BIN / "ruff"), *check, "src", "tests", "bench")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# mypy's cache outside the checkout: a fresh clone (CI's) reuses what the last run learnt of torch,
# transformers, ... (about 95 of its 100 CPU seconds on 2 cores); mypy checks every cached module
# against its source's hash, so a stale entry is never trusted.
MYPY_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcfsdp" / "mypy"


def test_mypy_finds_no_type_error_in_the_package():
    proc = run(str(BIN / "mypy"), "--cache-dir", str(MYPY_CACHE))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


MAX_MODULE_LINES = 450  # docs/design.md: a module that outgrows this holds more than one job


def test_no_module_of_the_package_is_over_450_lines():
    lengths = {path: len(path.read_text().splitlines()) for path in (ROOT / "src" / "hpcfsdp").rglob("*.py")}
    assert lengths and max(lengths.values()) > 100  # the walk found the package
    assert {str(path.relative_to(ROOT)): n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def _newest_python() -> str:
    """The newest CPython 3.x that runs on this machine (PATH and pyenv's versions; a pyenv shim of a
    version not selected does not run), else the one running the tests."""
    found = {sys.version_info[:2]: sys.executable}
    # pyenv's versions before PATH: a pyenv shim (~/.pyenv/shims/python3.13) runs the version pyenv
    # is set to, and fails ("command not found") where that is another one.
    roots = sorted(Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")).glob("versions/3.*/bin"))
    roots += [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).name != "shims"]
    for folder in roots:
        for exe in folder.glob("python3.[0-9]*"):
            if not exe.name.removeprefix("python3.").isdigit():
                continue
            said = subprocess.run(
                [exe, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True
            )
            if said.returncode == 0:
                major, minor = map(int, said.stdout.split())
                found.setdefault((major, minor), str(exe))
    return found[max(found)]


def test_every_module_compiles_under_the_newest_python_present(tmp_path):
    """Python 3.13 refuses a docstring holding a lone surrogate ("\\ud800") that 3.11 compiles: the
    package must import on every release requires-python admits. So no docstring holds one (checked
    under any Python), and the newest Python on this machine compiles every module."""
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_bytes(), str(path))
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False) or ""
                assert not has_surrogate(doc), (
                    f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}: a lone surrogate in a docstring"
                )
    python = _newest_python()
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src", copy)
    proc = subprocess.run([python, "-m", "compileall", "-q", str(copy)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{python}: {proc.stdout[-3000:]}{proc.stderr[-1000:]}"
