"""Tables of labelled cells: the per-cell comparison, best configurations, the baseline
comparison, the OOM frontier, pivots, failures and the environment, as DataFrames of text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from ..contracts.fields import spelt_alike
from ..contracts.gpus import GPU_WORDS, PROCESS_WORDS, RankWords, rank_words
from ..contracts.names import slurm_job_of
from ..contracts.record import (
    MISSING,
    STATUSES,
)
from ..contracts.recordspec import knob_applies
from .read import INVALID, MARK, SHORT, SPREAD, Cells, describe, frame_rows, marked, value_text
from .render import markdown_table

METRIC_NAMES = {"tokens_per_s_per_gpu": "tokens/s/gpu", "mfu": "MFU", "peak_memory_gib": "peak GiB"}


METRIC_FORMATS = {"tokens_per_s_per_gpu": "{:,.0f}", "mfu": "{:.1%}", "peak_memory_gib": "{:.2f}"}


DEFAULT_BASELINES = ("ddp", "fsdp2_zero3")


# The metric columns of the cell table, in order: (DataFrame column, header).
CELL_METRICS = (
    ("tokens_per_s_per_gpu", "tokens/s/gpu"),
    ("step_time_s", "step s"),
    ("mfu", "MFU"),
    ("peak_memory_gib", "peak GiB"),
    ("final_loss", "final loss"),
)
PRINTED_ROWS = 30  # rows of the cell table that `hpcfsdp collect` prints; report/results.csv has them all


def varied_fields(frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> list[str]:
    """The spec fields (and the number of ranks) whose value differs between the cells: what tells
    two rows of the cell table apart. The strategy is always shown, so it is not among them."""
    candidates = dict.fromkeys((*spec_fields, "world_size"))
    return [
        name
        for name in candidates
        if name != "strategy" and name in frame and not spelt_alike(frame[name].tolist(), value_text)
    ]


def comparison_table(frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> pd.DataFrame:
    """One row per cell, as text, best first: ok cells by tokens/s per GPU, then the others by
    status. Columns: the strategy, each field that varies in the sweep, the status, the metrics
    and the cell id."""
    fields = varied_fields(frame, spec_fields)
    metric_headers = [h for _, h in CELL_METRICS]
    metric_headers.insert(1, SPREAD_HEADER)
    headers = ["strategy", *(SHORT.get(f, f) for f in fields), "status", *metric_headers, "cell"]
    if frame.empty:
        return pd.DataFrame(columns=headers)
    ranked = _ranked(frame)
    strategies = ranked["strategy"].tolist()
    columns = {"strategy": ranked["strategy"].map(value_text)}
    columns.update(
        {
            SHORT.get(f, f): pd.Series(
                [
                    value_text(v) if knob_applies(f, s) else ""
                    for v, s in zip(ranked[f].tolist(), strategies, strict=True)
                ],
                index=ranked.index,
            )
            for f in fields
        }
    )
    columns["status"] = _outcome(ranked).map(value_text)
    for column, header in CELL_METRICS:
        values = (
            pd.to_numeric(ranked[column], errors="coerce") if column in ranked else pd.Series(None, index=ranked.index)
        )
        columns[header] = values.map(lambda v, c=column: fmt(c, v) if c in METRIC_FORMATS else value_text(v))
    columns[SPREAD_HEADER] = spread_texts(ranked)
    columns["cell"] = ranked["cell_id"].map(value_text)
    table = pd.DataFrame(columns, columns=headers).reset_index(drop=True)
    return in_rank_words(table, frame)


PER_PROCESS = PROCESS_WORDS.rate  # the cell table's tokens/s/gpu where no cell used a GPU
SPREAD_HEADER = "p10-p90"  # beside tokens/s: the window's slow and fast steps (contracts/record.py Spread)


def spread_texts(frame: pd.DataFrame) -> pd.Series:
    """Each row's tokens/s spread as "p10-p90" text, a dash where the record has none."""
    low, high = (
        pd.to_numeric(frame[c], errors="coerce") if c in frame else pd.Series(float("nan"), index=frame.index)
        for c in SPREAD
    )
    return pd.Series(
        [
            f"{fmt('tokens_per_s_per_gpu', a)}-{fmt('tokens_per_s_per_gpu', b)}" if pd.notna(a) and pd.notna(b) else "-"
            for a, b in zip(low, high, strict=True)
        ],
        index=frame.index,
    )


def _outcome(frame: pd.DataFrame) -> pd.Series:
    """The status as tables rank it (read.outcomes: `invalid` for an untrusted ok record)."""
    return frame["outcome"] if "outcome" in frame else frame["status"]


def frame_rank_words(frame: pd.DataFrame) -> RankWords:
    """GPU words, or process words where every record's device_type says cpu (cells without a
    record aside): what the tables and the report call a rank of these cells."""
    return rank_words(frame["device_type"].tolist() if "device_type" in frame else ())


