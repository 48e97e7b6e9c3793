"""The history store: one row per cell record, appended by every `hpcfsdp collect` (DuckDB).

A sweep folder stands alone; the history remembers what each *setup* gave on each *system* across
sweeps, so that `collect` can tell a regression (results/regressions.py) and `hpcfsdp history`
can list and filter runs. docs/history.md describes the columns.

- A row is keyed by the sweep folder, the cell id and the record's *attempt* (its launch id and
  start time): collecting a sweep again replaces its rows instead of adding them, and a cell rerun
  in the same folder adds a row for the new attempt, keeping the old one.
- The *setup* is a hash of the spec's fields that differ from their defaults, leaving out the
  measurement-only ones (spec.MEASUREMENT_FIELDS): cells that differ in steps or seed are one setup.
- The *system* is the Slurm cluster name (else the first host name) and the GPU name.

Login side: DuckDB and pandas only, no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import UserError
from ..fields import SpecError
from ..record import ACCOUNTING_KEY, slurm_job_of
from ..spec import MEASUREMENT_FIELDS, RunSpec
from .read import Collection

TABLE = "runs"
KEY = ("sweep_dir", "cell_id", "attempt")
# name -> DuckDB type, in table order. A later hpcfsdp may add columns: History adds them to an older file.
COLUMNS: dict[str, str] = {
    "sweep_dir": "VARCHAR",  # the sweep folder, absolute
    "cell_id": "VARCHAR",
    "attempt": "VARCHAR",  # launch id @ start time: one per run of the cell
    "sweep": "VARCHAR",
    "setup": "VARCHAR",
    "setup_fields": "VARCHAR",  # JSON: the fields the setup hashes
    "spec": "VARCHAR",  # JSON: the full spec
    "cluster": "VARCHAR",
    "gpu": "VARCHAR",
    "partition": "VARCHAR",
    "hostnames": "VARCHAR",
    "started_at": "TIMESTAMP",  # UTC
    "collected_at": "TIMESTAMP",  # UTC
    "duration_s": "DOUBLE",
    "model": "VARCHAR",
    "strategy": "VARCHAR",
    "batch_size": "BIGINT",
    "grad_accum": "BIGINT",
    "seq_len": "BIGINT",
    "activation_checkpointing": "VARCHAR",
    "precision": "VARCHAR",
    "nodes": "BIGINT",
    "world_size": "BIGINT",
    "status": "VARCHAR",
    "stage": "VARCHAR",
    "error": "VARCHAR",
    "tokens_per_s_per_gpu": "DOUBLE",
    "mfu": "DOUBLE",
    "peak_memory_gib": "DOUBLE",
    "step_time_s": "DOUBLE",
    "final_loss": "DOUBLE",
    "hpcfsdp_version": "VARCHAR",
    "torch_version": "VARCHAR",
    "transformers_version": "VARCHAR",
    "cuda_version": "VARCHAR",
    "nccl_version": "VARCHAR",
    "driver_version": "VARCHAR",
    "git_commit": "VARCHAR",
    "slurm_job_id": "VARCHAR",
    "elapsed_s": "DOUBLE",
    "queue_wait_s": "DOUBLE",
    "energy_j": "DOUBLE",
}
# Record field (flattened, as collect's frame has it) -> history column, where the names differ.
RECORD_COLUMNS = {
    "slurm.job_partition": "partition",
    "versions.hpcfsdp": "hpcfsdp_version",
    "versions.torch": "torch_version",
    "versions.transformers": "transformers_version",
    "versions.cuda": "cuda_version",
    "versions.nccl": "nccl_version",
    "versions.driver": "driver_version",
    "slurm_accounting.elapsed_s": "elapsed_s",
    "slurm_accounting.queue_wait_s": "queue_wait_s",
    "slurm_accounting.consumed_energy_j": "energy_j",
}
_DEFAULTS = RunSpec().to_dict()


class HistoryError(UserError, RuntimeError):
    """The history file cannot be opened (absent, another process holds it, not a DuckDB file)."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# ---------------------------------------------------------------------------------------------
# Setups


