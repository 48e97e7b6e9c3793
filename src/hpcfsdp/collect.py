"""Records -> one pandas DataFrame -> comparison tables (CSV + Markdown)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .record import RECORD_NAME, RecordError, read_record

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


@dataclass
class Collection:
    frame: pd.DataFrame
    unreadable: list[str]


def load_records(sweep_dir: str | Path) -> Collection:
    """Every record under <sweep_dir>/cells; unreadable ones are listed by path, never fatal."""
    rows, unreadable = [], []
    for path in sorted(Path(sweep_dir).glob(f"cells/*/{RECORD_NAME}")):
        try:
            record = read_record(path)
        except RecordError as exc:
            unreadable.append(str(exc))
            continue
        rows.append(_flatten(record))
    return Collection(pd.DataFrame(rows), unreadable)


def _flatten(record: dict) -> dict:
    """Spec fields become top-level columns so tables can group by any of them."""
    row = {k: v for k, v in record.items() if k not in ("spec", "memory", "traceback")}
    row.update(record.get("spec", {}))
    for stage, reading in (record.get("memory") or {}).items():
        for key, value in reading.items():
            row[f"mem_{stage}_{key}"] = value
    return row


def comparison_table(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame(columns=[header for _, header in TABLE_COLUMNS])
    present = [(col, header) for col, header in TABLE_COLUMNS if col in frame.columns]
    table = frame[[col for col, _ in present]].rename(columns=dict(present))
    table = table.sort_values(["strategy", "batch", "accum"], kind="stable")
    return table.reset_index(drop=True)


def write_report(sweep_dir: str | Path) -> tuple[pd.DataFrame, Path, list[str]]:
    """Write report/results.csv (every column) and report/summary.md; return the table."""
    collection = load_records(sweep_dir)
    report = Path(sweep_dir) / "report"
    report.mkdir(parents=True, exist_ok=True)
    collection.frame.to_csv(report / "results.csv", index=False)
    table = comparison_table(collection.frame)
    lines = [f"# {Path(sweep_dir).name}: {len(table)} cell(s)", "", markdown_table(table), ""]
    if collection.unreadable:
        lines += ["## Unreadable records", "", *(f"- {msg}" for msg in collection.unreadable), ""]
    (report / "summary.md").write_text("\n".join(lines))
    return table, report, collection.unreadable


def markdown_table(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False, floatfmt=".4g") if len(table) else "(no records)"
