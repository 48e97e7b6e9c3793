"""The jobs YAML's field tables in the docs (docs/submit.md, docs/containers.md) and the field list of
`hpcfsdp run --help`, written from the short doc each field carries beside its declaration
(fields.documented: RunSpec, Resources, Container), so that neither can drift from the code.

A table sits in its page between `<!-- fields: NAME -->` and `<!-- /fields -->`;
tests/test_fielddocs.py fails when one differs from the declarations. After editing a field:

    python -m hpcfsdp.sweep.define.fielddocs docs            # rewrite the tables
    python -m hpcfsdp.sweep.define.fielddocs docs --check    # exit status 1, naming the pages that differ
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, NamedTuple

from ...contracts.spec import RunSpec, fields_in
from .container import Container
from .matrix import plain_value
from .resources import Resources


class Table(NamedTuple):
    """A table of a dataclass's fields: those named (all where none is), and its column headings."""

    cls: type
    names: tuple[str, ...]
    heading: tuple[str, str, str]


TABLES: dict[str, Table] = {
    "runspec": Table(RunSpec, (), ("field", "default", "meaning")),
    "batch_search": Table(RunSpec, fields_in("batch_search"), ("field", "default", "meaning")),
    "slurm": Table(Resources, (), ("field", "default", "sbatch")),
    "container": Table(Container, (), ("key", "default", "what it is")),
}
# The pages of docs/ that hold the tables, each table in one.
PAGES = {"submit.md": ("runspec", "batch_search", "slurm"), "containers.md": ("container",)}
MARKED = re.compile(r"(<!-- fields: (\w+) -->\n).*?(<!-- /fields -->)", re.DOTALL)


def field_doc(item: Field) -> str:
    """A field's short doc; a field declared without one is a mistake of the package's, said here."""
    doc = item.metadata.get("doc", "")
    if not doc:
        raise LookupError(f"{item.name} has no doc: declare it with fields.documented (or spec.option)")
    return doc


def default_of(item: Field) -> Any:
    return item.default_factory() if item.default_factory is not MISSING else item.default


def yaml_value(value: Any) -> str:
    """A default as it is written in a jobs YAML."""
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(yaml_value, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {yaml_value(item)}" for key, item in value.items()) + "}"
    return plain_value(value)


def default_cell(item: Field) -> str:
    value = default_of(item)
    shown = "unset" if value is None or value == "" else f"`{yaml_value(value)}`"
    means = item.metadata.get("default_means", "")
    return f"{shown} ({means})" if means else shown


def markdown_table(table: Table) -> str:
    chosen = [item for item in fields(table.cls) if not table.names or item.name in table.names]
    lines = ["| " + " | ".join(table.heading) + " |", "| --- | --- | --- |"]
    for item in chosen:
        cells = (f"`{item.name}`", default_cell(item), field_doc(item))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def rewrite(page: str) -> str:
    """The page with each marked table written afresh from the declarations."""

    def table(match: re.Match[str]) -> str:
        if match.group(2) not in TABLES:
            raise LookupError(f"<!-- fields: {match.group(2)} -->: no such table (known: {', '.join(TABLES)})")
        return match.group(1) + markdown_table(TABLES[match.group(2)]) + match.group(3)

    return MARKED.sub(table, page)


def help_listing(cls: type, width: int = 100) -> str:
    """One entry per field for --help: KEY=DEFAULT, then its doc, as plain text."""
    lines = []
    for item in fields(cls):
        value = yaml_value(default_of(item)) or '""'
        means = item.metadata.get("default_means", "")
        doc = (field_doc(item) + (f"; {value}: {means}" if means else "")).replace("`", "")
        key = f"{item.name}={value}"
        lines += textwrap.wrap(
            f"{key:<30} {doc}", width, initial_indent="  ", subsequent_indent=" " * 33, break_on_hyphens=False
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpcfsdp.sweep.define.fielddocs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("docs", type=Path, help="the docs folder (docs/ of a checkout)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a table differs")
    args = parser.parse_args(argv)
    stale = []
    for name in PAGES:
        path = args.docs / name
        text = path.read_text()
        fresh = rewrite(text)
        if fresh != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(fresh)
    verb = "differ from the declarations" if args.check else "rewritten"
    print(f"{', '.join(stale)}: {verb}" if stale else "the field tables are up to date", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
