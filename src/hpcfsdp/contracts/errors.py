"""The one base class of the errors a user can act on.

Each kind (a bad spec, an unreadable record, a refused sbatch, a history that cannot be opened,
...) is a `UserError` carrying the exit status it ends `hpcfsdp` with; `cli.main` prints it, as
one line, in one place. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os

# What `hpcfsdp collect` exits with, past a UserError's own status, and what each means: the
# `submit --then-collect` job records the status and `hpcfsdp status` says it in these words.
COLLECT_REGRESSED = 1  # a cell regressed (against --compare, or with --fail-on-regression)
COLLECT_UNCHECKED = 3  # the history could not be updated, so no cell was checked against it
COLLECT_ENDINGS = {
    0: "report written",
    COLLECT_REGRESSED: "report written; a cell regressed",
    COLLECT_UNCHECKED: "report written; the history could not be updated, so no cell was checked against it",
}

# The exit statuses of every command (docs/submit.md, "Exit statuses"): what a cron job or CI reads.
EXIT_OK = 0
EXIT_ERROR = 1  # a UserError: something met on the way (a file, a record, Slurm's refusal)
EXIT_USAGE = 2  # the command line, or the jobs YAML it names, is wrong (argparse, SpecError)
EXIT_NOT_OK = 3  # some cells ended in a status other than ok (or have no usable record)
EXIT_IN_FLIGHT = 4  # nothing failed, but some cells are still pending or running


class UserError(Exception):
    """Something the user can fix or must know; str() is one line. `exit_status`: what `hpcfsdp`
    exits with (1; 2 for bad input, SpecError)."""

    exit_status = EXIT_ERROR
    json_answered = False  # a --json command already printed its own document of this error (plan's refusal)

    def line(self) -> str:
        """What `hpcfsdp` prints on stderr."""
        return f"error: {self}"

    def lines(self) -> list[str]:
        """Every line `hpcfsdp` prints on stderr: one, but for several problems of one file at once."""
        return [self.line()]


class Stopped(UserError):
    """An interrupt (Ctrl-C, SIGTERM, SIGHUP) ended the command: what it left, and how to go on.
    Its exit status is the shell's for the signal (128 + its number)."""

    def __init__(self, message: str, exit_status: int = 130):
        super().__init__(message)
        self.exit_status = exit_status

    def line(self) -> str:
        return str(self)


class UsageError(UserError):
    """A command line argparse refuses, where the command answers in JSON (else argparse says so)."""

    exit_status = EXIT_USAGE

    def __init__(self, prog: str, message: str):
        super().__init__(f"{prog}: {message}")


def os_error_text(exc: OSError) -> str:
    """'<path>: <what the system said>', as one line."""
    paths = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
    what = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) and exc.filename and not os.path.isdir(exc.filename):
        what = "a file is where a folder is needed"  # mkdir(exist_ok=True) of a path that is a file
    return f"{paths}: {what}" if paths else what
