"""The pieces cli.py's subcommand parsers share: the --json and --max-cells options, worded once,
and the checked numbers some options take (argparse types: a positive integer, tune's --eta)."""

from __future__ import annotations

import argparse


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
