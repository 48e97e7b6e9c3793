"""Over time: append a collection to the history, then check each cell against its reference and
against the earlier runs of its setup on its system (docs/history.md).

Flagged as a regression:
- tokens/s per GPU below its reference by more than the tolerance, or peak memory above it;
- tokens/s per GPU below the median of the earlier ok runs of its setup on its system (cluster and
  GPU) by more than the tolerance;
- a cell that is not ok while its setup has a reference or ran ok on its system before.
A cell whose figures cannot be trusted (contracts/validity.py) is checked against nothing, and
earlier such runs are no history to check against.
A cell faster than its reference by more than the tolerance is named too, as a hint to update the
reference, but is no regression.

And a sweep against a reference sweep, cell by cell (`hpcfsdp collect --compare`): per-metric
deltas, regressions beyond a threshold, and the run-to-run noise that bounds it.
"""

from __future__ import annotations

import json
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..contracts.files import write_text
from ..contracts.record import MISSING
from ..sweep.folder.layout import planned_cell_ids
from .defaults import DEFAULT_TOLERANCE
from .history import HistoryError, updated_history
from .history_rows import KEY, history_rows
from .read import INVALID_OUTCOME, METRICS, Collection, frame_rows, load_records, outcomes, value_text
from .references import Reference, References
from .render import Section, to_markdown
from .report import ROW_LIMIT, report_folder
from .tables import METRIC_NAMES, fmt

REGRESSION = "REGRESSION"


@dataclass(frozen=True)
class OverTimeOptions:
    history: Path | None  # None: --no-history
    references: References = field(default_factory=References)  # read and checked before anything is written
    tolerance: float = DEFAULT_TOLERANCE


@dataclass
class OverTime:
    """What the checks found: a table of the cells that had something to be compared with, one
    line per regression, hints (faster than the reference) and notes (what was appended)."""

    table: pd.DataFrame
    regressions: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unchecked: str = ""  # why the history could not be updated and checked against: collect then fails

    def section(self) -> Section:
        text = " ".join(self.notes)
        if self.table.empty:
            return Section("Over time", text=text)
        shown = self.table.head(ROW_LIMIT)
        if len(self.table) > ROW_LIMIT:
            text += f" The first {ROW_LIMIT:,} of {len(self.table):,} checked cells, regressions first."
        return Section("Over time", text=text, table=shown, items=[*self.regressions, *self.hints])


def over_time(
    collection: Collection, sweep_dir: Path, options: OverTimeOptions, log: Callable[[str], None] = print
) -> OverTime:
    """Append the collection to the history (unless there is none) and check every record. A
    history that cannot be updated (locked past the wait, a full disk, not a DuckDB file) is no
    pass: the result says why in `unchecked`, and collect fails."""
    references = options.references
    rows = history_rows(collection, sweep_dir)
    notes, earlier, unchecked = [], None, ""
    if options.history is not None:
        try:
            with updated_history(options.history, log) as store:
                added = store.append(rows)
                earlier = store.earlier_runs(rows)
            notes.append(f"History: {added} new row(s) in {options.history} ({len(rows) - added} collected before).")
        except HistoryError as exc:
            unchecked = str(exc)
            notes.append(f"History not updated, so no cell was checked against it: {exc}.")
    if references.path:
        notes.append(f"References: {len(references.entries)} in {references.path}.")
    result = check(rows, earlier, references, options.tolerance)
    result.notes[:0] = notes
    result.unchecked = unchecked
    return result


