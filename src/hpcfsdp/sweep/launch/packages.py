"""Check, before anything is queued, that the environment the cells run in has the packages of
the levers they ask for (hpcfsdp/extras.py): one line per lever value whose package is missing,
naming the YAML line and key that set it, the package and the pip line. Nothing is imported."""

from __future__ import annotations

from ...extras import missing
from ..define.matrix import Sweep
from .preflight import place


def package_problems(sweep: Sweep) -> list[str]:
    """One line per (key, value) of the sweep's cells whose package this environment lacks."""
    seen: dict[tuple[str, str], str] = {}
    for cell in sweep.cells:
        for name, why in missing(cell.spec):
            value = getattr(cell.spec, name)
            seen.setdefault((name, value), f"{place(sweep, name, value)}: {why}")
    return list(seen.values())
