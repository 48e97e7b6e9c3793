"""A bytecode folder of the user's own for the supervisor and its ranks (issue 52).

The first cell of an allocation pays the imports of torch and transformers. Where the install
holds no current bytecode beside its sources and Python may not write it there (an image built
with `pip install --no-compile` and run with PYTHONDONTWRITEBYTECODE=1, as the lent GPU image is;
a read-only venv of a module system), every process compiles torch, sympy and the rest from
source: 13-15 s of imports on an H200 node against 7 s with bytecode (bench/import_cost.sh). So
the supervisor points Python at a bytecode folder of the user's own (sys.pycache_prefix, and
PYTHONPYCACHEPREFIX for a rank it starts by exec) that the first allocation fills and every later
one reads. Python writes each file there atomically, so ranks and nodes may fill it at once.

HPCFSDP_BYTECODE_CACHE: unset, ~/.cache/hpcfsdp/bytecode where the install lacks bytecode; a
folder, that folder always (a node-local or scratch one); `off`, never. A pycache prefix the user
set (PYTHONPYCACHEPREFIX, -X pycache_prefix) is left as it is. Bytecode is code that runs: the
folder and the one above it must be the user's (or root's, above) and writable by nobody else,
and neither a link; otherwise it is not used, and the cell's log says why.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import stat
import sys
from collections.abc import MutableMapping
from pathlib import Path

from ...contracts.fs.ownership import user_name

BYTECODE_CACHE_ENV = "HPCFSDP_BYTECODE_CACHE"
PREFIX_ENV = "PYTHONPYCACHEPREFIX"
PROBED_PACKAGE = "torch"  # the largest import of every rank, and the one an image leaves uncompiled
# the folder this process set (a kept supervisor sets it again in each launch's environment)
_applied: str | None = None


def use_bytecode_cache(environ: MutableMapping[str, str], probe: str = PROBED_PACKAGE) -> str:
    """Point this process, and through `environ` the ranks it execs, at the bytecode folder where
    one is wanted; the line for the cell's log that says so, or why none is used ("" where the
    install's own bytecode serves, or the user chose)."""
    global _applied
    choice = environ.get(BYTECODE_CACHE_ENV, "").strip()
    prefix = environ.get(PREFIX_ENV) or sys.pycache_prefix
    if choice == "off" or (prefix and prefix != _applied):
        return ""
    folder, why = _bytecode_folder(choice, probe)
    if folder is None:
        return why
    sys.pycache_prefix = _applied = folder
    sys.dont_write_bytecode = False
    environ[PREFIX_ENV] = folder
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return why


@functools.cache
def _bytecode_folder(choice: str, probe: str) -> tuple[str | None, str]:
    """The folder to use (None: none) and the log's line; decided once a process."""
    if choice:
        folder, reason = Path(choice).expanduser().absolute(), f"{BYTECODE_CACHE_ENV}={choice}"
    else:
        missing = _installed_bytecode_missing(probe)
        if not missing:
            return None, ""
        try:
            folder, reason = Path.home() / ".cache" / "hpcfsdp" / "bytecode", missing
        except (RuntimeError, KeyError):  # no HOME, and no passwd entry to find it in
            return (
                None,
                f"[hpcfsdp] supervisor: no bytecode folder ({missing}): no home; name one in {BYTECODE_CACHE_ENV}",
            )
    problem = _private_folder_problem(folder)
    if problem:
        return None, (
            f"[hpcfsdp] supervisor: no bytecode folder ({reason}): {folder}: {problem}; "
            f"name one of your own in {BYTECODE_CACHE_ENV}, or `off`"
        )
    return str(folder), f"[hpcfsdp] supervisor: bytecode from and to {folder} ({reason})"


def _installed_bytecode_missing(package: str) -> str:
    """Why the package's own bytecode would not serve a new process ("" where it would): its
    __init__'s .pyc beside the source is missing or stale, and Python may not write it there."""
    spec = importlib.util.find_spec(package)  # locates, imports nothing
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    source = Path(spec.origin)
    pyc = source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
    if _current(source, pyc):
        return ""
    writable = os.access(pyc.parent if pyc.parent.is_dir() else source.parent, os.W_OK)
    if writable and not sys.dont_write_bytecode:
        return ""  # Python writes it beside the source itself, once
    refused = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else f"{pyc.parent} is read-only"
    return f"{package} has no current bytecode beside its source and {refused}"


def _current(source: Path, pyc: Path) -> bool:
    """Whether Python would use pyc for source (PEP 552: a hash-based pyc, or the source's mtime
    and size in its header)."""
    try:
        with open(pyc, "rb") as file:
            header = file.read(16)
        info = source.stat()
    except OSError:
        return False
    flags, mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12))
    if header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    return flags != 0 or (mtime == int(info.st_mtime) & 0xFFFFFFFF and size == info.st_size & 0xFFFFFFFF)


def _private_folder_problem(folder: Path) -> str:
    """Why folder may not hold bytecode ("" where it may), made 0700 where missing."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"not made ({exc.strerror or exc})"
    me = os.geteuid()
    for path, owners in ((folder, {me}), (folder.parent, {me, 0})):
        try:
            info = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if stat.S_ISLNK(info.st_mode):
            return f"{path} is a link"
        if info.st_uid not in owners:
            return f"{path} is owned by {user_name(info.st_uid)}"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return ""
