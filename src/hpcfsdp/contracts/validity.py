"""Whether a record's measurement can be trusted, and why not: one rule for every reader.

A cell can finish `ok` and still measure nothing worth ranking: an optimizer that holds the
unsharded parameters (seed 003's `optimizer_order: before_shard`) trains nothing, so its step is
not a training step; a loss that ran away is no workload anyone runs; a rank on a shared GPU, or
fewer GPUs than asked (`resource_problems`, written by the cell), measures another machine than
the spec's. The report, the pivots, the recommendation, `tune` and the regression gate all ask
`invalid_reasons` and leave out a cell it gives reasons for; the report names it and why.

A record must also prove that it is the measurement of the cell whose folder holds it (issue 51).
A results folder is shared with people who can write into it. A record copied from another cell's
folder (its `cell_id` relabelled), or one whose figures were edited, must not be ranked. So:

- its spec must make the folder's cell id (cell_id_of: the id is a hash of the spec's fields
  that differ from their defaults; sweep/define/matrix.cell_id is this same function);
- its throughput must agree with its step time and its tokens per step: tokens/s x the timed
  window's step time = tokens per step = batch x seq_len x grad_accum x world size, and tokens/s
  per GPU x world size = tokens/s, each within FIGURE_TOLERANCE (what the cell writes is exact to
  a float's rounding; only an edited or a made-up figure is further off).

Either failing makes the record `corrupt` (record_state below), named by its path; unlike an
invalid one, it is no measurement of this cell at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .files import RecordError, read_json_object
from .jsontypes import shown
from .record import CORRUPT, MISSING, SPEC_NAME, RecordState, read_record
from .spec import RunSpec

# A loss that ends this many times above where it started ran away (a training that works lowers
# it; a few steps of noise move it by percents, not by half).
LOSS_GROWTH_DIVERGED = 1.5


def invalid_reasons(record: Mapping[str, Any]) -> list[str]:
    """Why this record's figures must not be ranked, in words a user reads; [] when they can be.

    Reads only what the record holds: `optimizer_tracks_model` with the measured
    `parameters_changed` of `parameters_total`, `resource_problems`, `losses`,
    `final_loss`, `float8_linears` with the spec's `float8`. A record without a field (an older
    hpcfsdp's) is judged on those it has."""
    reasons = []
    unchanged = _unchanged_parameters(record)
    if record.get("optimizer_tracks_model") is False:
        reasons.append(
            "the optimizer was built before sharding and does not update the model"
            + (f": {unchanged}" if unchanged else "")
        )
    elif unchanged:
        reasons.append(f"the model did not train: {unchanged}")
    problems = record.get("resource_problems")
    if isinstance(problems, list):
        reasons += [f"resources not as asked: {problem}" for problem in problems if isinstance(problem, str)]
    reasons += _divergence(record)
    spec = record.get("spec")
    float8 = spec.get("float8") if isinstance(spec, Mapping) else None
    if float8 not in (None, "none") and record.get("float8_linears") == 0:
        reasons.append(
            f"float8: {float8} was asked, but no Linear layer ran in float8: it measured the model unconverted"
        )
    return reasons


def _finite_ends(losses: Any) -> list[tuple[int, float]]:
    """(step from 1, loss) of the record's first finite loss and of its last, where that is
    another step: all _divergence compares, found from each end (not a walk of every step of
    every record a collect reads)."""
    if not isinstance(losses, Sequence) or isinstance(losses, str):
        return []
    first = next(((step, loss) for step, loss in enumerate(losses, 1) if _finite(loss)), None)
    if first is None:
        return []
    last = next((step, loss) for step, loss in zip(range(len(losses), 0, -1), reversed(losses)) if _finite(loss))
    return [(step, float(loss)) for step, loss in ([first] if last[0] == first[0] else [first, last])]


def _finite(loss: Any) -> bool:
    return isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)


def _unchanged_parameters(record: Mapping[str, Any]) -> str:
    """The cell's own evidence that its model did not train ("0 of 218 parameters changed over
    10 steps"), "" where some changed or the record did not count them (an older hpcfsdp's)."""
    changed, total, steps = record.get("parameters_changed"), record.get("parameters_total"), record.get("losses")
    if changed != 0 or not isinstance(total, int) or isinstance(total, bool) or total < 1:
        return ""
    over = f" over {len(steps)} steps" if isinstance(steps, Sequence) and not isinstance(steps, str) else ""
    return f"0 of {total:,} parameters changed{over}"


