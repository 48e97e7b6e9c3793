"""JSON values checked against type annotations: which fields of a TypedDict are marked Checked,
and whether a parsed value is what its annotation says, as one line ("mfu: expected a number or
null, got "fast""). The record's shape (record.py) is declared once, with these marks; read_record
checks a record through them. And json_ready, which makes values strict JSON (the `--json` answers).
"""

from __future__ import annotations

import json
import math
from datetime import date
from types import NoneType, UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints, is_typeddict

T = TypeVar("T")
CHECKED = "checked"
# A field that a reader depends on: a value of another type than the annotation's, null aside,
# makes the whole file unusable. A float field takes an integer too (a hand-made record may say 2).
Checked = Annotated[T, CHECKED]

UNIONS = (Union, UnionType)
# Exact types, as json.loads gives them: true is a bool, not the number 1.
NUMBER_TYPES = frozenset({int, float})
SCALAR_TYPES = frozenset({str, int, float, bool})
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def checked_fields(*shapes: type) -> dict[str, Any]:
    """name -> annotation (without the mark), of the fields of the TypedDicts marked Checked."""
    return {
        name: get_args(hint)[0]
        for shape in shapes
        for name, hint in get_type_hints(shape, include_extras=True).items()
        if get_origin(hint) is Annotated and CHECKED in hint.__metadata__
    }


def value_problem(name: str, value: Any, hint: Any) -> str | None:
    """Whether value (null aside) is what the annotation `hint` says: exactly its JSON type (true is
    no integer), a list of numbers or of text, or an object whose keys are checked the same way."""
    if value is None:
        return None
    kinds = tuple(kind for kind in (get_args(hint) if get_origin(hint) in UNIONS else (hint,)) if kind is not NoneType)
    shape = kinds[0]
    if is_typeddict(shape) or get_origin(shape) is dict:
        if not isinstance(value, dict):
            return f"{name}: expected an object, got {shown(value)}"
        declared = get_type_hints(shape) if is_typeddict(shape) else dict.fromkeys(value, get_args(shape)[1])
        for key, item in value.items():
            problem = (
                value_problem(f"{name}.{key}", item, declared[key])
                if key in declared
                else type_problem(f"{name}.{key}", item, ())  # a key of a newer hpcfsdp
            )
            if problem:
                return problem
        return None
    if get_origin(shape) is list:
        (element,) = get_args(shape)
        allowed = NUMBER_TYPES if element is float else {element}
        if isinstance(value, list) and set(map(type, value)) <= allowed:
            return None
        words = "numbers" if element is float else TYPE_WORDS[element]
        return f"{name}: expected a list of {words}, got {shown(value)}"
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


def json_ready(value: Any) -> Any:
    """value as strict JSON takes it (RFC 8259: no NaN): a number that is not finite, NaN, NaT and
    pandas' NA become null; numpy scalars Python's; dates ISO 8601 text; tuples lists; any other
    object its text."""
    if isinstance(value, dict):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
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
