"""Comparing a sweep with a reference sweep cell by cell (`hpcfsdp collect --compare`):
per-metric deltas, regressions beyond a threshold, and the run-to-run noise that bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..contracts.files import write_text
from ..contracts.record import MISSING
from .read import INVALID_OUTCOME, METRICS, Collection, load_records, outcomes, value_text
from .render import Section, to_markdown
from .report import report_folder
from .tables import METRIC_NAMES, fmt


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


def compare_sweeps(
    current_dir: str | Path, reference_dir: str | Path, threshold: float = 0.05, current: Collection | None = None
) -> Comparison:
    """Deltas current / reference - 1 for every cell of the reference sweep; a change beyond
    threshold in the worse direction, or a cell ok in the reference and not now (failed, `invalid`:
    figures that cannot be trusted, or `missing`: no readable record in the current sweep), is a
    regression; an invalid cell's figures are compared with nothing. `current`: the current
    sweep's records where the caller read them already (collect reads each record once)."""
    current = current if current is not None else load_records(current_dir)
    reference = load_records(reference_dir)
    cur = current.frame.reindex(columns=["cell_id", "status", *METRICS])
    ref = reference.frame.reindex(columns=["cell_id", "strategy", "batch_size", "status", *METRICS])
    for frame, read in ((cur, current), (ref, reference)):
        frame[list(METRICS)] = frame[list(METRICS)].apply(pd.to_numeric, errors="coerce")
        if not frame.empty:  # an untrusted ok cell is `invalid`: its figures are compared with nothing
            frame["status"] = outcomes(read.frame)
            frame.loc[frame["status"] == INVALID_OUTCOME, list(METRICS)] = float("nan")
    paired = ref.merge(cur, on="cell_id", suffixes=("_ref", ""), how="left").sort_values(
        ["strategy", "batch_size", "cell_id"]
    )
    paired["status"] = paired["status"].fillna(MISSING)

    table = pd.DataFrame(
        {
            "cell": paired["cell_id"],
            "strategy": paired["strategy"],
            "batch": paired["batch_size"].map(value_text),
            "status": [
                s if s == r else f"{r} -> {s}" for s, r in zip(paired["status"], paired["status_ref"], strict=False)
            ],
        }
    )
    regressions, flagged = [], pd.Series(False, index=paired.index)
    for metric, worse in WORSE.items():
        change = paired[metric] / paired[f"{metric}_ref"] - 1
        table[METRIC_NAMES[metric]] = [
            _delta(metric, r, c, d) for r, c, d in zip(paired[f"{metric}_ref"], paired[metric], change, strict=False)
        ]
        bad = worse * change > threshold
        flagged |= bad
        regressions += [
            f"{cid}: {METRIC_NAMES[metric]} {_delta(metric, r, c, d)}"
            for cid, r, c, d in zip(
                paired["cell_id"][bad], paired[f"{metric}_ref"][bad], paired[metric][bad], change[bad], strict=False
            )
        ]
    lost = (paired["status_ref"] == "ok") & (paired["status"] != "ok")
    flagged |= lost
    regressions += [
        f"{cid}: status ok -> {status}"
        for cid, status in zip(paired["cell_id"][lost], paired["status"][lost], strict=False)
    ]
    table["regression"] = flagged.map({True: "REGRESSION", False: ""}).to_numpy()

    notes = [f"threshold {threshold:.1%}; delta = current / reference - 1"]
    cur_ids, ref_ids = set(cur["cell_id"]), set(ref["cell_id"])
    if cur_ids != ref_ids:
        notes.append(
            f"unmatched: {len(cur_ids - ref_ids)} cell(s) only in the current sweep, "
            f"{len(ref_ids - cur_ids)} only in the reference"
        )
    if ref_ids and not cur_ids & ref_ids:
        notes.append(
            "no cell in common: a cell id hashes the spec's non-default fields, so a field changed between "
            "the two sweeps (or ids made before hpcfsdp hashed only those) gives every cell a new id, and "
            "every ok reference cell counts as missing"
        )
    notes += [
        f"{name}: {len(c.unreadable)} unreadable record(s) skipped"
        for name, c in (("current", current), ("reference", reference))
        if c.unreadable
    ]
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
    ok = frame[outcomes(frame) == "ok"]
    stats = (
        pd.to_numeric(ok["tokens_per_s_per_gpu"], errors="coerce")
        .groupby([ok[k] for k in keys], dropna=False)
        .agg(["std", "mean", "size"])
    )
    stats = stats[stats["size"] > 1]
    if stats.empty:
        return None
    return float((stats["std"] / stats["mean"]).median()), len(stats)


def _noise_note(collections: dict[str, Collection], threshold: float) -> str:
    parts, worst = [], 0.0
    for name, collection in collections.items():
        noise = run_to_run_noise(collection)
        if noise:
            parts.append(
                f"{name} {noise[0]:.1%} (median CV of tokens/s/gpu over {noise[1]} config(s) repeated with other seeds)"
            )
            worst = max(worst, noise[0])
    if not parts:
        return "run-to-run noise unknown: no config repeated with another seed"
    warning = "; the threshold is below 2x the noise, expect false alarms" if threshold < 2 * worst else ""
    return "run-to-run noise: " + "; ".join(parts) + warning


def write_comparison(
    sweep_dir: str | Path, reference_dir: str | Path, threshold: float, current: Collection | None = None
) -> tuple[Comparison, str, Path]:
    """Compare and write report/compare.md; returns the comparison, its text and the file."""
    comparison = compare_sweeps(sweep_dir, reference_dir, threshold, current)
    text = comparison.render(str(sweep_dir), str(reference_dir))
    path = report_folder(Path(sweep_dir)) / "compare.md"
    write_text(path, text)
    return comparison, text, path
