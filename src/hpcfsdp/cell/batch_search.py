"""`batch_size: auto`: the largest per-device batch that fits, found inside the cell's own allocation.

Where the cell's spec.json carries the login side's memory prediction (sweep/predict/memory.py's
batch_prediction: the predicted peak per batch), the search starts at the batch predicted to fit
the memory the cell finds (`plan --memory`'s auto:N for that memory), and brackets from there:
one up, then 3, 7, ... up while probes fit, or one down, then 3, 7, ... down while they do not,
so that a prediction that is right costs two probes and one that is one batch off three. Without
one, it doubles the batch from the spec's `batch_size` until a probe runs out of memory (or
reaches the cap: `max_batch_size`, and `global_batch_size`'s per-rank share where one is given).
Then it narrows the gap between the largest batch that fitted and the smallest that did not until
the two are neighbours. Inside the gap it tries the batch where a straight line through the peak
memory of the two largest batches that fitted meets the limit (activation memory grows linearly
with the batch), else the midpoint; a wrong guess only narrows the gap like a midpoint would, and
a right one saves the probes that halving would spend. The limit is the device memory free when
the search starts, less `batch_margin` of it; on a CPU there is none, and the midpoint is used.

A probe runs in processes of its own, one per rank (batch_probe.py; forked by the rank's probe
starter, probe_start.py, else a new interpreter), with a process group of their own: a rank that
runs out of memory mid-step leaves its peers inside a collective that, under NCCL, nothing in
their process could end. Here, each rank waits for its probe process and
watches the cell's store: when one rank's probe fails, every rank ends its own probe process
(SIGKILL; the driver frees its memory), and the cell's processes, which never entered the
probe's collectives, agree on the outcome over a gloo group and go on to the next probe. A probe
that runs past its deadline (`init_timeout_s` plus `train_timeout_s` per step) ends the cell as a
`hang`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from ..contracts.files import RecordError, read_json_object
from ..contracts.fs.beneath import make_folders, remove
from ..contracts.record import BatchProbe, BatchSearchRecord
from ..contracts.sources import Sources
from ..contracts.spec import RunSpec
from .batch_probe import PROBE_SPEC_ENV, ProbeOutcome, ProbeResult
from .probe_start import ProbeProcess, close_probe_starter, how_probes_start, start_probe
from .ranks.distributed import DistEnv
from .ranks.ports import free_port

ProbeStatus = Literal["ok", "oom", "over_margin"]
GIB = 1024**3
AGREE_TIMEOUT_S = 60  # how long a rank waits for the others' outcome of a probe
POLL_S = 0.1
PROBE_FOLDER = "batch_search"  # in the cell folder: each probe's result, per rank


class ProbeHung(RuntimeError):
    """A probe ran past its deadline: the cell records `hang` at stage batch_search."""


class ProbeFailed(RuntimeError):
    """A probe failed for another reason than memory: the cell records `error`."""


@dataclass(frozen=True)
class Probe:
    """One batch tried: figures are the maximum over ranks (the slowest step)."""

    batch_size: int
    status: ProbeStatus  # over_margin: ran, but its peak reserved memory crossed the limit
    peak_memory_gib: float  # CUDA peak allocated (up to the failed allocation for an OOM); CPU: process max RSS
    peak_reserved_gib: float | None  # CUDA only: what the margin is checked against
    tokens_per_s_per_gpu: float | None  # from the steps after the first; None for an OOM
    wall_s: float  # build, steps and release
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.status == "ok"


@dataclass
class BatchSearch:
    """The search's probes and outcome; `record()` is the record's `batch_search` object."""

    first_batch: int
    cap: int
    margin: float
    probe_steps: int
    capacity_gib: float | None = None  # device memory free when the search started
    probes: list[Probe] = field(default_factory=list)
    predicted_batch: int | None = None  # the prediction's batch for the memory found: the first probe
    chosen_batch_size: int = 0  # what the cell then measured (largest fitting batch, or below it for global_batch_size)
    wall_s: float = 0.0

    @property
    def limit_gib(self) -> float | None:
        return self.capacity_gib * (1 - self.margin) if self.capacity_gib is not None else None

    @property
    def largest_fitting_batch(self) -> int:
        return max((p.batch_size for p in self.probes if p.fits), default=0)

    @property
    def smallest_failing_batch(self) -> int | None:
        return min((p.batch_size for p in self.probes if not p.fits), default=None)

    def record(self) -> BatchSearchRecord:
        return {
            "probes": [cast(BatchProbe, asdict(p)) for p in self.probes],
            "largest_fitting_batch": self.largest_fitting_batch,
            "smallest_failing_batch": self.smallest_failing_batch,
            "chosen_batch_size": self.chosen_batch_size,
            "capped": self.largest_fitting_batch == self.cap,
            "first_batch": self.first_batch,
            "cap": self.cap,
            "margin": self.margin,
            "capacity_gib": self.capacity_gib,
            "limit_gib": self.limit_gib,
            "probe_steps": self.probe_steps,
            "wall_s": self.wall_s,
            "predicted_batch": self.predicted_batch,
        }


def next_batch(
    probes: list[Probe], first: int, cap: int, limit_gib: float | None = None, predicted: bool = False
) -> int | None:
    """The next batch to try, or None when the frontier is known (or the cap fits). `predicted`:
    `first` is the prediction's batch, and the search brackets it (steps of 1, 2, 4, ... from it)."""
    if not probes:
        return first
    fitted = [p for p in probes if p.fits]
    low = max((p.batch_size for p in fitted), default=0)
    high = min((p.batch_size for p in probes if not p.fits), default=None)
    if high is None:
        step = low - first + 1 if predicted else low
        return min(low + step, cap) if low < cap else None
    if predicted and not fitted:
        return max(1, high - (first - high + 1)) if high > 1 else None
    if high - low <= 1:
        return None
    guess = _where_memory_meets(fitted, limit_gib)
    return min(max(guess if guess is not None else (low + high) // 2, low + 1), high - 1)


def _where_memory_meets(fitted: list[Probe], limit_gib: float | None) -> int | None:
    """The largest batch whose peak reserved memory, on the line through the two largest fitting
    batches, stays within the limit; None without a limit or two such points."""
    points = sorted((p.batch_size, p.peak_reserved_gib) for p in fitted if p.peak_reserved_gib is not None)
    if limit_gib is None or len(points) < 2:
        return None
    (b1, m1), (b2, m2) = points[-2:]
    slope = (m2 - m1) / (b2 - b1)
    if slope <= 0:
        return None
    return b2 + math.floor((limit_gib - m2) / slope)


def largest_batch_for(spec: RunSpec, fitting: int) -> int:
    """The batch to measure: the largest that fits and, with global_batch_size, divides its per-rank share."""
    if not spec.global_batch_size:
        return fitting
    share = spec.global_batch_size // spec.world_size
    return max(b for b in range(1, fitting + 1) if share % b == 0)


def predicted_batch(prediction: Mapping[str, Any] | None, capacity_gib: float | None, spec: RunSpec) -> int | None:
    """The largest batch the prediction puts within (1 - batch_margin) of the memory less its
    reserve (as plan --memory's auto:N): the memory this device has, else the sweep's GPU memory;
    None without a prediction, a memory, or a batch predicted to fit."""
    if not prediction:
        return None
    largest = None
    try:
        capacity = capacity_gib if capacity_gib is not None else prediction["capacity_gib"]
        if capacity is None:
            return None
        limit = (float(capacity) - float(prediction["reserve_gib"])) * (1 - spec.batch_margin)
        for batch, gib in zip(range(spec.batch_size, spec.batch_cap + 1), prediction["required_gib"], strict=False):
            if float(gib) > limit:  # memory grows with the batch: stop at the first miss
                break
            largest = batch
    except (KeyError, TypeError, ValueError):
        return None  # a spec.json of another hpcfsdp: the search starts where the spec says
    return largest


def search_batch_size(
    search: BatchSearch,
    spec: RunSpec,
    sources: Sources,
    env: DistEnv,
    cell_dir: Path,
    log: Callable[[str], None],
    prediction: Mapping[str, Any] | None = None,
) -> RunSpec:
    """Probe batches into `search` (the caller keeps it, so a failure record still has the probes),
    from the batch `prediction` puts within the device's memory where there is one; return the spec
    to measure. Raises torch.OutOfMemoryError when not even the smallest batch fits, ProbeFailed /
    ProbeHung when a probe fails otherwise."""
    started = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREE_TIMEOUT_S))
    search.capacity_gib = _free_device_memory(env.device)
    search.predicted_batch = predicted_batch(prediction, search.capacity_gib, spec)
    if search.predicted_batch is not None:
        search.first_batch = search.predicted_batch
        log(f"starting at the predicted batch {search.predicted_batch}")
    folder = cell_dir / PROBE_FOLDER
    make_folders(folder)
    log(f"probe processes {how_probes_start()}")
    predicted = search.predicted_batch is not None
    try:
        while (
            batch := next_batch(search.probes, search.first_batch, search.cap, search.limit_gib, predicted)
        ) is not None:
            probe = _probe(spec, sources, env, folder, len(search.probes), batch, search.limit_gib, group)
            search.probes.append(probe)
            speed = f", {probe.tokens_per_s_per_gpu:,.0f} tokens/s/gpu" if probe.tokens_per_s_per_gpu else ""
            log(f"batch {batch}: {probe.status} (peak {probe.peak_memory_gib:.2f} GiB{speed}, {probe.wall_s:.1f} s)")
    finally:
        close_probe_starter()
    search.wall_s = time.perf_counter() - started
    dist.destroy_process_group(group)
    fitting = search.largest_fitting_batch
    if not fitting:
        raise torch.OutOfMemoryError(
            f"batch_size: auto: no batch fits; batch {search.smallest_failing_batch} "
            f"was {search.probes[-1].status} ({search.probes[-1].error or 'over the margin'})"
        )
    search.chosen_batch_size = largest_batch_for(spec, fitting)
    return spec.with_batch_size(search.chosen_batch_size)


