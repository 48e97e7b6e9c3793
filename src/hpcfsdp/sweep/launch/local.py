"""The local executor: one cell at a time on this machine, each launched by one supervisor process
kept for the whole submit (WarmSupervisor; tune's local probes use it too) with the cell's world
size, within the sweep's time limit as under Slurm; the print executor's shell line per cell; and
the ending of a cell's every process when its time is up or submit is interrupted (or killed)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ...contracts.files import RecordError
from ...contracts.fs.beneath import open_for_writing
from ...contracts.record import MISSING, RECORD_NAME, read_record, write_record
from ...contracts.spec import JOB_END_ENV, LAUNCH_STARTED_ENV
from ...progress import coloured
from ..define.matrix import Cell, Sweep
from ..folder.layout import LOG_NAME, cell_dir, records_set_aside, update_manifest, write_local_run
from ..track.lost import log_tails, record_launch_failure
from ..track.processes import LAUNCH_DIR_ENV, LOCAL_GRACE_S, kill_survivors, launched_in, processes_under
from ..track.status import cell_state
from .environment import HF_TOKEN_ENV, job_environment, secret_names, without_secrets
from .interrupts import Interrupted

GPU_WAIT_S = 60.0  # how long a cell waits for GPUs that other processes hold before it is not started
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TORCHRUN = "torch.distributed.run"
# What the local executor and tune's launches start: the node's supervisor (cell/supervise/), which
# starts the cell's ranks and watches them; the print executor prints torchrun.
SUPERVISOR = "hpcfsdp.cell.supervise"
IDLE_EXIT_S = 5.0  # how long a supervisor between launches takes to leave once its socket is closed
MAX_REPLY = 4096
LOG_TAIL_BYTES = 8000  # what a supervisor that died said on its own stderr, added to the launch's log


def torchrun_command(directory: Path, nprocs: int, nnodes: int = 1) -> list[str]:
    """torchrun for one cell: --standalone on one machine; on several, run the same command on each
    node with MASTER_ADDR set to the first one (c10d rendezvous)."""
    if nnodes == 1:
        launch = ["--standalone"]
    else:
        launch = [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=${MASTER_ADDR:?}:29500",
            f"--rdzv-id={directory.name}",
        ]
    return [
        sys.executable,
        "-m",
        TORCHRUN,
        *launch,
        f"--nproc-per-node={nprocs}",
        "-m",
        "hpcfsdp",
        "run",
        "--cell-dir",
        str(directory),
    ]


def print_command(sweep: Sweep, sweep_dir: Path, cell: Cell) -> str:
    """One runnable shell line for the cell: `env` without the tokens of the shell it runs in
    (the Hugging Face ones always, and any other set here), the cell's environment, then torchrun."""
    unset = dict.fromkeys([*HF_TOKEN_ENV, *secret_names(os.environ)])
    env = [f"{k}={shlex.quote(v)}" for k, v in job_environment(sweep).items()]
    args = torchrun_command(cell_dir(sweep_dir, cell).absolute(), cell.spec.gpus_per_node, cell.spec.nodes)
    return " ".join(
        [
            "env",
            *(f"-u {shlex.quote(name)}" for name in unset),
            *env,
            *(f'"{a}"' if "${" in a else shlex.quote(a) for a in args),
        ]
    )


def srun_command(sweep: Sweep, sweep_dir: Path, cell: Cell) -> list[str]:
    """The cell as a Slurm user would start it by hand inside an allocation of its shape: srun with
    one task per node, each running print_command's torchrun; on several nodes the rendezvous is on
    the allocation's first node (MASTER_ADDR)."""
    first_node = ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"']
    cpus = sweep.resources.cpus_per_task * cell.spec.gpus_per_node
    srun = f"srun --nodes={cell.spec.nodes} --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1"
    return [*(first_node if cell.spec.nodes > 1 else []), f"{srun} {print_command(sweep, sweep_dir, cell)}"]


