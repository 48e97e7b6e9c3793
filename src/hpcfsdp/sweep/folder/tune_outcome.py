"""tune.json's shape, declared once, and its one reader: what `hpcfsdp tune` writes (tune/output.py)
and what the report's tune section and `submit --only-best` read (results/tuned.py, tune/output.py).

The file sits in a sweep folder anyone of a team may write, so it is checked as records are
(jsontypes): every key a reader uses has its type, and every figure the records' range (0 to
1e15: a made-up pick at 1e308 tokens/s is refused, never printed). A file that fails is a
RecordError in one line; the report says so in its tune section, and collect goes on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

from ...contracts.files import RecordError, read_json_object
from ...contracts.jsontypes import Checked, Figure, shown, value_problem
from ...contracts.record import Spread
from .layout import TUNE_NAME

SetupValue = str | int | float | bool | None


class TuneRow(TypedDict, total=False):
    """One setup of the ranking (and of best, oom_frontier, failed): its furthest stage's result."""

    cell_id: Checked[str]
    stage: Checked[str]
    depth: Checked[int]
    run: Checked[str]
    computed_from: Checked[str]
    setup: Checked[dict[str, SetupValue]]
    status: Checked[str]
    tokens_per_s_per_gpu: Figure[float | None]
    timed_steps: Figure[int | None]
    peak_memory_gib: Figure[float | None]
    error: Checked[str]
    # what tune adds to a row: the spread of its tokens/s, a repeated pick's two runs and the setups
    # it is within noise of, an untrusted run's reasons (contracts/validity.py)
    tokens_per_s_spread: Checked[Spread | None]
    runs_tokens_per_s_per_gpu: Checked[list[Figure[float]]]
    within_noise_of: Checked[list[str]]
    invalid_reasons: Checked[list[str]]


class TuneSpend(TypedDict, total=False):
    tune_gpu_hours: Figure[float]
    by_stage: Checked[dict[str, Figure[float]]]
    launches: Figure[int]
    grid_cells: Figure[int]
    grid_estimate_gpu_hours: Figure[float | None]
    grid_estimate_basis: Checked[str]
    fraction_of_grid: Figure[float | None]


class TuneOutcome(TypedDict, total=False):
    sweep: Checked[str]
    best: Checked[TuneRow | None]
    pruned: Checked[dict[str, str]]
    notes: Checked[list[str]]
    spend: Checked[TuneSpend]


ROW_LISTS = ("ranking", "oom_frontier", "failed", "invalid")  # lists of TuneRow, checked row by row (stages: no reader)


def read_outcome(sweep_dir: Path) -> dict[str, Any]:
    """tune.json of the sweep folder, checked; FileNotFoundError where no tune ran, RecordError (one
    line naming the file and the first value that is wrong) where it cannot be used."""
    path = Path(sweep_dir) / TUNE_NAME
    found = read_json_object(path, root=sweep_dir, kind="tune outcome")
    if problem := outcome_problem(found):
        raise RecordError(f"{path}: unusable tune outcome ({problem})")
    return found


def outcome_problem(found: dict[str, Any]) -> str:
    """The first value of tune.json that is not what TuneOutcome declares ("" for none)."""
    declared = {key: value for key, value in found.items() if key not in (*ROW_LISTS, "stages")}
    if problem := value_problem("tune.json", declared, TuneOutcome):
        return problem.removeprefix("tune.json.")
    for key in ROW_LISTS:
        rows = found.get(key, [])
        if not isinstance(rows, list):
            return f"{key}: expected a list, got {shown(rows)}"
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                return f"{key}[{index}]: expected an object, got {shown(row)}"
            if problem := value_problem(f"{key}[{index}]", row, TuneRow):
                return problem
    return ""