def spec_values(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A spec as plain values: absent (None, NaN) fields dropped, and integers that a DataFrame
    column turned into floats (4096.0 beside an older record without the field) made integers again."""
    out = {}
    for name, value in spec.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if hasattr(value, "item"):  # a numpy scalar
            value = value.item()
        default = _DEFAULTS.get(name)
        if type(default) is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        out[name] = value
    return out


def setup_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that make the setup: those that differ from RunSpec's defaults (so a field added
    by a later hpcfsdp, at its default, keeps every setup as it was), less the measurement-only ones."""
    return _setup_fields(spec_values(spec))


def setup_key(spec: Mapping[str, Any]) -> str:
    return _setup_key(_canonical(setup_fields(spec)))


def _setup_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {
        name: value
        for name, value in sorted(values.items())
        if name not in MEASUREMENT_FIELDS and (name not in _DEFAULTS or value != _DEFAULTS[name])
    }


def _canonical(fields: dict[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _setup_key(canonical: str) -> str:
    return hashlib.sha1(canonical.encode()).hexdigest()[:12]


def attempt_of(launch_id: Any, started_at: Any) -> str:
    """One run of a cell: its launch id (Slurm job and restart, or torchrun's run) and start time."""
    launch = launch_id if isinstance(launch_id, str) and launch_id else "-"
    started = f"{started_at:.6f}" if isinstance(started_at, (int, float)) and not math.isnan(started_at) else "-"
    return f"{launch}@{started}"


def system_of(slurm_cluster: Any, hostnames: Any) -> str | None:
    """The Slurm cluster's name; outside Slurm, the (first) host the cell ran on."""
    if isinstance(slurm_cluster, str) and slurm_cluster:
        return slurm_cluster
    if isinstance(hostnames, list) and hostnames:
        return str(hostnames[0])
    return None


# ---------------------------------------------------------------------------------------------
# Rows


SLURM_ID_COLUMNS = ("slurm.job_id", "slurm.array_job_id", "slurm.array_task_id")


def _slurm_jobs(frame: pd.DataFrame) -> list[str | None]:
    """Each row's Slurm job (record.slurm_job_of), from the frame's dotted columns."""
    ids = frame.reindex(columns=list(SLURM_ID_COLUMNS))
    keys = ("job_id", "array_job_id", "array_task_id")
    return [slurm_job_of(dict(zip(keys, row, strict=True))) for row in ids.itertuples(index=False)]


def accounting_jobs(frame: pd.DataFrame) -> dict[str, str]:
    """cell id -> Slurm job, of the records that ran under Slurm and have no accounting yet."""
    if frame.empty:
        return {}
    known = frame.reindex(columns=[f"{ACCOUNTING_KEY}.state"]).iloc[:, 0].map(pd.notna)
    return {
        cell_id: job
        for cell_id, job, has in zip(frame["cell_id"], _slurm_jobs(frame), known, strict=True)
        if job and not has
    }


def merge_accounting(frame: pd.DataFrame, added: dict[str, dict[str, Any]]) -> None:
    """Put accounting just added to records (cell id -> fields) into the collection's frame too."""
    if not added:
        return
    extra = pd.DataFrame.from_dict(added, orient="index").add_prefix(f"{ACCOUNTING_KEY}.")
    for column in extra:
        values = frame["cell_id"].map(extra[column])
        frame[column] = values.combine_first(frame[column]) if column in frame else values


def history_rows(collection: Collection, sweep_dir: Path) -> pd.DataFrame:
    """One row per readable record of the collection, in the history's columns."""
    frame = collection.frame
    if frame.empty:
        return pd.DataFrame({name: pd.Series(dtype=object) for name in COLUMNS})

    def column(name: str) -> pd.Series:
        return frame[name] if name in frame else pd.Series([None] * len(frame), index=frame.index, dtype=object)

    names = list(collection.spec_fields)
    columns = [frame[name].tolist() for name in names]  # column-wise: far faster than row dicts of a wide frame
    specs = [spec_values(dict(zip(names, values, strict=True))) for values in zip(*columns, strict=True)]
    rows = pd.DataFrame(index=frame.index)
    rows["sweep_dir"] = str(Path(sweep_dir).resolve())
    rows["cell_id"] = frame["cell_id"]
    rows["attempt"] = [
        attempt_of(launch, started) for launch, started in zip(column("launch_id"), column("started_at"), strict=True)
    ]
    rows["sweep"] = column("sweep")
    fields = [_canonical(_setup_fields(spec)) for spec in specs]
    rows["setup"] = [_setup_key(canonical) for canonical in fields]
    rows["setup_fields"] = fields
    rows["spec"] = [_canonical(spec) for spec in specs]
    rows["cluster"] = [system_of(c, h) for c, h in zip(column("slurm.cluster_name"), column("hostnames"), strict=True)]
    rows["gpu"] = column("device_name")
    rows["hostnames"] = column("hostnames").map(lambda hs: ",".join(map(str, hs)) if isinstance(hs, list) else None)
    rows["started_at"] = pd.to_datetime(pd.to_numeric(column("started_at"), errors="coerce"), unit="s")
    rows["collected_at"] = pd.Timestamp(utc_now())
    rows["slurm_job_id"] = _slurm_jobs(frame)
    rows["error"] = column("error").map(lambda e: str(e).splitlines()[0][:500] if isinstance(e, str) and e else None)
    for name in (
        "model",
        "strategy",
        "batch_size",
        "grad_accum",
        "seq_len",
        "activation_checkpointing",
        "precision",
        "nodes",
    ):
        rows[name] = [spec.get(name) for spec in specs]
    for name in (
        "duration_s",
        "world_size",
        "status",
        "stage",
        "tokens_per_s_per_gpu",
        "mfu",
        "peak_memory_gib",
        "step_time_s",
        "final_loss",
        "git_commit",
    ):
        rows[name] = column(name)
    for field, name in RECORD_COLUMNS.items():
        rows[name] = column(field)
    return rows[list(COLUMNS)].reset_index(drop=True)


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


class History:
    """The DuckDB file; use as a context manager. Read-only for `hpcfsdp history` (it must exist);
    collect writes through `updated_history`, never into the file itself."""

    def __init__(self, path: Path, read_only: bool = False):
        try:
            import duckdb
        except ImportError:  # a dependency, but an image without network may lack it: collect carries on
            raise HistoryError(f"{path}: duckdb is not installed (pip install duckdb)") from None
        self.path = Path(path)
        if read_only and not self.path.is_file():
            raise HistoryError(
                f"{self.path}: no history here yet (every `hpcfsdp collect` appends to it; "
                "--history PATH names another)"
            )
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except (OSError, duckdb.Error) as exc:  # no permission, not a DuckDB file
            raise HistoryError(f"{self.path}: cannot open ({str(exc).splitlines()[0]})") from None
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
        present = {
            row[0]
            for row in self._run("SELECT column_name FROM information_schema.columns WHERE table_name = ?", [TABLE])
        }
        for name, kind in COLUMNS.items():
            if name not in present:  # a file written by an older hpcfsdp
                self._run(f"ALTER TABLE {TABLE} ADD COLUMN {name} {kind}")

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
                 AND r.gpu IS NOT DISTINCT FROM c.gpu AND r.started_at < coalesce(c.started_at, c.collected_at)
                WHERE r.status = 'ok' AND r.tokens_per_s_per_gpu IS NOT NULL
                  AND NOT EXISTS (SELECT 1 FROM current_rows x
                                  WHERE x.sweep_dir = r.sweep_dir AND x.cell_id = r.cell_id AND x.attempt = r.attempt)
                GROUP BY c.sweep_dir, c.cell_id, c.attempt""").df()
        finally:
            self.con.unregister("current_rows")
        return found if not found.empty else empty


def medians_by_setup(rows: pd.DataFrame) -> pd.DataFrame:
    """Ok rows grouped by system and setup: median tokens/s per GPU and peak memory, the number of
    runs, and the setup's fields (of its latest run). For `hpcfsdp history --set-reference`."""
    ok = rows[(rows["status"] == "ok") & rows["tokens_per_s_per_gpu"].notna()]
    if ok.empty:
        return pd.DataFrame(
            columns=["cluster", "gpu", "setup", "setup_fields", "tokens_per_s_per_gpu", "peak_memory_gib", "runs"]
        )
    ok = ok.sort_values("started_at", na_position="first")
    groups = ok.groupby(["cluster", "gpu", "setup"], dropna=False, sort=True)
    return groups.agg(
        setup_fields=("setup_fields", "last"),
        tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "median"),
        peak_memory_gib=("peak_memory_gib", "median"),
        runs=("cell_id", "size"),
    ).reset_index()


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
    import duckdb

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HistoryError(f"{path}: not updated ({exc.strerror or exc})") from None
    with _history_lock(path, log, LOCK_WAIT_S if wait_s is None else wait_s):
        scratch = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            if path.is_file() and path.stat().st_size:  # 0 bytes: an interrupted write of an older hpcfsdp
                shutil.copyfile(path, scratch)
            with History(scratch) as store:
                yield store
                store.checkpoint()
            with open(scratch, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(scratch, path)
        except (OSError, duckdb.Error, HistoryError) as exc:
            if isinstance(exc, OSError) and exc.strerror:
                reason = exc.strerror
            else:  # DuckDB's message, or History's "<scratch>: cannot open (...)": about the copy
                reason = str(exc).splitlines()[0].removeprefix(f"{scratch}: ").replace(str(scratch), str(path))
            raise HistoryError(f"{path}: not updated ({reason}); the file is as it was") from None
        finally:
            for leftover in (scratch, scratch.with_name(scratch.name + ".wal")):
                leftover.unlink(missing_ok=True)


LOCK_WAIT_S = 120.0  # how long a collect waits for another one's update of the history


@contextmanager
def _history_lock(path: Path, log: Callable[[str], None], wait_s: float) -> Iterator[None]:
    lock_path = path.with_name(path.name + ".lock")
    try:
        handle = open(lock_path, "a+b", buffering=0)  # noqa: SIM115  (closed by the with below); unbuffered: a full disk fails at write, not at close
    except OSError as exc:
        raise HistoryError(f"{path}: not updated (its lock {lock_path}: {exc.strerror or exc})") from None
    with handle:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().decode(errors="replace").strip() or "another process"
                if time.monotonic() >= deadline:
                    raise HistoryError(
                        f"{path}: not updated (another collect has held its lock for {wait_s:g} s: {holder})"
                    ) from None
                if not said:
                    log(f"waiting up to {wait_s:g} s for the history {path}: another collect updates it ({holder})")
                    said = True
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        except OSError:  # a full disk: the note is for people, the lock is the flock
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                handle.seek(0)
                handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