def _probe(
    spec: RunSpec, sources: Sources, env: DistEnv, folder: Path, index: int, batch: int, limit_gib: float | None, group
) -> Probe:
    """One probe: this rank's probe process, then the ranks' agreement on what it found (out of
    memory if any rank was, the largest peak, the slowest step)."""
    started = time.perf_counter()
    result = _run_probe_process(spec, sources, env, folder, index, batch)
    outcomes: list[ProbeResult | None] = [None] * env.world_size
    dist.all_gather_object(outcomes, result, group=group)
    seen = [o for o in outcomes if o is not None]
    failures = sorted((o for o in seen if o["status"] != "ok"), key=lambda o: o["failed_at"] or math.inf)
    failed = next((o for o in failures if o["status"] == "oom"), None)  # a peer's error may follow an OOM
    if failed is None and failures:
        failed = failures[0]  # the first to fail: the others' errors (a peer gone) follow from it
        if failed["status"] == "hang":
            raise ProbeHung(f"batch_size: auto: the probe at batch {batch} {failed['error']}")
        raise ProbeFailed(f"batch_size: auto: the probe at batch {batch} failed: {failed['error']}")
    peak = max(o["peak_memory_gib"] for o in seen)
    reserved = max((o["peak_reserved_gib"] for o in seen if o["peak_reserved_gib"] is not None), default=None)
    step_s = max(o["step_s"] for o in seen)
    if failed is not None:
        status: ProbeStatus = "oom"
    elif limit_gib is not None and reserved is not None and reserved > limit_gib:
        status = "over_margin"
    else:
        status = "ok"
    return Probe(
        batch_size=batch,
        status=status,
        peak_memory_gib=peak,
        peak_reserved_gib=reserved,
        tokens_per_s_per_gpu=batch * spec.seq_len / step_s if status != "oom" and step_s > 0 else None,
        wall_s=time.perf_counter() - started,
        error=failed["error"] if failed is not None else "",
    )


