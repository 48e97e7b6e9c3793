"""One probe of `batch_size: auto`, in processes of its own: `python -m hpcfsdp.cell.batch_probe RESULT`.

Each rank of the cell starts one such process per probe (batch_search.py): forked by the rank's
probe starter (probe_start.py), which pays no imports and calls `main`, or, where the rank may not
fork, as that command. The probe forms a process group of its own, builds the cell's model,
strategy and optimizer at the probe's batch, trains `batch_probe_steps` steps of the one training
loop, and writes what it saw to RESULT.

Why a process of its own: a rank that runs out of memory in the middle of a step leaves its peers
waiting inside a collective, and under NCCL nothing in that process can free them (the
communicators are gone with the failure, and a CUDA error can poison the context). A probe's
processes end with it, whatever happened, so the cell's own processes stay clean for the next
probe and for the measured run, and nothing one probe allocated is left for the next.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Literal, TypedDict

import torch

from ..contracts.files import write_json
from ..contracts.sources import Sources
from ..contracts.spec import RunSpec
from .build import build_probe
from .data import open_data, training_batches
from .measure.metrics import median, memory_reading, reset_peak_memory
from .ranks.distributed import DistEnv, init_distributed, shutdown
from .stopping.faults import inject_fault
from .stopping.watchdog import leave, set_parent_death_signal
from .train import train

PROBE_SPEC_ENV = "HPCFSDP_PROBE_SPEC"  # the cell's spec (JSON) and the batch to try
# Errors that mean a device (or host) allocation failed, beside the allocator's own OutOfMemoryError:
# a CUDA error (torch.AcceleratorError), cuBLAS or NCCL failing to allocate, the host allocator.
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "can't allocate memory", "Failed to CUDA calloc")

ProbeOutcome = Literal["ok", "oom", "error", "hang"]  # hang: past its deadline (batch_search.py)


class ProbeResult(TypedDict):
    status: ProbeOutcome
    peak_memory_gib: float  # CUDA peak allocated (up to the failed allocation); CPU: the process's max RSS
    peak_reserved_gib: float | None  # CUDA only
    step_s: float  # median of the steps after the first; 0 when it did not train through
    error: str
    failed_at: float | None  # when (time.time()) it failed: the earliest failure is the cause, the rest follow it
    parent_pid: int | None  # who started the probe process: the rank's probe starter, or the rank (probe_start.py)


def is_oom(exc: BaseException) -> bool:
    """Out of memory: the caching allocator's OutOfMemoryError, or any other failure to allocate
    that says so (a CUDA error from a kernel launch, cuBLAS' or NCCL's own buffers)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, Exception) and any(marker in str(exc) for marker in OOM_MARKERS)
    )


def probe_spec(spec: RunSpec, batch: int) -> RunSpec:
    """The cell's setup at `batch`, for as many steps as a probe takes."""
    return spec.replace(batch_size=batch, grad_accum=1, steps=spec.batch_probe_steps, warmup_steps=1)


def train_probe(spec: RunSpec, sources: Sources, env: DistEnv, batch: int) -> tuple[dict[str, float], float]:
    """Build at `batch` and train the probe's steps; the memory reading and the median time of
    the steps after the first."""
    probe = probe_spec(spec, batch)
    blocks = open_data(sources.data, sources.tokenizer, spec.seq_len, spec.text_column)
    model, optimizer, vocab_size = build_probe(probe, sources, env)
    reset_peak_memory(env.device)  # like a measured cell: the peak of training, not of building
    batches = training_batches(blocks, vocab_size, batch, spec.seq_len, spec.seed, env.rank, env.world_size, env.device)

    def on_step_end(step: int, _log: object) -> None:
        if step == 0:
            inject_fault("train_step", env, batch)

    log = train(model, optimizer, batches, probe, env, probe.steps, warmup=1, on_step_end=on_step_end)
    step_times, _ = log.timed(1)
    return memory_reading(env.device), median(step_times)


def main(result_path: Path) -> None:
    set_parent_death_signal(signal.SIGKILL)  # a probe never outlives the rank that started it
    given = json.loads(os.environ[PROBE_SPEC_ENV])
    where = "batch-search probe"
    spec, sources = RunSpec.resolved(given["spec"], where, Sources.from_dict(given["sources"], where))
    env = init_distributed(spec.device, spec.init_timeout_s)
    status: ProbeOutcome = "ok"
    error, step_s, failed_at = "", 0.0, None
    try:
        reading, step_s = train_probe(spec, sources, env, int(given["batch"]))
    except Exception as exc:
        failed_at = time.time()
        status = "oom" if is_oom(exc) else "error"
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        reading = memory_reading(env.device)  # the peak up to the allocation that failed
    result: ProbeResult = {
        "status": status,
        "peak_memory_gib": reading.get("peak_allocated_gib", reading["cpu_max_rss_gib"]),
        "peak_reserved_gib": reading.get("peak_reserved_gib"),
        "step_s": step_s,
        "error": error,
        "failed_at": failed_at,
        "parent_pid": os.getppid(),
    }
    write_json(result_path, result)
    if status != "ok":
        leave(1)  # a peer may wait inside a collective: no destroy_process_group
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
