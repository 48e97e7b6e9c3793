"""Typed fields of the dataclasses a user fills in (RunSpec, Resources, a references entry): their
names, the short doc each carries beside its declaration, YAML values coerced to the field types,
Literal choices, and bad input as one line (SpecError: where, key, what).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .errors import EXIT_USAGE, UserError
from .names import MAX_NAME_BYTES, folder_name_problem, unseen_character

# C0 and C1 control characters and DEL: a newline in a value that reaches an #SBATCH line would end
# it and make the rest a shell line of the batch script; none belongs in a name, path or option.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# `auto` in a field that takes it (a dataclass's AUTO_FIELD: the field, and the flag `auto` sets
# instead; the field keeps its default): batch_size -> auto_batch, mem_gb -> mem_auto.
AUTO = "auto"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SpecError(UserError, ValueError):
    """A bad value in user input, as one line '<where>: <key>: <what>'.

    `where` is a file (and line) or a section, `key` the offending key ("" for a whole-file
    problem), `what` what was expected and what came. Kept apart so that the YAML loader can point
    at the line that set `key` without parsing the message.
    """

    exit_status = EXIT_USAGE

    def __init__(self, where: str, key: str = "", what: str = ""):
        self.where, self.key, self.what = where, key, what
        super().__init__(": ".join(part for part in (where, key, what) if part))


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def spelt_alike(values: Iterable[Any], spell: Callable[[Any], str]) -> bool:
    """Whether every value has the same spelling (at most one distinct text): each distinct value
    spelt once, not each of 10,000 cells'. Values are told apart by type as well (True == 1, but
    they are spelt apart) and a float zero by its sign (0.0 == -0.0)."""
    values = list(values)
    if one_value(values):
        return True
    try:
        distinct = [key[1] for key in set(told_apart(values))]
    except TypeError:  # an unhashable value (a list in a hand-edited spec.json): spell them all
        distinct = values
    return len({spell(value) for value in distinct}) <= 1


_ONE_SPELLING = {str, int, bool}  # types whose equal values are spelt alike (unlike 0.0 and -0.0, or [1] and [True])


def one_value(values: list[Any]) -> bool:
    """Whether the values (at least one) are all one text, integer or boolean of one type: spelt
    alike, told in C (a collect asks it of some 60 spec fields of 10,000 cells, most of one value)."""
    kinds = set(map(type, values))
    return len(kinds) == 1 and kinds <= _ONE_SPELLING and values.count(values[0]) == len(values)


def told_apart(values: Iterable[Any]) -> list[tuple[Any, ...]]:
    """Each value as a key that no value of another spelling shares: by type as well (True == 1)
    and a float zero by its sign (0.0 == -0.0). A dict or set of them raises TypeError where a
    value is unhashable. The keys are (type, value) pairs, made in C (zip, map; collect makes them
    for the some 600,000 spec values of 10,000 records), and (type, value, sign) triples where a
    float zero is among the values; the keys of one call are all of one shape."""
    values = values if isinstance(values, list) else list(values)
    keys = list(zip(map(type, values), values))
    floats = [kind for kind in set(map(type, values)) if issubclass(kind, float)]
    if not floats or (floats == [float] and (float, 0.0) not in keys):  # `in`: a tuple compare in C
        return keys
    return [(type(v), v, isinstance(v, float) and v == 0 and repr(v)) for v in values]


def documented(default: Any, doc: str, *, default_means: str = "", **metadata: Any) -> Any:
    """A dataclass field: its default, and its short doc beside it, from which docs/submit.md's
    tables and `hpcfsdp run --help` are written (sweep/define/fielddocs.py). `default_means` says what a
    default of 0 or "" stands for ("the partition's default"). A mutable default is copied for
    each instance."""
    meta = {"doc": doc, "default_means": default_means, **metadata}
    if isinstance(default, (dict, list, set)):
        return field(default_factory=functools.partial(copy.copy, default), metadata=meta)
    return field(default=default, metadata=meta)


MAX_PROBLEMS = 20  # what one run shows of a file's problems, at most


class SpecErrors(SpecError):
    """Several problems of one file, each its own `error:` line (the first MAX_PROBLEMS of them),
    so that three mistyped keys take one run to find, not three. As a SpecError it is the first."""

    def __init__(self, problems: list[SpecError]):
        self.problems = problems
        first = problems[0]
        super().__init__(first.where, first.key, first.what)

    def lines(self) -> list[str]:
        more = len(self.problems) - MAX_PROBLEMS
        return [p.line() for p in self.problems[:MAX_PROBLEMS]] + ([f"error: ... and {more} more"] if more > 0 else [])


def raise_problems(problems: list[SpecError]) -> None:
    """One SpecError for one problem, SpecErrors for several; nothing for none."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise SpecErrors(problems)


def unknown_key(where: str, key: str, known: tuple[str, ...], section: str = "") -> SpecError:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(known)}"
    return SpecError(where, f"{section}.{key}" if section else str(key), f"unknown key{hint}")


