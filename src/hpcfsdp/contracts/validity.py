"""Whether a record's measurement can be trusted, and why not: one rule for every reader.

A cell can finish `ok` and still measure nothing worth ranking: an optimizer that holds the
unsharded parameters (seed 003's `optimizer_order: before_shard`) trains nothing, so its step is
not a training step; a loss that ran away is no workload anyone runs; a rank on a shared GPU, or
fewer GPUs than asked (`resource_problems`, written by the cell), measures another machine than
the spec's. The report, the pivots, the recommendation, `tune` and the regression gate all ask
`invalid_reasons` and leave out a cell it gives reasons for; the report names it and why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

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
    losses = _finite_losses(record.get("losses"))
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
    reasons += _divergence(record, losses)
    spec = record.get("spec")
    float8 = spec.get("float8") if isinstance(spec, Mapping) else None
    if float8 not in (None, "none") and record.get("float8_linears") == 0:
        reasons.append(
            f"float8: {float8} was asked, but no Linear layer ran in float8: it measured the model unconverted"
        )
    return reasons


def _finite_losses(losses: Any) -> list[tuple[int, float]]:
    """(step from 1, loss) for each finite loss of the record."""
    if not isinstance(losses, Sequence) or isinstance(losses, str):
        return []
    return [
        (step, float(loss))
        for step, loss in enumerate(losses, 1)
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
    ]


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


def _divergence(record: Mapping[str, Any], losses: list[tuple[int, float]]) -> list[str]:
    """A loss that was not finite in a record that still says ok, or one that grew by
    LOSS_GROWTH_DIVERGED or more from the first step to the last."""
    if record.get("status") != "ok":
        return []  # a `diverged` record says so in its status
    nonfinite = record.get("nonfinite_steps")
    final = record.get("final_loss")
    if (isinstance(nonfinite, list) and nonfinite) or (isinstance(final, float) and not math.isfinite(final)):
        steps = ", ".join(str(s) for s in nonfinite) if isinstance(nonfinite, list) and nonfinite else "the last"
        return [f"the loss diverged: not finite at step(s) {steps}"]
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