def _loss_evidence(losses: list[tuple[int, float]]) -> str:
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    return f"loss {first:.4g} at step {first_step}, {last:.4g} at step {last_step}"


def _divergence(record: Mapping[str, Any]) -> list[str]:
    """A loss that was not finite in a record that still says ok, or one that grew by
    LOSS_GROWTH_DIVERGED or more from the first step to the last."""
    if record.get("status") != "ok":
        return []  # a `diverged` record says so in its status
    nonfinite = record.get("nonfinite_steps")
    final = record.get("final_loss")
    if (isinstance(nonfinite, list) and nonfinite) or (isinstance(final, float) and not math.isfinite(final)):
        steps = ", ".join(str(s) for s in nonfinite) if isinstance(nonfinite, list) and nonfinite else "the last"
        return [f"the loss diverged: not finite at step(s) {steps}"]
    losses = _finite_ends(record.get("losses"))
    if len(losses) >= 2 and losses[0][1] > 0 and losses[-1][1] >= LOSS_GROWTH_DIVERGED * losses[0][1]:
        return [f"the loss diverged: it grew instead of falling ({_loss_evidence(losses)})"]
    return []


def is_trusted(record: Mapping[str, Any]) -> bool:
    """An `ok` record whose figures may be ranked."""
    return record.get("status") == "ok" and not invalid_reasons(record)


