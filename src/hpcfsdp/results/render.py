"""Render the report's files: sections as Markdown (summary.md) or one self-contained HTML page
(index.html), and the cells as report/results.csv and results.parquet.

A section is plain data (a title, a paragraph, a table of formatted strings, bullet items,
images); the section renderer knows nothing about records, so the same sections make both documents.
Tables are rendered here rather than by pandas/tabulate: their cells are strings already, and a
large sweep has hundreds of small pivot tables, where the generic renderers' per-table cost adds up.

results.csv and results.parquet hold every cell's record, lists and objects as JSON text, text a
spreadsheet would run as a formula quoted, each parquet column of one type. At 10,000 records
they are a second of CPU (pandas' CSV writer, Arrow's conversion) that needs nothing else the
report makes: tables_writing writes them in a forked process while collect checks the history and
writes the report's text on the other core.
"""

from __future__ import annotations

import base64
import gc
import html
import json
import math
import multiprocessing
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd
from pydantic_core import PydanticSerializationError, to_json

from ..contracts.files import atomic_output, garbage_collection_paused, read_regular_file
from ..recordschema import declared_type
from .read import SPLIT_MIN_RECORDS, frame_rows

MAX_FIGURE_BYTES = 64 << 20  # a figure of the report is some 100 KB; more is no figure hpcfsdp drew


@dataclass(frozen=True)
class Section:
    title: str
    text: str = ""
    table: pd.DataFrame | None = None
    items: list[str] = field(default_factory=list)
    images: list[tuple[str, Path]] = field(default_factory=list)  # (caption, PNG file)
    links: list[tuple[str, str]] = field(default_factory=list)  # (text, a path relative to the report folder)
    level: int = 2


def to_markdown(title: str, sections: list[Section], relative_to: Path | None = None) -> str:
    """Markdown; images are linked relative to `relative_to` (the folder the file is written in).
    Every string is escaped (`markdown_text`): values come from records and YAML files."""
    lines = [f"# {markdown_text(title)}", ""]
    for section in sections:
        lines += [f"{'#' * section.level} {markdown_text(section.title)}", ""]
        if section.text:
            lines += [markdown_text(section.text), ""]
        if section.items:
            lines += [*(f"- {markdown_text(item)}" for item in section.items), ""]
        if section.links:
            lines += [*(f"- [{markdown_text(text)}](<{quote(href)}>)" for text, href in section.links), ""]
        if section.table is not None:
            lines += [markdown_table(section.table), ""]
        for caption, path in section.images:
            link = path.relative_to(relative_to) if relative_to else path
            lines += [f"![{markdown_text(caption)}]({link.as_posix()})", ""]
    return "\n".join(lines)


# Characters that would turn a value into markup: a line break (ends a table row or an item), a
# pipe (ends a table cell), brackets (a link, or an image fetched from anywhere), `<` (raw
# HTML, which Markdown viewers render; `>` alone is none), `*`, `_` and `~` (emphasis, strikethrough), a
# backtick (code), `&` (an entity), `#` (a heading's closing sequence) and `$` (math, on GitHub).
# Each gets CommonMark's backslash escape; the backslash itself too, so that a value's own
# backslash cannot undo one. An underscore inside a word (fsdp2_zero3) is no markup and stays.
_MARKDOWN_ESCAPES = str.maketrans({**{char: "\\" + char for char in "\\|[]<*~`&#$"}, "\n": " ", "\r": " "})
_EMPHASIS_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def markdown_text(value: object) -> str:
    """A value as literal Markdown text, on one line."""
    text = str(value).translate(_MARKDOWN_ESCAPES)
    return _EMPHASIS_UNDERSCORE.sub(r"\\_", text) if "_" in text else text


def markdown_table(table: pd.DataFrame) -> str:
    """The one Markdown table renderer: cells as literal text (`markdown_text`), columns padded."""
    if table.empty:
        return "(none)"
    rows = [[markdown_text(v) for v in row] for row in _rows(table)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(table.columns))]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |" for row in rows
    ]
    lines.insert(1, "|" + "|".join(":" + "-" * (width + 1) for width in widths) + "|")
    return "\n".join(lines)


def _html_table(table: pd.DataFrame) -> str:
    if table.empty:
        return "<p>(none)</p>"
    head, *body = [[html.escape(str(v)) for v in row] for row in _rows(table)]
    return (
        "<table><thead><tr>"
        + "".join(f"<th>{cell}</th>" for cell in head)
        + "</tr></thead><tbody>"
        + "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in body)
        + "</tbody></table>"
    )