def coerce_fields(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check names and types of user values against the dataclass fields (YAML gives plain types)."""
    types = _field_types(cls)
    out: dict[str, Any] = {}
    auto_key, auto_flag = getattr(cls, "AUTO_FIELD", ("", ""))
    auto = bool(auto_key) and values.get(auto_key) == AUTO
    if auto and values.get(auto_flag, True) is not True:
        raise SpecError(
            where, auto_flag, f"{shown(values[auto_flag])} contradicts {auto_key}: auto; leave {auto_flag} out"
        )
    for key, value in values.items():
        if key not in types:
            raise unknown_key(where, key, tuple(types))
        if auto and key == auto_key:
            out[auto_flag] = True  # the field keeps its default (batch_size: the search's first batch)
            continue
        out[key] = _coerce(where, key, value, types[key])
    return out


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """Each field's type, read off its default (annotations are strings here)."""
    return {
        f.name: type(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
        for f in fields(cls)
    }


def _coerce(where: str, key: str, value: Any, expected: type) -> Any:
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(where, key, f"expected true or false, got {shown(value)}")
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:  # the record, pandas, parquet and DuckDB hold no larger
                raise SpecError(
                    where, key, f"expected an integer within 64 bits (-2**63 to 2**63 - 1), got {shown(value)}"
                )
            return value
        raise SpecError(
            where,
            key,
            f"expected an integer{' or auto' if key in ('batch_size', 'mem_gb') else ''}, got {shown(value)}",
        )
    if expected is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            raise SpecError(where, key, f"expected a finite number, got {shown(value)}")
        return number
    if expected is str:
        if key == "activation_checkpointing" and isinstance(value, bool):
            return "full" if value else "none"
        if isinstance(value, str):
            return value
        raise SpecError(where, key, f"expected a string, got {shown(value)}")
    if expected is dict:
        if isinstance(value, dict):
            return dict(value)
        raise SpecError(where, key, f"expected a mapping, got {shown(value)}")
    return value


@functools.cache
def choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields of a dataclass typed as a Literal, and their allowed values."""
    hints = get_type_hints(cls)
    return {name: get_args(hint) for name, hint in hints.items() if get_origin(hint) is Literal}


def require_choices(where: str, instance: Any) -> None:
    for key, allowed in choices(type(instance)).items():  # type: ignore[arg-type]  # a class is hashable
        value = getattr(instance, key)
        if value not in allowed:
            close = difflib.get_close_matches(value, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(where, key, f"expected one of {', '.join(allowed)}; got {value!r}{hint}")


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def one_line(text: str) -> str:
    """`text` with control characters written as escapes: a message that quotes user input raw
    (a key, a path) still prints as one line."""
    return CONTROL_CHARACTERS.sub(lambda match: repr(match.group())[1:-1], text)


def require_no_control_characters(where: str, key: str, value: str) -> None:
    """No control character, nor one that is invisible or turns the text around (names.py), nor a
    leading `~user` of no user here: every text of a RunSpec, Resources and extra_sbatch reaches a
    path, an sbatch line or a report."""
    if CONTROL_CHARACTERS.search(value):
        raise SpecError(where, key, f"expected no control characters (newline, tab, NUL, ...), got {shown(value)}")
    unseen = unseen_character(value)
    if unseen:
        raise SpecError(
            where, key, f"holds {unseen}, a character that is invisible or changes the direction of the text around it"
        )
    user = unknown_home(value)
    if user:
        raise SpecError(where, key, f"{user}: no such user here, so no home folder for it to name, in {shown(value)}")


def unknown_home(value: str) -> str:
    """The `~user` a path begins with where this machine knows no such user ("" otherwise):
    Path.expanduser() would raise RuntimeError on it, wherever the path is first used."""
    head = value.split("/", 1)[0] if value.startswith("~") else ""
    return head if head and os.path.expanduser(head) == head else ""


def check_folder_name(where: str, key: str, value: Any) -> None:
    """A name that becomes one folder (results/<name>): not . or .., no separator, fits a file name."""
    if (
        not isinstance(value, str)
        or value in ("", ".", "..")
        or "/" in value
        or "\\" in value
        or CONTROL_CHARACTERS.search(value)
        or len(value.encode()) > MAX_NAME_BYTES
    ):
        raise SpecError(
            where,
            key,
            "expected a folder-safe string (not . or .., no / or \\, no control characters, "
            f"at most {MAX_NAME_BYTES} bytes), got {shown(value)}",
        )
    problem = folder_name_problem(value)
    if problem:
        raise SpecError(where, key, f"{problem}: {shown(value)}")


def text_fields(instance: Any) -> Iterator[tuple[str, str]]:
    """The free-text fields of a RunSpec or Resources and their values."""
    for name in _text_field_names(type(instance)):  # type: ignore[arg-type]  # a class is hashable
        yield name, getattr(instance, name)


@functools.cache
def _text_field_names(cls: type) -> tuple[str, ...]:
    """Fields typed str that are no choice (a Literal is checked against its values)."""
    return tuple(name for name, kind in _field_types(cls).items() if kind is str and name not in choices(cls))
