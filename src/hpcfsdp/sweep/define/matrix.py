"""A jobs YAML file -> a Sweep -> cells (RunSpec + stable id), grouped by resource shape.

Sections of the YAML: name, base (defaults for every cell), slurm (Resources), matrix (cartesian
axes: lists of values), include / exclude (lists of partial cells), setup (shell lines run before
each array task).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...contracts.fields import (
    SpecError,
    check_folder_name,
    coerce_fields,
    field_names,
    raise_problems,
    shown,
    spelt_alike,
    unknown_key,
)
from ...contracts.gpus import RankWords, rank_words
from ...contracts.sources import Sources, resolve_sources
from ...contracts.spec import RunSpec
from ...contracts.strategies import STRATEGIES
from ...contracts.validity import cell_id_of
from .resources import Resources, sbatch_word_hint
from .secret_shapes import require_no_secret
from .yamlfile import LineLoader, read_text, syntax_error

SECTIONS = ("name", "base", "slurm", "matrix", "include", "exclude", "setup")
_SPEC_FIELDS = field_names(RunSpec)
_RESOURCE_FIELDS = field_names(Resources)
_DEFAULTS = RunSpec().to_dict()
MAX_CELLS = 100_000  # a sweep larger than this is refused before it is expanded; plan / submit --max-cells N
# Setup lines are shell the user writes: a newline or tab may be meant; other control characters
# (NUL, carriage return, escape sequences) would corrupt the batch script unseen.
_SETUP_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: its spec, an id that is a stable hash of the spec (the user's own
    strings), and what the spec's model, data and tokenizer name, resolved where it was loaded."""

    spec: RunSpec
    id: str
    sources: Sources

    @classmethod
    def of(cls, spec: RunSpec, sources: Sources | None = None) -> Cell:
        """The cell of a spec; `sources` None: resolved now, from this working directory."""
        return cls(spec=spec, id=cell_id(spec), sources=sources or resolve_sources("spec", spec))

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
    lines: dict[str, int] = field(default_factory=dict)  # 'section.key' / 'include[i].key' -> its YAML line

    def groups(self) -> dict[tuple[int, int], list[Cell]]:
        """Cells by resource shape (nodes, GPUs per node); arrays() splits each into job arrays."""
        return by_shape(self.cells)


def by_shape(cells: Iterable[Cell]) -> dict[tuple[int, int], list[Cell]]:
    """Cells grouped by resource shape (nodes, GPUs per node), in order of first appearance."""
    out: dict[tuple[int, int], list[Cell]] = {}
    for cell in cells:
        out.setdefault(cell.shape, []).append(cell)
    return out


def arrays(
    cells: Iterable[Cell], max_size: int | None, cells_per_task: int = 1
) -> list[tuple[tuple[int, int], list[Cell]]]:
    """The job arrays of these cells: one per shape, split into arrays of at most max_size tasks
    (the cluster's MaxArraySize or slurm.max_array_size; None: no limit) of packed() cells each."""
    out = []
    for shape, group in by_shape(cells).items():
        size = max_size * packed(shape[0], cells_per_task) if max_size else len(group)
        out += [(shape, group[start : start + size]) for start in range(0, len(group), size)]
    return out


def packed(nodes: int, cells_per_task: int) -> int:
    """The cells one array task of this shape runs (slurm.cells_per_task): a cell of several nodes
    is a task of its own, whose failure srun's --kill-on-bad-exit must end on every node."""
    return cells_per_task if nodes == 1 else 1


def tasks_of(cells: list[Cell], per_task: int) -> list[list[Cell]]:
    """The array's tasks: its cells, per_task at a time, in order."""
    return [cells[start : start + per_task] for start in range(0, len(cells), per_task)]


def cells_rank_words(cells: Iterable[Cell]) -> RankWords:
    """What one rank of these cells is called in what is printed (GPU, or process on the CPU)."""
    return rank_words(cell.spec.device for cell in cells)


def cells_on_shape(cells: list[Cell], nodes: int, ranks: int, count: int | None = None) -> str:
    """ "3 cell(s) on 2 node(s) x 4 GPU(s)" (process(es) on the CPU): `count` of these cells, else all."""
    shown = len(cells) if count is None else count
    return f"{shown} cell(s) on {nodes} node(s) x {ranks} {cells_rank_words(cells).count}"


