"""The history store: one row per cell record, appended by every `hpcfsdp collect` (DuckDB).

A sweep folder stands alone; the history remembers what each *setup* gave on each *system* across
sweeps, so that `collect` can tell a regression (results/regressions.py) and `hpcfsdp history`
can list and filter runs. docs/history.md describes the columns; results/history_rows.py makes
the rows (their key, setup and system). Here: the DuckDB file, its queries and filters, and its
update, one collect at a time and the file replaced whole or not at all.

Login side: DuckDB and pandas only, no torch.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from ..contracts.errors import UserError
from ..contracts.fields import SpecError
from ..contracts.files import LockBusy, OwnershipError, RecordError, linked_file, open_lock, take_lock
from ..contracts.fs.beneath import folder, make_folders, new_temp, open_file, pinned, removed_in, renamed_in
from ..contracts.fs.ownership import holder_words, user_name, write_lock_note
from ..contracts.names import has_surrogate, readable
from .history_rows import COLUMNS, KEY

TABLE = "runs"
# The DuckDB storage format the history is written in, whatever DuckDB writes it: DuckDB 1.1 and
# every later one open it (DuckDB 2.0 writes by default a format that 1.5 and older cannot read).
# The file's header then says storage version 64. docs/history.md; pyproject pins the writers tested.
STORAGE_VERSION = "v1.1.0"
STORAGE_VERSION_NUMBER = 64  # what the header of a file in STORAGE_VERSION's format says (DuckDB 1.0 to 1.4 write it)


class HistoryError(UserError, RuntimeError):
    """The history file cannot be opened (absent, another process holds it, not a DuckDB file)."""


# ---------------------------------------------------------------------------------------------
# Filters


@dataclass(frozen=True)
class Filters:
    """What `hpcfsdp history` narrows the rows to; every one optional."""

    model: str = ""
    strategy: str = ""
    system: str = ""  # a part of the cluster or GPU name, any case
    setup: str = ""  # a setup key or its beginning
    sweep: str = ""
    status: str = ""
    since: datetime | None = None  # UTC, inclusive
    until: datetime | None = None  # UTC, exclusive

    def sql(self) -> tuple[str, list[Any]]:
        clauses, params = ["TRUE"], []
        for name in ("model", "strategy", "sweep", "status"):
            if getattr(self, name):
                clauses.append(f"{name} = ?")
                params.append(getattr(self, name))
        if self.system:
            clauses.append("(cluster ILIKE ? OR gpu ILIKE ?)")
            params += [f"%{self.system}%"] * 2
        if self.setup:
            clauses.append("starts_with(setup, ?)")
            params.append(self.setup)
        if self.since:
            clauses.append("started_at >= ?")
            params.append(self.since)
        if self.until:
            clauses.append("started_at < ?")
            params.append(self.until)
        return " AND ".join(clauses), params


def parse_day(text: str, option: str, end_of_day: bool = False) -> datetime:
    """YYYY-MM-DD or an ISO date and time, as UTC; a bare date given to --until means the whole day."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise SpecError("history", option, f"expected a date YYYY-MM-DD or YYYY-MM-DDTHH:MM, got {text!r}") from None
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    if end_of_day and len(text) == 10:
        moment += timedelta(days=1)
    return moment


# ---------------------------------------------------------------------------------------------
# The store


def _duckdb(path: Path, doing: str = "") -> Any:
    """The duckdb module, imported on first use; a dependency, but a wheelhouse carried to a node
    may lack it: then a HistoryError naming the file, and collect carries on."""
    try:
        import duckdb
    except ImportError:
        raise HistoryError(f"{path}: {doing}duckdb is not installed (pip install duckdb)") from None
    return duckdb