def run_local(sweep: Sweep, sweep_dir: Path, cells: list[Cell], log: Callable[[str], None]) -> dict[str, str]:
    """Run the cells one at a time; cell id -> the status each recorded. Interrupted (Ctrl-C,
    SIGTERM, SIGHUP): the running cell's processes are ended, and its earlier record is current
    again. A cell that ended without a record gets one (timeout or error) with its log's tail. One
    supervisor process launches them all (WarmSupervisor): the ranks' code is imported once."""
    with WarmSupervisor(sweep_dir) as launch:
        return _run_cells(sweep, sweep_dir, cells, log, launch)


def _run_cells(
    sweep: Sweep, sweep_dir: Path, cells: list[Cell], log: Callable[[str], None], launch: WarmSupervisor
) -> dict[str, str]:
    env = without_secrets(os.environ) | job_environment(sweep)
    limit_s = sweep.resources.time_min * 60
    if sweep.resources.container:
        log("note: slurm.container is for Slurm jobs; the local executor runs the cells here, outside it")
    outcomes: dict[str, str] = {}
    for index, cell in enumerate(cells, 1):
        write_local_run(sweep_dir, cell.id, [later.id for later in cells[index:]])  # for `status`; submit ends it
        directory = cell_dir(sweep_dir, cell)
        if cell.spec.nodes > 1:
            log(
                f"note: {cell.id} asks for {cell.spec.nodes} nodes; the local executor runs its "
                f"{cell.spec.world_size} ranks on this machine"
            )
        log(f"[{index}/{len(cells)}] {cell.id} ({cell.spec.world_size} process(es))")
        started = time.time()
        entry = {"executor": "local", "job_id": None, "submitted_at": started}
        update_manifest(sweep_dir, {cell.id: entry})
        if cell.spec.device != "cpu" and (held := _wait_for_gpus(env, log)):
            error = f"not started: its GPUs are still held by {held} after {GPU_WAIT_S:.0f} s"
            record_launch_failure(directory, error, "", status="error")
            outcomes[cell.id] = "error"
            log(f"    error ({error})")
            continue
        try:
            with records_set_aside(sweep_dir, [cell]):
                returncode = launch(directory, cell.spec.world_size, env, limit_s)
        except Interrupted as exc:
            exc.running_cell = cell.id  # what submit says it stopped
            raise
        # The launch's end: from submitted_at, its whole wall time (start-up included, which the
        # record's duration_s leaves out), what the cell cost; a cell cut short by an interrupt has none.
        update_manifest(sweep_dir, {cell.id: entry | {"ended_at": time.time()}})
        state = cell_state(sweep_dir, cell)
        status = outcomes[cell.id] = state.status
        if status == MISSING:
            timed_out = returncode is None
            ended = (
                f"was killed at the {sweep.resources.time_min} min time limit" if timed_out else f"exited {returncode}"
            )
            status = outcomes[cell.id] = "timeout" if timed_out else "error"
            record_launch_failure(
                directory,
                f"its supervisor {ended} without a record",
                log_tails([directory / LOG_NAME], chars=4000),
                status=status,
            )
            status += f" ({ended} without a record; see {directory / LOG_NAME})"
        said = coloured(status, outcomes[cell.id], sys.stderr)  # the local executor logs to stderr
        log(f"    {said} in {time.time() - started:.0f} s{_rate(state.record)}")
    return outcomes


def _rate(record: dict | None) -> str:
    """`, 1,234 tokens/s` for a record that has a rate; "" for one without."""
    rate = (record or {}).get("tokens_per_s")
    return f", {rate:,.0f} tokens/s" if isinstance(rate, (int, float)) and rate == rate else ""


