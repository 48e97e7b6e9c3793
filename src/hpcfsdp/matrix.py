"""A jobs YAML file -> a Sweep -> cells (RunSpec + stable id), grouped by resource shape.

Sections of the YAML: name, base (defaults for every cell), slurm (Resources), matrix (cartesian
axes: lists of values), include / exclude (lists of partial cells), setup (shell lines run before
each array task).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from .spec import Resources, RunSpec, SpecError, field_names, unknown_key_message

SECTIONS = ("name", "base", "slurm", "matrix", "include", "exclude", "setup")


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: its spec and an id that is a stable hash of the resolved spec."""

    spec: RunSpec
    id: str

    @classmethod
    def of(cls, spec: RunSpec) -> "Cell":
        return cls(spec=spec, id=cell_id(spec))

    @property
    def shape(self) -> tuple[int, int]:
        """The resource shape that decides which job array a cell goes to."""
        return (self.spec.nodes, self.spec.gpus_per_node)


@dataclass(frozen=True)
class Sweep:
    name: str
    source: str
    cells: tuple[Cell, ...]
    resources: Resources = field(default_factory=Resources)
    setup: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict)

    def groups(self) -> dict[tuple[int, int], list[Cell]]:
        """Cells by resource shape (nodes, GPUs per node): one job array each."""
        out: dict[tuple[int, int], list[Cell]] = {}
        for cell in self.cells:
            out.setdefault(cell.shape, []).append(cell)
        return out


def cell_id(spec: RunSpec) -> str:
    """A readable prefix plus a hash of every field, so a re-run of the same cell gets the same id."""
    canonical = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha1(canonical.encode()).hexdigest()[:10]
    return f"{spec.strategy}-b{spec.batch_size}-a{spec.grad_accum}-{digest}"


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader that remembers the line of every mapping key, for error messages."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> "_LinedDict":
    mapping = _LinedDict()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.lines[key] = key_node.start_mark.line + 1
    return mapping


class _LinedDict(dict):
    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such jobs file")
    try:
        raw = yaml.load(path.read_text(), Loader=_LineLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise SpecError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_sweep(raw, source=str(path), default_name=path.stem)


def parse_sweep(raw: Any, source: str = "<yaml>", default_name: str = "sweep") -> Sweep:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in raw:
        if key not in SECTIONS:
            raise SpecError(unknown_key_message(_where(source, raw, key), key, SECTIONS))
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name or "/" in name:
        raise SpecError(f"{_where(source, raw, 'name')}: name: expected a folder-safe string, got {name!r}")
    base = _mapping(raw, "base", source)
    axes = _mapping(raw, "matrix", source)
    for axis, values in axes.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{_where(source, axes, axis)}: matrix.{axis}: expected a non-empty list of values")
    spec_fields = field_names(RunSpec)
    for section, mapping in (("base", base), ("matrix", axes)):
        for key in mapping:
            if key not in spec_fields:
                raise SpecError(unknown_key_message(_where(source, mapping, key), key, spec_fields, section))
    include = _partials(raw, "include", source, spec_fields)
    exclude = _partials(raw, "exclude", source, spec_fields)
    resources = Resources.from_dict(_mapping(raw, "slurm", source), where=f"{_where(source, raw, 'slurm')}: slurm")
    setup = raw.get("setup", [])
    if not isinstance(setup, list) or not all(isinstance(line, str) for line in setup):
        raise SpecError(f"{_where(source, raw, 'setup')}: setup: expected a list of shell lines")

    cells: dict[str, Cell] = {}
    for index, values in enumerate(_expand(base, axes, include, exclude)):
        where = f"{source}: cell {index} ({_short(values, base)})"
        cell = Cell.of(RunSpec.from_dict(values, where=where))
        cells.setdefault(cell.id, cell)
    if not cells:
        raise SpecError(f"{source}: matrix: no cells left after exclude")
    return Sweep(name=name, source=source, cells=tuple(cells.values()), resources=resources, setup=tuple(setup), raw=_plain(raw))


def _expand(base: dict, axes: dict, include: list[dict], exclude: list[dict]) -> Iterator[dict]:
    keys = list(axes)
    for combo in itertools.product(*(axes[k] for k in keys)):
        values = {**base, **dict(zip(keys, combo))}
        if not any(_matches(values, partial) for partial in exclude):
            yield values
    for partial in include:
        yield {**base, **partial}


def _matches(values: dict, partial: dict) -> bool:
    return all(values.get(k, _default(k)) == v for k, v in partial.items())


def _default(key: str) -> Any:
    return getattr(RunSpec(), key)


def _mapping(raw: dict, key: str, source: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{_where(source, raw, key)}: {key}: expected a mapping, got {type(value).__name__}")
    return value


def _partials(raw: dict, key: str, source: str, spec_fields: tuple[str, ...]) -> list[dict]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise SpecError(f"{_where(source, raw, key)}: {key}: expected a list of mappings (partial cells)")
    for item in value:
        for k in item:
            if k not in spec_fields:
                raise SpecError(unknown_key_message(_where(source, item, k), k, spec_fields, key))
    return value


def _where(source: str, mapping: Any, key: Any) -> str:
    line = getattr(mapping, "lines", {}).get(key)
    return f"{source}:{line}" if line else source


def _short(values: dict, base: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items() if base.get(k) != v) or "base"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