class History:
    """The DuckDB file; use as a context manager. Read-only for `hpcfsdp history` (it must exist);
    collect writes through `updated_history`, never into the file itself."""

    def __init__(self, path: Path, read_only: bool = False):
        duckdb = _duckdb(path)
        self.path = _utf8_path(Path(path))
        if read_only:  # a link is followed as collect follows it: the user's own, to a file of theirs
            self.path = _linked_history(self.path, "not read")
            if not self.path.is_file():
                raise HistoryError(
                    f"{self.path}: no history here yet (every `hpcfsdp collect` appends to it; "
                    "--history PATH names another)"
                )
        # A new file is made in STORAGE_VERSION's format; an existing one keeps its own.
        config: dict[str, Any] = {} if read_only else {"storage_compatibility_version": STORAGE_VERSION}
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only, config=config)
        except (OSError, duckdb.Error) as exc:  # no permission, not a DuckDB file
            raise HistoryError(f"{self.path}: cannot open ({str(exc).splitlines()[0]})") from None
        # Times without a zone (a file of an earlier hpcfsdp, the filters, the rows collected) are UTC.
        self._run("SET TimeZone = 'UTC'")
        if not read_only:
            self._create()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.con.close()

    def checkpoint(self) -> None:
        """Write everything into the database file itself (no write-ahead log left beside it)."""
        self._run("CHECKPOINT")

    def _create(self) -> None:
        columns = ", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())
        self._run(f"CREATE TABLE IF NOT EXISTS {TABLE} ({columns}, PRIMARY KEY ({', '.join(KEY)}))")
        present = dict(
            self._run("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ?", [TABLE])
        )
        for name, kind in COLUMNS.items():
            if name not in present:  # a file written by an older hpcfsdp
                self._run(f"ALTER TABLE {TABLE} ADD COLUMN {name} {kind}")
            elif kind == "TIMESTAMPTZ" and present[name] == "TIMESTAMP":  # an older hpcfsdp's UTC without its zone
                self._run(f"ALTER TABLE {TABLE} ALTER {name} SET DATA TYPE TIMESTAMPTZ")

    def _run(self, sql: str, params: list | None = None) -> list[tuple]:
        """Execute and fetch to the end: DuckDB takes no other statement on a connection before."""
        return self.con.execute(sql, params or []).fetchall()

    def count(self) -> int:
        return self._run(f"SELECT count(*) FROM {TABLE}")[0][0]

    def append(self, rows: pd.DataFrame) -> int:
        """Insert the rows, replacing any with the same key (the same record collected again:
        accounting added since is kept); returns how many were new."""
        if rows.empty:
            return 0
        before = self.count()
        self.con.register("incoming", rows)
        try:
            names = ", ".join(COLUMNS)
            casts = ", ".join(f"CAST({name} AS {kind}) AS {name}" for name, kind in COLUMNS.items())
            self._run(f"INSERT OR REPLACE INTO {TABLE} ({names}) SELECT {casts} FROM incoming")
        finally:
            self.con.unregister("incoming")
        return self.count() - before

    def select(self, filters: Filters = Filters()) -> pd.DataFrame:
        where, params = filters.sql()
        return self.con.execute(f"SELECT * FROM {TABLE} WHERE {where} ORDER BY started_at, sweep, cell_id", params).df()

    def earlier_runs(self, current: pd.DataFrame) -> pd.DataFrame:
        """For each current row (by KEY): the median tokens/s per GPU and the number of the ok runs
        whose figures can be trusted
        of its setup on its system (cluster and GPU) that started before it, other than the rows
        of the current collection (a seed repeat in the same sweep is no history)."""
        empty = pd.DataFrame(columns=[*KEY, "history_median", "history_runs"])
        if current.empty:
            return empty
        self.con.register("current_rows", current[[*KEY, "setup", "cluster", "gpu", "started_at", "collected_at"]])
        try:
            found = self.con.execute(f"""
                SELECT c.sweep_dir, c.cell_id, c.attempt,
                       median(r.tokens_per_s_per_gpu) AS history_median, count(*) AS history_runs
                FROM current_rows c JOIN {TABLE} r
                  ON r.setup = c.setup AND r.cluster IS NOT DISTINCT FROM c.cluster
                 AND r.gpu IS NOT DISTINCT FROM c.gpu
                 AND r.started_at < CAST(coalesce(c.started_at, c.collected_at) AS TIMESTAMPTZ)
                WHERE r.status = 'ok' AND r.tokens_per_s_per_gpu IS NOT NULL AND r.invalid_reasons IS NULL
                  AND NOT EXISTS (SELECT 1 FROM current_rows x
                                  WHERE x.sweep_dir = r.sweep_dir AND x.cell_id = r.cell_id AND x.attempt = r.attempt)
                GROUP BY c.sweep_dir, c.cell_id, c.attempt""").df()
        finally:
            self.con.unregister("current_rows")
        return found if not found.empty else empty


# ---------------------------------------------------------------------------------------------
# Updating: one collect at a time, and the file replaced whole or not at all


