"""How the supervisor starts a rank: forked from its own process, which imported the rank's code
once (torch, transformers, cell/run.py and the cell's model class) without touching CUDA, so that a
rank pays no imports and each later cell of the same process none either (issue 52); or, where a
fork would not be safe (a thread in this process, CUDA initialised in it) or where the user
asks for it (HPCFSDP_RANK_START=exec, for debugging), a new interpreter running
`python -m hpcfsdp run --cell-dir`, as every rank started before the fork.

A forked rank starts as that command would: a session of its own, the signal handlers of a fresh
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
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NoReturn

from ...contracts.files import read_json_object
from ...contracts.record import SPEC_NAME

RANK_START_ENV = "HPCFSDP_RANK_START"  # `exec`: every rank a new interpreter (debugging); else forked
HELD = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)  # blocked across the fork: no supervisor handler runs in a rank
# What a fresh interpreter's handlers are: Python's own for SIGINT, SIGPIPE and SIGXFSZ ignored, the rest default.
FRESH_HANDLERS: dict[int, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}

Start = Literal["fork", "exec"]
_PRIVATE_FDS: set[int] = set()  # this process's descriptors that a forked rank closes (keep_from_ranks)


# Set while the ranks' code is imported: a torch.cuda.is_available() asks NVML, not the driver (which
# a fork must not carry); libgomp, loaded with torch, starts no pool of threads (with more than one,
# torch's import runs a parallel region: 2 threads on the CPU machine), each rank sets its own;
# pyarrow's jemalloc (loaded by the data code on the GPU image) starts no background thread.
IMPORTING_ENV = {
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    "OMP_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}


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


def fork_refusal(environ: Mapping[str, str]) -> str:
    """Why this process starts its ranks by exec rather than fork; "" when it forks them."""
    if environ.get(RANK_START_ENV, "fork") == "exec":
        return f"{RANK_START_ENV}=exec"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        return f"{threads} threads in the supervisor's process"
    if cuda_initialised():
        return "CUDA is initialised in the supervisor's process"
    return ""


def cuda_initialised() -> bool:
    """Whether torch initialised CUDA in this process, whose state a forked child cannot use. The
    driver library being mapped is not that: the GPU image's torch 2.11 maps libcuda.so at import
    (bench/fork_threads.py), and a fork before cuInit is safe, as torch's own fork check says."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


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
    sys.stdout.flush()  # what this process buffered is not printed again by the rank
    sys.stderr.flush()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        pid = os.fork()
        if pid == 0:
            _forked_rank(cell_dir, env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


def _forked_rank(cell_dir: Path, env: dict[str, str]) -> NoReturn:
    """The rank, in the forked child: as `python -m hpcfsdp run --cell-dir` would start; SIGTERM and
    SIGUSR2 stay blocked until `run` holds them itself (early_signals), as from its first line."""
    status = 1
    try:
        os.setsid()
        for fd in _PRIVATE_FDS:
            os.close(fd)
        for signum in signal.valid_signals():
            _fresh_handler(signum)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.environ.clear()
        os.environ.update(env)
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = [sys.argv[0], "run", "--cell-dir", str(cell_dir)]
        runpy.run_module("hpcfsdp", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _fresh_handler(signum: int) -> None:
    """Put back the handler a new interpreter has for signum (the supervisor's and submitit's go)."""
    fresh = FRESH_HANDLERS.get(signum, signal.SIG_DFL)
    try:
        if signal.getsignal(signum) not in (None, fresh):
            signal.signal(signum, fresh)
    except (OSError, ValueError):  # SIGKILL, SIGSTOP, and the numbers glibc keeps for itself
        pass


def _exit_status(code: object) -> int:
    """The exit status SystemExit(code) gives an interpreter (its message printed as it prints it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
