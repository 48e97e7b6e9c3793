"""JSON values checked against type annotations: which fields of a TypedDict are marked Checked,
and whether a parsed value is what its annotation says, as one line ("mfu: expected a number or
null, got "fast""). The record's shape (record.py) is declared once, with these marks; read_record
checks a record through them.

A mark may add a range: a Figure (tokens/s, a time, memory, energy) is a number from 0 to 1e15,
a Moment a Unix time between 2000-01-01 and a day after now. A value of the right type but
out of its range (Infinity tokens/s, a negative peak memory, a start in the year 10^292) would
otherwise win a ranking or overflow a datetime or a parquet column. And json_ready, which makes
values strict JSON (the `--json` answers).

The same marks also compile (compiled_check) into one pydantic-core validator, which checks a
record in Rust several times faster than the walk below: collect reads every record of a
sweep. The compiled check only ever answers "valid": a record it refuses goes through the walk,
which words the one-line problem (and has the last word, so the two can never disagree on a
record the walk takes).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from datetime import date
from types import NoneType, UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints, is_typeddict

from .names import readable

try:  # a dependency of the login side; where it is missing (a compute node), the walk checks alone
    from pydantic_core import SchemaValidator, ValidationError, core_schema
except ImportError:  # pragma: no cover - pydantic-core is installed with hpcfsdp
    SchemaValidator = core_schema = None  # type: ignore[assignment,misc]

T = TypeVar("T")
CHECKED = "checked"
# A field that a reader depends on: a value of another type than the annotation's, null aside,
# makes the whole file unusable. A float field takes an integer too (a hand-made record may say 2).
Checked = Annotated[T, CHECKED]
FIGURE = "figure"
MOMENT = "moment"
# A checked number (or list of numbers) from 0 to FIGURE_MAX: a measurement.
Figure = Annotated[T, CHECKED, FIGURE]
# No figure of one cell comes near (FLOPs per token of a 10^14-parameter model; a petajoule): the
# bound keeps what the report derives from figures (tokens/s per GPU x GPUs, joules x 10^9 per
# billion tokens) finite, where 1e308 would print as "inf".
FIGURE_MAX = 1e15
# A checked Unix time (seconds): from 2000-01-01 to a day after now.
Moment = Annotated[T, CHECKED, MOMENT]
EARLIEST_MOMENT = 946_684_800.0  # 2000-01-01T00:00:00Z: no record is older than the suite
MOMENT_SLACK_S = 86_400.0  # a clock a day ahead is a wrong clock, not a record from the future
# JSON integers every reader takes (pandas, parquet, DuckDB: 64-bit signed).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT64_FLOAT_LIMIT = 9.2e18  # below 2**63 as a float, so that float(2**63) is past it

UNIONS = (Union, UnionType)
# Exact types, as json.loads gives them: true is a bool, not the number 1.
NUMBER_TYPES = frozenset({int, float})
SCALAR_TYPES = frozenset({str, int, float, bool})
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def checked_fields(*shapes: type) -> dict[str, Any]:
    """name -> annotation (without the mark), of the fields of the TypedDicts marked Checked."""
    return {
        name: _without_check(hint)
        for shape in shapes
        for name, hint in get_type_hints(shape, include_extras=True).items()
        if get_origin(hint) is Annotated and CHECKED in hint.__metadata__
    }


def _without_check(hint: Any) -> Any:
    """The annotation without the Checked mark; a range mark (Figure, Moment) stays on it."""
    inner, *marks = get_args(hint)
    ranges = tuple(mark for mark in marks if mark in (FIGURE, MOMENT))
    return Annotated[inner, ranges[0]] if ranges else inner


def _range_of(hint: Any) -> tuple[Any, str]:
    """(the annotation without marks, its range mark or "")."""
    if get_origin(hint) is not Annotated:
        return hint, ""
    inner, *marks = get_args(hint)
    return inner, next((mark for mark in marks if mark in (FIGURE, MOMENT)), "")


def value_problem(name: str, value: Any, hint: Any) -> str | None:
    """Whether value (null aside) is what the annotation `hint` says: exactly its JSON type (true is
    no integer), a list of numbers or of text, or an object whose keys are checked the same way;
    and, for a Figure or a Moment, within its range."""
    if value is None:
        return None
    hint, bounds = _range_of(hint)
    problem = _type_problem_of(name, value, hint)
    if problem or not bounds:
        return problem
    return range_problem(name, value, bounds)


def range_problem(name: str, value: Any, bounds: str) -> str | None:
    """Whether a number, or each number of a list, is within the range FIGURE or MOMENT names."""
    numbers = value if isinstance(value, list) else [value]
    for index, number in enumerate(numbers):
        if number is None:
            continue
        where = f"{name}[{index}]" if isinstance(value, list) else name
        if type(number) is int and not INT64_MIN <= number <= INT64_MAX:
            return f"{where}: expected an integer within 64 bits, got {shown(number)}"
        if bounds == FIGURE and not (math.isfinite(number) and 0 <= number <= FIGURE_MAX):
            return f"{where}: expected a number from 0 to {FIGURE_MAX:g}, got {shown(number)}"
        if bounds == MOMENT and not (
            math.isfinite(number) and EARLIEST_MOMENT <= number <= time.time() + MOMENT_SLACK_S
        ):
            return f"{where}: expected a Unix time from 2000-01-01 to a day after now, got {shown(number)}"
    return None


def _type_problem_of(name: str, value: Any, hint: Any) -> str | None:
    kinds = tuple(kind for kind in (get_args(hint) if get_origin(hint) in UNIONS else (hint,)) if kind is not NoneType)
    shape = kinds[0]
    if is_typeddict(shape) or get_origin(shape) is dict:
        if not isinstance(value, dict):
            return f"{name}: expected an object, got {shown(value)}"
        declared = (
            get_type_hints(shape, include_extras=True)
            if is_typeddict(shape)
            else dict.fromkeys(value, get_args(shape)[1])
        )
        for key, item in value.items():
            problem = (
                value_problem(f"{name}.{key}", item, declared[key])
                if key in declared
                else type_problem(f"{name}.{key}", item, ())  # a key of a newer hpcfsdp
            )
            if problem:
                return problem
        return None
    if get_origin(shape) in (list, Sequence):  # a Sequence: a list the writer may build of a narrower type
        element, element_bounds = _range_of(get_args(shape)[0])  # list[Figure[float]]: each a figure
        elements = get_args(element) if get_origin(element) in UNIONS else (element,)
        allowed = {kind for kind in elements if kind is not float} | (NUMBER_TYPES if float in elements else set())
        if isinstance(value, list) and set(map(type, value)) <= allowed:
            return range_problem(name, value, element_bounds) if element_bounds else None
        words = "numbers" if float in elements else TYPE_WORDS[elements[0]]
        nulls = " or nulls" if NoneType in elements else ""
        return f"{name}: expected a list of {words}{nulls}, got {shown(value)}"
    return type_problem(name, value, kinds + ((int,) if float in kinds else ()))


def type_problem(name: str, value: Any, allowed: tuple[type, ...]) -> str | None:
    """Whether value (null aside) has one of the allowed types (exactly: true is no integer);
    an empty `allowed` lets any single value through (a field of a newer hpcfsdp)."""
    if value is None:
        return None
    if not allowed:
        return None if type(value) in SCALAR_TYPES else f"{name}: expected a single value, got {shown(value)}"
    if type(value) in allowed:
        return None
    words = "a number" if float in allowed else " or ".join(TYPE_WORDS[kind] for kind in allowed)
    return f"{name}: expected {words} or null, got {shown(value)}"


def shown(value: Any, limit: int = 40) -> str:
    """A value as it reads in the JSON file, cut short: "fast", [1, "x"]; None is a key null or absent."""
    if value is None:
        return "null or missing"
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # an integer past the digit limit, or deep nesting
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The compiled check: the same annotations and marks as pydantic-core schemas.

JSON_VALUE_REF = "json_value"


def _limits(bounds: str) -> tuple[float, float]:
    """The range a mark names, as of now: a Moment compiled now is stricter later, never looser."""
    if bounds == FIGURE:
        return 0.0, FIGURE_MAX
    if bounds == MOMENT:
        return EARLIEST_MOMENT, time.time() + MOMENT_SLACK_S
    return INT64_MIN, INT64_MAX  # an integer's; a float without a mark has no range


def _integer_schema(bounds: str = "") -> Any:
    """An integer (true is none) within 64 bits and the range `bounds` names."""
    low, high = _limits(bounds)
    return core_schema.int_schema(strict=True, ge=max(math.ceil(low), INT64_MIN), le=min(math.floor(high), INT64_MAX))


def number_schema(bounds: str = "", finite: bool = False) -> Any:
    """A float or an integer (true is neither) within the range `bounds` names (then finite);
    `finite` without a range refuses NaN and infinities only. pydantic-core takes an integer for a
    float and compares it as one: without a range, one of 9.2e18 or more (even a float, where the
    walk takes it) is refused here, so that an integer past 64 bits never passes."""
    low, high = _limits(bounds) if bounds else (-INT64_FLOAT_LIMIT, INT64_FLOAT_LIMIT)
    return core_schema.float_schema(strict=True, allow_inf_nan=not (bounds or finite), ge=low, le=high)


def scalar_schema(kind: type, bounds: str = "") -> Any:
    """One JSON value of a Python type (exactly: true is no integer), within the range `bounds` names."""
    if kind is float:
        return number_schema(bounds)
    if kind is int:
        return _integer_schema(bounds)
    return {str: core_schema.str_schema(strict=True), bool: core_schema.bool_schema(strict=True)}[kind]


def one_of(schemas: list[Any]) -> Any:
    """A value that passes one of the schemas, tried in their order (a branch that fails costs an error)."""
    return schemas[0] if len(schemas) == 1 else core_schema.union_schema(schemas, mode="left_to_right")


def single_value_schema() -> Any:
    """Any single JSON value (of a key a newer hpcfsdp wrote): text, a number, true/false or null."""
    return core_schema.nullable_schema(one_of([scalar_schema(kind) for kind in (float, str, bool)]))


def json_value_definition() -> Any:
    """Any JSON value whose integers fit 64 bits (what integer_out_of_int64 asks of a whole record)."""
    reference = core_schema.definition_reference_schema(JSON_VALUE_REF)
    return core_schema.nullable_schema(
        one_of(
            [
                # the most frequent first, each branch tried costs an error: in a real record's
                # undeclared values (its ranks, environment, sources) text (issue 54: a third less)
                core_schema.str_schema(strict=True),
                number_schema(),
                core_schema.dict_schema(core_schema.str_schema(), reference, strict=True),
                core_schema.list_schema(reference, strict=True),
                core_schema.bool_schema(strict=True),
            ]
        ),
        ref=JSON_VALUE_REF,
    )


def annotation_schema(hint: Any) -> Any:
    """The pydantic-core schema of an annotation as value_problem reads it (null always taken)."""
    hint, bounds = _range_of(hint)
    kinds = tuple(kind for kind in (get_args(hint) if get_origin(hint) in UNIONS else (hint,)) if kind is not NoneType)
    shape = kinds[0]
    if is_typeddict(shape):
        fields = {name: annotation_schema(item) for name, item in get_type_hints(shape, include_extras=True).items()}
        schema = typed_dict_check(fields, single_value_schema())
    elif get_origin(shape) is dict:
        schema = core_schema.dict_schema(core_schema.str_schema(), annotation_schema(get_args(shape)[1]), strict=True)
    elif get_origin(shape) in (list, Sequence):
        (element,) = get_args(shape)
        elements = [kind for kind in (get_args(element) if get_origin(element) in UNIONS else (element,))]
        item = one_of([scalar_schema(kind, bounds) for kind in elements if kind is not NoneType])
        schema = core_schema.list_schema(
            core_schema.nullable_schema(item) if NoneType in elements else item, strict=True
        )
    else:
        schema = one_of([scalar_schema(kind, bounds) for kind in kinds])
    return core_schema.nullable_schema(schema)


def typed_dict_check(fields: dict[str, Any], extras: Any, required: tuple[str, ...] = ()) -> Any:
    """An object with these keys' schemas (all optional but `required`), any other key `extras`."""
    return core_schema.typed_dict_schema(
        {name: core_schema.typed_dict_field(schema, required=name in required) for name, schema in fields.items()},
        extra_behavior="allow",
        extras_schema=extras,
        strict=True,
    )


