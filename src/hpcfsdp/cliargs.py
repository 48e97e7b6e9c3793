"""The pieces cli.py's subcommand parsers share: the --json and --max-cells options, worded once,
the checked numbers some options take (argparse types: a positive integer, tune's --eta), and
where the pages of docs/ that help texts name are."""

from __future__ import annotations

import argparse
import re
from importlib.resources import files
from pathlib import Path

DOC_NAMED = re.compile(r"\bdocs/[\w.-]+\.md\b")  # a page of docs/ that a help text names


def docs_folder() -> Path:
    """The folder of the pages help names: the package's docs/ (pyproject.toml's package data; in
    a checkout, src/hpcfsdp/docs links to docs/), so a user of the wheel alone has them too."""
    return Path(str(files("hpcfsdp") / "docs"))


def docs_line(help_text: str) -> str:
    """The line that ends a help text naming a page of docs/: where that page is installed."""
    if not DOC_NAMED.search(help_text):
        return ""
    return f"\nthe docs/*.md pages named above: in a checkout, and installed with the package in {docs_folder()}\n"


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    text = f"print one JSON document on stdout instead of the tables: {what} (docs/submit.md)"
    parser.add_argument("--json", action="store_true", help=text)


def add_max_cells(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-cells",
        type=positive_int,
        metavar="N",
        help="refuse a jobs YAML of more than N cells, counted before expanding it (default 100,000)",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def halving_factor(text: str) -> int:
    """--eta: 1 would keep every setup at every stage (and its rungs' count divides by log(1))."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer of 2 or more (keep the best 1/eta), got {text}")
    return value
