"""The rows a sweep adds to the history (results/history.py): one per cell record, in the history's
columns, keyed by its attempt and naming its setup and system; and the Slurm accounting that
collect adds to the records before their rows are made; and the other way, the history's rows as
`hpcfsdp history` shows them (its table and --json).

- A row is keyed by the sweep folder, the cell id and the record's *attempt* (its launch id and
  start time): collecting a sweep again replaces its rows instead of adding them, and a cell rerun
  in the same folder adds a row for the new attempt, keeping the old one.
- The *setup* is a hash of the spec's fields that differ from their defaults, leaving out the
  measurement-only ones (recordspec.MEASUREMENT_FIELDS): cells that differ in steps or seed are one setup.
- The *system* is the Slurm cluster name (else the first host name) and the GPU name.

Login side: pandas only, no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from ..contracts.fields import one_value, told_apart
from ..contracts.files import garbage_collection_paused
from ..contracts.record import ACCOUNTING_KEY
from ..contracts.recordspec import MEASUREMENT_FIELDS
from ..contracts.spec import RunSpec
from .read import INVALID, Collection
from .tables import first_line, slurm_jobs

KEY = ("sweep_dir", "cell_id", "attempt")  # a row: one attempt of one cell of one sweep folder
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
    "started_at": "TIMESTAMPTZ",  # with its zone, UTC: a reader anywhere reads the same moment
    "collected_at": "TIMESTAMPTZ",
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
    "tokens_per_s_per_gpu": "DOUBLE",  # the timed window's mean (a median step in rows before tokens_per_s_p10 existed)
    "tokens_per_s_p10": "DOUBLE",  # the record's tokens_per_s_spread
    "tokens_per_s_p90": "DOUBLE",
    "invalid_reasons": "VARCHAR",  # contracts/validity.py's reasons, "; "-joined; null when its figures can be trusted
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
    "tokens_per_s_spread.p10": "tokens_per_s_p10",
    "tokens_per_s_spread.p90": "tokens_per_s_p90",
}
_DEFAULTS = RunSpec().to_dict()


def utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# ---------------------------------------------------------------------------------------------
# Setups


def spec_values(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A spec as plain values: absent (None, NaN) fields dropped, and integers that a DataFrame
    column turned into floats (4096.0 beside an older record without the field) made integers again."""
    return {name: plain for name, value in spec.items() if (plain := _spec_value(name, value)) is not _ABSENT}


def _spec_columns(names: list[str], columns: list[list[Any]]) -> list[list[Any]]:
    """spec_values of each row of these columns (one list of values per field), a column at a time:
    each field's values as plain values, _ABSENT where the row has none."""
    return [
        [value if type(value) in _PLAIN else _spec_value(name, value) for value in values]
        for name, values in zip(names, columns, strict=True)
    ]


def _canonical_columns(names: list[str], plain: list[list[Any]]) -> tuple[list[str], list[str]]:
    """Each row's spec and setup fields (_spec_columns' rows) as _canonical spells them, the same
    bytes, made a column at a time: a field's `"name":value` text is spelt once per distinct value,
    not once per row (10,000 records hold some hundred distinct values), and a row's text is its
    fields' texts joined in sorted order. Returns (specs, setups)."""
    spec_parts, setup_parts = [], []
    for name, values in sorted(zip(names, plain, strict=True), key=lambda pair: pair[0]):
        if one_value(values):  # most fields: one value in every row
            spec, setup = _field_texts(name, values[0])
            spec_parts.append([spec] * len(values))
            setup_parts.append([setup] * len(values))
            continue
        keys = told_apart(values)
        try:  # each distinct value spelt once, then every row's text looked up (in C)
            spelt = {key: _field_texts(name, key[1]) for key in dict.fromkeys(keys)}
            column = list(map(spelt.__getitem__, keys))
        except TypeError:  # an unhashable value (a list in a hand-edited spec.json): spell each
            column = [_field_texts(name, value) for value in values]
        spec_parts.append([spec for spec, _ in column])
        setup_parts.append([setup for _, setup in column])
    return _joined(spec_parts), _joined(setup_parts)


