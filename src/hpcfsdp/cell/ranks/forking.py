"""A process of a cell forked from one that has the cell's code imported, started as a new
interpreter would start (issue 52): the node's supervisor forks its ranks (supervise/start.py), a
rank's probe starter forks each batch-search probe (cell/probe_start.py). Nothing here imports
torch at import time; a forked process sets torch's threads only where torch is already loaded.

A fork is safe only from a process with one thread (a fork copies the calling thread alone: a lock
another thread held stays held) and without CUDA initialised (the driver's state is not the
child's to use); where it is not, or where the user asks (HPCFSDP_RANK_START=exec, for
debugging), the caller starts a new interpreter instead and says why (fork_refusal).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

# pyarrow's jemalloc (loaded by the data code on the GPU image) starts no background thread: with it
# a rank that torchrun exec'd has two threads and may not fork its probe starter (H200, 2026-11-29).
NO_ALLOCATOR_THREAD = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
RANK_START_ENV = "HPCFSDP_RANK_START"  # `exec`: ranks and probes each a new interpreter (debugging); else forked
# What a fresh interpreter's handlers are: Python's own for SIGINT, SIGPIPE and SIGXFSZ ignored, the rest default.
FRESH_HANDLERS: dict[int, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}


def fork_refusal(environ: Mapping[str, str], whose: str) -> str:
    """Why this process (`whose`: "the supervisor's process", ...) starts new interpreters rather
    than forking; "" when it may fork."""
    if environ.get(RANK_START_ENV, "fork") == "exec":
        return f"{RANK_START_ENV}=exec"
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        return f"{threads} threads in {whose}"
    if cuda_initialised():
        return f"CUDA is initialised in {whose}"
    return ""


def cuda_initialised() -> bool:
    """Whether torch initialised CUDA in this process, whose state a forked child cannot use. The
    driver library being mapped is not that: the GPU image's torch 2.11 maps libcuda.so at import
    (bench/fork_threads.py), and a fork before cuInit is safe, as torch's own fork check says."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def fork_into(child: Callable[[], NoReturn], held: Iterable[int] = ()) -> int:
    """Fork; the child runs `child`, which never returns (leave_after). `held`: signals blocked
    across the fork, so that no handler of this process runs in the child before it puts back its
    own. What this process buffered for stdout and stderr is written first, not again by the child.
    The child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        pid = os.fork()
        if pid == 0:
            child()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


def start_fresh(env: Mapping[str, str], unblock: set[int] | None = None, threads: bool = True) -> None:
    """In a forked child: become what a new interpreter started with `env` and
    start_new_session=True would be: a session of its own, a fresh interpreter's signal handlers,
    `env` as os.environ, torch's threads from its OMP_NUM_THREADS (libgomp read the variable once,
    when the parent imported torch; `threads` False: later, by set_torch_threads, for a child that
    may fork again first: torch starts its pool at once). `unblock`: the signals to unblock; None: every one."""
    os.setsid()
    for signum in signal.valid_signals():
        _fresh_handler(signum)
    if unblock is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    else:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
    os.environ.clear()
    os.environ.update(env)
    if threads:
        set_torch_threads()


def set_torch_threads() -> None:
    """torch's intra-op threads from this process's OMP_NUM_THREADS (where torch is imported): what a
    new interpreter gets from libgomp at import. torch starts the threads here, so a process that
    forks after this point is refused (fork_refusal)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def leave_after(main: Callable[[], object]) -> NoReturn:
    """In a forked child: run `main` as an interpreter runs its program, then os._exit with the
    status it would exit with (a SystemExit's code, 1 after an exception's traceback), never
    returning into the parent's code."""
    status = 1
    try:
        main()
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
    """Put back the handler a new interpreter has for signum (the parent's and submitit's go)."""
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
