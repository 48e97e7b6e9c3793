"""Render report sections as Markdown (summary.md) or one self-contained HTML page (index.html).

A section is plain data (a title, a paragraph, a table of formatted strings, bullet items,
images); this module knows nothing about records, so the same sections make both documents.
Tables are rendered here rather than by pandas/tabulate: their cells are strings already, and a
large sweep has hundreds of small pivot tables, where the generic renderers' per-table cost adds up.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from ..contracts.files import read_regular_file

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
    blanked = ([("" if v is None or v != v else v) for v in row] for row in table.itertuples(index=False))
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
