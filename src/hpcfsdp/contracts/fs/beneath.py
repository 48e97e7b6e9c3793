"""Paths beneath a folder, opened through its directory descriptor: no symbolic link is followed.

A results folder is often shared by a team, and anyone who can write in it may put a link, a FIFO
or a device where hpcfsdp expects its own file, or swap a folder for a link while a command runs.
So every file hpcfsdp opens, writes, renames, removes or lists under a sweep folder, the history,
the references, the cache and tune's state is reached here (issue 51): the folder a command was
given (`root`; the user named it, so a link in its own path is theirs) is opened once, each part
below it is opened relative to the descriptor of the part above (`dir_fd`) with O_NOFOLLOW, and
the file itself with O_NOFOLLOW and O_NONBLOCK (a FIFO without a writer never hangs the open),
then fstat-ed: a regular file, or an OSError. Reads are capped; writes go to a temporary file in
the same folder that is renamed over the name (files.atomic_output). A temporary file holds an
flock while it is written, so one a killed process left (its flock dropped by the kernel, on any
node of the file system) is known and removed by the next write in that folder.

A path handed to a library that opens it by name (pandas, matplotlib, DuckDB) is written as
/proc/self/fd/<folder's descriptor>/<name>: the kernel resolves it to the folder opened here,
whatever link is put at the folder's name since.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | CLOEXEC

# A temporary file of atomic_output (and the history's copy): ".<name>.<pid>.<8 hex>", and what
# DuckDB adds to such a file (its write-ahead log, the history's rewritten copy).
TEMP_NAME = re.compile(r"\.(?P<name>.+)\.[0-9]+\.[0-9a-f]{8}(?:\.rewritten)?(?:\.wal)?")


FRESH_S = 1.0  # a temporary file younger than this is never taken for a killed writer's


class NotARegularFile(OSError):
    """A path that is a FIFO, a device, a socket or a folder: reading it could block for ever or
    never end (a FIFO named result.json, /dev/zero behind a link)."""


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words, when it is not a regular file."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"


def parts_below(path: str | Path, root: str | Path | None) -> tuple[str, list[str]]:
    """(the folder opened as given, the names below it down to path's own): root where path is
    written under it, else path's parent. A `..` below root is refused (EINVAL)."""
    path = os.fspath(path)
    top = os.fspath(root) if root is not None else os.path.dirname(path) or "."
    top = top.rstrip("/") or "/"
    prefix = top if top.endswith("/") else top + "/"
    if root is None or not path.startswith(prefix):
        top, names = os.path.dirname(path) or ".", [os.path.basename(path)]
    else:
        names = [name for name in path[len(prefix) :].split("/") if name and name != "."]
    if ".." in names or not names:
        raise OSError(errno.EINVAL, "not a path below its folder", path)
    return top, names


def open_folder(top: str, names: list[str], path: str, create: bool = False) -> int:
    """A descriptor of top/names..., each name opened below the one above with O_NOFOLLOW (made,
    0777 less the umask, when create and missing). A link, or a file where a folder belongs, is
    an OSError naming path: ELOOP for a link, ENOTDIR otherwise."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC) if not create else _made_top(top)
    try:
        for depth, name in enumerate(names, 1):
            try:
                below = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                below = os.open(name, DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                raise _not_a_folder(fd, name, os.path.join(top, *names[:depth])) from None
            os.close(fd)
            fd = below
        return fd
    except BaseException:
        os.close(fd)
        raise


def _made_top(top: str) -> int:
    os.makedirs(top, exist_ok=True)
    return os.open(top, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)


def _not_a_folder(fd: int, name: str, path: str) -> OSError:
    try:
        link = stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
    except OSError:
        link = False
    if link:
        return OSError(errno.ELOOP, "a symbolic link where a folder belongs, not followed", path)
    return OSError(errno.ENOTDIR, "a file is where a folder is needed", path)


@contextmanager
def folder(path: str | Path, root: str | Path | None = None, create: bool = False) -> Iterator[int]:
    """The descriptor of the folder at path (below root, as open_folder opens it) for the block."""
    text = os.fspath(path)
    if root is not None and os.fspath(root).rstrip("/") == text.rstrip("/"):
        top, names = text, list[str]()
    else:
        top, names = parts_below(text, root)
    fd = open_folder(top, names, text, create)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file(
    path: str | Path,
    flags: int = os.O_RDONLY,
    root: str | Path | None = None,
    mode: int = 0o666,
    create_dirs: bool = False,
) -> int:
    """A descriptor of the regular file at path, reached below root without following a link
    (root: the folder the command was given; by default path's own folder). A link at the name
    is an OSError (ELOOP), anything but a regular file NotARegularFile, found before a byte is
    read or written; with O_CREAT the file is made with mode (less the umask) where none is."""
    text = os.fspath(path)
    top, names = parts_below(text, root)
    parent = open_folder(top, names[:-1], text, create_dirs)
    try:
        fd = _open_in(parent, names[-1], flags, mode, text)
    finally:
        os.close(parent)
    return fd


def _open_in(parent: int, name: str, flags: int, mode: int, path: str) -> int:
    truncate = bool(flags & os.O_TRUNC)  # only once it is known to be a regular file of one name
    try:
        fd = os.open(name, (flags & ~os.O_TRUNC) | FILE_FLAGS, mode, dir_fd=parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not followed", path) from None
        if exc.errno == errno.EISDIR:
            raise NotARegularFile(errno.EISDIR, "a folder", path) from None
        raise OSError(exc.errno, exc.strerror, path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, kind_of(info.st_mode), path)
    if flags & (os.O_WRONLY | os.O_RDWR) and info.st_nlink > 1:
        os.close(fd)
        raise OSError(errno.EMLINK, "a file with other names too (a hard link), not written", path)
    if truncate:
        os.ftruncate(fd, 0)
    return fd


def open_for_writing(path: str | Path, root: str | Path | None = None) -> int:
    """A new, empty regular file at path for a file hpcfsdp writes as it goes (a log, a fault
    handler's file): whatever was at the name (an earlier file, a link, a FIFO) is removed as a
    name first, never followed or emptied; the folder is reached as open_file reaches it."""
    text = os.fspath(path)
    top, names = parts_below(text, root)
    with folder_of(top, names, text) as parent:
        with suppress(FileNotFoundError):
            os.unlink(names[-1], dir_fd=parent)
        return _open_in(parent, names[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, text)


def read_file(path: str | Path, limit: int, tail: bool = False, root: str | Path | None = None) -> bytes:
    """The bytes of the regular file at path (open_file: no link), of at most `limit` bytes: a
    longer one is an OSError (EFBIG), or with `tail` its last `limit` bytes."""
    fd = open_file(path, os.O_RDONLY, root)
    try:
        return read_open(fd, limit, tail, os.fspath(path))
    finally:
        os.close(fd)


def read_open(fd: int, limit: int, tail: bool, path: str) -> bytes:
    """read_file's part once the file is open."""
    size = os.fstat(fd).st_size
    start = 0
    if size > limit:
        if not tail:
            raise OSError(errno.EFBIG, f"larger than {max(limit >> 20, 1)} MiB", path)
        start = size - limit
    chunks, offset = [], start
    while offset - start < limit and (chunk := os.pread(fd, min(1 << 20, limit - (offset - start)), offset)):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


@contextmanager
def folder_of(top: str, names: list[str], path: str, create: bool = False) -> Iterator[int]:
    fd = open_folder(top, names[:-1], path, create)
    try:
        yield fd
    finally:
        os.close(fd)


def remove(path: str | Path, root: str | Path | None = None) -> bool:
    """Remove the file (or link: never what it leads to) at path; whether there was one."""
    text = os.fspath(path)
    top, names = parts_below(text, root)
    try:
        with folder_of(top, names, text) as parent:
            os.unlink(names[-1], dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def names_in(path: str | Path, root: str | Path | None = None) -> list[str]:
    """The names in the folder at path (reached without following a link), sorted; [] when
    there is no such folder."""
    try:
        with folder(path, root) as fd:
            return sorted(os.listdir(fd))
    except (FileNotFoundError, NotADirectoryError):
        return []


def rename(source: str | Path, target: str | Path, root: str | Path | None = None, replace: bool = True) -> None:
    """Rename source to target, both reached below root without following a link (a link at
    either name is moved or replaced as a name, never followed); without replace, an existing
    target is a FileExistsError (a hard link, then the source's name removed)."""
    src_top, src_names = parts_below(source, root)
    dst_top, dst_names = parts_below(target, root)
    with (
        folder_of(src_top, src_names, os.fspath(source)) as src,
        folder_of(dst_top, dst_names, os.fspath(target), create=True) as dst,
    ):
        if replace:
            os.rename(src_names[-1], dst_names[-1], src_dir_fd=src, dst_dir_fd=dst)
            return
        os.link(src_names[-1], dst_names[-1], src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
        os.unlink(src_names[-1], dir_fd=src)


def pinned(fd: int, name: str = "") -> Path:
    """A name for an open folder (and a file in it) that a library can open: it resolves to that
    folder, whatever is put at the folder's own name since."""
    return Path(f"/proc/self/fd/{fd}", name) if name else Path(f"/proc/self/fd/{fd}")


def temp_name(name: str) -> str:
    """A fresh temporary file name for name, of TEMP_NAME's shape."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}"


def new_temp(parent: int, name: str, mode: int = 0o666) -> tuple[int, str]:
    """(descriptor, name) of a new temporary file for name in the open folder parent, under an
    flock held until the descriptor is closed; temporary files that killed writers left there
    for the same name are removed first (clean_temps)."""
    clean_temps(parent, name)
    while True:
        tmp = temp_name(name)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | FILE_FLAGS, mode, dir_fd=parent)
        except FileExistsError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, tmp


@contextmanager
def replacing(path: str | Path, root: str | Path | None = None, mode: int = 0o666) -> Iterator[tuple[int, int, str]]:
    """(folder, descriptor, name) of a new temporary file beside path (new_temp: the folder reached
    below root without following a link, and made where missing) for the block to write; then
    fsync and rename over path's name, which replaces a link there, never follows it. A block that
    raises leaves the old file, or none, and no temporary file."""
    text = os.fspath(path)
    top, names = parts_below(text, root)
    with folder_of(top, names, text, create=True) as parent:
        fd, tmp = new_temp(parent, names[-1], mode)
        try:
            yield parent, fd, tmp
            os.fsync(fd)
            os.rename(tmp, names[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        finally:
            os.close(fd)


def clean_temps(parent: int, name: str | None = None) -> list[str]:
    """Remove the temporary files in the open folder parent (of `name`, or of any name) whose
    writer is gone: no flock on them. Returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        found = TEMP_NAME.fullmatch(entry)
        if not found or (name is not None and found.group("name") != name):
            continue
        base = entry.removesuffix(".wal").removesuffix(".rewritten")
        if base != entry and base in entries:
            continue  # the log or copy of a temporary file still there: removed with it, or kept
        if _abandoned(parent, entry):
            with suppress(OSError):
                os.unlink(entry, dir_fd=parent)
                removed.append(entry)
                for extra in (".wal", ".rewritten", ".rewritten.wal"):
                    with suppress(OSError):
                        os.unlink(entry + extra, dir_fd=parent)
    return removed


def _abandoned(parent: int, entry: str) -> bool:
    try:
        fd = os.open(entry, os.O_RDONLY | FILE_FLAGS, dir_fd=parent)
    except OSError as exc:
        return exc.errno == errno.ELOOP  # a link at a temporary name: no writer's
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return True
        if time.time() - info.st_mtime < FRESH_S:  # made this instant: its writer may not hold its flock yet
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def make_folders(path: str | Path) -> Path:
    """The folder at path and those above it, made where missing (0777 less the umask)."""
    os.makedirs(path, exist_ok=True)
    return Path(path)


def remove_tree(path: str | Path) -> None:
    """Remove the folder at path and all in it, best effort: shutil.rmtree walks it through
    descriptors and removes a link as a name, never what it leads to (a link at path itself is
    left)."""
    shutil.rmtree(path, ignore_errors=True)


def entries(path: str | Path | int) -> list[os.DirEntry[str]]:
    """The entries of the folder at path, or of the open folder fd (os.scandir's: their kind is
    known without following a link); an OSError where it cannot be listed."""
    with os.scandir(path) as listing:
        return list(listing)


def matching(path: str | Path, pattern: str, root: str | Path | None = None) -> list[Path]:
    """The paths of the names in the folder at path (reached as names_in reaches it) that match
    the shell pattern, sorted; each is then read through this layer (no link followed)."""
    return [Path(path, name) for name in names_in(path, root) if fnmatch.fnmatchcase(name, pattern)]


def names_of(fd: int) -> list[str]:
    """The names in an open folder, sorted."""
    return sorted(os.listdir(fd))


def remove_links_in(fd: int) -> None:
    """Remove every symbolic link in the open folder fd (as names: never what they lead to)."""
    for name in os.listdir(fd):
        if stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode):
            os.unlink(name, dir_fd=fd)


def removed_in(fd: int, *names: str) -> None:
    """Remove these names (files or links, as names) from the open folder fd, where they are."""
    for name in names:
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)


def renamed_in(fd: int, source: str, target: str, fsync: bool = False) -> None:
    """Rename source over target in the open folder fd (fsync-ing source first, where asked)."""
    if fsync:
        written = os.open(source, os.O_RDWR | FILE_FLAGS, dir_fd=fd)
        try:
            os.fsync(written)
        finally:
            os.close(written)
    os.rename(source, target, src_dir_fd=fd, dst_dir_fd=fd)
