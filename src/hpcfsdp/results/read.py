"""Reading a sweep's records into one DataFrame, and labelling its cells.

Reading is never fatal: a record that cannot be read is named by path and skipped, and a cell
that was planned (manifest.json, cells/<id>/spec.json) but left no record is listed as missing.
Labelling adds each cell's `variant` (strategy and varied knobs) and `setting` (what a table
holds fixed), and averages repeats into configurations (`ok_configs`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..contracts.files import RecordError, garbage_collection_paused, read_json_object
from ..contracts.record import MISSING, RECORD_NAME, SPEC_NAME, memory_in_stage_order
from ..contracts.recordspec import BATCH_SEARCH_FIELDS, STRATEGY_KNOBS, spec_problem
from ..contracts.validity import invalid_reasons, record_state
from ..progress import Progress
from ..sweep.folder.layout import (
    CELLS_DIR,
    MANIFEST_NAME,
    cell_dir,
    cell_files,
    planned_cell_ids,
    unusable_cell_folders,
)

METRICS = ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib")
INVALID = "invalid_reasons"  # the column of each record's invalid_reasons (contracts/validity.py): [] when trusted
SPREAD = ("tokens_per_s_spread.p10", "tokens_per_s_spread.p90")  # tokens/s per GPU at the slow and fast steps


# Optional per-step fractions and utilisation: averaged over repeats like the metrics.
EXTRA_NUMBERS = (
    "data_time_fraction",
    "comm_exposed_fraction",
    "gpu_util_mean",
    "gpu_hours_per_billion_tokens",
    "joules_per_token",
    "memory_capacity_gib",
    *SPREAD,
)


# Short names for table headers and plot panel titles.
SHORT = {
    "batch_size": "batch",
    "grad_accum": "accum",
    "activation_checkpointing": "ckpt",
    "seq_len": "seq",
    "gpus_per_node": "gpus/node",
}


@dataclass
class Collection:
    """The records of one sweep folder, and what could not be read or has no record yet."""

    frame: pd.DataFrame  # one row per readable record; spec fields are top-level columns
    unreadable: list[str]  # one message per bad file, naming its path and the problem
    missing: pd.DataFrame = field(default_factory=pd.DataFrame)  # planned cells without a record
    spec_fields: tuple[str, ...] = ()
    unplanned: list[str] = field(default_factory=list)  # one line per record of a cell no submit of the folder made

    @property
    def cells(self) -> pd.DataFrame:
        """Records and missing cells together: one row per cell of the sweep."""
        parts = [part for part in (self.frame, self.missing) if not part.empty]
        return pd.concat(parts, ignore_index=True) if len(parts) > 1 else (parts[0] if parts else pd.DataFrame())


def load_records(
    sweep_dir: str | Path,
    scheduler_states: dict[str, str] | None = None,
    progress: Progress | None = None,
    recorded: list[str] | None = None,
) -> Collection:
    """Every record under <sweep_dir>/cells, read as status and submit read them (record.py);
    unreadable ones are listed by path, never fatal, and no link out of the sweep folder is followed.

    scheduler_states (cell id -> Slurm's word for its job: PENDING, RUNNING, CANCELLED, ...), where
    the caller asked the scheduler, names the state of cells that have no record yet. progress
    counts the records read. recorded: the cells with a record (layout.cell_ids_with), where the
    caller listed them already (a stat of each cell's record: a tenth of a second at 10,000)."""
    sweep_dir = Path(sweep_dir)
    cells = sweep_dir / CELLS_DIR
    paths = (
        cell_files(sweep_dir, RECORD_NAME)
        if recorded is None
        else [Path(cells, cell_id, RECORD_NAME) for cell_id in recorded]
    )
    if progress:
        progress.count(len(paths))
    unreadable = list(unusable_cell_folders(sweep_dir).values())
    with garbage_collection_paused():  # some million small dicts and lists, none in a cycle
        read = _read_in_two(paths, sweep_dir, progress)
    unreadable.extend(read.problems)
    manifest = _read_json(sweep_dir / MANIFEST_NAME, sweep_dir, unreadable, "manifest")
    missing = _missing_cells(sweep_dir, manifest, {path.parent.name for path in paths}, unreadable, scheduler_states)
    rows, unplanned = _planned_rows(sweep_dir, read.rows, manifest)
    return Collection(pd.DataFrame(rows), unreadable, missing, tuple(read.spec_fields), unplanned)


def _planned_rows(
    sweep_dir: Path, rows: list[dict[str, Any]], manifest: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of cells a submit (or tune) of this folder made, and a line for each other: a
    cell folder added by hand or by someone else, whose record is its own but no plan's (issue
    51, item 6). Those are never ranked, tabled, plotted or put in the history. A folder without a
    manifest.json (records of `hpcfsdp run` by hand) has no plan to hold them to: all are its own."""
    if not (sweep_dir / MANIFEST_NAME).exists():
        return rows, []
    kept = [row for row in rows if row["cell_id"] in manifest]
    if len(kept) == len(rows):
        return rows, []
    lines = [
        f"{sweep_dir / CELLS_DIR / row['cell_id'] / RECORD_NAME}: cell {row['cell_id']} is in no plan of this "
        f"folder ({MANIFEST_NAME} names it not): listed apart, never ranked"
        for row in rows
        if row["cell_id"] not in manifest
    ]
    return kept, lines


SPLIT_MIN_RECORDS = 2_000  # fewer records are read in this process alone: a fork costs more than it saves


@dataclass
class _Read:
    """Some records read: a row for each usable one and a line for each that is not, in their
    paths' order, and the spec fields they name, in the order they first appear."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    spec_fields: dict[str, None] = field(default_factory=dict)

    def then(self, later: _Read) -> _Read:
        """These records, then `later`'s: what reading all their paths in one go gives."""
        return _Read(self.rows + later.rows, self.problems + later.problems, {**self.spec_fields, **later.spec_fields})


def _read_in_two(paths: list[Path], sweep_dir: Path, progress: Progress | None) -> _Read:
    """The records at paths, the second half read by a forked worker while this process reads the
    first (the machine's other core is idle until the figures are drawn: a third of a second less
    at 10,000 records). The same rows and problems in the same order as one process reading them
    all; one process where the records are few, there is one core, or the worker could not run."""
    if len(paths) < SPLIT_MIN_RECORDS or (os.cpu_count() or 1) < 2:
        return _read_rows(paths, sweep_dir, progress)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    half = len(paths) // 2
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        try:
            later = pool.submit(_read_rows, paths[half:], sweep_dir)
        except OSError:  # no fork (a process limit): this process reads them all
            return _read_rows(paths, sweep_dir, progress)
        first = _read_rows(paths[:half], sweep_dir, progress)
        try:
            second = later.result()
        except BrokenProcessPool:  # the worker was killed: this process reads its half too
            return first.then(_read_rows(paths[half:], sweep_dir, progress))
    if progress:
        progress.advance(len(paths) - half)
    return first.then(second)


def _read_rows(paths: list[Path], sweep_dir: Path, progress: Progress | None = None) -> _Read:
    read = _Read()
    for path in paths:
        if progress:
            progress.advance()
        state = record_state(path, root=sweep_dir, cell_id=path.parent.name)
        if state.problem:
            read.problems.append(state.problem)
        elif state.record is not None:
            read.spec_fields.update(dict.fromkeys(state.record["spec"]))
            # The folder names the cell, never the record's own cell_id: a value that becomes
            # paths (export, accounting) and names in reports must not come from inside a file.
            flat = _flatten(state.record)
            flat.pop("cell_id", None)
            read.rows.append({"cell_id": path.parent.name, **flat, INVALID: invalid_reasons(state.record)})
    return read


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    """Spec fields become top-level columns so tables can group by any of them; other nested
    objects become dotted columns (memory.end.peak_allocated_gib, versions.torch; memory's stages
    in run order, not the file's sorted order). Lists such as `losses` stay lists. The traceback
    and the ranks' resources stay in the record file."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        if key in ("spec", "traceback", "ranks"):
            continue
        if isinstance(value, dict):
            _add_dotted(row, key, memory_in_stage_order(value) if key == "memory" else value)
        else:
            row[key] = value
    row.update(record["spec"])
    return row


def _add_dotted(row: dict[str, Any], prefix: str, mapping: dict[str, Any]) -> None:
    """Dotted names interned: every row's names are then the same strings, which the rows a
    worker of _read_in_two sends back pickle once (half the bytes, half the time). Each name is
    made once per process (_DOTTED), not once per record: some 175 per record."""
    names = _DOTTED.get(prefix) or _DOTTED.setdefault(prefix, {})
    for key, value in mapping.items():
        name = names.get(key) or names.setdefault(key, sys.intern(f"{prefix}.{key}"))
        if isinstance(value, dict):
            _add_dotted(row, name, value)
        else:
            row[name] = value


_DOTTED: dict[str, dict[str, str]] = {}  # prefix -> key -> the interned "prefix.key"


def _missing_cells(
    sweep_dir: Path,
    manifest: dict[str, Any],
    recorded: set[str],
    problems: list[str],
    scheduler_states: dict[str, str] | None,
) -> pd.DataFrame:
    """Cells named by the manifest or by a spec.json that have no result.json (yet)."""
    planned = set(manifest) | set(planned_cell_ids(sweep_dir))
    rows = []
    for cell_id in sorted(planned - recorded):
        spec = _planned_spec(cell_dir(sweep_dir, cell_id) / SPEC_NAME, sweep_dir, problems)
        entry = manifest.get(cell_id)
        job = entry.get("job_id") if isinstance(entry, dict) else None
        reason = f"no {RECORD_NAME}" + (f" (Slurm job {job}: {_job_state(cell_id, scheduler_states)})" if job else "")
        rows.append({"cell_id": cell_id, "status": MISSING, "error": reason, "slurm.job_id": job, **spec})
    return pd.DataFrame(rows)


def _job_state(cell_id: str, scheduler_states: dict[str, str] | None) -> str:
    if scheduler_states is None:
        return "pending, running or lost; `hpcfsdp status` asks Slurm"
    return scheduler_states.get(cell_id) or "not in the queue, state unknown without accounting"


def _planned_spec(spec_path: Path, sweep_dir: Path, problems: list[str]) -> dict[str, Any]:
    """The spec of a cell's spec.json; {} when there is none, or (with a note in problems) when
    it is not usable: the cell is still listed as missing, without its spec fields."""
    spec = _read_json(spec_path, sweep_dir, problems, "cell spec").get("spec")
    if spec is None:
        return {}
    problem = spec_problem(spec)
    if problem:
        problems.append(f"{spec_path}: {problem}")
        return {}
    return spec


def _read_json(path: Path, sweep_dir: Path, problems: list[str], kind: str) -> dict[str, Any]:
    """A JSON object from path; {} when absent, and a note in problems when it is not readable."""
    try:
        return read_json_object(path, root=sweep_dir, kind=kind)
    except FileNotFoundError:
        return {}
    except RecordError as exc:
        problems.append(str(exc))
        return {}


@dataclass(frozen=True)
class Cells:
    """Every cell of a sweep with two label columns added.

    `variant`: the strategy, plus any strategy knob varied within it ("fsdp2_zero3 (prefetch_depth=1)").
    `setting`: what a table or plot panel holds fixed: grad_accum, activation_checkpointing and
    any other varied workload field (an ordered categorical, so groups sort naturally).
    """

    frame: pd.DataFrame
    workload: tuple[str, ...]  # spec fields that define the work: all but strategy, its knobs, seed
    fixed: tuple[str, ...]  # the fields a setting holds fixed

    @property
    def ok(self) -> pd.DataFrame:
        """The cells whose figures rank: ok, and no reason not to trust them."""
        return self.frame[self.frame["outcome"] == "ok"]

    @property
    def invalid(self) -> pd.DataFrame:
        """The cells that finished ok with figures that cannot be trusted (contracts/validity.py)."""
        return self.frame[self.frame["outcome"] == INVALID_OUTCOME]


def label_cells(collection: Collection) -> Cells:
    frame = collection.cells.copy()
    spec_fields = collection.spec_fields or ("strategy", "batch_size", "grad_accum", "activation_checkpointing")
    for column in (
        "cell_id",
        "status",
        *spec_fields,
        "strategy",
        "batch_size",
        "grad_accum",
        "activation_checkpointing",
        *METRICS,
        *EXTRA_NUMBERS,
    ):
        if column not in frame:
            frame[column] = None
    for column in (*METRICS, *EXTRA_NUMBERS):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    _fill_added_fields(frame, spec_fields)
    frame["outcome"] = outcomes(frame)
    # How batch_size: auto searched does not change what its cell then measured at the batch it chose.
    workload = tuple(f for f in spec_fields if f not in (*STRATEGY_KNOBS, *BATCH_SEARCH_FIELDS, "strategy", "seed"))
    varied = [f for f in workload if f != "batch_size" and frame[f].nunique() > 1]
    fixed = tuple(dict.fromkeys(("grad_accum", "activation_checkpointing", *varied)))
    frame["variant"] = _variants(frame, [k for k in STRATEGY_KNOBS if k in frame])
    frame["setting"] = _settings(frame, fixed)
    return Cells(frame, workload, fixed)


INVALID_OUTCOME = "invalid"  # an ok record with reasons not to trust it, as the tables show its status


def outcomes(frame: pd.DataFrame) -> pd.Series:
    """Each cell's status as the tables rank it: `invalid` for an ok record that invalid_reasons
    gives reasons for, else the record's status."""
    reasons = frame[INVALID] if INVALID in frame else pd.Series(None, index=frame.index, dtype=object)
    untrusted = reasons.map(lambda r: isinstance(r, list) and bool(r))
    return frame["status"].where(~(untrusted & (frame["status"] == "ok")), INVALID_OUTCOME)


def _fill_added_fields(frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> None:
    """A record written before a spec field existed lacks it; when every other record of the
    sweep has one same value, the old record ran with that behaviour too: fill it in, so the
    record still matches its baseline and lands in the right table."""
    records = frame["status"] != MISSING
    for name in spec_fields:
        values = frame.loc[records, name]
        if values.isna().any() and values.nunique() == 1:
            frame.loc[records & values.isna(), name] = values.dropna().iloc[0]


def _variants(frame: pd.DataFrame, knobs: list[str]) -> pd.Series:
    labels = frame["strategy"].copy()
    for strategy, group in frame.groupby("strategy"):
        varied = [k for k in knobs if group[k].nunique() > 1]
        if varied:
            labels[group.index] = [
                f"{strategy} ({', '.join(f'{k}={value_text(v)}' for k, v in zip(varied, values, strict=False))})"
                for values in frame_rows(group[varied])
            ]
    return labels


def _settings(frame: pd.DataFrame, fixed: tuple[str, ...]) -> pd.Categorical:
    labels = pd.Series(
        [describe(dict(zip(fixed, values, strict=False))) for values in frame_rows(frame[list(fixed)])],
        index=frame.index,
    )
    ordered = frame.assign(_label=labels).sort_values(list(fixed), key=_natural_order, na_position="last")
    natural = ordered["_label"].unique()
    return pd.Categorical(labels, categories=natural, ordered=True)


def _natural_order(column: pd.Series) -> pd.Series:
    """Checkpointing from least to most recomputation; everything else by value."""
    if column.name == "activation_checkpointing":
        return column.map({"none": 0, "selective": 1, "full": 2})
    return column


def frame_rows(frame: pd.DataFrame) -> list[tuple[Any, ...]]:
    """frame's rows as tuples of the values itertuples(index=False) gives, made a column at a time
    (tolist): pandas 3 iterates a column of text (Arrow) one value at a time, some ten times slower,
    and collect walks columns of 10,000 cells' texts."""
    columns = [column.tolist() for _, column in frame.items()]
    return list(zip(*columns, strict=True)) if columns else [()] * len(frame)


def describe(values: dict[str, Any]) -> str:
    """{"grad_accum": 1, "activation_checkpointing": "none"} -> "accum 1, ckpt none"."""
    return ", ".join(f"{SHORT.get(k, k)} {value_text(v)}" for k, v in values.items())


def value_text(value: Any) -> str:
    """A value as a person writes it: 2 not 2.0, 4 significant digits, a dash for nothing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):  # a whole number as one, unless it is too long to read (lr: 1e30 is 1e+30)
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


def ok_configs(cells: Cells, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Ok cells (or `rows` of cells) averaged over repeats (cells whose spec differs only in seed);
    `repeats` counts them."""
    ok = cells.ok if rows is None else rows
    keys = ["variant", *cells.workload]
    numbers = {c: "mean" for c in (*METRICS, *EXTRA_NUMBERS)}
    firsts = {
        c: "first"
        for c in ("strategy", "setting", "cell_id", "device_name", "device_type", "auto_batch", MARK)
        if c in ok
    }
    configs = ok.groupby(keys, dropna=False, sort=False, observed=True).agg({**numbers, **firsts, "status": "size"})
    return configs.rename(columns={"status": "repeats"}).reset_index()


MARK = "not_ranked"  # the figures' word for an invalid cell they draw, dashed ("" for a ranked one)
NOT_UPDATING = "not updating"


def marked(invalid: pd.DataFrame) -> pd.DataFrame:
    """Invalid cells as the figures draw them: every cell is drawn, and one that ranks nowhere says
    why beside its strategy ("not updating": a model that did not train; else "not ranked")."""
    words = invalid[INVALID].map(
        lambda reasons: (
            NOT_UPDATING
            if any("does not update the model" in r or "did not train" in r for r in reasons)
            else "not ranked"
        )
    )
    return invalid.assign(variant=invalid["variant"].astype(str) + ": " + words, **{MARK: words})


def drawn_configs(cells: Cells) -> pd.DataFrame:
    """The figures' configurations: ok_configs, then the invalid cells' (marked), which rank nowhere."""
    ranked = ok_configs(cells).assign(**{MARK: ""})
    if cells.invalid.empty:
        return ranked
    return pd.concat([ranked, ok_configs(cells, marked(cells.invalid))], ignore_index=True)
