"""The report's sections on what the sweep folder holds beside the records.

Tune: what `hpcfsdp tune` found (tune.json in the sweep folder, written by tune/output.py): the
pick, the ranking with each setup's furthest stage, the OOM frontier, what was left out before
running, and the search's spend against the grid's. The final stage's cells are the sweep's own
cells, so their figures stand in the report's tables beside any grid cell.

Profiles: the torch.profiler traces that `profile: true` cells wrote in cells/<id>/profile/
(cell/profiling.py: one Chrome-trace JSON per rank), linked relative to the report, with how to
open them (docs/collector.md, "Profiles"). Only regular files inside the cell's own profile folder
are linked, and only names a trace handler writes (letters, digits, `.`, `_`, `-`): the folder may
hold what another user put there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd

from ..contracts.files import RecordError
from ..contracts.fs.beneath import entries
from ..contracts.gpus import rank_words_named
from ..sweep.folder.layout import cell_dir, cell_ids_with
from ..sweep.folder.tune_outcome import read_outcome
from .render import Section


def tune_section(sweep_dir: Path) -> Section | None:
    """None where no tune ran in this folder; a section saying so where its tune.json cannot be used
    (unreadable, or a value of the wrong type or out of the records' ranges: tune_outcome.py)."""
    try:
        found = read_outcome(sweep_dir)
    except FileNotFoundError:
        return None
    except RecordError as exc:
        return Section("Tune", text=f"Not shown: {exc}.")
    best = found.get("best") or {}
    spend = found.get("spend") or {}
    grid = spend.get("grid_estimate_gpu_hours")
    words = rank_words_named(found.get("rank"))  # GPU, or process on the CPU (tune.json's `rank`)
    spent = f"{spend.get('tune_gpu_hours') or 0.0:.4f} {words.hours} in {spend.get('launches') or 0} launch(es)"
    text = (
        f"Chosen by `hpcfsdp tune`: {best.get('cell_id') or 'none'}"
        + (f", {best['tokens_per_s_per_gpu']:,.1f} tokens/s {words.per}" if best.get("tokens_per_s_per_gpu") else "")
        + (f" (mean of {len(best['runs_tokens_per_s_per_gpu'])} runs)" if best.get("runs_tokens_per_s_per_gpu") else "")
        + (f", within noise of {', '.join(best['within_noise_of'])}" if best.get("within_noise_of") else "")
        + f". The search spent {spent}"
        + (f", against about {grid:.4f} for the grid ({spend.get('grid_estimate_basis') or ''})." if grid else ".")
    )
    rows = [
        {
            "cell": row.get("cell_id"),
            "stage": row.get("stage"),
            "status": row.get("status"),
            "tokens/s/gpu": round(row["tokens_per_s_per_gpu"], 1) if row.get("tokens_per_s_per_gpu") else None,
            "computed from": row.get("computed_from", ""),
            **(row.get("setup") or {}),
        }
        for row in found.get("ranking") or []
    ]
    items = [f"OOM: {row.get('cell_id')} (at {row.get('stage')})" for row in found.get("oom_frontier") or []]
    items += [f"left out before running: {cell}: {why}" for cell, why in (found.get("pruned") or {}).items()]
    items += [f"note: {note}" for note in found.get("notes") or []]
    return Section("Tune", text=text, table=pd.DataFrame(rows) if rows else None, items=items)


PROFILE_DIR = "profile"  # cells/<id>/profile/: cell/profiling.write_trace's folder
TRACE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.pt\.trace\.json(\.gz)?")
HOW_TO_OPEN = (
    "Each file is one rank's trace (Chrome trace format). Open it at https://ui.perfetto.dev "
    "(Open trace file; nothing is uploaded), or with TensorBoard's profiler plugin: "
    "`pip install torch-tb-profiler` then `tensorboard --logdir <the cell's profile folder>`."
)


def profile_sections(sweep_dir: Path, cell_ids: list[str], report: Path) -> list[Section]:
    """The cells' traces, a link each (relative to the report folder); none where no cell has one."""
    links = []
    for cell_id in sorted(set(cell_ids) & set(cell_ids_with(sweep_dir, PROFILE_DIR))):  # one scandir, not a stat a cell
        folder = cell_dir(sweep_dir, cell_id) / PROFILE_DIR
        if folder.is_symlink() or not folder.is_dir():
            continue
        for entry in sorted(entries(folder), key=lambda entry: entry.name):  # a link is never a trace
            if TRACE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                links.append((f"{cell_id}: {entry.name}", Path(os.path.relpath(entry.path, report)).as_posix()))
    return [Section("Profiles", text=HOW_TO_OPEN, links=links)] if links else []
