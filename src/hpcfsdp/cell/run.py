"""Run one cell: build model, apply strategy, train, measure, write the record.

Called by `hpcfsdp run` (under torchrun or by hand) and by each Slurm array task (submitit).
A failing cell still leaves a record that says why. This module is the cell's sequence; Slurm's
signals are handled in signals.py, injected faults come from faults.py, and the optional
profiles and memory snapshot from profiling.py.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..contracts.attempts import keep_as_attempt
from ..contracts.fields import SpecError
from ..contracts.files import RecordError, read_json_object
from ..contracts.record import (
    BATCH_FOUND_KEY,
    BATCH_HINT_KEYS,
    BATCH_PREDICTION_KEY,
    RECORD_NAME,
    SPEC_NAME,
    FailedRecord,
    OkRecord,
    failure_record,
    read_record,
    write_record,
)
from ..contracts.sources import Sources, resolve_sources
from ..contracts.spec import RunSpec
from .batch_probe import is_oom
from .batch_search import BatchSearch, ProbeHung, search_batch_size
from .build import build
from .data import open_data, training_batches
from .levers import check_device, float8_linear_count
from .measure.context import cell_context, start_context
from .measure.metrics import (
    NvmlSampler,
    TrainLog,
    energy,
    figures_so_far,
    full_param_norm,
    gpu_utilisation,
    memory_reading,
    ok_record,
    parameter_sums,
    parameters_changed,
    reset_peak_memory,
)
from .measure.phases import PhaseClock
from .measure.provenance import launch_id, launch_rank, provenance
from .measure.steps import ProgressFile, print_step
from .measure.summary import summary_line
from .probe_start import open_probe_starter
from .profiling import memory_snapshot, profile_communication, write_trace
from .ranks.distributed import DistEnv, StartupError, init_distributed, set_collective_timeout, shutdown
from .ranks.forking import set_torch_threads
from .ranks.resources import Seen, gather, node_name
from .stopping import early_signals
from .stopping.faults import inject_fault
from .stopping.heartbeats import Heartbeat, PeerTrouble, blamed
from .stopping.requeue import done_before, name_requeued_run, requeued_too_often
from .stopping.signals import (
    LAUNCHER_GONE,
    CellCancelled,
    CellTimeout,
    PeerFailed,
    SignalEnding,
    handle_time_limit,
    recording_failure,
    restore_handlers,
    signal_cause,
    signal_outcome,
    submitit_requeues,
)
from .stopping.watchdog import Blame, StepDeadlines, Watchdog, end_with_launcher, leave
from .train import Diverged, train

# The process groups' own timeout lies this far past the watchdog's deadline, so that a hung rank is
# ended by the watchdog, with its record, before NCCL's error handling tears the process down.
BACKSTOP_S = 60.0
# What a collective that ran past the process group's timeout raises (gloo; NCCL's watchdog).
COLLECTIVE_TIMEOUT_MARKERS = ("Timed out waiting", "collective operation timeout")


def run_cell_dir(cell_dir: Path) -> str:
    meta = read_json_object(cell_dir / SPEC_NAME, kind="cell spec")
    where = str(cell_dir / SPEC_NAME)
    try:
        # Validated again on the compute node, with the sources as the login node resolved them
        # (never decided again here): a path checked at plan time may be gone by now.
        spec, sources = RunSpec.resolved(meta["spec"], where, Sources.of_cell_spec(meta, where))
    except SpecError as exc:
        write_record(cell_dir / RECORD_NAME, failure_record("error", "setup", str(exc), cell=meta, **provenance()))
        raise SystemExit(f"cell {meta['cell_id']} failed: {exc}") from None
    if launch_rank() == 0 and (named := name_requeued_run(cell_dir)):  # before keep_as_attempt moves it
        print(f"[hpcfsdp] {meta['cell_id']}: {named}", flush=True)
    if done_before(cell_dir):
        print(f"[hpcfsdp] {meta['cell_id']}: an earlier run of this job recorded ok: not run again", flush=True)
        return "ok"
    too_often = requeued_too_often()
    if too_often:  # the record of the run Slurm requeued (preempted, node_fail) stays the cell's
        print(f"[hpcfsdp] {meta['cell_id']}: {too_often}", flush=True)
        try:
            return read_record(cell_dir / RECORD_NAME)["status"]
        except (RecordError, FileNotFoundError):
            return "missing"
    hints = {key: meta[key] for key in BATCH_HINT_KEYS if key in meta}
    return run_cell(spec, cell_dir, meta["cell_id"], meta["sweep"], sources, hints)


def run_cell(
    spec: RunSpec,
    cell_dir: Path,
    cell_id: str,
    sweep: str,
    sources: Sources | None = None,
    batch_hints: Mapping[str, Any] | None = None,
) -> str:
    """Train one cell on this process's rank and write the record; returns the status. `sources`:
    the spec's model, data and tokenizer as resolved where the cell was planned; None (a spec given
    here): resolved in this process, at the cell's stage setup. `batch_hints`: spec.json's hints
    for a `batch_size: auto` cell (record.BATCH_HINT_KEYS): the prediction its search starts from,
    or the batch a tune probe found, measured without a search."""
    clock = PhaseClock(time.time())
    if launch_rank() == 0:
        # Before the process group forms, so no rank has written yet: a record left by an earlier
        # run (by hand, or a command --executor print printed) is kept in attempts/, not overwritten.
        keep_as_attempt(cell_dir)
    if spec.expandable_segments:  # read when CUDA initialises, so before the process group
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    end_with_launcher(LAUNCHER_GONE)
    node = node_name()
    path = cell_dir / RECORD_NAME
    if spec.auto_batch and BATCH_FOUND_KEY not in (batch_hints or {}):
        open_probe_starter()  # before the process group's threads: the probes are forked from a copy of this rank
    set_torch_threads()  # a rank forked by its supervisor starts torch's threads only now, after its probe starter
    try:
        env = init_distributed(spec.device, spec.init_timeout_s)
    except Exception as exc:  # a device another process holds, a rendezvous that failed: one line, recorded
        error = str(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {_first_line(exc)}"
        if not _keeps_earlier_failure(cell_dir, "error"):
            failure = failure_record("error", "setup", error, traceback.format_exc(), failed_rank=launch_rank())
            failure.update(start_context(spec, cell_id, sweep, node, clock))
            write_record(path, failure)
        raise SystemExit(f"cell {cell_id} failed at setup: {error}") from None
    heartbeat = Heartbeat(cell_dir, launch_id(), env.rank, node, env.world_size, env.local_world_size - 1)
    progress = _Progress(
        clock, batch_hints=batch_hints or {}, blame=heartbeat.peer_trouble if env.world_size > 1 else None
    )
    # The handlers stay until the record is written: torchrun passes a SIGTERM on twice when it is
    # itself signalled twice, and Slurm may signal twice (preemption): the handler lets the second
    # pass, where the default action would end the rank between its failure and its record.
    previous_handlers = handle_time_limit(progress.blame)
    requeue = submitit_requeues(previous_handlers)

    def end(status: str, error: str, stack: str, peer: PeerTrouble | None) -> None:
        """The watchdog's record, for a rank that could not end itself (blocked, or hung), naming the
        peer the trouble came from where there was one."""
        failure = failure_record(status, progress.stage, error, stack, failed_rank=env.rank)
        if peer is not None:
            blamed(failure, peer)
        print(f"[hpcfsdp] {cell_id}: {failure['error']}", flush=True)
        if not _keeps_earlier_failure(cell_dir, failure["status"]):
            failure.update(
                cell_context(
                    progress.measured or spec, env, cell_id, sweep, progress.seen or [], progress.ok, node, clock
                )
            )
            write_record(path, failure)
        heartbeat.left()

    # Started while the entry point still holds the signals: its thread never takes them itself.
    progress.watchdog = Watchdog(
        env.rank,
        end,
        lambda signum: signal_outcome(signum, requeue),
        beat=heartbeat.beat,
        blame=progress.blame,
        peers=heartbeat.exits,
    )
    try:
        record, spec = _trained_record(spec, sources, env, cell_dir, cell_id, progress)
        status = record["status"]
        progress.ok = status == "ok"
        final: Mapping[str, Any] = record  # the cell's record: this rank's, or the one that failed first
        if (env.is_main or status != "ok") and not _keeps_earlier_failure(cell_dir, status):
            record.update(cell_context(spec, env, cell_id, sweep, progress.seen or [], progress.ok, node, clock))
            write_record(path, record)
        elif env.is_main:  # another rank failed first, and its record says why
            final = _read_or(path, record)
        progress.watchdog.finished()
        heartbeat.left()
    finally:
        restore_handlers(previous_handlers)
    if env.is_main:
        print(summary_line(final, path), flush=True)
    if status == "ok":
        shutdown()
        return status
    failed = f"cell {cell_id} failed: {final['error']}"
    if env.world_size > 1:
        # No destroy_process_group: under NCCL it blocks while a peer waits inside a collective.
        # The non-zero exit makes torchrun / srun end the others.
        print(failed, file=sys.stderr, flush=True)
        leave(1)
    shutdown()
    raise SystemExit(failed)


def _trained_record(
    spec: RunSpec, sources: Sources | None, env: DistEnv, cell_dir: Path, cell_id: str, progress: _Progress
) -> tuple[OkRecord | FailedRecord, RunSpec]:
    """The cell trained (or its failure as a record), and the spec it measured: with batch_size:
    auto, the batch the search chose."""
    record: OkRecord | FailedRecord
    try:
        # A signal held since the entry point reaches handle_time_limit's handler here: CellTimeout,
        # CellCancelled (recorded at stage setup) or a requeue.
        early_signals.release()
        record = _train_cell(spec, sources, env, cell_dir, cell_id, progress)
    except (Exception, SignalEnding) as exc:  # every failure must become a record
        recording_failure()  # a signal now (torchrun ending the survivors) must not cut the record short
        failure = _record_exception(exc, progress.stage, env)
        cause = signal_cause(exc)
        peer = cause.peer if isinstance(cause, PeerFailed) else None
        if peer is None and progress.blame is not None and failure["status"] in ("error", "hang"):
            peer = progress.blame(failure["status"])  # "Connection reset by peer": which peer, and why
        if peer is not None:
            blamed(failure, peer)
        if failure["status"] == "timeout" and progress.log is not None and progress.stage == "train":
            figures = figures_so_far(progress.measured or spec, env, progress.log)
            failure["error"] = f"{failure['error']}; {figures.pop('said')}"
            failure.update(figures)  # type: ignore[typeddict-item]
        if failure["status"] == "oom" and (snapshot := memory_snapshot(spec, env, cell_dir)):
            failure["memory_snapshot"] = snapshot  # taken while the exception still holds the failing step's tensors
        print(f"[hpcfsdp] {cell_id}: rank {env.rank} failed at {progress.stage}: {failure['error']}", flush=True)
        record = failure
    if progress.batch_search is not None:
        record["batch_search"] = progress.batch_search.record()
    elif found := progress.batch_hints.get(BATCH_FOUND_KEY):
        record["batch_search"] = found  # the tune probe's search, whose batch this cell measured
    spec = progress.measured or spec  # batch_size: auto: the record holds the batch chosen
    return record, spec


@dataclass
class _Progress:
    clock: PhaseClock  # where the launch's time went: the record's phases
    batch_hints: Mapping[str, Any] = field(default_factory=dict)  # batch_size: auto: spec.json's hints
    stage: str = "setup"
    batch_search: BatchSearch | None = None  # batch_size: auto: its probes so far
    measured: RunSpec | None = None  # batch_size: auto: the spec at the batch it chose
    watchdog: Watchdog | None = None  # ends the rank when a step hangs or it cannot end itself
    blame: Blame | None = None  # the peer that died or stopped answering (heartbeats), with several ranks
    seen: list[Seen] | None = None  # what each rank runs on, gathered at set-up
    ok: bool = False  # the cell trained to its end on this rank
    file: ProgressFile = field(default_factory=ProgressFile)  # rank 0's stage and step, for status --watch
    log: TrainLog | None = None  # the training's steps so far: a timed-out cell's figures


def _train_cell(
    spec: RunSpec, sources: Sources | None, env: DistEnv, cell_dir: Path, cell_id: str, progress: _Progress
) -> OkRecord:
    """The whole cell on this rank, stage by stage (set-up, data, batch search, model, shard, train,
    then the optional profiles): the ok record's fields. Memory is read after each stage (max over
    ranks later); `progress` says which stage a failure happened at."""

    def enter(stage: str) -> None:
        progress.stage = stage
        progress.clock.enter(stage)
        progress.file.note(env, cell_dir, stage)
        inject_fault(stage, env)

    enter("setup")
    progress.seen = gather(env)
    if env.world_size != spec.world_size:
        raise RuntimeError(
            f"world size {env.world_size} does not match the spec's nodes x gpus_per_node = "
            f"{spec.nodes} x {spec.gpus_per_node}; launch {spec.world_size} processes"
        )
    check_device(spec, env.device)
    enter("data")
    sources = sources or resolve_sources(f"cell {cell_id}", spec)
    blocks = open_data(sources.data, sources.tokenizer, spec.seq_len, spec.text_column)
    if spec.auto_batch:
        enter("batch_search")

        def say(line: str) -> None:
            if env.is_main:
                print(f"[hpcfsdp] {cell_id}: batch search: {line}", flush=True)

        if found := progress.batch_hints.get(BATCH_FOUND_KEY):
            say(f"batch {found['chosen_batch_size']}, as {found['reused_from']} found it: no search")
            spec = progress.measured = spec.with_batch_size(int(found["chosen_batch_size"]))
        else:
            progress.batch_search = BatchSearch(
                spec.batch_size, spec.batch_cap, spec.batch_margin, spec.batch_probe_steps
            )
            spec = progress.measured = search_batch_size(
                progress.batch_search, spec, sources, env, cell_dir, say, progress.batch_hints.get(BATCH_PREDICTION_KEY)
            )
    if spec.memory_snapshot and env.device.type == "cuda":  # after a search: the measured batch's history
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    memory: dict[str, dict[str, float]] = {}
    built = build(spec, sources, env, memory, enter)
    model, optimizer, flops = built.model, built.optimizer, built.flops
    enter("train")
    start_sums = parameter_sums(model)  # before the peak is reset: its float64 sums are no part of training
    reset_peak_memory(env.device)
    batches = training_batches(
        blocks, built.vocab_size, spec.batch_size, spec.seq_len, spec.seed, env.rank, env.world_size, env.device
    )
    if env.is_main:
        where = (
            f" (rendezvous {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')})"
            if env.world_size > 1
            else ""
        )
        print(
            f"[hpcfsdp] {cell_id}: training {spec.steps} steps on {env.world_size} x {env.device.type}{where}",
            flush=True,
        )

    sampler = NvmlSampler(env.device) if spec.nvml else None
    deadlines = StepDeadlines(spec.init_timeout_s, spec.train_timeout_s)

    def watch_next_step(limit_changed: bool = True) -> None:
        """The next step's deadline, and the collectives' timeout a little past it."""
        if progress.watchdog is not None:
            progress.watchdog.arm(deadlines.limit_s)
        if limit_changed:
            set_collective_timeout(deadlines.limit_s + BACKSTOP_S)

    def on_step_end(step: int, log: TrainLog) -> None:
        progress.log = log  # the steps so far: a cell stopped at its time limit keeps their figures
        before = deadlines.limit_s
        deadlines.step_ended(log.step_times_s[-1])
        watch_next_step(limit_changed=deadlines.limit_s != before)
        if step == 0:
            inject_fault("train_step", env, spec.batch_size)
        if step == spec.warmup_steps - 1:
            memory["after_warmup"] = memory_reading(env.device)
            if sampler is not None:
                sampler.start()  # utilisation of the timed steps only
        print_step(env, spec, step, log)
        progress.file.note(env, cell_dir, progress.stage, step + 1, spec.steps)

    if sampler is not None and spec.warmup_steps == 0:
        sampler.start()
    watch_next_step()
    try:
        log = train(model, optimizer, batches, spec, env, spec.steps, spec.warmup_steps, on_step_end)
    finally:
        if progress.watchdog is not None:
            progress.watchdog.disarm()
        if sampler is not None:
            sampler.stop()
    progress.clock.trained(log)
    memory["end"] = memory_reading(env.device)
    record = ok_record(spec, env, log, flops.flops_per_token, memory)
    record["parameters_changed"], record["parameters_total"] = parameters_changed(model, start_sums, env)
    record.update(
        {
            "flops_tied_lm_head": flops.tied_lm_head,
            "non_embedding_params": flops.non_embedding_params,
            "optimizer_tracks_model": built.optimizer_tracks_model,
            "model_source": built.source.provenance,
            "data_source": blocks.provenance if blocks else {"kind": "synthetic"},
        }
    )
    if spec.float8 != "none":
        record["float8_linears"] = float8_linear_count(model)
    if sampler is not None:
        record.update(gpu_utilisation(sampler.summary(), env))
    record.update(energy(record.get("energy_per_rank_j"), record))
    if spec.comm_profile_steps:
        enter("comm_profile")
        record.update(profile_communication(model, optimizer, batches, spec, env))
    if spec.profile:
        enter("profile")
        record["profile_trace_dir"] = write_trace(model, optimizer, batches, spec, env, cell_dir)
    if snapshot := memory_snapshot(spec, env, cell_dir):
        record["memory_snapshot"] = snapshot
    if spec.record_param_norm:
        record["final_param_norm"] = full_param_norm(model)
    return record


def _record_exception(exc: BaseException, stage: str, env: DistEnv) -> FailedRecord:
    exc = signal_cause(exc)
    if isinstance(exc, CellTimeout):
        status = "timeout"
    elif isinstance(exc, PeerFailed):
        status = "error"  # blamed() makes it the peer's
    elif isinstance(exc, CellCancelled):
        status = exc.status
    elif is_oom(exc):
        status = "oom"
    elif isinstance(exc, Diverged):
        status = "diverged"
    elif isinstance(exc, ProbeHung) or any(marker in str(exc) for marker in COLLECTIVE_TIMEOUT_MARKERS):
        status = "hang"  # a probe past its deadline; the process group's own timeout before the watchdog's
    else:
        status = "error"
    record = failure_record(
        status,
        stage,
        str(exc) if isinstance(exc, PeerFailed) else f"{type(exc).__name__}: {exc}",
        traceback.format_exc(),
        failed_rank=env.rank,
        memory_at_failure=memory_reading(env.device),
    )
    if isinstance(exc, Diverged):
        record.update({"diverged_step": exc.step, "losses": exc.losses})
    if isinstance(exc, CellCancelled):
        record.update(exc.fields)
    return record


def _read_or(path: Path, fallback: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        return read_record(path)
    except RecordError:
        return fallback


def _keeps_earlier_failure(cell_dir: Path, status: str) -> bool:
    """The first failing rank's record says why the cell failed; ranks that fail after it (a peer
    closed the connection, the launcher sent SIGTERM) must not overwrite it."""
    if status == "ok":
        return False
    try:
        earlier = read_record(cell_dir / RECORD_NAME)
    except (RecordError, FileNotFoundError):
        return False
    return earlier["status"] != "ok" and earlier.get("launch_id") == launch_id()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
