"""report/results.csv and results.parquet: every cell's record as a table, lists and objects as
JSON text, text a spreadsheet would run as a formula quoted, each parquet column of one type.

At 10,000 records these two files are a second of CPU (pandas' CSV writer, Arrow's conversion),
which needs nothing the rest of the report makes: tables_writing writes them in a forked process
while collect checks the history and writes the report's text on the other core.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic_core import PydanticSerializationError, to_json

from ..contracts.files import atomic_output, garbage_collection_paused
from ..recordschema import declared_type
from .read import SPLIT_MIN_RECORDS

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
