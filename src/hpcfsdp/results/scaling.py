"""The scaling table: each strategy's tokens/s per GPU as the GPU count grows, against the smallest
GPU count that ran ok.

This is weak scaling at a fixed per-device batch, the table of the FSDP2 blog (seed 004): the same
model, sequence length, per-device batch, accumulation and precision on 4, 8, 16, ... GPUs. A model
that does not fit one GPU has no one-GPU cell, so each workload is scaled against its own smallest
GPU count with an ok cell (its base: the fastest cell there). Efficiency at N GPUs is tokens/s per
GPU at N over the base's; a row whose p10-p90 steps overlap the base's is within noise of it: this
run cannot tell its per-GPU rate from the base's (it scales perfectly, as far as it can tell). A
sweep whose ok cells of every workload ran at one GPU count has no table; one whose cells ran at
several counts says why (unscaled_reason). On the CPU a rank is a process, and the words say so.
"""

from __future__ import annotations

import pandas as pd

from ..contracts.gpus import RankWords
from .read import SPREAD, Cells
from .render import Section
from .tables import fmt, frame_rank_words, spread_texts

# What a cell must share with its base.
WORKLOAD = ("model", "seq_len", "batch_size", "grad_accum", "precision")
RATE, BASE, BASE_RATE, EFFICIENCY = "tokens_per_s_per_gpu", "base_world_size", "base_rate", "efficiency"
NOISE = "within_noise"
SHOWN = ("model", "strategy", "nodes", "world_size", RATE, "spread", EFFICIENCY, NOISE, "mfu", "peak_memory_gib")


def scaling_table(ok: pd.DataFrame) -> pd.DataFrame:
    """One row per ok cell of a workload whose ok cells ran at several GPU counts, with its base's
    GPU count, efficiency against the base, and whether it is within noise of the base; raw numbers
    (scaling_printable words and formats them)."""
    needed = {*WORKLOAD, "strategy", "world_size", RATE}
    if ok.empty or not needed <= set(ok.columns) or ok["world_size"].nunique() < 2:
        return pd.DataFrame(columns=[*SHOWN, BASE])
    keys = list(WORKLOAD)
    wanted = [
        *keys,
        "strategy",
        "nodes",
        "world_size",
        RATE,
        *SPREAD,
        "mfu",
        "peak_memory_gib",
        "comm_exposed_fraction",
    ]
    ok = ok[[column for column in dict.fromkeys(wanted) if column in ok]]  # a record's other columns: none here
    rows = ok[pd.to_numeric(ok[RATE], errors="coerce") > 0].copy()
    rows[BASE] = rows.groupby(keys, dropna=False)["world_size"].transform("min")
    rows = rows[rows.groupby(keys, dropna=False)["world_size"].transform("nunique") >= 2]
    if rows.empty:
        return pd.DataFrame(columns=[*SHOWN, BASE])
    at_base = rows[rows["world_size"] == rows[BASE]]
    spread = [c for c in SPREAD if c in rows]
    names = {RATE: BASE_RATE, **{c: f"base_{c}" for c in spread}}
    fastest = at_base.loc[at_base.groupby(keys, dropna=False)[RATE].idxmax()].set_index(keys)[[RATE, *spread]]
    own = at_base.loc[at_base.groupby([*keys, "strategy"], dropna=False)[RATE].idxmax()]
    own = own.set_index([*keys, "strategy"])[[RATE, *spread]]
    rows = rows.join(fastest.rename(columns=names), on=keys)
    mine = rows.join(own.rename(columns={c: f"{n}_own" for c, n in names.items()}), on=[*keys, "strategy"])
    for column in names.values():  # the strategy's own cell at the base count, where it ran there
        rows[column] = mine[f"{column}_own"].where(mine[f"{column}_own"].notna(), rows[column])
    rows[EFFICIENCY] = rows[RATE] / rows[BASE_RATE]
    rows[NOISE] = _overlapping(rows, spread)
    return rows.sort_values(["model", "world_size", "strategy"], kind="stable").reset_index(drop=True)


