"""The scaling table: each strategy's tokens/s per GPU as the GPU count grows, against one GPU.

This is weak scaling at a fixed per-device batch, the table of the FSDP2 blog (seed 004): the same
model, sequence length, per-device batch, accumulation and precision on 1, 2, 4, ... GPUs. Its
efficiency at N GPUs is tokens/s per GPU at N over the one-GPU figure of that workload (the fastest
one-GPU cell of it: on one GPU every strategy trains the same unsharded model). A sweep whose ok cells
ran at one GPU count only has no scaling table; one that ran at several but has no ok one-GPU cell
says so (unscaled_reason) rather than scaling against a sharded cell.
"""

from __future__ import annotations

import pandas as pd

# What a cell must share with its one-GPU baseline.
WORKLOAD = ("model", "seq_len", "batch_size", "grad_accum", "precision")
COLUMNS = {
    "model": "model",
    "strategy": "strategy",
    "nodes": "nodes",
    "world_size": "GPUs",
    "tokens_per_s_per_gpu": "tokens/s/gpu",
    "efficiency": "vs 1 GPU",
    "mfu": "MFU",
    "peak_memory_gib": "peak GiB",
    "comm_exposed_fraction": "exposed comm",
}


def scaling_table(ok: pd.DataFrame) -> pd.DataFrame:
    """One row per ok cell of a workload that ran at several GPU counts, one GPU among them."""
    needed = {*WORKLOAD, "strategy", "world_size", "tokens_per_s_per_gpu"}
    if ok.empty or not needed <= set(ok.columns) or ok["world_size"].nunique() < 2:
        return pd.DataFrame(columns=list(COLUMNS.values()))
    keys = list(WORKLOAD)
    one_gpu = ok[ok["world_size"] == 1].groupby(keys, dropna=False)["tokens_per_s_per_gpu"].max().rename("one_gpu")
    rows = ok.join(one_gpu, on=keys)
    rows = rows[rows["one_gpu"].notna() & (rows["one_gpu"] > 0)].copy()
    if rows["world_size"].nunique() < 2:
        return pd.DataFrame(columns=list(COLUMNS.values()))
    rows["efficiency"] = rows["tokens_per_s_per_gpu"] / rows["one_gpu"]
    rows = rows.sort_values(["model", "world_size", "strategy"], kind="stable")
    present = [c for c in COLUMNS if c in rows.columns]
    return rows[present].rename(columns=COLUMNS).reset_index(drop=True)


def unscaled_reason(frame: pd.DataFrame, table: pd.DataFrame) -> str:
    """Why a sweep whose cells ran at several GPU counts has no scaling table ("" where it has one,
    or ran at one count): no one-GPU cell, or none of them ok (their statuses)."""
    if not table.empty or "world_size" not in frame or frame["world_size"].nunique() < 2:
        return ""
    one_gpu = frame[frame["world_size"] == 1]
    if one_gpu.empty:
        return "Not shown: no cell ran on one GPU, so there is nothing to scale against."
    statuses = ", ".join(f"{count} {status}" for status, count in one_gpu["outcome"].value_counts().items())
    return (
        f"Not shown: no one-GPU cell ran ok to scale against (the one-GPU cells: {statuses}); "
        "a one-GPU cell of the same model, sequence length, batch, accumulation and precision is needed."
    )
