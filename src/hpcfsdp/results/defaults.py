"""File names and defaults of the results side, in a module that loads nothing else: the parser
shows them in its help, and importing the modules that use them would load pandas."""

from __future__ import annotations

DEFAULT_RESULTS = "results"  # the parent of sweep folders, and of the history and references beside them
HISTORY_NAME = "history.duckdb"
REFERENCES_NAME = "references.yaml"
DEFAULT_TOLERANCE = 0.10  # how far below its reference or its history's median a cell may fall
