"""`hpcfsdp collect` (and the table `submit` prints once its cells ended): Slurm accounting into the
records, the history and references checks, the report, and what is printed of them.

Its order matters: a bad references file stops the command before anything is written; the
accounting is added to the records before they are read into the history and the report; the
figures start drawing (in a worker process) before the history is checked, on the core the check
leaves idle.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..contracts.errors import COLLECT_REGRESSED, COLLECT_UNCHECKED
from ..contracts.fields import SpecError
from ..contracts.files import RecordError
from ..contracts.jsontypes import strict_json
from ..contracts.record import CORRUPT, RECORD_NAME
from ..progress import Progress
from ..sweep.folder.guards import require_sweep_folder, require_utf8_path
from ..sweep.folder.layout import (
    CELLS_DIR,
    cell_ids_with,
    read_manifest,
    slurm_jobs,
)
from ..sweep.track.accounting import note_accounting
from ..sweep.track.status import resources_line
from .defaults import DEFAULT_TOLERANCE, HISTORY_NAME, REFERENCES_NAME
from .read import INVALID
from .regressions import OverTimeOptions
from .tables import CELL_FIGURES

PROGRESS_MIN_RECORDS = 500  # a sweep of fewer records collects without progress lines


def over_time_options(
    sweep_dir: Path,
    history: Path | None = None,
    references: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    use_history: bool = True,
) -> OverTimeOptions:
    """The history and references a collection of sweep_dir uses: those given, else the defaults
    beside the sweep folder (results/history.duckdb, results/references.yaml where it exists)."""
    from .references import References, load_references

    beside = sweep_dir.resolve().parent
    path = Path(references) if references else beside / REFERENCES_NAME
    return OverTimeOptions(
        history=(history or beside / HISTORY_NAME) if use_history else None,
        references=load_references(path) if path.is_file() else References(),
        tolerance=tolerance,
    )


def collect(
    sweep_dir: Path,
    baseline: str | None = None,
    plots: bool = True,
    compare: Path | None = None,
    threshold: float = 0.05,
    over_time: OverTimeOptions | None = None,
    fail_on_regression: bool = False,
    as_json: bool = False,
) -> int:
    """Add Slurm accounting, append to the history and check each cell over time, write the report;
    print the comparison against `compare` if given, the cell table, the regressions, and what was
    written (as_json: all that on stderr, and one JSON document on stdout). The exit status: 1 when
    a cell regressed against `compare` (or, with fail_on_regression, against its reference or
    history); else 3 when the history could not be updated and checked (the gate could not look:
    never a pass); else 0. A collect that takes a while shows its progress on stderr (progress.py)."""
    from .history_rows import accounting_jobs, merge_accounting
    from .read import load_records
    from .regressions import over_time as check_over_time
    from .regressions import write_comparison
    from .report import report_started
    from .tables import cells_document, printed_comparison

    def say(line: str) -> None:  # what the command prints: stdout, or stderr beside a JSON document
        print(line, file=sys.stderr if as_json else sys.stdout)

    for folder in (sweep_dir, compare):
        if folder is not None and not folder.is_dir():
            raise SpecError(f"{folder}: no such sweep folder")
    require_sweep_folder(sweep_dir)  # as status: no report, nor a history beside it, in a folder that is no sweep
    require_utf8_path(Path(sweep_dir).absolute())
    options = over_time or over_time_options(sweep_dir)  # a bad references file stops here, before any writing
    progress = Progress("reading records", min_count=PROGRESS_MIN_RECORDS)
    recorded = cell_ids_with(sweep_dir, RECORD_NAME)  # listed once: for squeue's question, and to read
    collection = load_records(sweep_dir, scheduler_states(sweep_dir, recorded), progress, recorded)
    progress.stage("adding Slurm accounting and checking the history")
    merge_accounting(collection.frame, note_accounting(sweep_dir, accounting_jobs(collection.frame)))
    with report_started(sweep_dir, collection, baseline, plots) as write_rest:  # the figures draw meanwhile
        checked = check_over_time(collection, sweep_dir, options, log=lambda line: print(line, file=sys.stderr))
        if checked.unchecked:  # never a silent pass: the gate could not look (collect exits 1)
            print(f"error: history {checked.unchecked}; --no-history collects without it", file=sys.stderr)
        progress.stage("writing the report" + (" and its plots" if plots else ""))
        report = write_rest((checked.section(),))
    progress.done("collect")
    for message in report.unreadable:
        print(f"warning: skipped {message}", file=sys.stderr)
    for message in report.unplanned:
        print(f"warning: not ranked: {message}", file=sys.stderr)
    for note in report.notes:
        print(f"warning: {note}", file=sys.stderr)
    for line in resource_warnings(collection.frame):
        print(f"warning: {line}", file=sys.stderr)
    regressions: list[str] = []
    if compare is not None:
        comparison, text, path = write_comparison(sweep_dir, compare, threshold, collection)
        regressions = [str(line) for line in comparison.regressions]
        say(text)
        say(f"wrote {path}\n")
    for line in report.untrusted:  # first: a broken setup is the first thing a user must hear of
        say(f"not ranked (its figures cannot be trusted): {line}")
    for line in report.recommendation:
        say(line)
    say(printed_comparison(report.table, report.directory / "results.csv"))
    say("over time: " + " ".join(checked.notes))
    for line in checked.regressions:
        say(f"regression: {line}")
    for line in checked.hints:
        say(f"note: {line}")
    tables = [p.name for p in report.files if p.suffix != ".png"]
    plots_drawn = len(report.files) - len(tables)
    skipped = "".join(f"; no {name} plot: {why}" for name, why in report.skipped_plots.items())
    say(f"wrote {report.directory}/: {', '.join(tables)}, {plots_drawn} plot(s) in plots/{skipped}")
    if regressions or (fail_on_regression and checked.regressions):
        code = COLLECT_REGRESSED
    else:
        code = COLLECT_UNCHECKED if checked.unchecked else 0
    if as_json:
        print(
            strict_json(
                {
                    "sweep_dir": str(sweep_dir),
                    "exit_status": code,
                    "cells": cells_document(collection.cells, collection.spec_fields)
                    + corrupt_cells(recorded, collection),
                    "recommendation": report.recommendation,
                    "untrusted": report.untrusted,
                    "regressions": [*checked.regressions, *regressions],
                    "notes": [*checked.notes, *checked.hints],
                    "unreadable": report.unreadable,
                    "unplanned": report.unplanned,
                    "history_unchecked": checked.unchecked or None,
                    "files": [str(path) for path in report.files],
                }
            )
        )
    return code


def corrupt_cells(recorded: list[str], collection: Any) -> list[dict[str, Any]]:
    """`collect --json`'s entries for the cells whose record could not be read: status `corrupt`,
    the reader's line (naming the file) as the reason, no figures; after the table's cells. A cell
    no plan made is none of them: `unplanned` lists it apart."""
    read = set(collection.frame["cell_id"]) if "cell_id" in collection.frame else set()
    entries: list[dict[str, Any]] = []
    for cell_id in (cid for cid in recorded if cid not in read):
        folder = f"{CELLS_DIR}/{cell_id}/"
        if any(folder in line for line in collection.unplanned):
            continue
        reason = next((line for line in collection.unreadable if folder in line), f"{folder}{RECORD_NAME}: unreadable")
        entries.append(
            {
                **dict.fromkeys(("job_id", "strategy", "tokens_per_s_spread")),
                **{key: None for _, key in CELL_FIGURES},
                **{"cell_id": cell_id, "status": CORRUPT, "reason": reason, "fields": {}, INVALID: []},
            }
        )
    return entries


def resource_warnings(frame: Any) -> list[str]:
    """A line for each cell whose record says it ran on other resources than it asked for."""
    if "resource_problems" not in frame:
        return []
    cells, problems = frame["cell_id"].tolist(), frame["resource_problems"].tolist()
    lines = (resources_line(cell, problem) for cell, problem in zip(cells, problems, strict=True))
    return [line for line in lines if line]


def scheduler_states(sweep_dir: Path, recorded: list[str]) -> dict[str, str] | None:
    """Cell id -> Slurm's state of its latest job, for the sweep's Slurm cells without a record
    (`recorded`: the cells with one); None when squeue does not answer (collect then says it does
    not know)."""
    from ..sweep.track.status import sweep_status

    with_record = set(recorded)
    try:
        cell_ids = [cid for cid in read_manifest(sweep_dir) if cid not in with_record]
    except RecordError:  # collect names the broken manifest itself
        return {}
    if not slurm_jobs(sweep_dir, cell_ids).ids:
        return {}
    report = sweep_status(sweep_dir, cell_ids)
    return (
        None
        if report.note
        else {c.cell_id: f"{c.slurm} ({c.reason})" if c.reason else c.slurm for c in report.cells if c.job_id}
    )
