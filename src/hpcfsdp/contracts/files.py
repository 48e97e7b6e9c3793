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
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from .errors import UserError
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


def write_json(path: str | Path, value: Any, sort_keys: bool = False) -> Path:
    """The one atomic JSON writer (records, the sweep's and the cache's manifests): see
    atomic_output. Strict JSON, which every parser reads (jq, JavaScript's JSON.parse, DuckDB's
    read_json): a float that is not finite, for which JSON has no word (Python's json would write a
    bare NaN or Infinity), is written as null. Values JSON does not know are written as text."""
    text = json.dumps(_finite(value), indent=2, sort_keys=sort_keys, default=str, allow_nan=False) + "\n"
    return write_text(path, text)


def _finite(value: Any) -> Any:
    """value with every float that is not finite, at any depth of its dicts and lists, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_text(path: str | Path, text: str) -> Path:
    """Write a text file atomically (atomic_output)."""
    with atomic_output(path) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A temporary file of a unique name beside path for the block to write (a table, a plot, a
    YAML file), then fsync and rename over path: a reader sees the old file or the new one, never
    half of one, and a write that fails (a full disk) leaves the old file, or none, and no
    temporary file. Its OSError names path, not the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it; mkstemp makes 0600
        finally:
            os.close(fd)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno is None:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno), str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def linked_file(path: str | Path) -> Path:
    """The file a path names, where a shared file may be reached through a symbolic link (a team's
    history or references on another disk): where the link leads, when that is a regular file or
    none in a folder that is there; else a RecordError. A write there then replaces that file,
    never the link; a link planted in a shared folder never makes a command replace a device, a
    FIFO or a folder."""
    path = Path(path)
    if not path.is_symlink():
        problem = _not_replaceable(path)
        if problem:
            raise RecordError(f"{path}: {problem}, not a file hpcfsdp writes; left as it is")
        return path
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        if not target.parent.is_dir():
            raise RecordError(f"{path}: a link to {target}, in no folder; nothing written") from None
        return target
    except OSError as exc:
        raise RecordError(f"{path}: a link to {target} ({exc.strerror or exc}); nothing written") from None
    if not stat.S_ISREG(mode):
        raise RecordError(f"{path}: a link to {target}, {_kind_of(mode)}; nothing written there")
    return target


def _not_replaceable(path: Path) -> str:
    """What is at path that is no regular file ("" for a regular file or nothing): a symbolic
    link, a FIFO, device or socket, a folder."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return ""
    if stat.S_ISREG(mode):
        return ""
    return _kind_of(mode)


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"


LOCK_NOTE_MAX = 4096  # a lock's note ("hpcfsdp submit: pid 4242 on login1, since ...") is one short line
LOCK_NOTE_STARTS = (b"hpcfsdp ", b"pid ")  # this hpcfsdp's notes, and those of earlier ones