def cell_id(spec: RunSpec) -> str:
    """A readable prefix plus a hash of the fields that differ from their defaults
    (contracts/validity.cell_id_of, which proves a record is its folder's cell's from its spec).

    The same cell gets the same id in a re-run, and keeps it when a later hpcfsdp adds a RunSpec
    field (whose default keeps the old behaviour): resubmitting skips its record and `collect
    --compare` pairs it across versions. A changed default is caught by submit, which reruns a
    cell whose record was made with other values (submit.select_cells).
    """
    return cell_id_of(vars(spec))  # the fields' values as they are: what to_dict copies, uncopied


CELL_ID = re.compile(rf"(?:{'|'.join(map(re.escape, STRATEGIES))})-b(?:auto|[0-9]+)-a[0-9]+-[0-9a-f]{{10}}")


def is_cell_id(text: object) -> bool:
    """Whether text is a cell id as cell_id makes it (a folder name, never a path), for ids read
    back from a file (tune's state)."""
    return isinstance(text, str) and CELL_ID.fullmatch(text) is not None


def load_sweep(path: str | Path, max_cells: int = MAX_CELLS) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such jobs file")
    try:
        text = read_text(path)
        raw = yaml.load(text, Loader=LineLoader)
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow; it has a position, not a mark
        line = text.count("\n", 0, exc.position) + 1
        raise SpecError(
            f"{path}:{line}", "", f"not valid YAML (unacceptable character #x{exc.character:04x}: {exc.reason})"
        ) from None
    except yaml.MarkedYAMLError as exc:
        raise syntax_error(path, exc) from None
    except yaml.YAMLError as exc:
        raise SpecError(str(path), "", f"not valid YAML ({exc})") from None
    except OSError as exc:
        raise SpecError(str(path), "", f"cannot read the jobs file ({exc.strerror})") from None
    if raw is None:  # nothing but comments and blank lines: a mistake, never a sweep of one default cell
        raise SpecError(str(path), "", "empty jobs file")
    return parse_sweep(raw, source=str(path), default_name=path.stem, max_cells=max_cells)


def _unknown_slurm_key(where: str, key: str) -> SpecError:
    hint = sbatch_word_hint(key)
    return SpecError(where, f"slurm.{key}", hint) if hint else unknown_key(where, key, _RESOURCE_FIELDS, "slurm")


def parse_sweep(raw: Any, source: str = "<yaml>", default_name: str = "sweep", max_cells: int = MAX_CELLS) -> Sweep:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping with sections {', '.join(SECTIONS)}")
    # The file's structure: every unknown key of every section (and the slurm section's values) at once.
    problems = [unknown_key(_where(source, raw, key), key, SECTIONS) for key in raw if key not in SECTIONS]
    name = raw.get("name", default_name)
    check_folder_name(_where(source, raw, "name"), "name", name)
    base = _mapping(raw, "base", source)
    axes = _mapping(raw, "matrix", source)
    for axis, values in axes.items():
        if not isinstance(values, list) or not values:
            problems.append(
                SpecError(_where(source, axes, axis), f"matrix.{axis}", "expected a non-empty list of values")
            )
    for section, mapping in (("base", base), ("matrix", axes)):
        problems += [
            unknown_key(_where(source, mapping, key), key, _SPEC_FIELDS, section)
            for key in mapping
            if key not in _SPEC_FIELDS
        ]
    include = _partials(raw, "include", source)
    exclude = _partials(raw, "exclude", source)
    slurm = _mapping(raw, "slurm", source)
    unknown = [key for key in slurm if key not in _RESOURCE_FIELDS]
    problems += [_unknown_slurm_key(_where(source, slurm, key), key) for key in unknown]
    try:
        resources = Resources.from_dict({k: v for k, v in slurm.items() if k not in unknown}, where=source)
    except SpecError as exc:
        problems.append(_located(exc, source, [("slurm", slurm)], _where(source, raw, "slurm"), prefix="slurm."))
    raise_problems(problems)
    setup = raw.get("setup", [])
    if not isinstance(setup, list) or not all(isinstance(line, str) for line in setup):
        raise SpecError(_where(source, raw, "setup"), "setup", "expected a list of shell lines")
    for index, line in enumerate(setup):
        if _SETUP_CONTROL.search(line):
            raise SpecError(
                _where(source, raw, "setup"),
                f"setup[{index}]",
                f"expected no control characters other than newline and tab, got {shown(line)}",
            )
        require_no_secret(_where(source, raw, "setup"), f"setup[{index}]", line)  # it goes into the batch script
    _check_cell_count(source, raw, axes, include, max_cells)

    exclusions = [_Exclusion(source, index, partial) for index, partial in enumerate(exclude)]
    cells: dict[str, Cell] = {}
    for origin, values in _expand(base, axes, include):
        if origin is None and any([e.drops(values) for e in exclusions]):  # a list: every match counts
            continue
        try:
            spec, sources = RunSpec.resolved(values, where=source)
        except SpecError as exc:  # a problem once per place (line and key), then on to the next cell
            problem = _cell_error(exc, source, raw, base, axes, include, origin, values)
            if (problem.where, problem.key) not in {(p.where, p.key) for p in problems}:
                problems.append(problem)
            continue
        cell = Cell.of(spec, sources)
        cells.setdefault(cell.id, cell)
    raise_problems(problems)
    for exclusion in exclusions:
        if not exclusion.matched:
            raise SpecError(
                f"{exclusion.where}: exclude[{exclusion.index}]: matches no cell of the matrix "
                f"({_plain_partial(exclusion.values)}); check its keys and values"
            )
    if not cells:
        raise SpecError(_where(source, raw, "exclude"), "exclude", "no cells left after exclude")
    return Sweep(
        name=name,
        source=source,
        cells=tuple(cells.values()),
        resources=resources,
        setup=tuple(setup),
        raw=_plain(raw),
        lines=_key_lines(raw),
    )