def _field_texts(name: str, value: Any) -> tuple[str, str]:
    """A field's text in a spec's canonical JSON, and in its setup's ("" where it is left out)."""
    if value is _ABSENT:
        return "", ""
    text = f"{_CANONICAL.encode(name)}:{_CANONICAL.encode(value)}"
    return text, text if _in_setup(name, value) else ""


def _joined(parts: list[list[str]]) -> list[str]:
    """Each row's field texts (empty where the field is left out) as one JSON object."""
    return ["{" + ",".join(filter(None, row)) + "}" for row in zip(*parts, strict=True)]


_ABSENT = object()  # _spec_value of None and NaN: the field is left out
_PLAIN = {str, bool, int}  # a value of these types (not subclasses) is its own _spec_value


def _spec_value(name: str, value: Any) -> Any:
    if type(value) in _PLAIN:
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _ABSENT
    if hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if type(_DEFAULTS.get(name)) is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def setup_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that make the setup: those that differ from RunSpec's defaults (so a field added
    by a later hpcfsdp, at its default, keeps every setup as it was), less the measurement-only ones."""
    return _setup_fields(spec_values(spec))


def setup_key(spec: Mapping[str, Any]) -> str:
    return _setup_key(_canonical(setup_fields(spec)))


def _setup_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in sorted(values.items()) if _in_setup(name, value)}


def _in_setup(name: str, value: Any) -> bool:
    """Whether a spec field makes the setup: not measurement-only, and not at RunSpec's default."""
    return name not in MEASUREMENT_FIELDS and (name not in _DEFAULTS or value != _DEFAULTS[name])


# What json.dumps(fields, sort_keys=True, separators=(",", ":")) makes anew for each call: one, for
# every field text and setup of the history's rows.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _canonical(fields: dict[str, Any]) -> str:
    return _CANONICAL.encode(fields)


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


