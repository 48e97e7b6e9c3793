"""The suite's files written whole or not at all, and its JSON files read with one line of error.

Every file a command writes (records, manifests, tables, plots, YAML) goes through atomic_output:
a reader sees the old file or the new one, never half of one. Every JSON object a command reads
(records, spec.json, manifest.json, the cache's manifest) goes through read_json_object: a file
that cannot be used is a RecordError naming it in one line, never a traceback; a bulk read of them
runs with the garbage collector paused (garbage_collection_paused). Every lock file (a sweep's
.submit.lock, history.duckdb.lock) is opened by open_lock.

Results folders are often shared by a team, so anyone may plant a link or a device in them: a
file is written by a rename into its folder, which replaces a link at its name, never what the
link leads to; a file meant to be shared through a link (the history, the references) is written
where the link leads only when that is a regular file or none (linked_file); and a lock is never
opened through a link, nor emptied unless it is a lock file of hpcfsdp (open_lock).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import UserError
from .fs.beneath import (
    NotARegularFile,
    kind_of,
    open_file,
    pinned,
    read_file,
    replacing,
)
from .fs.ownership import holder_words, lock_mode, ownership_problem, refusal_line, user_name
from .names import has_surrogate

try:
    from pydantic_core import from_json
except ImportError:  # a dependency; without it (a compute node) JSON is parsed by the standard library, slower
    from_json = None  # type: ignore[assignment]

# How a surrogate is written in JSON text (UTF-8 bytes hold none): "\ud800". A pair of them is one
# character (an emoji); a lone one is no text (names.has_surrogate).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class RecordError(UserError, ValueError):
    """A record (or other sweep JSON file) that cannot be used: one line naming the path and what is wrong."""


class LockError(RecordError):
    """A lock file that cannot be used (open_lock): what a command that refuses it says is of the
    lock, not of the file it guards (a manifest's queued jobs)."""


def write_json(path: str | Path, value: Any, sort_keys: bool = False, root: str | Path | None = None) -> Path:
    """The one atomic JSON writer (records, the sweep's and the cache's manifests): see
    atomic_output. Strict JSON, which every parser reads (jq, JavaScript's JSON.parse, DuckDB's
    read_json): a float that is not finite, for which JSON has no word (Python's json would write a
    bare NaN or Infinity), is written as null. Values JSON does not know are written as text."""
    text = json.dumps(_finite(value), indent=2, sort_keys=sort_keys, default=str, allow_nan=False) + "\n"
    return write_text(path, text, root)


def _finite(value: Any) -> Any:
    """value with every float that is not finite, at any depth of its dicts and lists, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_text(path: str | Path, text: str, root: str | Path | None = None) -> Path:
    """Write a text file atomically (atomic_output; its folder reached below root, no link followed)."""
    with atomic_output(path, root) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def atomic_output(path: str | Path, root: str | Path | None = None) -> Iterator[Path]:
    """A temporary file of a unique name beside path for the block to write (a table, a plot, a
    YAML file), then fsync and rename over path: a reader sees the old file or the new one, never
    half of one, and a write that fails (a full disk) leaves the old file, or none, and no
    temporary file. The folder is reached below root (path's own by default) without following a
    link, and made where missing; the name yielded resolves to that folder whatever is put at its
    name meanwhile (beneath.pinned), and a link at path is replaced, never followed. Temporary
    files that killed writers left beside path are removed first (beneath.clean_temps). Its
    OSError names path, not the temporary file."""
    path = Path(path)
    try:
        with replacing(path, root) as (parent, _, tmp):
            yield pinned(parent, tmp)
    except OSError as exc:
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from None


def linked_file(path: str | Path) -> Path:
    """The file a path names, where a shared file may be reached through a symbolic link (a team's
    history or references on another disk): where the link leads, when the link is the user's
    own (one another user put there is refused: it could lead to the user's other database, or
    to a file a shell runs, ~/.bashrc.d/x) and leads to a regular file or none in a folder that is
    there; else a RecordError. A file that is there must be the user's and writable by no one
    else (ownership.check_owned). A write there then replaces that file, never the link; a link
    never makes a command replace a device, a FIFO or a folder."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return path
    if not stat.S_ISLNK(info.st_mode):
        if not stat.S_ISREG(info.st_mode):
            raise RecordError(f"{path}: {kind_of(info.st_mode)}, not a file hpcfsdp writes; left as it is")
        check_owned(path, info)
        return path
    target = Path(os.path.realpath(path))
    if info.st_uid != os.geteuid():
        raise RecordError(
            f"{path}: a link to {target} that {user_name(info.st_uid)} made, not you; not followed, nothing written "
            "(remove it, and look at who put it there)"
        )
    try:
        found = os.stat(target)
    except FileNotFoundError:
        if not target.parent.is_dir():
            raise RecordError(f"{path}: a link to {target}, in no folder; nothing written") from None
        return target
    except OSError as exc:
        raise RecordError(f"{path}: a link to {target} ({exc.strerror or exc}); nothing written") from None
    if not stat.S_ISREG(found.st_mode):
        raise RecordError(f"{path}: a link to {target}, {kind_of(found.st_mode)}; nothing written there")
    check_owned(target, found)
    return target


class OwnershipError(UserError):
    """A path hpcfsdp would write or trust that another user owns or can write (fs/ownership.py):
    one line naming the path, its owner and mode, and the fix."""


def check_owned(path: str | Path, info: os.stat_result | None = None) -> None:
    """OwnershipError unless the file or folder at path (or of this stat) is the user's and
    writable by no one else, or a group's that shares it on purpose (ownership_problem); nothing
    there is nothing to check."""
    if info is None:
        try:
            info = os.stat(path)
        except OSError:
            return
    if problem := ownership_problem(info):
        raise OwnershipError(refusal_line(path, info, problem))


def check_folder_tree(folder: str | Path, parts: tuple[str, ...]) -> None:
    """check_owned of folder and of each of its parts that exists; a link among them is refused."""
    folder = Path(folder)
    check_owned(folder)
    for part in parts:
        path = folder / part
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise OwnershipError(
                f"{path}: a symbolic link where hpcfsdp keeps a folder of its own; not followed (remove it, "
                "and look at who put it there)"
            )
        check_owned(path, info)


# Lock files: a sweep's .submit.lock, history.duckdb.lock, the cache's locks (issue 51, item 9).
LOCK_NOTE_MAX = 4096  # a lock's note ("hpcfsdp submit: pid 4242 on login1, since ...") is one short line
LOCK_NOTE_STARTS = (b"hpcfsdp ", b"pid ")  # this hpcfsdp's notes, and those of earlier ones


def open_lock(path: str | Path) -> int:
    """A descriptor, open for reading and writing, of the lock file at path (made where there is
    none), to flock and to write its note in. flock needs only a descriptor, which reading gives:
    so a lock is made 0600 (0660 in a group's shared folder: ownership.lock_mode), a wider one of
    the user's own is narrowed, and one of another owner is refused. Its note is rewritten at
    each take: so it is never opened through a symbolic link (beneath.open_file), and refused
    unless it is a lock file of hpcfsdp: a regular file of no other name (no hard link), empty or
    holding a lock's note. A RecordError (an OwnershipError) names the path and what is there."""
    path = Path(path)
    mode = lock_mode()
    try:
        fd = open_file(path, os.O_RDWR | os.O_CREAT, mode=mode)
    except OSError as exc:
        what = "a symbolic link where a lock file belongs" if exc.errno == errno.ELOOP else exc.strerror
        if isinstance(exc, NotARegularFile) or exc.errno == errno.EMLINK:
            raise LockError(f"{path}: {exc.strerror}; not used as a lock, nothing written (remove it)") from None
        raise LockError(f"{path}: cannot take the lock ({what or exc})") from None
    try:
        info = os.fstat(fd)
        problem = (
            "a file with other names too (a hard link)"
            if info.st_nlink > 1
            else "not a lock file of hpcfsdp (it holds something else)"
            if info.st_size > LOCK_NOTE_MAX or (info.st_size and not os.pread(fd, 8, 0).startswith(LOCK_NOTE_STARTS))
            else ""
        )
        if not problem and (owner := ownership_problem(info)):
            os.close(fd)
            raise OwnershipError(refusal_line(path, info, owner))
        if not problem and stat.S_IMODE(info.st_mode) & ~mode:
            os.fchmod(fd, mode)  # an earlier hpcfsdp's 0644: anyone who could read it could hold it
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem:
        os.close(fd)
        raise LockError(f"{path}: {problem}; not used as a lock, nothing written (remove it)")
    return fd


class LockBusy(LockError):
    """A lock another process held past the wait: one line naming the lock and its holder (holder:
    the holder's words alone, for a caller's own line)."""

    def __init__(self, line: str, holder: str) -> None:
        super().__init__(line)
        self.holder = holder


def take_lock(
    fd: int,
    path: str | Path,
    wait_s: float,
    on_wait: Callable[[str], None] = lambda holder: None,
    lock: Callable[[int, int], Any] = fcntl.flock,
    holder: Callable[[int], str] = holder_words,
) -> None:
    """Take the exclusive lock of the open fd with `lock` (flock, or lockf for DuckDB's own record
    lock on the history), polling it for up to wait_s seconds; on_wait(holder(fd)) is called once
    when another holder makes it wait. LockBusy names the holder past the wait; an error of the
    lock other than "held" (EAGAIN, EACCES) is raised as it is."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() >= deadline:
                words = holder(fd)
                raise LockBusy(f"{path}: held by {words} for over {wait_s:g} s; nothing done", words) from None
            if not said:
                on_wait(holder(fd))
                said = True
            time.sleep(0.2)


@contextmanager
def exclusive_lock(
    path: str | Path, on_wait: Callable[[], None] = lambda: None, wait_s: float = 3600.0
) -> Iterator[None]:
    """Hold an exclusive flock on the lock file at path (open_lock: never a link, nor a file
    hpcfsdp did not make) for the block, waiting up to wait_s seconds (LockBusy past it); on_wait
    is called once when another holder makes it wait. The kernel drops the lock when its holder
    ends, however it ends."""
    fd = open_lock(path)
    try:
        take_lock(fd, path, wait_s, lambda holder: on_wait())
        yield
    finally:
        os.close(fd)  # and with it the flock


def parse_json(data: bytes) -> Any:
    """JSON text to a value: pydantic-core's parser (jiter; about 10 times faster than `json`:
    collect parses every record of a sweep) where it is installed and reads the text, with the
    same values as `json` (every integer exact, NaN and Infinity as json reads them, the last of
    duplicate keys); the standard library otherwise (no pydantic-core, or text jiter refuses:
    not UTF-8, nested past 200 levels, malformed), so error messages stay those of `json`."""
    if from_json is not None:
        try:
            return from_json(data, allow_inf_nan=True)
        except ValueError:
            pass
    return json.loads(data.decode("utf-8"))


def garbage_collection_paused() -> _CollectorPaused:
    """A `with` block with the garbage collector paused for a bulk read, then as it was (a caller
    that paused it keeps it paused). A bulk read makes many new objects, none in a reference cycle
    (a sweep's records and their rows, a profile's events): the full collections their number sets
    off walk every object the process holds and free nothing of them. Measured on the 2-core CPU
    machine: about 0.25 s of collecting 10,000 records, 0.5-0.9 s of a tiny cell's 0.6-1.1 s
    communication profile."""
    return _CollectorPaused()


class _CollectorPaused:
    """A class, not a generator: leaving the block makes no object once the collector runs again
    (a generator's end would, and set off a collection of the block's objects right there)."""

    def __enter__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            gc.enable()


def read_json_object(
    path: str | Path, root: str | Path | None = None, kind: str = "record", limit: int = 0
) -> dict[str, Any]:
    """A JSON object from path, or RecordError naming the path (a `kind` of file) and why not:
    unreadable, larger than `limit` bytes (MAX_JSON_BYTES by default), not UTF-8, not JSON, too
    deep (RecursionError) or an integer past Python's digit limit (ValueError), not an object, text
    with a lone surrogate, or reached through a symbolic link (below root, the folder the command
    was given; or at its own name). FileNotFoundError when there is no file."""
    path = path if isinstance(path, Path) else Path(path)  # not parsed again: a collect reads 10,000
    try:
        data = read_file(path, limit or MAX_JSON_BYTES, root=root)
        value = parse_json(data)
    except (FileNotFoundError, NotADirectoryError):  # no file (a file where its folder should be: none either)
        raise FileNotFoundError(path) from None
    except OSError as exc:
        raise RecordError(f"{path}: unreadable {kind} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: unreadable {kind} (not UTF-8 text)") from None
    except RecursionError:
        raise RecordError(f"{path}: unreadable {kind} (JSON nested too deeply)") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise RecordError(f"{path}: unreadable {kind} ({_one_line(exc)})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{path}: expected a JSON object, got {type(value).__name__}")
    if SURROGATE_ESCAPE.search(data) and (where := _surrogate_in(value)):
        raise RecordError(f"{path}: unreadable {kind} (a lone surrogate, which is no text, in {where})")
    return value


def _surrogate_in(value: Any) -> str:
    """The dotted name of the first key or text in value (walked without recursion) that holds a
    lone surrogate; "" when none does."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str) and has_surrogate(item):
            return where or "the value"
        if isinstance(item, dict):
            for key, child in item.items():
                if has_surrogate(key):
                    return f"a key of {where or 'the object'}"
                stack.append((f"{where}.{key}" if where else key, child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{index}]", child) for index, child in enumerate(item))
    return ""


MAX_JSON_BYTES = 64 << 20  # a record of a million steps' losses is some 20 MB; more is no record


def read_regular_file(path: str | Path, limit: int, tail: bool = False, root: str | Path | None = None) -> bytes:
    """The bytes of a regular file reached below root without following a link, of at most
    `limit` bytes (beneath.read_file): a longer one is an OSError (EFBIG), or with `tail` its last
    `limit` bytes; a link is an OSError (ELOOP), anything else than a regular file NotARegularFile,
    found before a byte is read."""
    return read_file(path, limit, tail, root)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]