@contextmanager
def updated_history(path: Path, log: Callable[[str], None], wait_s: float | None = None) -> Iterator[History]:
    """The history at path, open for appending; on leaving the block it replaces the file whole.

    Collects queue for the history's lock (history.duckdb.lock beside it, flock) for up to wait_s
    seconds (LOCK_WAIT_S), saying once that they wait. The update is made in a copy of the file
    beside it, which is checkpointed and renamed over it: a full disk, a crash or Ctrl-C leaves the
    old file as it was (or none, before the first collect) and no half-written one. A failure is a
    HistoryError naming the file and why, never a traceback."""
    path = _history_file(_utf8_path(Path(path)))
    duckdb = _duckdb(path, "not updated: ")
    try:
        make_folders(path.parent)
    except OSError as exc:
        raise HistoryError(f"{path}: not updated ({exc.strerror or exc})") from None
    wait = LOCK_WAIT_S if wait_s is None else wait_s
    with (
        _history_lock(path, log, wait),
        _duckdb_lock(path, log, wait) as current,
        folder(path.parent, path.parent) as parent,
    ):
        # The copy is made under the history's lock: any copy there is a killed collect's (new_temp
        # removes it). It is named through the folder's descriptor (beneath.pinned).
        fd, name = new_temp(parent, path.name)
        scratch = pinned(parent, name)
        try:
            if current is not None:
                _copy_from(current, fd)
                if _storage_version_number(fd) != STORAGE_VERSION_NUMBER:  # a file any collect wrote is
                    _rewrite_at_storage_version(scratch)
            else:  # DuckDB makes its file where none is (an empty one is no database to it)
                removed_in(parent, name)
            with History(scratch) as store:
                yield store
                store.checkpoint()
            renamed_in(parent, name, path.name, fsync=True)
        except (OSError, duckdb.Error, HistoryError) as exc:
            if isinstance(exc, OSError) and exc.strerror:
                reason = exc.strerror
            else:  # DuckDB's message, or History's "<scratch>: cannot open (...)": about the copy
                reason = str(exc).splitlines()[0].removeprefix(f"{scratch}: ").replace(str(scratch), str(path))
                reason = reason.replace(str(path.parent / name), str(path))  # as DuckDB resolved the name
            raise HistoryError(f"{path}: not updated ({reason}); the file is as it was") from None
        finally:
            os.close(fd)
            for leftover in (name, name + ".rewritten"):
                removed_in(parent, leftover, leftover + ".wal")


def _utf8_path(path: Path) -> Path:
    """path, which DuckDB opens only where it is UTF-8 text (a byte that is not, in a folder's name,
    made it raise std::bad_cast); a HistoryError in one line otherwise."""
    if has_surrogate(str(path)):
        raise HistoryError(
            f"{readable(str(path))}: not UTF-8 text, which DuckDB cannot open; give a history path that is"
        )
    return path


def _rewrite_at_storage_version(copy: Path) -> None:
    """Write the history's copy anew in STORAGE_VERSION's format (a file an older hpcfsdp let
    DuckDB 2.0 write in its own becomes one that DuckDB 1.1 opens): every table, its keys and rows."""
    import duckdb

    fresh = _rewritten(copy)
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {_sql_text(copy)} AS hpcfsdp_copy (READ_ONLY)")
        con.execute(f"ATTACH {_sql_text(fresh)} AS hpcfsdp_fresh (STORAGE_VERSION '{STORAGE_VERSION}')")
        con.execute("COPY FROM DATABASE hpcfsdp_copy TO hpcfsdp_fresh")
        con.execute("DETACH hpcfsdp_fresh")
    finally:
        con.close()
    os.replace(fresh, copy)


def _storage_version_number(fd: int) -> int:
    """The storage version a DuckDB file's header names: after its magic (DUCKDB_MAGIC), a
    little-endian 64-bit integer. Read from the open file: a second open and close of the history
    in this process would drop DuckDB's lock on it (_duckdb_lock)."""
    offset, magic = DUCKDB_MAGIC
    return int.from_bytes(os.pread(fd, 8, offset + len(magic)), "little")


def _rewritten(copy: Path) -> Path:
    return copy.with_name(copy.name + ".rewritten")


def _sql_text(path: Path) -> str:
    """A path as an SQL string literal (ATTACH takes no parameter)."""
    return "'" + str(path).replace("'", "''") + "'"


LOCK_WAIT_S = 120.0  # how long a collect waits for another one's update of the history


def _history_file(path: Path) -> Path:
    """The file a history path names: a symbolic link (to a shared disk, say) is followed, so that
    the update replaces the file it leads to, never the link with a file of its own; what it
    names is a DuckDB file or none (files.linked_file: never a device, a FIFO or another file)."""
    target = _linked_history(path, "the history is not updated")
    size = target.stat().st_size if target.is_file() else 0
    if size and not _is_duckdb(target):
        where = f"{path} (a link to {target})" if target != path else str(path)
        raise HistoryError(f"{where}: not a DuckDB file; not updated, left as it is")
    return target


