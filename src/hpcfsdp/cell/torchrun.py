"""`python -m hpcfsdp.cell.torchrun ARGS`: torchrun (`python -m torch.distributed.run ARGS`) as the
local executor and `tune` start it, less three costs of a launch that do nothing for one node:

- the stack walks of its rendezvous' event log. torch's dynamic rendezvous (the one `--standalone`
  uses) names the method behind each event it logs with `inspect.stack()`, twice per event, and
  inspect.stack reads the source file of every frame and looks up the module of each among all
  those loaded: on the 2-core CPU machine (torch 2.13, 2026-11-27) about 1 s of a launch before its
  first worker started and 1 s after its last ended. Here the same name is read off the frame.
- the rendezvous' random delay of 0-0.3 s before its first join, which spreads many nodes' first
  requests to the store; with `--standalone` there is one node.
- the interpreter's finalization once torchrun is done (its workers ended and reaped, its store
  shut down): tearing down torch's modules and C++ libraries took 0.5 s on the quiet 2-core
  machine and 3.5-4 s on a loaded one, after the cell's record was written (the record's
  `phases.teardown`). This process ends as Python would (its atexit handlers run, the same exit
  status, an uncaught exception printed the same way), without that tear-down.

Where torch has no such functions (another version), torchrun runs as it is.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable


def name_callers_from_frames() -> None:
    """Replace dynamic_rendezvous.get_method_name (the name of the function `depth` frames up) by
    one that reads the frame, not the whole stack and its sources."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if not callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def join_without_spreading_nodes() -> None:
    """Drop the dynamic rendezvous' random delay (a (low, high) range) before a node's first join;
    its fixed delays (the one-second pause between polls of the store) stay."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if not callable(delay):
        return

    def _delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    dynamic_rendezvous._delay = _delay


def exit_status(run: Callable[[], object]) -> int:
    """Call run; the exit status Python would end with after it, having printed an uncaught
    exception as Python does (sys.excepthook), from run's frame on: a failed cell's log names
    torch's frames, none of this module's. KeyboardInterrupt is raised on: Python ends by SIGINT
    then."""
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if exc.__traceback__ is not None:
            exc = exc.with_traceback(exc.__traceback__.tb_next)  # from run's frame on
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def exit_without_finalizing(code: int) -> None:
    """End the process as Python would after its main module, less the interpreter's tear-down of
    its modules: the atexit handlers run (logging's flush among them), then os._exit. Where a
    thread other than the daemons is still running (Python would wait for it), Python ends as usual."""
    main_thread = threading.main_thread()
    if any(t.is_alive() and not t.daemon and t is not main_thread for t in threading.enumerate()):
        raise SystemExit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    name_callers_from_frames()
    if "--standalone" in sys.argv:
        join_without_spreading_nodes()
    from torch.distributed.run import main as torchrun

    exit_without_finalizing(exit_status(torchrun))


if __name__ == "__main__":
    main()