def accounting_jobs(frame: pd.DataFrame) -> dict[str, str]:
    """cell id -> Slurm job, of the records that ran under Slurm and have no accounting yet."""
    if frame.empty:
        return {}
    known = frame.reindex(columns=[f"{ACCOUNTING_KEY}.state"]).iloc[:, 0].map(pd.notna)
    return {
        cell_id: job
        for cell_id, job, has in zip(frame["cell_id"].tolist(), slurm_jobs(frame), known.tolist(), strict=True)
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
    """One row per readable record of the collection, in the history's columns. Made with the
    garbage collector paused: some hundred thousand lists and tuples, none in a cycle (a third of
    the time at 10,000 records went to collections that freed nothing)."""
    with garbage_collection_paused():
        return _history_rows(collection, sweep_dir)


def _history_rows(collection: Collection, sweep_dir: Path) -> pd.DataFrame:
    frame = collection.frame
    if frame.empty:
        return pd.DataFrame({name: pd.Series(dtype=object) for name in COLUMNS})

    def column(name: str) -> pd.Series:
        return frame[name] if name in frame else pd.Series([None] * len(frame), index=frame.index, dtype=object)

    names = list(collection.spec_fields)
    plain = _spec_columns(names, [frame[name].tolist() for name in names])  # column-wise: faster than row dicts
    specs, fields = _canonical_columns(names, plain)
    setups: dict[str, str] = {}  # canonical setup fields -> setup key: some hundred distinct setups
    rows = pd.DataFrame(index=frame.index)
    rows["sweep_dir"] = str(Path(sweep_dir).resolve())
    rows["cell_id"] = frame["cell_id"]
    rows["attempt"] = [
        attempt_of(launch, started)
        for launch, started in zip(column("launch_id").tolist(), column("started_at").tolist(), strict=True)
    ]
    rows["sweep"] = column("sweep")
    rows["setup"] = [setups.get(text) or setups.setdefault(text, _setup_key(text)) for text in fields]
    rows["setup_fields"] = fields
    rows["spec"] = specs
    rows["cluster"] = [
        system_of(c, h)
        for c, h in zip(column("slurm.cluster_name").tolist(), column("hostnames").tolist(), strict=True)
    ]
    rows["gpu"] = column("device_name")
    rows["hostnames"] = column("hostnames").map(lambda hs: ",".join(map(str, hs)) if isinstance(hs, list) else None)
    rows["started_at"] = pd.to_datetime(pd.to_numeric(column("started_at"), errors="coerce"), unit="s")
    rows["collected_at"] = pd.Timestamp(utc_now())
    rows["slurm_job_id"] = slurm_jobs(frame)
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
        values = plain[names.index(name)] if name in names else [_ABSENT] * len(frame)
        rows[name] = [None if value is _ABSENT else value for value in values]
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
    rows["invalid_reasons"] = column(INVALID).map(lambda r: "; ".join(r) if isinstance(r, list) and r else None)
    return rows[list(COLUMNS)].reset_index(drop=True)


# Columns of `hpcfsdp history`'s table: (history column, header).
HISTORY_COLUMNS = (
    ("started_at", "started (UTC)"),
    ("sweep", "sweep"),
    ("cluster", "cluster"),
    ("gpu", "gpu"),
    ("model", "model"),
    ("strategy", "strategy"),
    ("batch_size", "batch"),
    ("grad_accum", "accum"),
    ("world_size", "ranks"),
    ("status", "status"),
    ("tokens_per_s_per_gpu", "tokens/s/gpu"),
    ("mfu", "MFU"),
    ("peak_memory_gib", "peak GiB"),
    ("torch_version", "torch"),
    ("setup", "setup"),
    ("cell_id", "cell"),
)


def history_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The runs of a history (History.select) as `hpcfsdp history` prints them."""
    table = rows[[column for column, _ in HISTORY_COLUMNS]].rename(columns=dict(HISTORY_COLUMNS))
    table["started (UTC)"] = table["started (UTC)"].dt.strftime("%Y-%m-%d %H:%M")
    return table


def _utc_text(moment: Any) -> str | None:
    """A history time (stored as UTC without a zone) as ISO 8601 that says it: ...T12:00:00+00:00."""
    if pd.isna(moment):
        return None
    stamp = pd.Timestamp(moment)
    return (stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")).isoformat()


def history_document(rows: pd.DataFrame) -> dict[str, Any]:
    """`history --json`: the runs as the table lists them, as values (started_at ISO 8601 with its
    offset, +00:00),
    with each run's Slurm job, git commit, sweep folder and the first line of its error."""
    shown = [column for column, _ in HISTORY_COLUMNS]
    extra = ("slurm_job_id", "git_commit", "sweep_dir", "error")
    runs = [
        {
            **{column: row[column] for column in shown},
            "started_at": _utc_text(row["started_at"]),
            "job_id": row["slurm_job_id"],
            "git_commit": row["git_commit"],
            "sweep_dir": row["sweep_dir"],
            "reason": None if first_line(row["error"]) == "-" else first_line(row["error"]),
        }
        for row in rows[[*shown, *extra]].to_dict("records")
    ]
    return {"runs": runs, "count": len(runs), "setups": int(rows["setup"].nunique())}


def medians_by_setup(rows: pd.DataFrame) -> pd.DataFrame:
    """Ok rows grouped by system and setup: median tokens/s per GPU and peak memory, the number of
    runs, and the setup's fields (of its latest run). For `hpcfsdp history --set-reference`."""
    ok = rows[(rows["status"] == "ok") & rows["tokens_per_s_per_gpu"].notna() & rows["invalid_reasons"].isna()]
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
