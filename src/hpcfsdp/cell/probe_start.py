"""How a rank starts its batch-search probes' processes: forked by its probe starter, not exec'd.

A probe process that starts as a new interpreter imports torch, transformers and the cell's code
again before it does anything: ~6 s of CPU per rank per probe on the CPU machine, ~11 s on an H200
node (issue 52). A rank cannot fork its probes itself: by the search it has threads (gloo's, the
watchdog's, torch's pool) and, on a GPU, CUDA initialised. So a rank that will search forks, before
it forms its process group (run.py), a small starter process: a copy of the rank as it is then,
its code imported, one thread, no CUDA. The rank asks it over a socket pair to fork each probe; the
probe starts as `python -m hpcfsdp.cell.batch_probe RESULT` would (ranks/forking.py: a session of
its own, a fresh interpreter's signal handlers, the probe's environment, torch's threads from its
OMP_NUM_THREADS) and leaves with os._exit. The starter tells the rank the probe's pid and, when it
ends, its exit status, and reaps it only once the rank has heard that (so the pid the rank may
still SIGKILL is never another process's). The rank sees a forked probe as it sees a
subprocess.Popen child (ForkedProbe): batch_search.py waits for it and ends it the same way.

The starter ends with the rank: its parent-death signal, and the end of its socket (the rank's
end closes with the rank). A probe ends with the starter (batch_probe's own parent-death signal).
Where the rank may not fork (ranks/forking.fork_refusal: a thread, CUDA initialised,
HPCFSDP_RANK_START=exec) or the starter is gone, probes are started by exec, as before, and the
search's log says why.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, NoReturn, Protocol

from .ranks.forking import fork_into, fork_refusal, leave_after, start_fresh
from .stopping.watchdog import set_parent_death_signal

IDLE_POLL_S = 0.05  # how often the starter looks for its probes' ends while one runs


class ProbeProcess(Protocol):
    """A probe's process as batch_search.py waits for it and ends it (subprocess.Popen, ForkedProbe)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


