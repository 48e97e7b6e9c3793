"""`python -m hpcfsdp.cell.supervise --serve FD`: the local executor's supervisor, kept for every
launch of one `submit` (and of one `tune`'s stage), so that the ranks' code is imported with the
first launch only and each later launch's ranks are forked without importing again (start.py):
on 2 CPU cores a launch's supervisor process paid ~6 s of imports, more than a tiny cell trains.

It runs one launch at a time, as the login side asks over the socket FD (sweep/launch/warm.py).
A request is one datagram: JSON {"cell_dir", "processes", "env", "deadline"}, with the launch's log
file attached (SCM_RIGHTS: the login side opened it, never through a link). Each launch runs as a
supervisor process of its own would (entry.supervise_launch: that environment, that log as stdout
and stderr, ended at the deadline as the local executor ends one). The reply is JSON {"exit": N}, or
{"exit": null} when the deadline came first. End of file on the socket ends it; so does a signal
between launches (a signal during one is passed on to its ranks, as any supervisor does).
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

from .entry import supervise_launch
from .start import keep_from_ranks

MAX_REQUEST = 1 << 20  # a request's bytes: the launch's environment is most of it


def serve(fd: int) -> int:
    """Launches as the socket asks, until it is closed; this process's exit status."""
    channel = socket.socket(fileno=fd)
    keep_from_ranks(fd)  # a rank that outlived this process must not hold the login side's socket open
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 1)
        except ConnectionResetError:
            return 0
        if not message:
            return 0
        if len(fds) != 1:
            raise SystemExit(f"supervisor: a request without its log file ({len(fds)} file descriptors)")
        log = fds[0]
        try:
            request = json.loads(message)
            status = supervise_launch(
                Path(request["cell_dir"]), int(request["processes"]), request["env"], log, float(request["deadline"])
            )
        except Exception:  # in the launch's log, where its missing record's tail is read
            os.write(log, f"[hpcfsdp] supervisor (pid {os.getpid()}) failed:\n{traceback.format_exc()}".encode())
            return 1
        finally:
            os.close(log)
        try:
            channel.send(json.dumps({"exit": status}).encode())
        except OSError:  # the login side is gone (a SIGKILLed submit): nothing is left to launch
            return 0