def _linked_history(path: Path, refused: str) -> Path:
    """files.linked_file of the history: where a link of the user's own leads; a link another user
    put there, or a file not the user's, is a HistoryError ending in `refused`."""
    try:
        return linked_file(path)
    except (RecordError, OwnershipError) as exc:
        raise HistoryError(f"{exc}; {refused}") from None


DUCKDB_MAGIC = (8, b"DUCK")  # where every DuckDB database file says what it is


def _is_duckdb(path: Path) -> bool:
    offset, magic = DUCKDB_MAGIC
    try:
        fd = open_file(path)
    except OSError:
        return False
    try:
        return os.pread(fd, len(magic), offset) == magic
    finally:
        os.close(fd)


@contextmanager
def _duckdb_lock(path: Path, log: Callable[[str], None], wait_s: float) -> Iterator[int | None]:
    """DuckDB's own lock on the history (a POSIX record lock on the whole file, which every DuckDB
    client takes when it opens the file: read-write exclusive, read-only shared), held while the
    update is made and renamed over the file: another client (a notebook, `duckdb` on the command
    line) that has the file open keeps it, and the collect waits for up to wait_s seconds, then
    fails with its name, instead of replacing the file under it. Yields the locked file's
    descriptor (None where there is no history yet), to copy from: a second open and close of
    the file in this process would drop the lock (POSIX)."""
    try:
        fd = open_file(path, os.O_RDWR)  # _history_file: no link
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise HistoryError(f"{path}: not updated ({exc.strerror or exc})") from None
    try:
        try:
            client = "another DuckDB client"  # DuckDB's own record lock (lockf), its holder as DuckDB names it
            held = f"{client} has held it open"
            _take(fd, path, wait_s, log, f"{client} has it open", held, fcntl.lockf, lambda _: _duckdb_holder(path))
        except OSError as exc:
            raise HistoryError(f"{path}: not updated (its lock: {exc.strerror or exc})") from None
        yield fd if os.fstat(fd).st_size else None  # 0 bytes: an interrupted write of an older hpcfsdp
    finally:
        os.close(fd)


def _duckdb_holder(path: Path) -> str:
    """Who holds the history, as DuckDB tells it ("... held in /usr/bin/python3 (PID 4242)")."""
    import duckdb

    try:
        duckdb.connect(str(path), read_only=True).close()
    except duckdb.Error as exc:
        found = re.search(r"held in (.*?)(\. See|$)", str(exc).splitlines()[0])
        if found:
            return found.group(1)
    return "a process that holds its lock"


def _copy_from(fd: int, target: int) -> None:
    """Copy the open file fd into the open, empty file target, from its start."""
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        os.pwrite(target, chunk, offset)
        offset += len(chunk)


def _take(
    fd: int,
    path: Path,
    wait_s: float,
    log: Callable[[str], None],
    waiting: str,
    held: str,
    lock: Callable[[int, int], Any] = fcntl.flock,
    holder: Callable[[int], str] = holder_words,
) -> None:
    """files.take_lock on one of the history's two locks: the line said once while it waits names
    who has it (`waiting`), and past the wait a HistoryError does (`held`), both with its holder."""
    try:
        take_lock(
            fd,
            path,
            wait_s,
            lambda words: log(f"waiting up to {wait_s:g} s for the history {path}: {waiting} ({words})"),
            lock=lock,
            holder=holder,
        )
    except LockBusy as exc:
        raise HistoryError(f"{path}: not updated ({held} for {wait_s:g} s: {exc.holder})") from None


@contextmanager
def _history_lock(path: Path, log: Callable[[str], None], wait_s: float) -> Iterator[None]:
    """history.duckdb.lock beside the history: one collect's update at a time (files.open_lock:
    never a link, nor a file hpcfsdp did not make)."""
    try:
        fd = open_lock(path.with_name(path.name + ".lock"))
    except (RecordError, OwnershipError) as exc:
        raise HistoryError(f"{path}: not updated: {exc}") from None
    try:
        _take(fd, path, wait_s, log, "another collect updates it", "another collect has held its lock")
        write_lock_note(fd, f"collect: pid {os.getpid()} of {user_name(os.geteuid())} on {os.uname().nodename}")
        try:
            yield
        finally:
            write_lock_note(fd, "")
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