def _key_lines(raw: dict) -> dict[str, int]:
    """The YAML line of every key of base, matrix, slurm and the include entries, for messages
    about a value found later (preflight.py)."""
    lines = {}
    for section in ("base", "matrix", "slurm"):
        for key, line in getattr(raw.get(section), "lines", {}).items():
            lines[f"{section}.{key}"] = line
    for index, entry in enumerate(raw.get("include") or []):
        for key, line in getattr(entry, "lines", {}).items():
            lines[f"include[{index}].{key}"] = line
    return lines


def _check_cell_count(source: str, raw: dict, axes: dict, include: list, max_cells: int) -> None:
    """Refuse a sweep of more than `max_cells` cells from the axis lengths, before expanding it."""
    product = math.prod(len(values) for values in axes.values()) if _has_product(axes, include) else 0
    if product + len(include) > max_cells:
        sizes = " x ".join(f"{len(values)} {axis}" for axis, values in axes.items()) or "1 base cell"
        extra = f" + {len(include):,} include" if include else ""
        raise SpecError(
            _where(source, raw, "matrix" if product > 1 else "include"),
            "matrix",
            f"{product + len(include):,} cells ({sizes}{extra}) is more than the limit of {max_cells:,}; "
            "split the sweep, or raise the limit with --max-cells",
        )


def _has_product(axes: dict, include: list[dict]) -> bool:
    """Whether the matrix makes cells: a file with `include:` and no matrix makes only its
    includes (the product of no axes, the base cell, is a cell nobody asked for there)."""
    return bool(axes) or not include


def _expand(base: dict, axes: dict, include: list[dict]) -> Iterator[tuple[int | None, dict]]:
    """(None, values) for each cell of the product, then (i, values) for include entry i."""
    if _has_product(axes, include):
        keys = list(axes)
        for combo in itertools.product(*(axes[k] for k in keys)):
            yield None, {**base, **dict(zip(keys, combo))}
    for index, partial in enumerate(include):
        yield index, {**base, **partial}


class _Exclusion:
    """One `exclude` entry. Values are compared after the same type coercion as a cell's (so
    `activation_checkpointing: true` drops `full` cells), before validation (so an entry can drop a
    combination that would not validate); an entry that drops nothing is an error, since a typo in
    it would otherwise leave every cell in."""

    def __init__(self, source: str, index: int, partial: dict):
        self.index = index
        self.values = partial
        lines = getattr(partial, "lines", None)
        self.where = f"{source}:{min(lines.values())}" if lines else source
        label = f"{source}: exclude[{index}]"
        try:
            self._coerced = coerce_fields(RunSpec, partial, label)
        except SpecError as exc:
            raise SpecError(_where(source, partial, exc.key), f"exclude[{index}].{exc.key}", exc.what) from None
        self.matched = False

    def drops(self, values: dict) -> bool:
        cell = {**_DEFAULTS, **values}
        try:
            hit = coerce_fields(RunSpec, {k: cell[k] for k in self.values}, "cell") == self._coerced
        except SpecError:  # the cell's own bad value: RunSpec.from_dict reports it, with its line
            return False
        self.matched |= hit
        return hit