def check(rows: pd.DataFrame, earlier: pd.DataFrame | None, references: References, tolerance: float) -> OverTime:
    """Compare each history row of the current collection with its reference and its earlier runs."""
    if earlier is not None and not earlier.empty:
        rows = rows.merge(earlier, on=list(KEY), how="left")
    else:
        rows = rows.assign(history_median=float("nan"), history_runs=0)
    rows["history_runs"] = rows["history_runs"].fillna(0).astype(int)
    out = OverTime(pd.DataFrame())
    table, unchecked, flagged = [], 0, 0
    needed = [
        "cell_id",
        "setup",
        "cluster",
        "gpu",
        "spec",
        "status",
        "tokens_per_s_per_gpu",
        "peak_memory_gib",
        "history_median",
        "history_runs",
        "invalid_reasons",
    ]
    row_of = namedtuple("Row", needed)  # type: ignore[misc]  # one named tuple per history row
    records: list[Any] = [row_of._make(values) for values in frame_rows(rows[needed])]
    invalid = [row.cell_id for row in records if isinstance(row.invalid_reasons, str)]
    for row in records:
        if isinstance(row.invalid_reasons, str):
            continue
        ref = references.find(row.cluster, row.gpu, row.setup, json.loads(row.spec)) if references.entries else None
        if ref is None and not row.history_runs:
            unchecked += 1
            continue
        problems, hints = _problems(row, ref, references.tolerance_of(ref, tolerance) if ref else tolerance, tolerance)
        flagged += bool(problems)
        out.regressions += [f"{row.cell_id}: {p}" for p in problems]
        out.hints += [f"{row.cell_id}: {h}" for h in hints]
        table.append(
            {
                "cell": row.cell_id,
                "setup": row.setup,
                "system": f"{row.cluster or '-'} / {row.gpu or '-'}",
                "status": row.status,
                "tokens/s/gpu": fmt("tokens_per_s_per_gpu", row.tokens_per_s_per_gpu),
                "reference": (
                    f"{fmt('tokens_per_s_per_gpu', ref.tokens_per_s_per_gpu)} "
                    f"±{references.tolerance_of(ref, tolerance):.0%}"
                )
                if ref
                else "-",
                "history median (runs)": (
                    f"{fmt('tokens_per_s_per_gpu', row.history_median)} ({row.history_runs})"
                    if row.history_runs
                    else "-"
                ),
                "verdict": REGRESSION if problems else ("faster" if hints else "ok"),
            }
        )
    if table:
        frame = pd.DataFrame(table)
        out.table = frame.sort_values("verdict", key=lambda v: v != REGRESSION, kind="stable").reset_index(drop=True)
    out.notes.append(
        f"Tolerance {tolerance:.0%} (a reference may set its own). {len(table)} cell(s) checked, "
        f"{flagged} with a regression; "
        f"{unchecked} with neither a reference nor an earlier run of their setup on their system."
        + (
            f" Not checked: {len(invalid)} cell(s) whose figures cannot be trusted ({', '.join(invalid)})."
            if invalid
            else ""
        )
    )
    return out


def _problems(row: Any, ref: Reference | None, ref_tolerance: float, tolerance: float) -> tuple[list[str], list[str]]:
    """The regressions of one cell (a history row), and its hints."""
    problems: list[str] = []
    hints: list[str] = []
    system = f"{row.cluster or '-'} / {row.gpu or '-'}"
    if row.status != "ok":
        if ref is not None:
            problems.append(
                f"status {row.status}; its reference ({ref.where}) expects "
                f"{fmt('tokens_per_s_per_gpu', ref.tokens_per_s_per_gpu)} tokens/s/gpu"
            )
        else:
            problems.append(f"status {row.status}; its setup ran ok {row.history_runs} time(s) before on {system}")
        return problems, hints
    tokens = row.tokens_per_s_per_gpu
    if ref is not None and pd.notna(tokens):
        change = tokens / ref.tokens_per_s_per_gpu - 1
        expected = fmt("tokens_per_s_per_gpu", ref.tokens_per_s_per_gpu)
        shown = (
            f"tokens/s/gpu {fmt('tokens_per_s_per_gpu', tokens)} is {abs(change):.1%} {{}} its reference "
            f"{expected} (tolerance {ref_tolerance:.0%}; {ref.where})"
        )
        if change < -ref_tolerance:
            problems.append(shown.format("below"))
        elif change > ref_tolerance:
            hints.append(shown.format("above") + ": `hpcfsdp history --set-reference` updates it")
    if ref is not None and ref.peak_memory_gib and pd.notna(row.peak_memory_gib):
        change = row.peak_memory_gib / ref.peak_memory_gib - 1
        if change > ref_tolerance:
            problems.append(
                f"peak memory {row.peak_memory_gib:.2f} GiB is {change:.1%} above its reference "
                f"{ref.peak_memory_gib:.2f} GiB (tolerance {ref_tolerance:.0%}; {ref.where})"
            )
    if row.history_runs and pd.notna(tokens):
        change = tokens / row.history_median - 1
        if change < -tolerance:
            problems.append(
                f"tokens/s/gpu {fmt('tokens_per_s_per_gpu', tokens)} is {-change:.1%} below the median "
                f"{fmt('tokens_per_s_per_gpu', row.history_median)} of {row.history_runs} earlier run(s) "
                f"of setup {row.setup} on {system} (tolerance {tolerance:.0%})"
            )
    return problems, hints


# ---------------------------------------------------------------------------------------------
# --compare: a sweep against a reference sweep


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


NOT_IN_SWEEP = "not in the current sweep"


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
    # A reference cell the current sweep never had (no spec.json, no record: another matrix) did not
    # go missing: it is not compared, and no regression.
    had = set(cur["cell_id"]) | set(planned_cell_ids(Path(current_dir))) | set(current.missing.get("cell_id", []))
    never = ~paired["cell_id"].isin(had)
    table = pd.DataFrame(
        {
            "cell": paired["cell_id"],
            "strategy": paired["strategy"],
            "batch": paired["batch_size"].map(value_text),
            "status": [
                f"{r}; {NOT_IN_SWEEP}" if n else s if s == r else f"{r} -> {s}"
                for s, r, n in zip(paired["status"], paired["status_ref"], never, strict=False)
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
    lost = (paired["status_ref"] == "ok") & (paired["status"] != "ok") & ~never
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
