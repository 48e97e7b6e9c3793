"""The suite's files written whole or not at all, and its JSON files read with one line of error.

Every file a command writes (records, manifests, tables, plots, YAML) goes through atomic_output:
a reader sees the old file or the new one, never half of one. Every JSON object a command reads
(records, spec.json, manifest.json, the cache's manifest) goes through read_json_object: a file
that cannot be used is a RecordError naming it in one line, never a traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import UserError

try:
    from pydantic_core import from_json
except ImportError:  # a dependency; without it (a compute node) JSON is parsed by the standard library, slower
    from_json = None  # type: ignore[assignment]


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


def read_json_object(path: str | Path, root: str | Path | None = None, kind: str = "record") -> dict[str, Any]:
    """A JSON object from path, or RecordError naming the path (a `kind` of file) and why not:
    unreadable, not UTF-8, not JSON, too deep (RecursionError) or an integer past Python's digit
    limit (ValueError), not an object, or (with root) a link that leads out of the folder root.
    FileNotFoundError when there is no file."""
    path = Path(path)
    if root is not None and not _inside(path, root):
        raise RecordError(f"{path}: leads out of {root} (a symbolic link); not read")
    try:
        value = parse_json(read_regular_file(path, MAX_JSON_BYTES))
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
    return value


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
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
