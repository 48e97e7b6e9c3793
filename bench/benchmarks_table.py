#!/usr/bin/env python3
"""Print the Markdown tables of docs/benchmarks.md from stored records, so no figure is typed in.

python bench/benchmarks_table.py perf bench/results/2026-11-22-h200x2/run3/qwen_perf [more sweep dirs]
python bench/benchmarks_table.py training bench/results/2026-11-22-h200x2/run1/gpu_strategies
python bench/benchmarks_table.py overhead <results>/overhead
"""

from __future__ import annotations

import json
import sys

import pandas as pd

from hpcfsdp.results.read import load_records
from hpcfsdp.results.render import markdown_table
from hpcfsdp.results.tables import printable

PERF_COLUMNS = {
    "sweep": "sweep",
    "model": "model",
    "strategy": "strategy",
    "batch_size": "batch",
    "seq_len": "seq",
    "compile": "compile",
    "kernels": "kernels",
    "attention": "attention",
    "loss": "loss",
    "float8": "float8",
    "activation_checkpointing": "AC",
    "adamw_impl": "AdamW",
    "status": "status",
    "tokens_per_s_per_gpu": "tokens/s/GPU",
    "mfu": "MFU",
    "step_time_s": "step s (median)",
    "step_time_p90_s": "p90",
    "peak_memory_gib": "peak GiB",
    "comm_exposed_fraction": "exposed comm",
    "gpu_util_mean": "GPU util %",
}
TRAINING_COLUMNS = {
    "model": "model",
    "strategy": "strategy",
    "cpu_offload": "offload",
    "meta_init": "meta init",
    "hsdp_shard_size": "shard size",
    "precision": "precision",
    "status": "status",
    "first_loss": "loss step 1",
    "final_loss": "final loss",
    "final_param_norm": "final param norm",
    "error": "error",
}


def perf_table(frame: pd.DataFrame) -> pd.DataFrame:
    table = _select(frame, PERF_COLUMNS)
    table["tokens/s/GPU"] = table["tokens/s/GPU"].map(lambda v: "-" if pd.isna(v) else f"{v:,.0f}")
    for column in [c for c in ("MFU", "exposed comm") if c in table]:
        table[column] = table[column].map(lambda v: "-" if pd.isna(v) else f"{100 * float(v):.1f}%")
    # Lever columns only where some cell sets the lever, so tables of older records stay as quoted.
    lever_defaults = {"attention": "sdpa", "loss": "default", "float8": "none", "AC": "none"}
    table = table.drop(columns=[c for c, d in lever_defaults.items() if c in table and (table[c].fillna(d) == d).all()])
    if "float8" in table:
        table = table.rename(columns={"MFU": "MFU (bf16 peak)"})  # float8 cells too: one scale (docs/metrics.md)
    order = [c for c in ("sweep", "model", "strategy", "compile", "kernels", "seq", "batch") if c in table]
    return table.sort_values(order)


def training_table(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.assign(first_loss=frame["losses"].map(lambda v: _first(v)))
    table = _select(frame, TRAINING_COLUMNS)
    for column in ("loss step 1", "final loss"):
        table[column] = table[column].map(lambda v: "-" if pd.isna(v) else f"{v:.7f}")
    table["final param norm"] = table["final param norm"].map(lambda v: "-" if pd.isna(v) else f"{v:.9f}")
    if "error" in table:  # absent when every cell was ok
        table["error"] = table["error"].fillna("").map(lambda v: str(v)[:70])
    return table.sort_values([c for c in ("model", "strategy", "offload", "meta init", "shard size") if c in table])


def overhead_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Pairs of cells that differ only in measuring (per-step sync and NVML on / off), by sweep
    folder and seed. The cost compares like with like: each side's timed window over its steps
    (`window_step_time_s`, which holds the per-step syncs where they ran). The tokens/s the records
    report differ in kind: the median step with per-step sync, the window's mean without."""
    frame = frame[(frame["status"] == "ok") & (frame["seed"] > 0)]
    index = ["source", "seed"]
    window = frame.pivot_table(index=index, columns="sync_each_step", values="window_step_time_s")
    reported = frame.pivot_table(index=index, columns="sync_each_step", values="tokens_per_s_per_gpu")
    pairs = pd.DataFrame(
        {
            "measured": reported[True],
            "bare": reported[False],
            "window_measured": window[True],
            "window_bare": window[False],
        }
    )
    pairs["cost"] = pairs["window_measured"] / pairs["window_bare"] - 1
    pairs["reported"] = 1 - pairs["measured"] / pairs["bare"]
    pairs.loc[("median", ""), :] = pairs.median()
    table = pairs.reset_index().rename(
        columns={
            "source": "run",
            "seed": "pair",
            "window_measured": "window s/step measured",
            "window_bare": "window s/step bare",
            "cost": "cost of measuring (windows)",
            "measured": "reported tokens/s/GPU measured (median step)",
            "bare": "reported tokens/s/GPU bare (window)",
            "reported": "reported difference",
        }
    )
    for column in ("reported tokens/s/GPU measured (median step)", "reported tokens/s/GPU bare (window)"):
        table[column] = table[column].map(lambda v: f"{v:,.0f}")
    for column in ("window s/step measured", "window s/step bare"):
        table[column] = table[column].map(lambda v: f"{v:.4f}")
    for column in ("cost of measuring (windows)", "reported difference"):
        table[column] = table[column].map(lambda v: f"{100 * v:+.2f}%")
    return table


def _first(losses):
    if isinstance(losses, str):
        losses = json.loads(losses)
    return losses[0] if isinstance(losses, list) and losses else float("nan")


def _select(frame: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    present = {k: v for k, v in columns.items() if k in frame.columns}
    return frame[frame["status"].notna()][list(present)].rename(columns=present)


def main(view: str, sweep_dirs: list[str]) -> None:
    frames = [load_records(d).frame.assign(source=str(k + 1)) for k, d in enumerate(sweep_dirs)]
    frame = pd.concat(frames, ignore_index=True)
    table = {"perf": perf_table, "training": training_table, "overhead": overhead_table}[view](frame)
    print(markdown_table(printable(table)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