def compiled_check(schema: Any) -> Callable[[Any], bool] | None:
    """Whether a value passes `schema` (with JSON_VALUE defined), compiled once; None where
    pydantic-core is not installed."""
    if SchemaValidator is None:
        return None
    validator = SchemaValidator(core_schema.definitions_schema(schema, [json_value_definition()]))

    def passes(value: Any) -> bool:
        try:
            validator.validate_python(value)
        except (ValidationError, RecursionError):
            return False
        return True

    return passes


def integer_out_of_int64(value: Any, name: str = "") -> str | None:
    """The dotted name of the first integer in value (an object, list or number, walked without
    recursion) outside 64-bit signed integers, or None. pandas, parquet and DuckDB hold no other:
    one such integer would stop the report of a whole sweep."""
    stack: list[tuple[str, Any]] = [(name, value)]
    while stack:
        where, item = stack.pop()
        if type(item) is int and not INT64_MIN <= item <= INT64_MAX:
            return where or "value"
        if isinstance(item, dict):
            stack.extend((f"{where}.{key}" if where else str(key), child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{index}]", child) for index, child in enumerate(item))
    return None


def json_ready(value: Any) -> Any:
    """value as strict JSON takes it (RFC 8259: no NaN, text UTF-8 holds: a lone surrogate, from a
    file name that is not UTF-8, escaped as names.readable does): a number that is not finite, NaN, NaT and
    pandas' NA become null; numpy scalars Python's; dates ISO 8601 text; tuples lists; any other
    object its text."""
    if isinstance(value, dict):
        return {readable(str(key)): json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if isinstance(value, str):
        return readable(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if type(value).__name__ in ("NAType", "NaTType") or value != value:  # pandas' NA and NaT, numpy's NaN
        return None
    if isinstance(value, date):
        return value.isoformat()
    if hasattr(value, "item"):  # a numpy scalar
        return json_ready(value.item())
    return str(value)


def strict_json(value: Any) -> str:
    """One JSON document of value (json_ready), as other languages' parsers, jq and DuckDB read it."""
    return json.dumps(json_ready(value), allow_nan=False, indent=2)