def within_noise(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two tokens/s spreads ({p10, p90}, a record's `tokens_per_s_spread`) overlap: the
    runs cannot tell the two setups apart. False where either has no spread."""
    if not a or not b:
        return False
    try:
        return float(a["p90"]) >= float(b["p10"]) and float(b["p90"]) >= float(a["p10"])
    except (KeyError, TypeError, ValueError):
        return False


_DEFAULTS = RunSpec().to_dict()
# json.dumps(values, sort_keys=True, separators=(",", ":")), its encoder made once, not per record
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
# Figures written by one float division each: a relative error of a few 1e-16. A thousand times a
# millionth still passes a figure that was rounded to 7 significant digits, and no edit that matters.
FIGURE_TOLERANCE = 1e-6
_ACCUM_IN_ID = re.compile(r"-bauto-a([0-9]+)-[0-9a-f]{10}$")


def cell_id_of(spec: Mapping[str, Any]) -> str:
    """The cell id of a spec given as field -> value (RunSpec.to_dict, vars of a RunSpec, a record's
    spec): a readable prefix plus a hash of the fields that differ from their defaults, so that the
    same cell keeps its id when a later hpcfsdp adds a field whose default keeps the old behaviour.
    A field the spec lacks (newer than the record) counts as its default."""
    values = {name: value for name, default in _DEFAULTS.items() if (value := spec.get(name, default)) != default}
    canonical = _CANONICAL.encode(values)
    digest = hashlib.sha1(canonical.encode()).hexdigest()[:10]
    batch = "auto" if spec.get("auto_batch") else spec.get("batch_size", _DEFAULTS["batch_size"])
    return f"{spec.get('strategy')}-b{batch}-a{spec.get('grad_accum', _DEFAULTS['grad_accum'])}-{digest}"


def identity_problem(record: Mapping[str, Any], cell_id: str, planned: Callable[[], Mapping[str, Any]]) -> str:
    """Why the record is not the measurement of cell `cell_id` ("" when it is): its spec makes
    another id. A `batch_size: auto` record holds the batch its search chose and the grad_accum
    derived from it, not the ones its id was made from: those are the id's own grad_accum and the
    search's first batch where no prediction moved it, or the default, or (read only then, by
    `planned`) the cell's spec.json's."""
    spec = record["spec"]
    if not spec.get("auto_batch"):
        made = cell_id_of(spec)
        return "" if made == cell_id else _other_cell(made)
    accum = _ACCUM_IN_ID.search(cell_id)
    if accum is None:
        return _other_cell(cell_id_of(spec))
    search = record.get("batch_search")
    starts = [_DEFAULTS["batch_size"]]
    if isinstance(search, Mapping) and search.get("predicted_batch") is None:
        starts.insert(0, search.get("first_batch"))
    for start in (*starts, None):
        if start is None:
            start = planned().get("batch_size")
        unsearched = {**spec, "batch_size": start, "grad_accum": int(accum.group(1))}
        if cell_id_of(unsearched) == cell_id:
            return ""
    return _other_cell(cell_id_of({**spec, "grad_accum": int(accum.group(1))}))


def _other_cell(made: str) -> str:
    return (
        f"its spec makes the cell id {made}, not its folder's: the record of another cell (or written "
        "before a default it holds changed); `hpcfsdp submit --retry-failed` runs this cell again"
    )


def figures_problem(record: Mapping[str, Any]) -> str:
    """Why the record's tokens/s cannot be what it measured ("" when it can): it disagrees with its
    tokens per step and the timed window's step time, or its tokens/s per GPU with tokens/s and the
    world size. Each relation is checked where the record holds both of its sides; an ok record
    without tokens/s per GPU ranks nowhere and is not checked."""
    per_gpu = _positive(record.get("tokens_per_s_per_gpu"))
    if record.get("status") != "ok" or per_gpu is None:
        return ""
    spec = record["spec"]
    world = _positive(record.get("world_size")) or spec.get("nodes", 1) * spec.get("gpus_per_node", 1)
    total, per_step = _positive(record.get("tokens_per_s")), _positive(record.get("tokens_per_step"))
    step = _positive(record.get("window_step_time_s"))
    if total is not None and not _close(per_gpu, total / world):
        return (
            f"tokens_per_s_per_gpu {per_gpu} is not tokens_per_s / world size = {total} / {world:g} = {total / world}"
        )
    if per_step is None:
        return ""
    batch = spec.get("batch_size", 1) * spec.get("seq_len", 0) * spec.get("grad_accum", 1) * world
    if per_step != batch:
        return f"tokens_per_step {per_step:g} is not batch_size x seq_len x grad_accum x world size = {batch:g}"
    if step is not None and not _close(total or per_gpu * world, per_step / step):
        given = f"tokens_per_s {total}" if total else f"tokens_per_s_per_gpu {per_gpu} x world size {world:g}"
        return f"{given} is not tokens_per_step / window_step_time_s = {per_step:g} / {step} = {per_step / step}"
    return ""


def _positive(value: Any) -> float | None:
    """A figure as a number: None unless it is a finite number above 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return value if ok else None


def _close(given: float, computed: float) -> bool:
    return math.isclose(given, computed, rel_tol=FIGURE_TOLERANCE)


def record_state(path: str | Path, root: str | Path | None = None, cell_id: str | None = None) -> RecordState:
    """missing, corrupt (with the one-line problem), or the record's status and the record. Given
    the cell_id its folder names, a record whose own cell_id is another's (a record copied from
    another cell's folder) is corrupt, and so is one whose spec makes another id or whose figures
    disagree (validity.py): it is no measurement of this cell (issue 44, item 10; issue 51)."""
    try:
        record = read_record(path, root)
    except FileNotFoundError:
        return RecordState(MISSING)
    except RecordError as exc:
        return RecordState(CORRUPT, problem=str(exc))
    own = record.get("cell_id")
    if cell_id is not None and own is not None and own != cell_id:
        return RecordState(CORRUPT, problem=f"{path}: the record of cell {shown(own)}, not of this cell's folder")
    problem = figures_problem(record) or (cell_id and identity_problem(record, cell_id, _planned_spec(path, root)))
    if problem:  # the record is kept: a caller that knows the plan tells a stale one (status.cell_state)
        return RecordState(CORRUPT, record, f"{path}: {problem}")
    return RecordState(record["status"], record)


def _planned_spec(path: str | Path, root: str | Path | None) -> Callable[[], dict[str, Any]]:
    """The spec of the cell's spec.json beside the record, read when called; {} where it has none."""

    def read() -> dict[str, Any]:
        try:
            spec = read_json_object(Path(path).with_name(SPEC_NAME), root, kind="cell spec").get("spec")
        except (RecordError, FileNotFoundError):
            return {}
        return spec if isinstance(spec, dict) else {}

    return read
