"""The one line `hpcfsdp run` ends with on rank 0: what happened, how fast, how much memory, where the record is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...contracts.gpus import rank_words


def summary_line(record: Mapping[str, Any], path: Path) -> str:
    """E.g. `[hpcfsdp] ddp-b1-a1-...: ok | 1,234 tokens/s per GPU | MFU 41.2% | peak memory 3.21 GiB | record ...`.

    A failed cell says where it stopped instead (`oom at train`, `diverged at step 2`), with "-"
    for what it did not measure and the memory it had reached when it failed.
    """
    status = record.get("status", "?")
    if status == "diverged":
        status += f" at step {record.get('diverged_step')}"
    elif status != "ok":
        status += f" at {record.get('stage', '?')}"
    speed = record.get("tokens_per_s_per_gpu")
    mfu = record.get("mfu")
    memory = record.get("memory_at_failure") or {}
    peak = record.get("peak_memory_gib", memory.get("peak_allocated_gib", memory.get("cpu_max_rss_gib")))
    per = rank_words([record.get("device_type")]).per  # per process on the CPU
    parts = [
        f"[hpcfsdp] {record.get('cell_id', '?')}: {status}",
        f"{speed:,.0f} tokens/s {per}" if speed is not None else f"- tokens/s {per}",
        f"MFU {mfu:.1%}" if mfu is not None else "MFU -",
        f"peak memory {peak:.2f} GiB" if peak is not None else "peak memory -",
        f"record {path}",
    ]
    return " | ".join(parts)