def gpus_held(env: dict[str, str]) -> str:
    """The processes that hold the GPUs a cell here would use (CUDA_VISIBLE_DEVICES, else all), as
    one phrase ("pid 123 (python, 30.1 GiB) on GPU 0, ..."); "" when none, or no nvidia-smi."""
    if shutil.which("nvidia-smi", path=env.get("PATH")) is None:
        return ""

    def query(*args: str) -> list[list[str]]:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]

    gpus = {row[1]: row[0] for row in query("--query-gpu=index,uuid") if len(row) == 2}
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    held = []
    for row in query("--query-compute-apps=pid,process_name,used_memory,gpu_uuid"):
        if len(row) != 4 or row[3] not in gpus or (visible and not {gpus[row[3]], row[3]} & set(visible)):
            continue
        pid, name, used_mib, uuid = row
        memory = f"{float(used_mib) / 1024:.1f} GiB" if used_mib.replace(".", "", 1).isdigit() else used_mib
        held.append(f"pid {pid} ({os.path.basename(name)}, {memory}) on GPU {gpus[uuid]}")
    return ", ".join(held)


def _wait_for_gpus(env: dict[str, str], log: Callable[[str], None]) -> str:
    """Wait up to GPU_WAIT_S for other processes to leave the GPUs (ranks of an earlier run that
    are still ending); what still holds them then, or ""."""
    held = gpus_held(env)
    if held:
        log(f"    its GPUs are held by {held}: waiting up to {GPU_WAIT_S:.0f} s for them to be free")
    deadline = time.monotonic() + GPU_WAIT_S
    while held and time.monotonic() < deadline:
        time.sleep(2)
        held = gpus_held(env)
    return held


class WarmSupervisor:
    """The local executor's supervisor process, kept for every launch of one `submit` or `tune` stage
    (`python -m hpcfsdp.cell.supervise --serve`, cell/supervise/serve.py): it imports the ranks' code
    with the first launch and forks each later launch's ranks without importing again. Called as a
    Launcher: one launch of the cell in `directory` on this machine, its output in the cell's
    log.txt; its exit status, None when it reached limit_s (then ended as Slurm ends a job at its
    limit: SIGTERM to the ranks, which record `timeout`, SIGKILL after the supervisor's grace). A
    supervisor that ended or hung is replaced by a fresh one at the next launch.

    `folder` marks the process (LAUNCH_DIR_ENV, which launched_in reads), and its forked ranks with
    it: the sweep (or tune's) folder that every launch of it is in."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).absolute()
        self.proc: subprocess.Popen | None = None
        self.channel: socket.socket | None = None
        # Its own stdout and stderr (between launches: a launch's are its log), read when it failed.
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115  closed with the supervisor, on __exit__

    def __enter__(self) -> WarmSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.errors.close()

    def __call__(self, directory: Path, processes: int, env: dict[str, str], limit_s: float) -> int | None:
        with os.fdopen(open_for_writing(directory / LOG_NAME), "w") as out:  # never through a link
            launched = time.time()
            request = {
                "cell_dir": str(Path(directory).absolute()),
                "processes": processes,
                "env": env | launch_limits(directory, launched, limit_s),
                "deadline": launched + limit_s,
            }
            returncode = self._launch(env, request, out.fileno(), limit_s)
        add_teardown(directory / RECORD_NAME, launched, time.time())
        return returncode

    def _launch(self, env: dict[str, str], request: dict, log: int, limit_s: float) -> int | None:
        proc, channel = self._started(env)
        try:
            socket.send_fds(channel, [json.dumps(request).encode()], [log])
            reply = _answer(proc, channel, limit_s + LOCAL_GRACE_S)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP of submit: each rank records `cancelled`
            self.close(LOCAL_GRACE_S, launching=True)
            raise
        except OSError:  # it ended before it took the request
            reply = None
        if reply is None:  # it ended or hung without an answer: this launch ends with it
            with contextlib.suppress(subprocess.TimeoutExpired):  # its socket closes before its exit is seen
                proc.wait(timeout=IDLE_EXIT_S)
            timed_out = proc.poll() is None
            self.close(grace_s=0.0, launching=True)
            self.errors.seek(0)
            os.write(log, self.errors.read()[-LOG_TAIL_BYTES:])  # what it said, for the record's log tail
            return None if timed_out else proc.returncode
        return reply["exit"]

    def _started(self, env: dict[str, str]) -> tuple[subprocess.Popen, socket.socket]:
        if self.proc is not None and self.channel is not None and self.proc.poll() is None:
            return self.proc, self.channel
        self.errors.seek(0)
        self.errors.truncate()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR, "--serve", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=self.errors,
                stderr=subprocess.STDOUT,
                env=env | {LAUNCH_DIR_ENV: str(self.folder)},
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=_end_with_parent(os.getpid()),
            )
        self.channel = ours
        return self.proc, ours

    def close(self, grace_s: float = LOCAL_GRACE_S, launching: bool = False) -> None:
        """End the supervisor: between launches, by closing its socket; during one (`launching`: an
        interrupt, a hang), by ending its session (_end_session). Then no process this run launched
        is left: a supervisor that died leaves its ranks running in their own sessions."""
        proc, self.proc = self.proc, None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if proc is not None and proc.poll() is None:
            if not launching:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=IDLE_EXIT_S)
            if proc.poll() is None:
                _end_session(proc, grace_s)
        kill_survivors(launched_in(self.folder))


def _answer(proc: subprocess.Popen, channel: socket.socket, wait_s: float) -> dict | None:
    """The supervisor's reply to a launch; None when it ended without one, or gave none within wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([channel], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
        if ready:
            message = channel.recv(MAX_REPLY)
            return json.loads(message) if message else None
        if proc.poll() is not None:  # a rank it forked may hold nothing of the socket, but check
            return None
    return None


