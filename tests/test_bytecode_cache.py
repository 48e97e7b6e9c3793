"""The supervisor's bytecode folder (cell/supervise/bytecode.py, issue 52): an install without
bytecode, run with PYTHONDONTWRITEBYTECODE=1 (the lent GPU image: torch compiled from source by
every process, 13-15 s of imports against 7 s), gets a folder of the user's own that the first
process fills and the next reads; an install with bytecode, a user's own prefix and `off` are left
as they are; a folder another user could write, or a link, is not used, and the log says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import TINY_CPU
from hpcfsdp.cli import main

USE = """
import json, os, sys
from hpcfsdp.cell.supervise.bytecode import use_bytecode_cache
line = use_bytecode_cache(os.environ, probe="pkg")
import pkg
print(json.dumps({"line": line, "prefix": sys.pycache_prefix, "dont_write": sys.dont_write_bytecode,
                  "env": {k: os.environ.get(k) for k in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}}))
"""


def an_install(tmp_path: Path) -> Path:
    """A package `pkg` (a module `pkg.late` that only a child imports), without bytecode."""
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (site / "pkg" / "late.py").write_text("VALUE = 2\n")
    return site


def use(tmp_path: Path, site: Path, **env: str) -> dict:
    """USE in a new interpreter (the decision is one per process), HOME in tmp_path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPYCACHEPREFIX", "HPCFSDP_BYTECODE"))}
    base |= {"HOME": str(tmp_path / "home"), "PYTHONDONTWRITEBYTECODE": "1"}
    base["PYTHONPATH"] = os.pathsep.join([str(site), base.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", USE], capture_output=True, text=True, timeout=60, env=base | env, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


def test_an_install_without_bytecode_gets_a_private_folder_that_the_next_process_and_an_execd_child_read(tmp_path):
    site = an_install(tmp_path)
    (tmp_path / "home").mkdir()
    seen = use(tmp_path, site)
    folder = tmp_path / "home" / ".cache" / "hpcfsdp" / "bytecode"
    assert seen["line"] == (
        f"[hpcfsdp] supervisor: bytecode from and to {folder} "
        "(pkg has no current bytecode beside its source and PYTHONDONTWRITEBYTECODE is set)"
    )
    assert seen["prefix"] == str(folder) and seen["dont_write"] is False
    assert seen["env"] == {"PYTHONPYCACHEPREFIX": str(folder), "PYTHONDONTWRITEBYTECODE": None}  # for an exec'd rank
    tag = sys.implementation.cache_tag
    written = folder / str(site).lstrip("/") / "pkg" / f"__init__.{tag}.pyc"
    assert written.is_file() and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert not (site / "pkg" / "__pycache__").exists()  # nothing written beside the install
    # a rank started by exec gets the environment: its own imports go to the same folder
    child = {**os.environ, **seen["env"], "PYTHONPATH": str(site)}
    child.pop("PYTHONDONTWRITEBYTECODE")
    subprocess.run([sys.executable, "-c", "import pkg.late"], env=child, check=True, timeout=60)
    assert (written.parent / f"late.{tag}.pyc").is_file()
    # the next process reads what the first wrote, and says where from
    written_at = written.stat().st_mtime_ns
    assert use(tmp_path, site)["prefix"] == str(folder) and written.stat().st_mtime_ns == written_at


def test_an_install_with_current_bytecode_a_users_own_prefix_and_off_are_left_as_they_are(tmp_path):
    site = an_install(tmp_path)
    (tmp_path / "home").mkdir()
    for env in ({"HPCFSDP_BYTECODE_CACHE": "off"}, {"PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}):
        seen = use(tmp_path, site, **env)
        assert seen["line"] == "" and seen["env"]["PYTHONDONTWRITEBYTECODE"] == "1", env
        assert seen["prefix"] == env.get("PYTHONPYCACHEPREFIX"), env
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True)
    seen = use(tmp_path, site)
    assert seen == {
        "line": "",
        "prefix": None,
        "dont_write": True,
        "env": {"PYTHONPYCACHEPREFIX": None, "PYTHONDONTWRITEBYTECODE": "1"},
    }
    assert not (tmp_path / "home" / ".cache").exists()


@pytest.mark.parametrize("unsafe", ["writable", "link", "parent_writable", "other_owner"])
def test_a_bytecode_folder_another_user_could_write_is_not_used_and_the_log_says_why(tmp_path, unsafe):
    site = an_install(tmp_path)
    (tmp_path / "home").mkdir()
    folder = tmp_path / "shared" / "bytecode"
    folder.parent.mkdir()
    if unsafe == "writable":
        folder.mkdir(mode=0o700)
        folder.chmod(0o777)
        why = f"{folder} is writable by others (mode 0777)"
    elif unsafe == "parent_writable":
        folder.parent.chmod(0o777)
        why = f"{folder.parent} is writable by others (mode 0777)"
    elif unsafe == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
        why = f"{folder} is a link"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a folder to another user")
        folder.mkdir(mode=0o700)
        os.chown(folder, 65534, 65534)
        why = f"{folder} is owned by nobody"
    seen = use(tmp_path, site, HPCFSDP_BYTECODE_CACHE=str(folder))
    assert seen["line"] == (
        f"[hpcfsdp] supervisor: no bytecode folder (HPCFSDP_BYTECODE_CACHE={folder}): {folder}: {why}; "
        "name one of your own in HPCFSDP_BYTECODE_CACHE, or `off`"
    )
    assert seen["prefix"] is None and seen["env"]["PYTHONPYCACHEPREFIX"] is None
    if unsafe == "link":
        assert not list((tmp_path / "elsewhere").iterdir())


def test_a_cells_rank_started_by_exec_imports_torch_through_the_named_bytecode_folder(tmp_path, monkeypatch):
    """A real cell, its lone rank started by exec (the supervisor imports nothing then): the rank's
    torch is compiled into the folder the supervisor named, its log says so, and the cell is ok."""
    jobs = tmp_path / "one.yaml"
    jobs.write_text(yaml.safe_dump({"name": "one", "base": {**TINY_CPU, "comm_profile_steps": 0}}))
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    (cell,) = (tmp_path / "results" / "one" / "cells").iterdir()
    folder = tmp_path / "bytecode"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env |= {"HPCFSDP_BYTECODE_CACHE": str(folder), "HPCFSDP_RANK_START": "exec", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hpcfsdp.cell.supervise", "--cell-dir", str(cell), "--nproc-per-node", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, textwrap.shorten(log[-3000:], 3000)
    assert f"[hpcfsdp] supervisor: bytecode from and to {folder} (HPCFSDP_BYTECODE_CACHE={folder})" in log
    import torch

    torch_source = Path(torch.__file__)
    compiled = folder / str(torch_source.parent).lstrip("/") / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert compiled.is_file(), sorted(p.name for p in folder.rglob("*"))[:20]
    assert json.loads((cell / "result.json").read_text())["status"] == "ok"