def _overlapping(rows: pd.DataFrame, spread: list[str]) -> pd.Series:
    """validity.within_noise of each row's spread and its base's, a column at a time (a sweep of
    10,000 cells at two node counts scales them all): False where either has no spread."""
    if len(spread) != 2:
        return pd.Series(False, index=rows.index)
    low, high, base_low, base_high = (
        pd.to_numeric(rows[column], errors="coerce") for column in (*spread, *(f"base_{c}" for c in spread))
    )
    return ((high >= base_low) & (base_high >= low)).fillna(False).astype(bool)


def scaling_printable(table: pd.DataFrame, words: RankWords) -> pd.DataFrame:
    """The scaling table as the report prints it: in the other tables' formats (thousands
    separators, MFU and exposed communication as %), a GPU called what it is (a process on the CPU)."""
    count = "GPUs" if words.one == "GPU" else "processes"
    columns = {
        "model": table["model"].astype(str),
        "strategy": table["strategy"].astype(str),
        "nodes": table["nodes"].map(lambda v: f"{v:.0f}" if pd.notna(v) else "-")
        if "nodes" in table
        else pd.Series("-", index=table.index),
        count: table["world_size"].map(lambda v: f"{v:.0f}"),
        words.rate: table[RATE].map(lambda v: fmt(RATE, v)),
        "p10-p90": spread_texts(table),
        f"base {count}": table[BASE].map(lambda v: f"{v:.0f}"),
        "efficiency": table[EFFICIENCY].map(lambda v: f"{v:.2f}x"),
        "within noise of base": [
            "base" if w == b else ("yes" if noisy else "no")
            for w, b, noisy in zip(table["world_size"], table[BASE], table[NOISE], strict=True)
        ],
        "MFU": table["mfu"].map(lambda v: fmt("mfu", v)) if "mfu" in table else pd.Series("-", index=table.index),
        "peak GiB": table["peak_memory_gib"].map(lambda v: fmt("peak_memory_gib", v)),
    }
    if "comm_exposed_fraction" in table and table["comm_exposed_fraction"].notna().any():
        columns["exposed comm"] = table["comm_exposed_fraction"].map(lambda v: f"{v:.1%}" if pd.notna(v) else "-")
    return pd.DataFrame(columns, index=table.index)


def unscaled_reason(frame: pd.DataFrame, table: pd.DataFrame, words: RankWords) -> str:
    """Why a sweep whose cells ran at several GPU counts has no scaling table ("" where it has one,
    or ran at one count): no workload ran ok at two counts (the statuses at each count)."""
    if not table.empty or "world_size" not in frame or frame["world_size"].nunique() < 2:
        return ""
    count = "GPU count" if words.one == "GPU" else "process count"
    statuses = "; ".join(
        f"at {size:.0f}: " + ", ".join(f"{n} {status}" for status, n in part["outcome"].value_counts().items())
        for size, part in frame.groupby("world_size", sort=True)
    )
    return (
        f"Not shown: no workload ran ok at two {count}s, so there is nothing to scale against ({statuses}); "
        "cells of the same model, sequence length, batch, accumulation and precision are needed at two or more."
    )


def scaling_sections(cells: Cells, row_limit: int) -> list[Section]:
    """The report's Scaling section, where ok cells ran one workload at several GPU counts: its
    first row_limit rows (the report's longest table)."""
    words = frame_rank_words(cells.frame)
    table = scaling_table(cells.ok)
    if reason := unscaled_reason(cells.frame, table, words):
        return [Section("Scaling", text=reason)]
    if table.empty:
        return []
    many = "GPUs" if words.one == "GPU" else "processes"
    bases = ", ".join(sorted({f"{b:.0f}" for b in table["base_world_size"]}, key=int))
    text = (
        f"Weak scaling at a fixed per-device batch: tokens/s {words.per} at N {many} over the same workload's "
        f"at the smallest {words.one} count that ran ok ({bases} {many}; model, sequence length, batch, "
        "accumulation and precision alike): the strategy's own cell there, else the fastest there. Within "
        "noise of base: its p10-p90 steps overlap the base's, so this run cannot tell its rate from the base's."
    )
    if len(table) > row_limit:  # the first rows, as the over-time table does: a page is no place for all
        text += f" The first {row_limit:,} of {len(table):,} rows, by model and {words.one} count."
    return [Section("Scaling", text=text, table=scaling_printable(table.head(row_limit), words))]