def launch_limits(directory: Path, launched: float, limit_s: float) -> dict[str, str]:
    """What a launch's processes are told of it: the end of its time limit, as Slurm's jobs are told
    it (SIGTERM before it is a cancel); the launch's start, from which the cell counts its phases and
    launch_span_s; and the folder that marks every process of the launch (launched_in finds them
    after a kill)."""
    return {
        JOB_END_ENV: f"{launched + limit_s:.0f}",
        LAUNCH_STARTED_ENV: repr(launched),
        LAUNCH_DIR_ENV: str(Path(directory).absolute()),
    }


def add_teardown(path: Path, launched: float, ended: float) -> None:
    """Add to the record this launch wrote its tear-down (phases.teardown): from the record's write
    (launched + launch_span_s, which the cell counted from `launched`) to the launch's end, which
    only the launching side sees. A record of another launch, or none, is left as it is."""
    try:
        record = read_record(path)
    except (RecordError, FileNotFoundError):
        return
    span, phases = record.get("launch_span_s"), record.get("phases")
    if not isinstance(span, float) or not isinstance(phases, dict) or (record.get("started_at") or 0) < launched:
        return
    write_record(path, {**record, "phases": {**phases, "teardown": max(0.0, ended - (launched + span))}})


def _end_with_parent(parent: int) -> Callable[[], None]:
    """For the supervisor's process, between fork and exec: ask Linux for SIGTERM when submit dies, so
    that a submit killed by SIGKILL (which runs none of its handlers) leaves no cell training.
    The supervisor passes the SIGTERM to its ranks, which record `cancelled`; the earlier record stays
    in attempts/. A parent that died before the request was made means exit at once."""

    def request() -> None:
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return request


def _end_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the supervisor's session, which passes it on to the ranks (each records `timeout`
    at the time limit's end, else `cancelled`); SIGKILL after grace_s, or at once on a second
    interrupt, to the supervisor and to every process that was under it (the ranks run in sessions
    of their own, and outlive a killed supervisor)."""
    under = processes_under(proc.pid)  # now: once the supervisor has ended, its ranks are no longer under it
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        under |= processes_under(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_survivors(under)
        if isinstance(exc, KeyboardInterrupt):
            raise
    kill_survivors(under)
