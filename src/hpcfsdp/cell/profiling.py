"""Optional measurements of a cell after its timed steps: the communication profile
(torch.profiler), a TensorBoard trace, and the CUDA allocator's memory snapshot.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..contracts.files import garbage_collection_paused
from ..contracts.fs.beneath import make_folders
from ..contracts.record import OkRecord
from ..contracts.spec import RunSpec
from .measure.metrics import Span, communication_breakdown, quiet_profiler
from .ranks.distributed import DistEnv, all_reduce_max
from .train import train


def profile_communication(model, optimizer, batches, spec: RunSpec, env: DistEnv) -> OkRecord:
    """A few extra steps under torch.profiler: collective time per step and its exposed part.

    One step runs under the profiler before the measured ones, so that the profiler's start-up
    (tracer set-up, and ranks starting it at different moments, which shows as collectives waiting
    for the late rank) is not counted. Fractions are of the profiled steps' own duration: the
    profiler lengthens a step, and dividing by the unprofiled step time could exceed 1.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    quiet_profiler()
    steps = spec.comm_profile_steps
    # On a GPU the breakdown reads kernels only: the host's ops (the bulk of a profile's events)
    # would be recorded, collected and read for nothing. On the CPU the ops are all there is.
    activity = ProfilerActivity.CUDA if env.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        log = train(model, optimizer, batches, spec, env, 1 + steps, warmup=1, on_step_end=lambda *_: prof.step())
    comm = communication_breakdown(profiled_spans(prof), steps)
    comm["comm_profile_step_time_s"] = log.window_s / steps
    comm = {key: all_reduce_max(value, env) for key, value in comm.items()}
    return {
        "comm_s_per_step": comm["comm_s_per_step"],
        "comm_exposed_s_per_step": comm["comm_exposed_s_per_step"],
        "comm_profile_step_time_s": comm["comm_profile_step_time_s"],
        "comm_fraction": comm["comm_s_per_step"] / comm["comm_profile_step_time_s"],
        "comm_exposed_fraction": comm["comm_exposed_s_per_step"] / comm["comm_profile_step_time_s"],
        "comm_profile_steps": steps,
    }


def profiled_spans(prof) -> list[Span]:
    """The profile's events as spans, read from the profiler's own results. `prof.events()` would
    make a FunctionEvent of some forty fields for each event and link each kernel to the op that
    launched it; the breakdown needs five fields. Read with the garbage collector paused: that many
    new objects set off full collections, each of which walks every object the rank holds (torch's
    and transformers' modules)."""
    with garbage_collection_paused():
        return [
            Span(
                event.name(),
                event.start_ns() / 1e3,
                event.end_ns() / 1e3,
                "cuda" in str(event.device_type()).lower(),
                event.is_user_annotation(),
            )
            for event in prof.profiler.kineto_results.events()
        ]


def write_trace(model, optimizer, batches, spec: RunSpec, env: DistEnv, cell_dir: Path) -> str:
    """A TensorBoard-readable trace of 1 wait + 1 warm-up + 2 active steps, one file per rank."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    quiet_profiler()
    trace_dir = cell_dir / "profile"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=2),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{env.rank}"),
        profile_memory=True,
        record_shapes=True,
    ) as prof:
        train(model, optimizer, batches, spec, env, 4, on_step_end=lambda *_: prof.step())
    return str(trace_dir)


def memory_snapshot(spec: RunSpec, env: DistEnv, cell_dir: Path) -> str | None:
    """With memory_snapshot on a GPU: this rank's allocator history (pytorch.org/memory_viz), after
    the run or at the out-of-memory error; the path it was written to (the record's
    `memory_snapshot`), else None."""
    if not (spec.memory_snapshot and env.device.type == "cuda"):
        return None
    path = cell_dir / f"memory_snapshot_rank{env.rank}.pickle"
    try:
        make_folders(cell_dir)  # a run by hand has no cell folder until its record
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as exc:  # the record matters more than the snapshot
        print(f"[hpcfsdp] rank {env.rank}: no memory snapshot: {type(exc).__name__}: {exc}", flush=True)
        return None
    return str(path)