def _run_probe_process(
    spec: RunSpec, sources: Sources, env: DistEnv, folder: Path, index: int, batch: int
) -> ProbeResult | None:
    """Start this rank's probe process and wait until every rank's has ended, or one failed (then
    end ours). Its result, or an error result; None when it was ended for a peer's failure before it
    wrote its own."""
    store = dist.distributed_c10d._get_default_store()
    key = f"hpcfsdp/batch_search/{index}"
    if env.rank == 0:  # the probe's rendezvous: a free port on rank 0's node
        host = "127.0.0.1" if env.world_size == env.local_world_size else socket.gethostname()
        store.set(f"{key}/rendezvous", f"{host}:{free_port('')}")
    host, port = store.get(f"{key}/rendezvous").decode().rsplit(":", 1)
    path = folder / f"{index}-rank{env.rank}.json"
    remove(path)
    child_env = {
        **os.environ,
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # the probe's rank 0 holds its own store
        PROBE_SPEC_ENV: json.dumps({"spec": spec.to_dict(), "sources": sources.to_dict(), "batch": batch}),
    }
    deadline = time.monotonic() + spec.init_timeout_s + spec.batch_probe_steps * spec.train_timeout_s
    failed_key, done_keys = f"{key}/failed", [f"{key}/done/{rank}" for rank in range(env.world_size)]
    child = start_probe(path, child_env)
    result: ProbeResult | None = None
    try:
        while (code := child.poll()) is None and not store.check([failed_key]) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if code is None:  # a peer's probe failed, or ours is past its deadline
            if time.monotonic() >= deadline:
                _end(child)
                result = _error_result(f"ran past its deadline ({_deadline_text(spec)})", "hang")
                store.set(failed_key, str(env.rank))
            else:
                result = _result_if_written(child, path)
        else:
            result = _read_result(path, code)
            if result["status"] != "ok":
                store.set(failed_key, str(env.rank))
        store.set(done_keys[env.rank], "")
        while not store.check(done_keys) and not store.check([failed_key]) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # every rank's probe ended, or one failed: then agree
    finally:
        _end(child)  # a signal (time limit, cancel) ends this rank: its probe goes with it
    return result