def open_lock(path: str | Path) -> int:
    """A descriptor, open for reading and writing, of the lock file at path (made where there is
    none), to flock and to write its note in. A lock lives in a folder others may write, and its
    note is rewritten at each take: so it is never opened through a symbolic link (O_NOFOLLOW),
    and refused unless it is a lock file of hpcfsdp: a regular file of no other name (no hard
    link), empty or holding a lock's note. A RecordError names the path and what is there."""
    path = Path(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    if problem := _not_replaceable(path):  # never open a device, even to look at it
        raise RecordError(f"{path}: {problem} where a lock file belongs; not used (remove it)")
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        what = "a symbolic link where a lock file belongs" if exc.errno == errno.ELOOP else exc.strerror
        raise RecordError(f"{path}: cannot take the lock ({what or exc})") from None
    try:
        info = os.fstat(fd)
        problem = (
            _kind_of(info.st_mode)
            if not stat.S_ISREG(info.st_mode)
            else "a file with other names too (a hard link)"
            if info.st_nlink > 1
            else "not a lock file of hpcfsdp (it holds something else)"
            if info.st_size > LOCK_NOTE_MAX or (info.st_size and not os.pread(fd, 8, 0).startswith(LOCK_NOTE_STARTS))
            else ""
        )
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem:
        os.close(fd)
        raise RecordError(f"{path}: {problem}; not used as a lock, nothing written (remove it)")
    return fd


@contextmanager
def exclusive_lock(path: str | Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive flock on the lock file at path (open_lock: never a link, nor a file
    hpcfsdp did not make) for the block; on_wait is called once when another holder makes it wait.
    The kernel drops the lock when its holder ends, however it ends."""
    fd = open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the flock


def write_lock_note(fd: int, note: str) -> None:
    """Say who holds a lock (for the people who wait): "hpcfsdp <command>: pid N on HOST..."; an empty
    note on release. Best effort: a full disk leaves the note out, never the lock (the flock)."""
    with suppress(OSError):
        os.ftruncate(fd, 0)
        if note:
            os.pwrite(fd, f"hpcfsdp {note}\n".encode(), 0)


def lock_holder(fd: int) -> tuple[str, str]:
    """(the command, the rest of its note) of a lock's holder, as write_lock_note wrote them; an
    earlier hpcfsdp's note gives no command (""). The note is one printable line, cut short: its
    file may have been written by anyone."""
    with suppress(OSError):
        text = os.pread(fd, LOCK_NOTE_MAX, 0).decode(errors="replace").split("\n", 1)[0]
        text = "".join(char for char in text if char.isprintable())[:200]
        command, _, rest = text.removeprefix("hpcfsdp ").partition(": ")
        return (command, rest) if text.startswith("hpcfsdp ") and rest else ("", text)
    return "", ""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    with a lone surrogate, or (with root) a link that leads out of the folder root.
    FileNotFoundError when there is no file."""
    path = Path(path)
    if root is not None and not _inside(path, root):
        raise RecordError(f"{path}: leads out of {root} (a symbolic link); not read")
    try:
        data = read_regular_file(path, limit or MAX_JSON_BYTES)
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


class NotARegularFile(OSError):
    """A path that is a FIFO, a device, a socket or a folder: reading it could block for ever or
    never end (a FIFO named result.json, /dev/zero behind a link)."""


def read_regular_file(path: str | Path, limit: int, tail: bool = False) -> bytes:
    """The bytes of a regular file, of at most `limit` bytes: a longer one is an OSError (EFBIG),
    or with `tail` its last `limit` bytes. Anything else than a regular file is NotARegularFile,
    found before a byte is read: opened without blocking (a FIFO without a writer would hang
    open()), then checked with fstat."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, device or socket)"
            raise NotARegularFile(errno.EINVAL, kind, str(path))
        start = 0
        if info.st_size > limit:
            if not tail:
                raise OSError(errno.EFBIG, f"larger than {limit >> 20} MiB", str(path))
            start = info.st_size - limit
        chunks, offset = [], start
        while offset - start < limit and (chunk := os.pread(fd, min(1 << 20, limit - (offset - start)), offset)):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def _inside(path: Path, root: str | Path) -> bool:
    """Whether path resolves to a place under root's real path. A path written as root/a/b (no
    `..`) none of whose parts below root is a link resolves to realpath(root)/a/b: inside, found
    with one lstat per part instead of realpath's one per part of the whole path and of root (collect
    checks every record of a sweep). Any link, `..` or missing part: realpath decides."""
    base = str(root if isinstance(root, Path) else Path(root))  # as Path writes it: no `.`, `//` or end `/`
    below = _plain_parts_below(str(path), base)
    if below is not None:
        try:
            for part in below:
                base = f"{base}/{part}" if base != "/" else f"/{part}"
                if stat.S_ISLNK(os.lstat(base).st_mode):
                    break
            else:
                return True
        except OSError:
            pass
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def _plain_parts_below(path: str, root: str) -> list[str] | None:
    """The parts of path (as Path writes it) below root as written, or None where path is not
    written under root or has a `..` part."""
    prefix = root if root.endswith("/") else root + "/"
    if path == root:
        return []
    if not path.startswith(prefix):
        return None
    parts = path[len(prefix) :].split("/")
    return None if ".." in parts else parts