def metric_name(metric: str, frame: pd.DataFrame) -> str:
    """A metric's short name (METRIC_NAMES) in frame's rank words: tokens/s/process on the CPU."""
    return METRIC_NAMES[metric].replace(GPU_WORDS.rate, frame_rank_words(frame).rate)


def in_rank_words(table: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """The table with its tokens/s/gpu headers ("ddp tokens/s/gpu" too) in frame's rank words."""
    rate = frame_rank_words(frame).rate
    return table.rename(columns=lambda header: header.replace(GPU_WORDS.rate, rate))


# What `collect --json` gives of each cell: (DataFrame column, key), the figures the table shows.
CELL_FIGURES = (
    ("tokens_per_s_per_gpu", "tokens_per_s_per_gpu"),
    ("step_time_s", "step_time_s"),
    ("mfu", "mfu"),
    ("peak_memory_gib", "peak_memory_gib"),
    ("final_loss", "final_loss"),
)


def cells_document(frame: pd.DataFrame, spec_fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """`collect --json`: every cell (records and missing ones) in the cell table's order, with its
    status, Slurm job, the first line of its error (or why it has no record), the fields that vary
    in the sweep and the table's figures as numbers (null where there is none)."""
    if frame.empty:
        return []
    fields = varied_fields(frame, spec_fields)
    ranked = _ranked(frame)
    cells = []
    for (_, row), job in zip(ranked.iterrows(), slurm_jobs(ranked), strict=True):
        error = first_line(row.get("error"))
        cells.append(
            {
                "cell_id": row["cell_id"],
                "status": row["status"],
                "job_id": job,
                "reason": None if error == "-" else error,
                "strategy": row.get("strategy"),
                "fields": {name: row.get(name) for name in fields},
                **{key: _number(row.get(column)) for column, key in CELL_FIGURES},
                "tokens_per_s_spread": _spread(row),
                INVALID: list(row[INVALID]) if isinstance(row.get(INVALID), list) else [],
            }
        )
    return cells


def _spread(row: pd.Series) -> dict[str, float] | None:
    low, high = (_number(row.get(column)) for column in SPREAD)
    return {"p10": low, "p90": high} if low is not None and high is not None else None


def _number(value: Any) -> float | None:
    number = pd.to_numeric(pd.Series([value]), errors="coerce").iloc[0]
    return None if pd.isna(number) else float(number)


def _ranked(frame: pd.DataFrame) -> pd.DataFrame:
    """Best first: ok cells by tokens/s per GPU, then the others (invalid ones first) by status."""
    speed = pd.to_numeric(frame["tokens_per_s_per_gpu"], errors="coerce") if "tokens_per_s_per_gpu" in frame else None
    return frame.assign(_failed=_outcome(frame) != "ok", _speed=speed, _shown=_outcome(frame)).sort_values(
        ["_failed", "_speed", "_shown", "cell_id"],
        ascending=[True, False, True, True],
        na_position="last",
        kind="stable",
    )


def printed_comparison(table: pd.DataFrame, full_table: Path) -> str:
    """The cell table as `hpcfsdp collect` prints it: the best PRINTED_ROWS rows, then a line
    saying how many were left out and where the full table is."""
    if table.empty:
        return "(no records)"
    text = markdown_table(table.head(PRINTED_ROWS))
    left_out = len(table) - PRINTED_ROWS
    if left_out > 0:
        text += f"\n{left_out:,} more row(s) not shown (of {len(table):,}); the full table: {full_table}"
    return text


def printable(table: pd.DataFrame) -> pd.DataFrame:
    """A table of raw values as text for printing: tokens/s/gpu as a whole number, other numbers
    to 4 significant digits, a dash for nothing."""
    return pd.DataFrame(
        {
            header: table[header].map(
                (lambda v: f"{v:.0f}" if isinstance(v, float) and v == v else value_text(v))
                if header in ("tokens/s/gpu", PER_PROCESS)
                else value_text
            )
            for header in table.columns
        },
        columns=table.columns,
    )


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
    rows = _config_rows(best, cells, ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib"))
    after_tokens = list(rows.columns).index(METRIC_NAMES["tokens_per_s_per_gpu"]) + 1
    rows.insert(after_tokens, SPREAD_HEADER, spread_texts(best).to_numpy())
    return in_rank_words(rows, cells.frame)


def baseline_table(configs: pd.DataFrame, cells: Cells, baseline: str) -> pd.DataFrame:
    """Each ok config against the baseline strategy's config of the same workload."""
    workload = list(cells.workload)
    base = (
        configs[configs["strategy"] == baseline]
        .groupby(workload, dropna=False)[["tokens_per_s_per_gpu", "peak_memory_gib"]]
        .mean()
        .rename(columns=lambda c: f"base_{c}")
        .reset_index()
    )
    others = configs[configs["strategy"] != baseline]
    paired = others.merge(base, on=workload, how="inner").sort_values(["setting", "variant", "batch_size"])
    rows = _config_rows(paired, cells, ())
    rows["tokens/s/gpu"] = [fmt("tokens_per_s_per_gpu", v) for v in paired["tokens_per_s_per_gpu"]]
    rows[f"{baseline} tokens/s/gpu"] = [fmt("tokens_per_s_per_gpu", v) for v in paired["base_tokens_per_s_per_gpu"]]
    rows["speed-up"] = [f"{v:.2f}x" for v in paired["tokens_per_s_per_gpu"] / paired["base_tokens_per_s_per_gpu"]]
    rows["peak GiB"] = [fmt("peak_memory_gib", v) for v in paired["peak_memory_gib"]]
    rows[f"{baseline} peak GiB"] = [fmt("peak_memory_gib", v) for v in paired["base_peak_memory_gib"]]
    saving = 1 - paired["peak_memory_gib"] / paired["base_peak_memory_gib"]
    rows["memory saving"] = [percent_text(v) for v in saving]
    return in_rank_words(rows, cells.frame)


def percent_text(fraction: float) -> str:
    """A fraction as a percentage to one decimal; one that rounds to zero is 0.0%, never -0.0%."""
    if pd.isna(fraction):
        return "-"
    return f"{round(fraction, 3) + 0.0:.1%}"


def probe_rows(cells: Cells) -> pd.DataFrame:
    """One row per probe of the `batch_size: auto` cells: the cell's labels and spec fields, with
    the probe's batch, status (ok, oom, over_margin), peak memory and tokens/s per GPU."""
    frame = cells.frame
    if "batch_search.probes" not in frame:
        return pd.DataFrame(columns=["variant", "setting", *cells.fixed, "batch_size", "status", *PROBE_NUMBERS])
    labels = ["cell_id", "variant", "setting", *dict.fromkeys(cells.fixed)]
    invalid = _outcome(frame) == "invalid"  # a broken setup's probes tell nothing of what fits either
    rows = [
        {**{k: cell[k] for k in labels}, **{k: probe.get(k) for k in ("batch_size", "status", *PROBE_NUMBERS)}}
        for _, cell in frame[frame["batch_search.probes"].map(lambda v: isinstance(v, list)) & ~invalid].iterrows()
        for probe in cell["batch_search.probes"]
        if isinstance(probe, dict)
    ]
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
    trusted = cells.frame.assign(status=_outcome(cells.frame))  # an invalid cell fits nothing the frontier can name
    runs = [part[[*keys, "batch_size", "status"]] for part in (trusted, probes) if not part.empty]
    frame = pd.concat(runs, ignore_index=True).dropna(subset=["variant", "batch_size"]) if runs else pd.DataFrame()
    if frame.empty:
        return pd.DataFrame()
    groups = frame.groupby(keys, dropna=False, sort=True)
    table = pd.DataFrame(
        {
            "largest ok batch": frame[frame["status"] == "ok"].groupby(keys, dropna=False)["batch_size"].max(),
            "smallest OOM batch": frame[frame["status"].isin(("oom", "over_margin"))]
            .groupby(keys, dropna=False)["batch_size"]
            .min(),
            "batches run": groups["batch_size"].agg(lambda s: ", ".join(value_text(b) for b in sorted(s.unique()))),
        }
    ).reset_index()
    table["largest ok batch"] = table["largest ok batch"].map(lambda v: value_text(v) if pd.notna(v) else "none")
    table["smallest OOM batch"] = table["smallest OOM batch"].map(value_text)
    return table.rename(columns={"variant": "strategy", **SHORT})


def pivot_tables(cells: Cells, metric: str) -> list[tuple[str, pd.DataFrame]]:
    """strategy x batch_size per setting: the metric where the cell ran, else its status (OOM, ...)."""
    keys = ["setting", "variant", "batch_size"]
    frame = cells.frame.assign(status=_outcome(cells.frame))[[*keys, "status", metric]]
    frame = frame.dropna(subset=["variant", "batch_size"])
    ran = frame["status"] == "ok"
    shown = frame[ran].groupby(keys, observed=True)[metric].mean().map(lambda v: fmt(metric, v))
    failed = frame[~ran].groupby(keys, observed=True)["status"].first().str.upper()
    tables = []
    for setting, values in shown.combine_first(failed).groupby(level="setting", observed=True, sort=True):
        grid = values.droplevel("setting").unstack("batch_size").fillna("")
        grid.columns = [f"b{value_text(b)}" for b in grid.columns]
        tables.append((str(setting), grid.rename_axis("strategy").reset_index()))
    return tables


def failures_table(cells: Cells) -> pd.DataFrame:
    failed = cells.frame[cells.frame["status"] != "ok"]
    stage = failed["stage"] if "stage" in failed else pd.Series("", index=failed.index)
    error = failed["error"] if "error" in failed else pd.Series("", index=failed.index)
    return (
        pd.DataFrame(
            {
                "cell": failed["cell_id"],
                "status": failed["status"],
                "job": [job or "-" for job in slurm_jobs(failed)],
                "strategy": failed["variant"].map(value_text),
                "batch": failed["batch_size"].map(value_text),
                "setting": failed["setting"].astype(str),
                "stage": stage.map(value_text),
                "reason": error.map(first_line),
            }
        )
        .sort_values(["status", "cell"])
        .reset_index(drop=True)
    )


SLURM_ID_COLUMNS = ("slurm.job_id", "slurm.array_job_id", "slurm.array_task_id")


def slurm_jobs(frame: pd.DataFrame) -> list[str | None]:
    """Each row's Slurm job as status, squeue and sacct spell it (names.slurm_job_of: ARRAY_TASK
    for an array task), from the frame's dotted columns."""
    ids = frame.reindex(columns=list(SLURM_ID_COLUMNS))
    keys = ("job_id", "array_job_id", "array_task_id")
    return [slurm_job_of(dict(zip(keys, row, strict=True))) for row in frame_rows(ids)]


def first_line(error: Any, limit: int = 160) -> str:
    """A record's error as one line of at most `limit` characters; a dash for none."""
    text = value_text(error).strip().splitlines()[0] if pd.notna(error) and str(error).strip() else "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config_rows(configs: pd.DataFrame, cells: Cells, metrics: tuple[str, ...]) -> pd.DataFrame:
    """Identifying columns of configs (strategy, batch, the setting's fields) plus formatted metrics."""
    rows = pd.DataFrame(
        {"strategy": configs["variant"].to_numpy(), "batch": configs["batch_size"].map(value_text).to_numpy()}
    )
    for name in cells.fixed:
        rows[SHORT.get(name, name)] = configs[name].map(value_text).to_numpy()
    for metric in metrics:
        rows[METRIC_NAMES[metric]] = [fmt(metric, v) for v in configs[metric]]
    if len(configs) and (configs["repeats"] > 1).any():
        rows["repeats"] = configs["repeats"].to_numpy()
    return rows


def environment_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Distinct values (with cell counts) of the fields that describe where the cells ran."""
    fields = [
        "device_name",
        "world_size",
        "nodes",
        "backend",
        "git_commit",
        "slurm.cluster_name",
        "slurm.job_partition",
        *sorted(c for c in frame.columns if c.startswith(("versions.", "environment."))),
    ]
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
        counts = counts.sort_index(key=lambda index: index.map(value_text))
    return ", ".join(f"{value_text(v)} ({n})" for v, n in counts.items())


def status_counts(cells: Cells, unreadable: list[str]) -> str:
    counts = cells.frame["status"].value_counts()
    order = [*STATUSES, MISSING]
    parts = [f"{counts[s]} {s}" for s in order if s in counts]
    if len(cells.invalid):  # ok records that rank nowhere
        parts = [f"{part} ({len(cells.invalid)} of them invalid)" if part.endswith(" ok") else part for part in parts]
    text = f"{len(cells.frame)} cell(s): " + (", ".join(parts) or "none")
    return text + (f"; {len(unreadable)} unreadable record file(s)" if unreadable else "")


def reference_cells(cells: Cells) -> tuple[pd.DataFrame, str]:
    """The ok cells of the one workload run by the most strategies, for like-for-like plots
    (loss curves, memory by stage), with the invalid cells of that workload marked (read.marked:
    drawn, dashed, ranked nowhere), and a label naming that workload."""
    ranked, invalid = cells.ok, cells.invalid  # properties: each a filter of every cell
    ok = ranked if not ranked.empty else invalid
    if ok.empty:
        return ok, ""
    keys = list(cells.workload)
    groups = ok.groupby(keys, dropna=False, sort=True)
    best = int(groups["variant"].nunique().to_numpy().argmax(axis=0))
    chosen = ok[groups.ngroup() == best]
    first = chosen.iloc[0]
    same = pd.Series(True, index=invalid.index)
    for key in keys if not invalid.empty else ():
        same &= (invalid[key] == first[key]) | (invalid[key].isna() & pd.isna(first[key]))
    parts = [chosen.assign(**{MARK: ""})] if ok is ranked else []
    if not invalid.empty:
        parts.append(marked(invalid[same]))
    label = describe({"batch_size": first["batch_size"], **{f: first[f] for f in cells.fixed}})
    return pd.concat(parts) if len(parts) > 1 else parts[0], label