def _rows(table: pd.DataFrame) -> list[list]:
    """Header then data rows, with a blank for a missing value (None, or NaN: the value unequal to itself)."""
    blanked = ([("" if v is None or v != v else v) for v in row] for row in frame_rows(table))
    return [list(table.columns), *blanked]


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #1d2430; line-height: 1.45; }
h1 { font-size: 1.5rem; border-bottom: 2px solid #d0d7de; padding-bottom: .4rem; }
h2 { font-size: 1.2rem; margin-top: 2rem; }
h3 { font-size: 1rem; margin-top: 1.2rem; color: #444; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0 1rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .55rem; text-align: right; }
th { background: #f3f5f7; }
td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafbfc; }
figure { margin: 1rem 0 2rem; }
figure img { max-width: 100%; border: 1px solid #e5e8eb; }
figcaption { font-size: .85rem; color: #555; }
nav a { margin-right: .8rem; font-size: .9rem; }
"""


def to_html(title: str, sections: list[Section]) -> str:
    """One page with no outside references: styles inline, images as base64 data URIs."""
    anchors = [f"s{i}" for i in range(len(sections))]
    nav = " ".join(
        f'<a href="#{a}">{html.escape(s.title)}</a>' for a, s in zip(anchors, sections, strict=True) if s.level == 2
    )
    body = [f"<h1>{html.escape(title)}</h1>", f"<nav>{nav}</nav>"]
    for anchor, section in zip(anchors, sections, strict=False):
        body.append(f'<h{section.level} id="{anchor}">{html.escape(section.title)}</h{section.level}>')
        if section.text:
            body.append(f"<p>{html.escape(section.text)}</p>")
        if section.items:
            body.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in section.items) + "</ul>")
        if section.links:
            body.append(
                "<ul>"
                + "".join(
                    f'<li><a href="{html.escape(quote(href))}">{html.escape(text)}</a></li>'
                    for text, href in section.links
                )
                + "</ul>"
            )
        if section.table is not None:
            body.append(_html_table(section.table))
        for caption, path in section.images:
            try:  # a figure a link was put at since it was drawn is not embedded: never what it leads to
                data = base64.b64encode(read_regular_file(path, MAX_FIGURE_BYTES)).decode("ascii")
            except OSError as exc:
                body.append(f"<p>{html.escape(caption)}: not embedded ({html.escape(exc.strerror or str(exc))})</p>")
                continue
            body.append(
                f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


Written = tuple[list[Path], list[str]]  # the files written, and a note per column parquet could not keep


@contextmanager
def tables_writing(frame: pd.DataFrame, report: Path) -> Iterator[Callable[[], Written]]:
    """write_tables(frame, report) started in a forked process (it has the frame through the fork:
    nothing pickled); what it yields waits for it and returns its answer. This process writes
    them instead where the records are few or there is one core, where no process could be forked, and where the
    worker failed or was killed: so any error (a full disk) is raised here, as write_tables raises it,
    and each file is still written whole or not at all (atomic_output). Forked with the collector
    paused, as the figures' workers are (plots.drawing_plots)."""
    if len(frame) < SPLIT_MIN_RECORDS or (os.cpu_count() or 1) < 2:
        yield lambda: write_tables(frame, report)
        return
    receiver, sender = multiprocessing.Pipe(duplex=False)
    worker = multiprocessing.get_context("fork").Process(target=_write_and_send, args=(frame, report, sender))
    started = True
    try:
        with garbage_collection_paused():
            gc.freeze()
            try:
                worker.start()
            finally:
                gc.unfreeze()
    except OSError:  # no fork (a process limit)
        started = False
    sender.close()
    if not started:
        receiver.close()
        yield lambda: write_tables(frame, report)
        return

    def answer() -> Written:
        try:
            written: Written | None = receiver.recv()
        except (EOFError, OSError):  # the worker died before it answered
            written = None
        worker.join()
        return written if written is not None else write_tables(frame, report)

    try:
        yield answer
    finally:
        receiver.close()
        worker.join()


def _write_and_send(frame: pd.DataFrame, report: Path, sender: Connection) -> None:
    try:
        written: Written | None = write_tables(frame, report)
    except BaseException:  # the parent writes them again, and raises the error there
        written = None
    sender.send(written)


def write_tables(frame: pd.DataFrame, report: Path) -> tuple[list[Path], list[str]]:
    """results.csv, and results.parquet when pyarrow is there; lists and objects as JSON text.
    Returns the files and a note per column that parquet could not keep as it was."""
    table = _exportable(frame)
    with atomic_output(report / "results.csv") as tmp:
        _without_formulas(table).to_csv(tmp, index=False)
    written = [report / "results.csv"]
    try:
        import pyarrow  # noqa: F401  (only to know whether parquet can be written)
    except ImportError:
        return written, []
    notes = _write_parquet(table, report / "results.parquet")
    return [*written, report / "results.parquet"], notes


def _write_parquet(table: pd.DataFrame, path: Path) -> list[str]:
    """A parquet column holds one type. Records checked only where the collector computes can
    still disagree elsewhere (a field text in one record, a number in another): such a column
    is written as text, with a note naming it; results.csv keeps the values as read. A column
    with no value at all (a GPU figure of a CPU sweep), which Arrow would type `null` (some
    readers refuse it), gets the type the record declares for it (recordschema.declared_type),
    else string."""
    import pyarrow

    fields, mixed, whole = [], [], {}
    for column in table.columns:
        try:
            kind = pyarrow.array(table[column], from_pandas=True).type
        except pyarrow.ArrowException:
            mixed.append(column)
            kind = pyarrow.string()
        if pyarrow.types.is_null(kind):
            kind = getattr(pyarrow, ARROW_TYPES.get(declared_type(column) or str, "string"))()
        elif pyarrow.types.is_floating(kind) and declared_type(column) is int:
            known = table[column].dropna()  # an int field that failed records lack, which pandas made float
            if (known == known.round()).all():  # int64 in every sweep, null where a record has none
                whole[column], kind = table[column].astype("Int64"), pyarrow.int64()
        fields.append(pyarrow.field(column, kind))
    typed = table.assign(**{column: table[column].map(_as_text) for column in mixed}, **whole)
    with atomic_output(path) as tmp:
        typed.to_parquet(tmp, index=False, schema=pyarrow.schema(fields))
    return [f"{path}: column(s) {', '.join(mixed)} hold values of more than one type; written as text"] if mixed else []


ARROW_TYPES = {float: "float64", int: "int64", bool: "bool_", str: "string"}  # declared type -> pyarrow's


def _as_text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


# What a spreadsheet reads as the start of a formula (OWASP's CSV injection list): a record's error
# "=HYPERLINK(...)" or "@SUM(...)" would run when results.csv is opened.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _without_formulas(table: pd.DataFrame) -> pd.DataFrame:
    """The table with every text cell that a spreadsheet would take for a formula quoted by a
    leading apostrophe, as spreadsheets themselves mark text; numbers are left as they are. A text
    column (pandas' str) is tested in Arrow, a column at a time; only a column of other objects
    (JSON text of lists beside NaN, true/false beside NaN) a value at a time."""
    quoted = {}
    for column in [c for c in table.columns if not pd.api.types.is_numeric_dtype(table[c])]:
        values = table[column]
        if isinstance(values.dtype, pd.StringDtype):
            formulas = values.str.startswith(FORMULA_STARTS).fillna(False).astype(bool)
            if formulas.any():
                quoted[column] = values.where(~formulas, "'" + values)
        else:
            quoted[column] = values.map(lambda v: "'" + v if isinstance(v, str) and v.startswith(FORMULA_STARTS) else v)
    return table.assign(**quoted) if quoted else table


def _exportable(frame: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in ("cell_id", "sweep", "status", "stage", "error") if c in frame]
    table = frame[first + [c for c in frame.columns if c not in first]].copy()
    for column in table.columns[table.dtypes == "object"]:
        values = table[column].dropna()
        if len(values) and isinstance(values.iloc[0], (list, dict)):  # a record field holds one JSON type
            table[column] = table[column].map(lambda v: _json_text(v) if isinstance(v, (list, dict)) else v)
    return table


NUMBERS_ONLY = b"0123456789.,-[]"  # JSON text of lists of numbers (and of such lists) has no other byte


def _json_text(value: list[Any] | dict[str, Any]) -> str:
    """json.dumps(value), written by pydantic-core's JSON writer (in Rust, ten times faster: the
    list fields of 10,000 records) where its text is numbers and brackets alone. It spells such
    numbers as json does, but for two: a number from 1e-05 to 1e-04 (0.00001) and an exponent
    (1e-7 against 1e-07); and it writes no space after a comma. Text with either of those, or with
    anything but numbers (strings, true/false/null, NaN, objects), is json.dumps' own: results.csv
    and results.parquet keep json.dumps' bytes."""
    try:
        text = to_json(value)
    except PydanticSerializationError:
        return json.dumps(value)
    if text.translate(None, NUMBERS_ONLY) or b"0.0000" in text:
        return json.dumps(value)
    return text.replace(b",", b", ").decode()
