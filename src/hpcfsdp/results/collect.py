"""Records -> one pandas DataFrame -> tables, plots and a report in <sweep>/report/.

Reading is never fatal: a record that cannot be read is named by path and skipped, and a cell
that was planned (manifest.json, cells/<id>/spec.json) but left no record is listed as missing.
docs/collector.md describes the outputs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from . import plots as plotting
from ..memory import gpu_memory_gib
from ..spec import BATCH_SEARCH_FIELDS, STRATEGY_KNOBS, SpecError
from ..record import (
    MISSING,
    RECORD_NAME,
    SPEC_NAME,
    STATUSES,
    RecordError,
    read_json_object,
    record_state,
    spec_problem,
)
from .report import Section, to_html, to_markdown

# Written by `hpcfsdp submit` and the cell set-up: together they name the cells a sweep planned.
MANIFEST_NAME = "manifest.json"

METRICS = ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib")
# Optional per-step fractions and utilisation: averaged over repeats like the metrics.
EXTRA_NUMBERS = ("data_time_fraction", "comm_exposed_fraction", "gpu_util_mean", "gpu_hours_per_billion_tokens",
                 "joules_per_token", "memory_capacity_gib")
METRIC_NAMES = {"tokens_per_s_per_gpu": "tokens/s/gpu", "mfu": "MFU", "peak_memory_gib": "peak GiB"}
METRIC_FORMATS = {"tokens_per_s_per_gpu": "{:,.0f}", "mfu": "{:.1%}", "peak_memory_gib": "{:.2f}"}

# Short names for table headers and plot panel titles.
SHORT = {"batch_size": "batch", "grad_accum": "accum", "activation_checkpointing": "ckpt", "seq_len": "seq",
         "gpus_per_node": "gpus/node"}
DEFAULT_BASELINES = ("ddp", "fsdp2_zero3")
ROW_LIMIT = 1000  # longest per-cell table in summary.md / index.html; results.csv has every row

# Columns of the printed comparison, in order: (DataFrame column, header).
TABLE_COLUMNS = (
    ("strategy", "strategy"),
    ("batch_size", "batch"),
    ("grad_accum", "accum"),
    ("activation_checkpointing", "ckpt"),
    ("world_size", "ranks"),
    ("status", "status"),
    ("tokens_per_s_per_gpu", "tokens/s/gpu"),
    ("step_time_s", "step s"),
    ("mfu", "MFU"),
    ("peak_memory_gib", "peak GiB"),
    ("final_loss", "final loss"),
    ("cell_id", "cell"),
)


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class Collection:
    """The records of one sweep folder, and what could not be read or has no record yet."""

    frame: pd.DataFrame  # one row per readable record; spec fields are top-level columns
    unreadable: list[str]  # one message per bad file, naming its path and the problem
    missing: pd.DataFrame = field(default_factory=pd.DataFrame)  # planned cells without a record
    spec_fields: tuple[str, ...] = ()

    @property
    def cells(self) -> pd.DataFrame:
        """Records and missing cells together: one row per cell of the sweep."""
        parts = [part for part in (self.frame, self.missing) if not part.empty]
        return pd.concat(parts, ignore_index=True) if len(parts) > 1 else (parts[0] if parts else pd.DataFrame())


def load_records(sweep_dir: str | Path, scheduler_states: dict[str, str] | None = None) -> Collection:
    """Every record under <sweep_dir>/cells, read as status and submit read them (record.py);
    unreadable ones are listed by path, never fatal, and no link out of the sweep folder is followed.

    scheduler_states (cell id -> Slurm's word for its job: PENDING, RUNNING, CANCELLED, ...), where
    the caller asked the scheduler, names the state of cells that have no record yet."""
    sweep_dir = Path(sweep_dir)
    paths = sorted(sweep_dir.glob(f"cells/*/{RECORD_NAME}"))
    unreadable: list[str] = []
    rows, spec_fields = [], {}
    for path in paths:
        state = record_state(path, root=sweep_dir)
        if state.problem:
            unreadable.append(state.problem)
        elif state.record is not None:
            spec_fields.update(dict.fromkeys(state.record["spec"]))
            rows.append({"cell_id": path.parent.name, **_flatten(state.record)})  # the folder names the cell
    missing = _missing_cells(sweep_dir, {path.parent.name for path in paths}, unreadable, scheduler_states)
    return Collection(pd.DataFrame(rows), unreadable, missing, tuple(spec_fields))


def _flatten(record: dict[str, Any]) -> dict[str, Any]:
    """Spec fields become top-level columns so tables can group by any of them; other nested
    objects become dotted columns (memory.end.peak_allocated_gib, versions.torch). Lists such as
    `losses` stay lists. The traceback stays in the record file."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        if key in ("spec", "traceback"):
            continue
        if isinstance(value, dict):
            _add_dotted(row, key, value)
        else:
            row[key] = value
    row.update(record["spec"])
    return row


def _add_dotted(row: dict[str, Any], prefix: str, mapping: dict[str, Any]) -> None:
    for key, value in mapping.items():
        if isinstance(value, dict):
            _add_dotted(row, f"{prefix}.{key}", value)
        else:
            row[f"{prefix}.{key}"] = value


def _missing_cells(sweep_dir: Path, recorded: set[str], problems: list[str],
                   scheduler_states: dict[str, str] | None) -> pd.DataFrame:
    """Cells named by the manifest or by a spec.json that have no result.json (yet)."""
    manifest = _read_json(sweep_dir / MANIFEST_NAME, sweep_dir, problems, "manifest")
    planned = set(manifest) | {path.parent.name for path in sweep_dir.glob(f"cells/*/{SPEC_NAME}")}
    rows = []
    for cell_id in sorted(planned - recorded):
        spec = _planned_spec(sweep_dir / "cells" / cell_id / SPEC_NAME, sweep_dir, problems)
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


# ---------------------------------------------------------------------------------------------
# Labelling: variants and settings


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
        return self.frame[self.frame["status"] == "ok"]


def label_cells(collection: Collection) -> Cells:
    frame = collection.cells.copy()
    spec_fields = collection.spec_fields or ("strategy", "batch_size", "grad_accum", "activation_checkpointing")
    for column in ("cell_id", "status", *spec_fields, "strategy", "batch_size", "grad_accum",
                   "activation_checkpointing", *METRICS, *EXTRA_NUMBERS):
        if column not in frame:
            frame[column] = None
    for column in (*METRICS, *EXTRA_NUMBERS):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    _fill_added_fields(frame, spec_fields)
    # How batch_size: auto searched does not change what its cell then measured at the batch it chose.
    workload = tuple(f for f in spec_fields if f not in (*STRATEGY_KNOBS, *BATCH_SEARCH_FIELDS, "strategy", "seed"))
    varied = [f for f in workload if f != "batch_size" and frame[f].nunique() > 1]
    fixed = tuple(dict.fromkeys(("grad_accum", "activation_checkpointing", *varied)))
    frame["variant"] = _variants(frame, [k for k in STRATEGY_KNOBS if k in frame])
    frame["setting"] = _settings(frame, fixed)
    return Cells(frame, workload, fixed)


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
            labels[group.index] = [f"{strategy} ({', '.join(f'{k}={_text(v)}' for k, v in zip(varied, values))})"
                                   for values in group[varied].itertuples(index=False)]
    return labels


def _settings(frame: pd.DataFrame, fixed: tuple[str, ...]) -> pd.Categorical:
    labels = pd.Series([describe(dict(zip(fixed, values))) for values in frame[list(fixed)].itertuples(index=False)],
                       index=frame.index)
    ordered = frame.assign(_label=labels).sort_values(list(fixed), key=_natural_order, na_position="last")
    natural = ordered["_label"].unique()
    return pd.Categorical(labels, categories=natural, ordered=True)


def _natural_order(column: pd.Series) -> pd.Series:
    """Checkpointing from least to most recomputation; everything else by value."""
    if column.name == "activation_checkpointing":
        return column.map({"none": 0, "selective": 1, "full": 2})
    return column


def describe(values: dict[str, Any]) -> str:
    """{"grad_accum": 1, "activation_checkpointing": "none"} -> "accum 1, ckpt none"."""
    return ", ".join(f"{SHORT.get(k, k)} {_text(v)}" for k, v in values.items())


def _text(value: Any) -> str:
    """A value as a person writes it: 2 not 2.0, 4 significant digits, a dash for nothing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return str(value)


def ok_configs(cells: Cells) -> pd.DataFrame:
    """Ok cells averaged over repeats (cells whose spec differs only in seed); `repeats` counts them."""
    ok = cells.ok
    keys = ["variant", *cells.workload]
    numbers = {c: "mean" for c in (*METRICS, *EXTRA_NUMBERS)}
    firsts = {c: "first" for c in ("strategy", "setting", "cell_id", "device_name", "device_type", "auto_batch") if c in ok}
    configs = ok.groupby(keys, dropna=False, sort=False, observed=True).agg({**numbers, **firsts, "status": "size"})
    return configs.rename(columns={"status": "repeats"}).reset_index()


# ---------------------------------------------------------------------------------------------
# Tables


def comparison_table(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame(columns=[header for _, header in TABLE_COLUMNS])
    present = [(col, header) for col, header in TABLE_COLUMNS if col in frame.columns]
    table = frame[[col for col, _ in present]].rename(columns=dict(present))
    table = table.sort_values(["strategy", "batch", "accum"], kind="stable")
    return table.reset_index(drop=True)


def markdown_table(table: pd.DataFrame) -> str:
    if not len(table):
        return "(no records)"
    floatfmt = [".0f" if header == "tokens/s/gpu" else ".4g" for header in table.columns]
    blanked = table.astype(object).where(table.notna(), None)  # tabulate shows None, not NaN, as missingval
    return blanked.to_markdown(index=False, floatfmt=floatfmt, missingval="-")


def fmt(metric: str, value: Any) -> str:
    return METRIC_FORMATS[metric].format(value) if pd.notna(value) else "-"


def choose_baseline(configs: pd.DataFrame, requested: str | None) -> str | None:
    """The requested strategy, else the first default present among ok cells."""
    if requested:
        return requested
    present = set(configs["strategy"])
    return next((s for s in DEFAULT_BASELINES if s in present), None)


def best_table(configs: pd.DataFrame, cells: Cells) -> pd.DataFrame:
    ranked = configs.dropna(subset=["tokens_per_s_per_gpu"]).sort_values("tokens_per_s_per_gpu", ascending=False)
    best = ranked.drop_duplicates("variant").sort_values("variant")
    return _config_rows(best, cells, ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib"))


def baseline_table(configs: pd.DataFrame, cells: Cells, baseline: str) -> pd.DataFrame:
    """Each ok config against the baseline strategy's config of the same workload."""
    workload = list(cells.workload)
    base = (configs[configs["strategy"] == baseline]
            .groupby(workload, dropna=False)[["tokens_per_s_per_gpu", "peak_memory_gib"]].mean()
            .rename(columns=lambda c: f"base_{c}").reset_index())
    others = configs[configs["strategy"] != baseline]
    paired = others.merge(base, on=workload, how="inner").sort_values(["setting", "variant", "batch_size"])
    rows = _config_rows(paired, cells, ())
    rows["tokens/s/gpu"] = [fmt("tokens_per_s_per_gpu", v) for v in paired["tokens_per_s_per_gpu"]]
    rows[f"{baseline} tokens/s/gpu"] = [fmt("tokens_per_s_per_gpu", v) for v in paired["base_tokens_per_s_per_gpu"]]
    rows["speed-up"] = [f"{v:.2f}x" for v in paired["tokens_per_s_per_gpu"] / paired["base_tokens_per_s_per_gpu"]]
    rows["peak GiB"] = [fmt("peak_memory_gib", v) for v in paired["peak_memory_gib"]]
    rows[f"{baseline} peak GiB"] = [fmt("peak_memory_gib", v) for v in paired["base_peak_memory_gib"]]
    saving = 1 - paired["peak_memory_gib"] / paired["base_peak_memory_gib"]
    rows["memory saving"] = [f"{v:.1%}" if pd.notna(v) else "-" for v in saving]
    return rows


def probe_rows(cells: Cells) -> pd.DataFrame:
    """One row per probe of the `batch_size: auto` cells: the cell's labels and spec fields, with
    the probe's batch, status (ok, oom, over_margin), peak memory and tokens/s per GPU."""
    frame = cells.frame
    if "batch_search.probes" not in frame:
        return pd.DataFrame(columns=["variant", "setting", *cells.fixed, "batch_size", "status", *PROBE_NUMBERS])
    labels = ["cell_id", "variant", "setting", *dict.fromkeys(cells.fixed)]
    rows = [{**{k: cell[k] for k in labels}, **{k: probe.get(k) for k in ("batch_size", "status", *PROBE_NUMBERS)}}
            for _, cell in frame[frame["batch_search.probes"].map(lambda v: isinstance(v, list))].iterrows()
            for probe in cell["batch_search.probes"] if isinstance(probe, dict)]
    probes = pd.DataFrame(rows, columns=[*labels, "batch_size", "status", *PROBE_NUMBERS])
    probes[list(PROBE_NUMBERS)] = probes[list(PROBE_NUMBERS)].apply(pd.to_numeric, errors="coerce")
    probes["setting"] = pd.Categorical(probes["setting"], categories=frame["setting"].cat.categories, ordered=True)
    return probes


PROBE_NUMBERS = ("peak_memory_gib", "tokens_per_s_per_gpu")


def frontier_table(cells: Cells) -> pd.DataFrame:
    """Largest batch that ran per strategy and setting (grad_accum aside: it does not change what
    fits), from the cells and the probes of `batch_size: auto` searches (a probe over the
    margin counts as not fitting)."""
    keys = ["variant", *(f for f in cells.fixed if f != "grad_accum")]
    probes = probe_rows(cells)
    runs = [part[[*keys, "batch_size", "status"]] for part in (cells.frame, probes) if not part.empty]
    frame = pd.concat(runs, ignore_index=True).dropna(subset=["variant", "batch_size"]) if runs else pd.DataFrame()
    if frame.empty:
        return pd.DataFrame()
    groups = frame.groupby(keys, dropna=False, sort=True)
    table = pd.DataFrame({
        "largest ok batch": frame[frame["status"] == "ok"].groupby(keys, dropna=False)["batch_size"].max(),
        "smallest OOM batch": frame[frame["status"].isin(("oom", "over_margin"))].groupby(keys, dropna=False)["batch_size"].min(),
        "batches run": groups["batch_size"].agg(lambda s: ", ".join(_text(b) for b in sorted(s.unique()))),
    }).reset_index()
    table["largest ok batch"] = table["largest ok batch"].map(lambda v: _text(v) if pd.notna(v) else "none")
    table["smallest OOM batch"] = table["smallest OOM batch"].map(_text)
    return table.rename(columns={"variant": "strategy", **SHORT})


def pivot_tables(cells: Cells, metric: str) -> list[tuple[str, pd.DataFrame]]:
    """strategy x batch_size per setting: the metric where the cell ran, else its status (OOM, ...)."""
    keys = ["setting", "variant", "batch_size"]
    frame = cells.frame[[*keys, "status", metric]].dropna(subset=["variant", "batch_size"])
    ran = frame["status"] == "ok"
    shown = frame[ran].groupby(keys, observed=True)[metric].mean().map(lambda v: fmt(metric, v))
    failed = frame[~ran].groupby(keys, observed=True)["status"].first().str.upper()
    tables = []
    for setting, values in shown.combine_first(failed).groupby(level="setting", observed=True, sort=True):
        grid = values.droplevel("setting").unstack("batch_size").fillna("")
        grid.columns = [f"b{_text(b)}" for b in grid.columns]
        tables.append((str(setting), grid.rename_axis("strategy").reset_index()))
    return tables


def failures_table(cells: Cells) -> pd.DataFrame:
    failed = cells.frame[cells.frame["status"] != "ok"]
    stage = failed["stage"] if "stage" in failed else pd.Series("", index=failed.index)
    error = failed["error"] if "error" in failed else pd.Series("", index=failed.index)
    job = failed["slurm.job_id"] if "slurm.job_id" in failed else pd.Series(None, index=failed.index)
    return pd.DataFrame({
        "cell": failed["cell_id"],
        "status": failed["status"],
        "job": job.map(_text),
        "strategy": failed["variant"].map(_text),
        "batch": failed["batch_size"].map(_text),
        "setting": failed["setting"].astype(str),
        "stage": stage.map(_text),
        "reason": error.map(_first_line),
    }).sort_values(["status", "cell"]).reset_index(drop=True)


def _first_line(error: Any, limit: int = 160) -> str:
    text = _text(error).strip().splitlines()[0] if pd.notna(error) and str(error).strip() else "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config_rows(configs: pd.DataFrame, cells: Cells, metrics: tuple[str, ...]) -> pd.DataFrame:
    """Identifying columns of configs (strategy, batch, the setting's fields) plus formatted metrics."""
    rows = pd.DataFrame({"strategy": configs["variant"].to_numpy(), "batch": configs["batch_size"].map(_text).to_numpy()})
    for name in cells.fixed:
        rows[SHORT.get(name, name)] = configs[name].map(_text).to_numpy()
    for metric in metrics:
        rows[METRIC_NAMES[metric]] = [fmt(metric, v) for v in configs[metric]]
    if len(configs) and (configs["repeats"] > 1).any():
        rows["repeats"] = configs["repeats"].to_numpy()
    return rows


def environment_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Distinct values (with cell counts) of the fields that describe where the cells ran."""
    fields = ["device_name", "world_size", "nodes", "backend", "git_commit",
              "slurm.cluster_name", "slurm.job_partition",
              *sorted(c for c in frame.columns if c.startswith(("versions.", "environment.")))]
    rows = [(name, _counted(frame[name].dropna())) for name in fields if name in frame and frame[name].notna().any()]
    if "hostnames" in frame:
        hosts = sorted({str(h) for hs in frame["hostnames"].dropna() if isinstance(hs, list) for h in hs})
        if hosts:
            shown = ", ".join(hosts[:20]) + (f" and {len(hosts) - 20} more" if len(hosts) > 20 else "")
            rows.append(("hostnames", shown))
    return pd.DataFrame(rows, columns=["field", "values (cells)"])


def _counted(values: pd.Series) -> str:
    counts = values.value_counts()
    try:
        counts = counts.sort_index()
    except TypeError:  # values of more than one type (a record's context field holds a number here, text there)
        counts = counts.sort_index(key=lambda index: index.map(_text))
    return ", ".join(f"{_text(v)} ({n})" for v, n in counts.items())


def status_counts(cells: Cells, unreadable: list[str]) -> str:
    counts = cells.frame["status"].value_counts()
    order = [*STATUSES, MISSING]
    parts = [f"{counts[s]} {s}" for s in order if s in counts]
    text = f"{len(cells.frame)} cell(s): " + (", ".join(parts) or "none")
    return text + (f"; {len(unreadable)} unreadable record file(s)" if unreadable else "")


# ---------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class Report:
    """What `write_report` wrote, and what `hpcfsdp collect` prints."""

    table: pd.DataFrame  # the comparison table, one row per cell
    directory: Path
    files: list[Path]
    unreadable: list[str]
    skipped_plots: dict[str, str]  # plot name -> why it was not drawn
    notes: list[str]  # what the tables could not keep as it was (e.g. a parquet column as text)
    recommendation: list[str] = field(default_factory=list)  # fastest, most headroom, cheapest


def write_report(sweep_dir: str | Path, baseline: str | None = None, plots: bool = True,
                 scheduler_states: dict[str, str] | None = None, collection: Collection | None = None,
                 first_sections: tuple[Section, ...] = ()) -> Report:
    """Write report/: results.csv (+ .parquet), summary.md, index.html and plots/*.png.

    `collection`: the sweep's records when the caller read them already; `first_sections` go
    before the others (the over-time checks)."""
    sweep_dir = Path(sweep_dir)
    collection = collection if collection is not None else load_records(sweep_dir, scheduler_states)
    cells = label_cells(collection)
    report = report_folder(sweep_dir)
    files, notes = write_tables(collection.cells, report)

    configs = ok_configs(cells)
    sections = [*first_sections, *summary_sections(cells, configs, baseline, collection.unreadable)]
    figures, skipped = [], {}
    if plots:
        reference, label = reference_cells(cells)
        figures, skipped = plotting.write_plots(configs, reference, label, report / "plots", probe_rows(cells))
        files += [path for _, path in figures]
    sections += [Section("Plots", text=_plot_note(plots, skipped), images=figures), *pivot_sections(cells, configs),
                 all_cells_section(cells), Section("Environment", table=environment_table(collection.frame))]

    title = f"{sweep_dir.name}: {status_counts(cells, collection.unreadable)}"
    (report / "summary.md").write_text(to_markdown(title, sections, relative_to=report))
    (report / "index.html").write_text(to_html(title, sections))
    files += [report / "summary.md", report / "index.html"]
    return Report(comparison_table(collection.cells), report, files, collection.unreadable, skipped, notes,
                  recommendation(configs, cells))


def report_folder(sweep_dir: Path) -> Path:
    """<sweep>/report/ (and plots/ in it), made ready to write into without leaving the sweep
    folder: a link left among their files is removed (the file is written afresh in its place),
    and a report/ or plots/ that is itself a link out of the sweep folder is refused."""
    report = sweep_dir / "report"
    for folder in (report, report / "plots"):
        if folder.is_symlink() and not Path(os.path.realpath(folder)).is_relative_to(os.path.realpath(sweep_dir)):
            raise SpecError(str(folder), "", f"a link to {os.path.realpath(folder)}, out of the sweep folder; "
                            "remove it (collect writes report/ itself)")
        folder.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            if entry.is_symlink():
                entry.unlink()
    return report


def write_tables(frame: pd.DataFrame, report: Path) -> tuple[list[Path], list[str]]:
    """results.csv, and results.parquet when pyarrow is there; lists and objects as JSON text.
    Returns the files and a note per column that parquet could not keep as it was."""
    table = _exportable(frame)
    table.to_csv(report / "results.csv", index=False)
    written = [report / "results.csv"]
    try:
        import pyarrow  # noqa: F401 - only to know whether parquet can be written
    except ImportError:
        return written, []
    notes = _write_parquet(table, report / "results.parquet")
    return written + [report / "results.parquet"], notes


def _write_parquet(table: pd.DataFrame, path: Path) -> list[str]:
    """A parquet column holds one type. Records checked only where the collector computes can
    still disagree elsewhere (a field text in one record, a number in another): such a column
    is written as text, with a note naming it; results.csv keeps the values as read."""
    import pyarrow

    try:
        table.to_parquet(path, index=False)
        return []
    except pyarrow.ArrowException:
        mixed = [column for column in table.columns[table.dtypes == object] if not _arrow_converts(table[column])]
        table.assign(**{column: table[column].map(_as_text) for column in mixed}).to_parquet(path, index=False)
        return [f"{path}: column(s) {', '.join(mixed)} hold values of more than one type; written as text"]


def _arrow_converts(column: pd.Series) -> bool:
    import pyarrow

    try:
        pyarrow.array(column, from_pandas=True)
    except pyarrow.ArrowException:
        return False
    return True


def _as_text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _exportable(frame: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in ("cell_id", "sweep", "status", "stage", "error") if c in frame]
    table = frame[first + [c for c in frame.columns if c not in first]].copy()
    for column in table.columns[table.dtypes == object]:
        values = table[column].dropna()
        if len(values) and isinstance(values.iloc[0], (list, dict)):  # a record field holds one JSON type
            table[column] = table[column].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    return table


def summary_sections(cells: Cells, configs: pd.DataFrame, baseline: str | None, unreadable: list[str]) -> list[Section]:
    """Recommendation, best configurations, baseline comparison, OOM frontier, then what did not
    finish or read."""
    lines = recommendation(configs, cells)
    sections = [Section("Recommendation", text="Among the cells that ran ok." if lines else "No cell finished ok.", items=lines),
                _best_section(configs, cells), _baseline_section(configs, cells, baseline),
                Section("OOM frontier", text="Largest per-device batch that ran, per strategy and setting.",
                        table=frontier_table(cells))]
    failures = failures_table(cells)
    if len(failures) > ROW_LIMIT:
        note = f"The first {ROW_LIMIT:,} of {len(failures):,}; results.csv has them all (columns status, stage, error)."
        sections.append(Section("Cells that did not finish ok", text=note, table=failures.head(ROW_LIMIT)))
    elif len(failures):
        sections.append(Section("Cells that did not finish ok", table=failures))
    if unreadable:
        sections.append(Section("Unreadable records (skipped)", items=list(unreadable)))
    return sections


def pivot_sections(cells: Cells, configs: pd.DataFrame) -> list[Section]:
    sections = []
    for metric in METRICS:
        if metric == "mfu" and configs[metric].isna().all():
            sections.append(Section("Pivot: MFU", text="No MFU values (CPU runs, or a GPU without a known peak)."))
            continue
        sections.append(Section(f"Pivot: {METRIC_NAMES[metric]}",
                                text="Strategy x per-device batch; a cell that did not run ok shows its status."))
        sections += [Section(setting, table=table, level=3) for setting, table in pivot_tables(cells, metric)]
    return sections


def all_cells_section(cells: Cells) -> Section:
    """The printed comparison table; past ROW_LIMIT rows a page is no place for it: results.csv is."""
    table = comparison_table(cells.frame)
    if len(table) > ROW_LIMIT:
        return Section("All cells", text=f"{len(table):,} cells: too many to list here; see results.csv.")
    for metric, header in METRIC_NAMES.items():
        if header in table:
            table[header] = table[header].map(lambda v, m=metric: fmt(m, v))
    return Section("All cells", table=table.map(_text))


def recommendation(configs: pd.DataFrame, cells: Cells) -> list[str]:
    """One line each for the fastest (tokens/s per GPU), the most memory headroom (GPU memory left
    at the peak; the lowest peak where the device's size is unknown) and the cheapest (GPU-hours
    per billion tokens) ok configuration, with its setup and the figures it was picked by."""
    ranked = configs.dropna(subset=["tokens_per_s_per_gpu"]).copy()
    if ranked.empty:
        return []
    # Records from before gpu_hours_per_billion_tokens existed: the same figure from their throughput.
    ranked["gpu_hours_per_billion_tokens"] = ranked["gpu_hours_per_billion_tokens"].fillna(
        1e9 / (3600 * ranked["tokens_per_s_per_gpu"]))
    named = ranked["device_name"] if "device_name" in ranked else pd.Series(None, index=ranked.index)
    by_name = pd.to_numeric(named.map(lambda n: gpu_memory_gib(str(n)) if pd.notna(n) else None), errors="coerce")
    ranked["capacity"] = ranked["memory_capacity_gib"].fillna(by_name)
    fastest = ranked.loc[ranked["tokens_per_s_per_gpu"].idxmax()]
    cheapest = ranked.loc[ranked["gpu_hours_per_billion_tokens"].idxmin()]
    lines = [f"Fastest: {_setup(fastest, cells)}: {fmt('tokens_per_s_per_gpu', fastest['tokens_per_s_per_gpu'])} "
             f"tokens/s per GPU (cell {fastest['cell_id']})"]
    known = ranked.dropna(subset=["capacity", "peak_memory_gib"])
    if known.empty:
        lowest = ranked.loc[ranked["peak_memory_gib"].idxmin()]
        lines.append(f"Most memory headroom: {_setup(lowest, cells)}: the lowest peak, "
                     f"{fmt('peak_memory_gib', lowest['peak_memory_gib'])} GiB (device memory size unknown; "
                     f"cell {lowest['cell_id']})")
    else:
        roomy = known.loc[(known["capacity"] - known["peak_memory_gib"]).idxmax()]
        free = roomy["capacity"] - roomy["peak_memory_gib"]
        lines.append(f"Most memory headroom: {_setup(roomy, cells)}: peak {fmt('peak_memory_gib', roomy['peak_memory_gib'])} "
                     f"of {roomy['capacity']:.1f} GiB, {free:.1f} GiB ({free / roomy['capacity']:.0%}) free "
                     f"(cell {roomy['cell_id']})")
    same = " (the fastest: GPU-hours per token are the inverse of tokens/s per GPU)" if cheapest.name == fastest.name else ""
    line = (f"Cheapest: {_setup(cheapest, cells)}: {cheapest['gpu_hours_per_billion_tokens']:.3g} GPU-hours per billion "
            f"tokens{same} (cell {cheapest['cell_id']})")
    energy = ranked.dropna(subset=["joules_per_token"])
    if not energy.empty:
        frugal = energy.loc[energy["joules_per_token"].idxmin()]
        line += (f"; least energy: {_setup(frugal, cells)}: {frugal['joules_per_token']:.3g} J per token "
                 f"({frugal['joules_per_token'] * 1e9 / 3.6e6:.3g} kWh per billion tokens)")
    return lines + [line]


def _setup(config: pd.Series, cells: Cells) -> str:
    batch = _text(config["batch_size"]) + (" (auto)" if config.get("auto_batch") == True else "")  # noqa: E712 - numpy bool or NaN
    return f"{config['variant']} at {describe({'batch_size': batch, **{f: config[f] for f in cells.fixed}})}"


def _best_section(configs: pd.DataFrame, cells: Cells) -> Section:
    if configs["tokens_per_s_per_gpu"].notna().sum() == 0:
        return Section("Best configuration", text="No cell finished ok.")
    top = configs.loc[configs["tokens_per_s_per_gpu"].idxmax()]
    where = describe({"batch_size": top["batch_size"], **{f: top[f] for f in cells.fixed}})
    text = (f"Best overall: {top['variant']} at {where}: {fmt('tokens_per_s_per_gpu', top['tokens_per_s_per_gpu'])} "
            f"tokens/s per GPU (cell {top['cell_id']}). Per strategy, by tokens/s per GPU among ok cells:")
    return Section("Best configuration", text=text, table=best_table(configs, cells))


def _baseline_section(configs: pd.DataFrame, cells: Cells, requested: str | None) -> Section:
    title = "Speed-up and memory saving vs baseline"
    baseline = choose_baseline(configs, requested)
    if baseline is None or baseline not in set(configs["strategy"]):
        wanted = baseline or " or ".join(DEFAULT_BASELINES)
        return Section(title, text=f"No ok cell of {wanted}: pass --baseline with a strategy of this sweep.")
    table = baseline_table(configs, cells, baseline)
    if table.empty:
        return Section(title, text=f"No ok {baseline} cell shares a workload with another strategy's ok cell.")
    text = (f"Baseline: {baseline}, compared at the same model, sequence, batch shape, checkpointing and "
            f"resources. Speed-up = tokens/s per GPU / baseline's; memory saving = 1 - peak / baseline's peak.")
    return Section(title, text=text, table=table)


def reference_cells(cells: Cells) -> tuple[pd.DataFrame, str]:
    """The ok cells of the one workload run by the most strategies, for like-for-like plots
    (loss curves, memory by stage), and a label naming that workload."""
    ok = cells.ok
    if ok.empty:
        return ok, ""
    groups = ok.groupby(list(cells.workload), dropna=False, sort=True)
    best = int(groups["variant"].nunique().to_numpy().argmax())
    chosen = ok[groups.ngroup() == best]
    first = chosen.iloc[0]
    return chosen, describe({"batch_size": first["batch_size"], **{f: first[f] for f in cells.fixed}})


def _plot_note(plots: bool, skipped: dict[str, str]) -> str:
    if not plots:
        return "Plots not drawn (--no-plots)."
    return " ".join(f"Skipped {name}: {why}." for name, why in skipped.items())


# ---------------------------------------------------------------------------------------------
# Comparing two sweeps


@dataclass(frozen=True)
class Comparison:
    """Per-cell deltas of a sweep against a reference sweep, matched by cell id."""

    table: pd.DataFrame
    regressions: list[str]
    notes: list[str]

    def render(self, current: str, reference: str) -> str:
        title = f"{current} vs {reference}: {len(self.table)} reference cell(s), {len(self.regressions)} regression(s)"
        sections = [Section("Per-cell deltas", table=self.table)]
        if self.regressions:
            sections.append(Section("Regressions", items=self.regressions))
        sections.append(Section("Notes", items=self.notes))
        return to_markdown(title, sections)


# metric -> direction that is worse (-1: a drop is a regression, +1: a rise is).
WORSE = {"tokens_per_s_per_gpu": -1, "mfu": -1, "peak_memory_gib": +1}


def compare_sweeps(current_dir: str | Path, reference_dir: str | Path, threshold: float = 0.05) -> Comparison:
    """Deltas current / reference - 1 for every cell of the reference sweep; a change beyond
    threshold in the worse direction, or a cell ok in the reference and not now (failed, or
    `missing`: no readable record in the current sweep), is a regression."""
    current, reference = load_records(current_dir), load_records(reference_dir)
    cur = current.frame.reindex(columns=["cell_id", "status", *METRICS])
    ref = reference.frame.reindex(columns=["cell_id", "strategy", "batch_size", "status", *METRICS])
    for frame in (cur, ref):
        frame[list(METRICS)] = frame[list(METRICS)].apply(pd.to_numeric, errors="coerce")
    paired = ref.merge(cur, on="cell_id", suffixes=("_ref", ""), how="left").sort_values(["strategy", "batch_size", "cell_id"])
    paired["status"] = paired["status"].fillna(MISSING)

    table = pd.DataFrame({"cell": paired["cell_id"], "strategy": paired["strategy"], "batch": paired["batch_size"].map(_text),
                          "status": [s if s == r else f"{r} -> {s}" for s, r in zip(paired["status"], paired["status_ref"])]})
    regressions, flagged = [], pd.Series(False, index=paired.index)
    for metric, worse in WORSE.items():
        change = paired[metric] / paired[f"{metric}_ref"] - 1
        table[METRIC_NAMES[metric]] = [_delta(metric, r, c, d) for r, c, d in zip(paired[f"{metric}_ref"], paired[metric], change)]
        bad = worse * change > threshold
        flagged |= bad
        regressions += [f"{cid}: {METRIC_NAMES[metric]} {_delta(metric, r, c, d)}"
                        for cid, r, c, d in zip(paired["cell_id"][bad], paired[f"{metric}_ref"][bad], paired[metric][bad], change[bad])]
    lost = (paired["status_ref"] == "ok") & (paired["status"] != "ok")
    flagged |= lost
    regressions += [f"{cid}: status ok -> {status}" for cid, status in zip(paired["cell_id"][lost], paired["status"][lost])]
    table["regression"] = flagged.map({True: "REGRESSION", False: ""}).to_numpy()

    notes = [f"threshold {threshold:.1%}; delta = current / reference - 1"]
    cur_ids, ref_ids = set(cur["cell_id"]), set(ref["cell_id"])
    if cur_ids != ref_ids:
        notes.append(f"unmatched: {len(cur_ids - ref_ids)} cell(s) only in the current sweep, {len(ref_ids - cur_ids)} only in the reference")
    if ref_ids and not cur_ids & ref_ids:
        notes.append("no cell in common: a cell id hashes the spec's non-default fields, so a field changed between "
                     "the two sweeps (or ids made before hpcfsdp hashed only those) gives every cell a new id, and "
                     "every ok reference cell counts as missing")
    notes += [f"{name}: {len(c.unreadable)} unreadable record(s) skipped" for name, c in (("current", current), ("reference", reference)) if c.unreadable]
    notes.append(_noise_note({"current": current, "reference": reference}, threshold))
    return Comparison(table.reset_index(drop=True), regressions, notes)


def _delta(metric: str, reference: float, current: float, change: float) -> str:
    if pd.isna(reference) and pd.isna(current):
        return "-"
    text = f"{fmt(metric, reference)} -> {fmt(metric, current)}"
    return text + (f" ({change:+.1%})" if pd.notna(change) else "")


def run_to_run_noise(collection: Collection) -> tuple[float, int] | None:
    """Median coefficient of variation of tokens/s per GPU over groups of ok cells whose spec
    differs only in seed, and the number of such groups; None when there are no repeats."""
    frame = collection.frame
    keys = [f for f in collection.spec_fields if f != "seed"]
    if frame.empty or not keys:
        return None
    ok = frame[frame["status"] == "ok"]
    stats = pd.to_numeric(ok["tokens_per_s_per_gpu"], errors="coerce").groupby([ok[k] for k in keys], dropna=False).agg(["std", "mean", "size"])
    stats = stats[stats["size"] > 1]
    if stats.empty:
        return None
    return float((stats["std"] / stats["mean"]).median()), len(stats)


def _noise_note(collections: dict[str, Collection], threshold: float) -> str:
    parts, worst = [], 0.0
    for name, collection in collections.items():
        noise = run_to_run_noise(collection)
        if noise:
            parts.append(f"{name} {noise[0]:.1%} (median CV of tokens/s/gpu over {noise[1]} config(s) repeated with other seeds)")
            worst = max(worst, noise[0])
    if not parts:
        return "run-to-run noise unknown: no config repeated with another seed"
    warning = "; the threshold is below 2x the noise, expect false alarms" if threshold < 2 * worst else ""
    return "run-to-run noise: " + "; ".join(parts) + warning


def write_comparison(sweep_dir: str | Path, reference_dir: str | Path, threshold: float) -> tuple[Comparison, str, Path]:
    """Compare and write report/compare.md; returns the comparison, its text and the file."""
    comparison = compare_sweeps(sweep_dir, reference_dir, threshold)
    text = comparison.render(str(sweep_dir), str(reference_dir))
    path = report_folder(Path(sweep_dir)) / "compare.md"
    path.write_text(text)
    return comparison, text, path
