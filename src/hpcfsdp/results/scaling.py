"""The scaling table: each strategy's tokens/s per GPU as the GPU count grows, against one GPU.

This is weak scaling at a fixed per-device batch, the table of the FSDP2 blog (seed 004): the same
model, sequence length, per-device batch, accumulation and precision on 1, 2, 4, ... GPUs. Its
efficiency at N GPUs is tokens/s per GPU at N over the one-GPU figure of that workload (the fastest
one-GPU cell of it: on one GPU every strategy trains the same unsharded model). A sweep whose ok cells
ran at one GPU count only has no scaling table.
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