class ProbeStarter:
    """The rank's side of its starter: ask for a probe, hear of its end."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self._conn = conn
        self._ended: dict[int, int] = {}  # probe pid -> exit status, until its ForkedProbe reads it
        self.gone = ""  # why the starter can no longer start probes

    def start(self, result: Path, env: Mapping[str, str]) -> ForkedProbe | None:
        """Fork a probe writing `result`, with `env`; None when the starter is gone (`gone` says why)."""
        if self._send({"start": str(result), "env": dict(env)}):
            while not self.gone:
                message = self._receive(None)
                if message and "started" in message:
                    return ForkedProbe(self, int(message["started"]))
        return None

    def exit_status(self, pid: int, block: bool) -> int | None:
        """A probe's exit status once it ended (then the starter reaps it); None while it runs."""
        while pid not in self._ended and not self.gone:
            if not self._receive(None if block else 0) and not block:
                break
        if pid not in self._ended:
            return -signal.SIGKILL if self.gone else None  # gone: the probe went with it (parent-death signal)
        self._send({"reap": pid})
        return self._ended.pop(pid)

    def close(self) -> None:
        """End the starter (its probes, if any, go with it) and reap it."""
        self._lost("closed")

    def _send(self, message: Mapping[str, Any]) -> bool:
        try:
            self._conn.send_bytes(json.dumps(message).encode())
            return True
        except OSError as exc:
            self._lost(f"its socket failed: {exc}")
            return False

    def _receive(self, timeout: float | None) -> dict[str, Any] | None:
        """One message from the starter within `timeout` (None: wait for it); an end is kept."""
        try:
            if not self._conn.poll(timeout):
                return None
            message = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError, ValueError):  # ValueError: a message cut by a signal's exception
            self._lost("its socket ended")
            return None
        if "ended" in message:
            self._ended[int(message["ended"])] = int(message["status"])
        elif "error" in message:
            self._lost(str(message["error"]))
        return message

    def _lost(self, why: str) -> None:
        """No more probes from the starter: kill it (a process the rank forked since may hold its
        socket open, so that it would never see the end) and reap it; its probes get their
        parent-death signal."""
        if self.gone:
            return
        self.gone = f"the probe starter (pid {self.pid}) is gone: {why}"
        self._conn.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class ForkedProbe:
    """A probe process the starter forked, as subprocess.Popen shows its child to the rank."""

    def __init__(self, starter: ProbeStarter, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._starter = starter

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.exit_status(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._starter.exit_status(self.pid, block=True)
        assert self.returncode is not None
        return self.returncode


_starter: ProbeStarter | None = None
_refusal = "no probe starter was started in this process"


def open_probe_starter() -> None:
    """Fork this process's probe starter, where a fork is safe (else say why, in how_probes_start).
    Call it before this process starts any thread: before its process group forms."""
    global _starter, _refusal
    if _starter is not None and not _starter.gone:
        return
    _refusal = fork_refusal(os.environ, "the rank's process")
    if _refusal:
        return
    ours, theirs = Pipe(duplex=True)
    pid = fork_into(lambda: _serve(theirs, ours), signal.valid_signals())  # the rank's handlers never run there
    theirs.close()
    _starter = ProbeStarter(pid, ours)


def close_probe_starter() -> None:
    """End this process's probe starter once the search is over, and reap it (the cell's training
    needs no probe; no process of the rank's is left behind it)."""
    global _starter, _refusal
    if _starter is not None:
        _starter.close()
        _starter, _refusal = None, "the probe starter was closed"


def how_probes_start() -> str:
    """What the search's log says of how its probe processes start."""
    if _starter is not None and not _starter.gone:
        return f"forked by the probe starter (pid {_starter.pid}) of this rank (pid {os.getpid()})"
    return f"started by exec from this rank (pid {os.getpid()}): {_starter.gone if _starter is not None else _refusal}"


def start_probe(result: Path, env: Mapping[str, str]) -> ProbeProcess:
    """This rank's probe process for one probe: forked by the starter, else a new interpreter."""
    if _starter is not None and not _starter.gone:
        if (forked := _starter.start(result, env)) is not None:
            return forked
        print(f"[hpcfsdp] batch search: probe processes started by exec from now on: {_starter.gone}", flush=True)
    command = [sys.executable, "-m", "hpcfsdp.cell.batch_probe", str(result)]
    return subprocess.Popen(command, env=dict(env), start_new_session=True)


def _serve(conn: Connection, ranks_end: Connection) -> NoReturn:
    """The starter: fork a probe on each request, report its pid and its end, reap it once the rank
    heard of it; leave when the rank does (EOF, or the parent-death signal)."""

    def serve() -> None:
        ranks_end.close()  # the rank's end: the rank's own going must reach this one as EOF
        set_parent_death_signal(signal.SIGKILL)  # every signal stays blocked here: SIGKILL ends it
        running: set[int] = set()
        while True:
            try:
                message = json.loads(conn.recv_bytes()) if conn.poll(IDLE_POLL_S if running else None) else {}
            except (EOFError, OSError, ValueError):  # the rank is gone (or its message cut): so are its probes
                for pid in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                return
            if "start" in message:
                try:
                    pid = fork_into(functools.partial(_probe, conn, Path(message["start"]), message["env"]))
                except OSError as exc:
                    conn.send_bytes(json.dumps({"error": f"fork failed: {exc}"}).encode())
                    continue
                running.add(pid)
                conn.send_bytes(json.dumps({"started": pid}).encode())
            elif "reap" in message:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(int(message["reap"]), 0)
            for pid in list(running):
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None and ended.si_pid:  # kept a zombie until the rank asks to reap it
                    running.discard(pid)
                    status = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
                    conn.send_bytes(json.dumps({"ended": pid, "status": status}).encode())

    leave_after(serve)


def _probe(conn: Connection, result: Path, env: Mapping[str, str]) -> NoReturn:
    """A probe process, forked by the starter: as `python -m hpcfsdp.cell.batch_probe RESULT`."""

    def probe() -> None:
        conn.close()
        start_fresh(env)
        from .batch_probe import main

        main(result)

    leave_after(probe)
