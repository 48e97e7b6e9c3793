"""A recorded spec (a record's `spec`, the RunSpec it ran with) checked as RunSpec takes it: the
walk that words one line (spec_problem) and the same checks as a pydantic-core schema
(spec_schema), which record.py compiles into the record's validator. And the groups of its fields
the readers of records compare and group cells by (the strategy knobs, the measurement-only fields,
those a batch search chose), derived from the groups RunSpec's fields name (spec.fields_in)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, get_args

from .fields import choices
from .jsontypes import (
    FIGURE,
    INT64_MAX,
    SCALAR_TYPES,
    TYPE_WORDS,
    core_schema,
    number_schema,
    range_problem,
    scalar_schema,
    shown,
    single_value_schema,
    typed_dict_check,
)
from .spec import NON_NEGATIVE_FIELDS, NON_NEGATIVE_NUMBERS, POSITIVE_FIELDS, RunSpec, fields_in
from .strategies import STRATEGIES, Family

# Every record has these spec fields (the cell id and every table group by them).
REQUIRED_SPEC_FIELDS = ("strategy", "batch_size")

# RunSpec's field groups, each named once on its fields (spec.option):
# RunSpec fields that only one family of strategies reads; a cell of another family carries their
# defaults. The collector uses this to match a cell with its baseline and to name variants.
FAMILY_KNOBS: dict[Family, tuple[str, ...]] = {family: fields_in(family) for family in get_args(Family)}
STRATEGY_KNOBS = tuple(dict.fromkeys(knob for knobs in FAMILY_KNOBS.values() for knob in knobs)) + fields_in("hybrid")


def knob_applies(name: str, strategy: object) -> bool:
    """Whether a cell of this strategy reads the spec field: a knob of another family (DDP's
    cpu_offload) or a hybrid's knob on a non-hybrid strategy is only its default, which the tables
    leave blank. A field that is no knob, and an unknown strategy, read as applying."""
    info = STRATEGIES.get(strategy) if isinstance(strategy, str) else None  # type: ignore[call-overload]
    if name not in STRATEGY_KNOBS or info is None:
        return True
    return name in FAMILY_KNOBS[info.family] or (info.hybrid and name in fields_in("hybrid"))


# RunSpec fields that change how a cell is measured or what it writes beside the measurement, not
# what it runs: cells that differ only in these are the same *setup* to the history and its
# regression checks (results/history_rows.py). Not among them: sync_each_step (it changes what the step
# time measures) and memory_snapshot (recording every allocation from set-up on slows the steps).
MEASUREMENT_FIELDS = fields_in("measurement")
# The fields whose values a `batch_size: auto` cell's record holds as the search chose them.
SEARCHED_FIELDS = fields_in("searched")
# The fields that say how the search ran (not what its cell then measured).
BATCH_SEARCH_FIELDS = fields_in("batch_search")


def spec_problem(spec: Any) -> str | None:
    """What makes a recorded spec unusable, or None. A field RunSpec has must have its type (and
    be one of its choices); a field it lacks (written by a newer hpcfsdp) must be a single value.
    A field the spec lacks is newer than the record: its default is what the record was made with."""
    if not isinstance(spec, dict):
        return f"spec: expected an object (the run's RunSpec), got {shown(spec)}"
    for name in REQUIRED_SPEC_FIELDS:
        if name not in spec:
            return f"spec.{name}: missing"
    types, allowed = _spec_types(), choices(RunSpec)
    for name, value in spec.items():
        expected = types.get(name)
        if expected is None:
            if value is not None and type(value) not in SCALAR_TYPES:
                return f"spec.{name}: expected text, a number or true/false, got {shown(value)}"
        elif not (type(value) is expected or (expected is float and type(value) is int)):
            return f"spec.{name}: expected {TYPE_WORDS[expected]}, got {shown(value)}"
        elif name in allowed and value not in allowed[name]:
            return f"spec.{name}: expected one of {', '.join(allowed[name])}, got {shown(value)}"
        else:
            problem = _spec_range_problem(name, value)
            if problem:
                return problem
    return None


def _spec_range_problem(name: str, value: Any) -> str | None:
    """A recorded spec's numbers as RunSpec takes them: counts positive (or 0 and more), all finite."""
    if name in POSITIVE_FIELDS and type(value) is int and value < 1:
        return f"spec.{name}: expected a positive integer, got {shown(value)}"
    if name in (*NON_NEGATIVE_FIELDS, *NON_NEGATIVE_NUMBERS) or (type(value) is float and not math.isfinite(value)):
        return range_problem(f"spec.{name}", value, FIGURE)
    return None


def spec_schema() -> Any:
    """spec_problem's checks as a schema: each RunSpec field of its default's type (a float field
    takes an integer), one of its choices, counts in their range, floats finite."""
    allowed = choices(RunSpec)
    fields: dict[str, Any] = {}
    for name, kind in _spec_types().items():
        if name in allowed:
            fields[name] = core_schema.literal_schema(list(allowed[name]))
        elif name in POSITIVE_FIELDS:
            fields[name] = core_schema.int_schema(strict=True, ge=1, le=INT64_MAX)
        elif name in (*NON_NEGATIVE_FIELDS, *NON_NEGATIVE_NUMBERS):
            fields[name] = scalar_schema(kind, FIGURE)
        else:
            fields[name] = number_schema(finite=True) if kind is float else scalar_schema(kind)
    return typed_dict_check(fields, single_value_schema(), required=REQUIRED_SPEC_FIELDS)


def _spec_types() -> dict[str, type]:
    return {f.name: type(f.default) for f in dataclasses.fields(RunSpec)}
