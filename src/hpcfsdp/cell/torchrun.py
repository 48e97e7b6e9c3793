"""`python -m hpcfsdp.cell.torchrun ARGS`: torchrun (`python -m torch.distributed.run ARGS`) as the
local executor and `tune` start it, less the stack walks of its rendezvous' event log.

torch's dynamic rendezvous (the one `--standalone` uses) names the method behind each event it
logs with `inspect.stack()`, twice per event, and inspect.stack reads the source file of every
frame and looks up the module of each among all those loaded: on the 2-core CPU machine (torch
2.13, 2026-11-27) about 1 s of a launch before its first worker started and 1 s after its last
ended. Here the same name is read off the frame itself. Where torch has no such function (another
version), torchrun runs as it is.
"""

from __future__ import annotations

import sys


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


def main() -> None:
    name_callers_from_frames()
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
