#!/usr/bin/env python3
"""Weak-scaling efficiency per strategy from a sweep's records: tokens/s per GPU at N GPUs over
the same cell's figure at 1 GPU (same model, batch, sequence length), and exposed communication.

    python bench/scaling_table.py results/scaling
"""

from __future__ import annotations

import sys

from hpcfsdp.results.read import load_records
from hpcfsdp.results.render import markdown_table
from hpcfsdp.results.tables import printable

KEY = ["model", "strategy", "batch_size", "seq_len"]


def scaling_table(sweep_dir: str):
    frame = load_records(sweep_dir).frame
    ok = frame[frame["status"] == "ok"].copy()
    one_gpu = ok[ok["world_size"] == 1].set_index(KEY)["tokens_per_s_per_gpu"].rename("one_gpu")
    ok = ok.join(one_gpu, on=KEY)
    ok["weak_scaling_efficiency"] = ok["tokens_per_s_per_gpu"] / ok["one_gpu"]
    columns = [
        *KEY,
        "world_size",
        "hsdp_shard_size",
        "tokens_per_s_per_gpu",
        "weak_scaling_efficiency",
        "comm_exposed_s_per_step",
        "comm_exposed_fraction",
        "peak_memory_gib",
    ]
    return ok[[c for c in columns if c in ok]].sort_values([*KEY, "world_size"])


if __name__ == "__main__":
    print(markdown_table(printable(scaling_table(sys.argv[1]))))
