"""How the supervisor starts a rank: forked from its own process, which imported the rank's code
once (torch, transformers, cell/run.py and the cell's model class) without touching CUDA, so that a
rank pays no imports and each later cell of the same process none either (issue 52); or, where a
fork would not be safe (a thread in this process, CUDA initialised in it) or where the user
asks for it (HPCFSDP_RANK_START=exec, for debugging), a new interpreter running
`python -m hpcfsdp run --cell-dir`, as every rank started before the fork.

A forked rank starts as that command would (ranks/forking.py, which a rank's probe starter uses
too, and which says when a fork is refused): a session of its own, the signal handlers of a fresh
interpreter, its environment (layout.rank_environment) in os.environ, torch's threads from its
OMP_NUM_THREADS (which libgomp read once, when the supervisor imported torch), stdout and stderr
the supervisor's; then it runs `python -m hpcfsdp` itself (runpy: the command's own __main__, the
CLI and `run`'s handling of signals and errors alike) and leaves with os._exit and its exit status,
never returning into the supervisor's code.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Literal, NoReturn

from ...contracts.files import read_json_object
from ...contracts.record import SPEC_NAME
from ..ranks.forking import NO_ALLOCATOR_THREAD, fork_into, leave_after, start_fresh

HELD = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)  # blocked across the fork: no supervisor handler runs in a rank

Start = Literal["fork", "exec"]
_PRIVATE_FDS: set[int] = set()  # this process's descriptors that a forked rank closes (keep_from_ranks)


# Set while the ranks' code is imported: a torch.cuda.is_available() asks NVML, not the driver (which
# a fork must not carry); libgomp, loaded with torch, starts no pool of threads (with more than one,
# torch's import runs a parallel region: 2 threads on the CPU machine), each rank sets its own;
# pyarrow's jemalloc starts no background thread (forking.NO_ALLOCATOR_THREAD).
IMPORTING_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OMP_NUM_THREADS": "1", **NO_ALLOCATOR_THREAD}


def warm_imports(cell_dir: Path) -> None:
    """Import what a rank of this cell imports before its cell starts, once per process, with
    IMPORTING_ENV; the cell's model class is imported from its config where it can be read (a cell
    whose model cannot be found says so itself, in its record)."""
    found = {name: os.environ.get(name) for name in IMPORTING_ENV}
    os.environ.update(IMPORTING_ENV)
    try:
        from ...contracts.sources import Sources
        from .. import run  # noqa: F401  torch, transformers' modeling code, the cell's whole sequence
        from ..models import model_class, resolve_model

        meta = read_json_object(cell_dir / SPEC_NAME, kind="cell spec")
        sources = Sources.of_cell_spec(meta, str(cell_dir / SPEC_NAME))
        if sources is not None:
            try:
                model_class(resolve_model(sources.model))
            except Exception:  # the rank meets the same error, and records it
                pass
    finally:
        for name, value in found.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def keep_from_ranks(fd: int) -> None:
    """Close fd in every rank this process forks from now on (a fork copies every descriptor; an
    exec'd rank gets none of this process's, which are not inheritable)."""
    _PRIVATE_FDS.add(fd)


def start_rank(how: Start, cell_dir: Path, env: dict[str, str]) -> int:
    """Start one rank of the cell with `env`; its pid."""
    if how == "exec":
        command = [sys.executable, "-m", "hpcfsdp", "run", "--cell-dir", str(cell_dir)]
        # as subprocess.Popen(start_new_session=True) started it: SIGPIPE and SIGXFSZ back to default
        return os.posix_spawn(sys.executable, command, env, setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    return fork_into(lambda: _forked_rank(cell_dir, env), HELD)


def _forked_rank(cell_dir: Path, env: dict[str, str]) -> NoReturn:
    """The rank, in the forked child: as `python -m hpcfsdp run --cell-dir` would start; SIGTERM and
    SIGUSR2 stay blocked until `run` holds them itself (early_signals), as from its first line."""

    def run() -> None:
        for fd in _PRIVATE_FDS:
            os.close(fd)
        _PRIVATE_FDS.clear()  # their numbers are free again in the rank
        start_fresh(env, unblock={signal.SIGINT}, threads=False)  # run_cell sets them, after its probe starter
        sys.argv = [sys.argv[0], "run", "--cell-dir", str(cell_dir)]
        runpy.run_module("hpcfsdp", run_name="__main__", alter_sys=True)

    leave_after(run)