def _deadline_text(spec: RunSpec) -> str:
    steps = f"{spec.batch_probe_steps} x train_timeout_s {spec.train_timeout_s:g}"
    return f"init_timeout_s {spec.init_timeout_s:g} + {steps}"


def _end(child: ProbeProcess) -> None:
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its session: compile workers too
    child.wait()


def _result_if_written(child: ProbeProcess, path: Path) -> ProbeResult | None:
    """End a probe process for a peer's failure; what it wrote of its own outcome, if it had.
    A probe that ran out of memory writes its result and then leaves; its peer's probe, seeing the
    connection close, fails too and may be recorded first. Ended between its write and its end,
    the probe that ran out of memory still says so (under load, 2026-11-27: the probe was taken
    for the peer's "Connection closed by peer" error, and the cell ended instead of searching on)."""
    _end(child)
    return _read_result(path, child.wait()) if path.exists() else None


def _read_result(path: Path, code: int) -> ProbeResult:
    try:
        return cast(ProbeResult, read_json_object(path, kind="batch-search probe result"))
    except (RecordError, FileNotFoundError):
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        return _error_result(f"the probe process {how} before writing its result")


def _error_result(error: str, status: ProbeOutcome = "error") -> ProbeResult:
    return {
        "status": status,
        "peak_memory_gib": 0.0,
        "peak_reserved_gib": None,
        "step_s": 0.0,
        "error": error,
        "failed_at": time.time(),
        "parent_pid": None,
    }


def _free_device_memory(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / GIB
