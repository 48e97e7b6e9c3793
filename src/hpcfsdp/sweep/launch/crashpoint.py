"""Test-only: HPCFSDP_FAULT=<point>:sigkill kills the login-side command itself at a named point,
as a SIGKILL from outside would (no handler, no cleanup), so that a test stops `submit` between
sbatch and the manifest (`submit_queued`) or `tune` just after it began a stage
(`tune_begun_<stage>`) at exactly that point. The cell's own faults are cell/stopping/faults.py's."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "HPCFSDP_FAULT"  # the same variable as the cell's faults (cell/stopping/faults.py)


def crash_point(point: str) -> None:
    """SIGKILL this process here when HPCFSDP_FAULT names this point."""
    if os.environ.get(FAULT_ENV) == f"{point}:sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