def _plain_partial(values: dict) -> str:
    return ", ".join(f"{k}: {plain_value(v)}" for k, v in values.items())


def plain_value(value: object) -> str:
    """YAML's spelling: true / false, not Python's."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def varying_columns(specs: list[Mapping[str, Any]], already: Iterable[str]) -> dict[str, list[str]]:
    """The RunSpec fields other than those `already` shown whose value differs between these specs (a RunSpec's
    to_dict, or a cell's spec.json): name -> each spec's value as YAML spells it. What tells two
    rows of a table apart where the cell ids alone would look alike (optimizer_order, cpu_offload)."""
    left_out = set(already)
    names = [
        name
        for name in field_names(RunSpec)
        if name not in left_out and not spelt_alike((spec.get(name, "-") for spec in specs), plain_value)
    ]
    return {name: [plain_value(spec.get(name, "-")) for spec in specs] for name in names}


def column_texts(columns: dict[str, list[str]], rows: int) -> tuple[str, list[str]]:
    """varying_columns as text to append to a table: the header's part, then each row's, every
    value right-aligned in its column."""
    widths = {name: max(len(name), *map(len, values)) for name, values in columns.items()}
    header = "".join(f" {name:>{widths[name]}}" for name in columns)
    return header, [
        "".join(f" {values[row]:>{widths[name]}}" for name, values in columns.items()) for row in range(rows)
    ]


def _cell_error(
    exc: SpecError,
    source: str,
    raw: dict,
    base: dict,
    axes: dict,
    include: list[dict],
    origin: int | None,
    values: dict,
) -> SpecError:
    """Point a cell's error at the YAML line that set the offending key: its include entry or
    matrix axis, else base; the cell's distinguishing values follow in parentheses."""
    if origin is None:
        places = [("matrix", axes), ("base", base)]
        fallback = _where(source, raw, "matrix" if axes else "base")
    else:
        entry = include[origin]
        places = [(f"include[{origin}]", entry), ("base", base)]
        line = min(getattr(entry, "lines", {}).values(), default=None)
        fallback = f"{source}:{line}" if line else _where(source, raw, "include")
    cell = ", ".join(f"{k}={v}" for k, v in values.items() if base.get(k) != v) or "base"
    section, varied = places[0]
    if exc.key == "global_batch_size" and exc.where == source and not _line_of(varied, exc.key):
        # A fixed global batch that this cell's batch or GPU count does not divide: the varied value is at fault.
        for part in ("batch_size", "gpus_per_node", "nodes"):
            if line := _line_of(varied, part):
                what = f"{values.get(part)} does not fit global_batch_size: {exc.what} (cell {cell})"
                return SpecError(f"{source}:{line}", f"{section}.{part}", what)
    return _located(exc, source, places, fallback, suffix=f" (cell {cell})")


def _located(
    exc: SpecError, source: str, places: list[tuple[str, dict]], fallback: str, prefix: str = "", suffix: str = ""
) -> SpecError:
    """Name the line and section where the error's key was set, or else (a default value) the
    `fallback` place, with `prefix` before the key."""
    if exc.where != source or not exc.key:
        return exc
    for section, mapping in places:
        line = _line_of(mapping, exc.key)
        if line:
            return SpecError(f"{source}:{line}", f"{section}.{exc.key}", exc.what + suffix)
    return SpecError(fallback, prefix + exc.key, exc.what + suffix)


def _line_of(mapping: Any, dotted_key: str) -> int | None:
    """The line of a (possibly nested, 'a.b') key: the innermost one the loader recorded."""
    line = None
    for part in dotted_key.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            break
        line = getattr(mapping, "lines", {}).get(part, line)
        mapping = mapping[part]
    return line


def _mapping(raw: dict, key: str, source: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(_where(source, raw, key), key, f"expected a mapping, got {type(value).__name__}")
    return value


def _partials(raw: dict, key: str, source: str) -> list[dict]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise SpecError(_where(source, raw, key), key, "expected a list of mappings (partial cells)")
    for index, item in enumerate(value):
        for k in item:
            if k not in _SPEC_FIELDS:
                raise unknown_key(_where(source, item, k), k, _SPEC_FIELDS, f"{key}[{index}]")
    return value


def _where(source: str, mapping: Any, key: Any) -> str:
    line = getattr(mapping, "lines", {}).get(key)
    return f"{source}:{line}" if line else source


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
