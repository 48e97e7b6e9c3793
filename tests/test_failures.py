"""A failing cell ends all ranks promptly and leaves a record saying why (oom / error / timeout /
diverged); `hpcfsdp run` ends with one summary line.

The faults are real exception types (torch.OutOfMemoryError, RuntimeError) or a real SIGTERM,
raised at a chosen stage and rank through the runner's HPCFSDP_FAULT test hook.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_CPU, run_torchrun_cell, torchrun_cell
from hpcfsdp.results.report import write_report
from hpcfsdp.sweep.define.matrix import parse_sweep
from hpcfsdp.sweep.launch.submit import select_cells
from hpcfsdp.sweep.track.status import sweep_status


@pytest.mark.parametrize(
    "fault, status, stage, rank",
    [
        ("train_step:oom:1", "oom", "train", 1),
        ("shard:error:0", "error", "shard", 0),
        ("train_step:timeout:0", "timeout", "train", 0),
    ],
)
def test_failure_leaves_a_record_and_no_hang(tmp_path, monkeypatch, fault, status, stage, rank):
    monkeypatch.setenv("HPCFSDP_FAULT", fault)
    started = time.monotonic()
    # memory_snapshot: the OOM handler's snapshot is CUDA-only; on CPU that path must not get in the way.
    record = run_torchrun_cell(tmp_path, 2, strategy="fsdp2_zero3", comm_profile_steps=0, memory_snapshot=True)
    assert time.monotonic() - started < 120  # the other rank did not hang in a collective
    assert record["status"] == status and record["stage"] == stage and record["failed_rank"] == rank
    assert "injected" in record["error"] or "SIGTERM" in record["error"]
    assert record["memory_at_failure"]["cpu_max_rss_gib"] > 0
    assert record["spec"]["strategy"] == "fsdp2_zero3" and record["world_size"] == 2
    assert "memory_snapshot" not in record
    if status == "timeout":  # stopped after its first step: the record keeps that step's figures
        steps = record["spec"]["steps"]
        assert record["finished_steps"] == 1 and len(record["losses"]) == 1, record["error"]
        assert re.search(rf"\(time limit\); after 1 of {steps} steps( \(.*loss [0-9.]+\))?$", record["error"])


DIVERGING = {"strategy": "ddp", "lr": 1.0e12, "steps": 6, "comm_profile_steps": 0}


def test_a_diverged_cell_records_diverged_with_its_step_and_counts_as_failed(tmp_path):
    record, proc = torchrun_cell(tmp_path, 2, **DIVERGING)
    assert record["status"] == "diverged" and record["stage"] == "train", record.get("error")
    step, losses = record["diverged_step"], record["losses"]
    # The cell stopped at the first loss that is not finite (with sync_each_step, at once): null
    # in the record (strict JSON), and its step named.
    assert 2 <= step < DIVERGING["steps"] and len(losses) == step
    assert all(math.isfinite(loss) for loss in losses[:-1]) and losses[-1] is None
    assert record["nonfinite_steps"] == [step]
    assert f"at step {step}" in record["error"] and "tokens_per_s" not in record
    assert proc.returncode != 0
    assert f"{record['cell_id']}: diverged at step {step} | - tokens/s per process | MFU - |" in proc.stdout

    sweep_dir = tmp_path / "results" / "t"
    sweep = parse_sweep({"name": "t", "base": {**TINY_CPU, "gpus_per_node": 2, **DIVERGING}})
    (cell,) = sweep.cells
    assert cell.id == record["cell_id"]
    assert select_cells(sweep, sweep_dir)[0] == []  # a plain resubmit keeps it
    assert select_cells(sweep, sweep_dir, retry_failed=True)[0] == [cell]  # --retry-failed reruns it
    assert sweep_status(sweep_dir, [cell.id]).counts() == {"diverged": 1}
    write_report(sweep_dir, plots=False)
    summary = (sweep_dir / "report" / "summary.md").read_text()
    assert summary.startswith("# t: 1 cell(s): 1 diverged")
    assert "No cell finished ok." in summary  # kept out of the best-configuration table
    failed = summary[summary.index("## Cells that did not finish ok") :]
    assert re.search(rf"^\| {cell.id} +\| diverged +\|", failed, re.M), failed


def test_without_a_sync_each_step_divergence_is_found_after_the_last_step(tmp_path):
    record = run_torchrun_cell(tmp_path, 2, sync_each_step=False, **DIVERGING)
    assert record["status"] == "diverged"
    step, losses = record["diverged_step"], record["losses"]
    assert len(losses) == DIVERGING["steps"] and 2 <= step < len(losses)  # every step ran; the first bad one is named
    assert all(math.isfinite(loss) for loss in losses[: step - 1]) and losses[step - 1] is None
    assert record["nonfinite_steps"][0] == step and all(losses[s - 1] is None for s in record["nonfinite_steps"])


def test_measurements_of_an_ok_cell(tmp_path):
    record, proc = torchrun_cell(tmp_path, 2, strategy="fsdp2_zero2", steps=5, warmup_steps=2)
    assert record["status"] == "ok"
    # One line at the end, on rank 0: status, speed, MFU (none on CPU), peak memory and the record.
    path = next((tmp_path / "results" / "t" / "cells").glob("*/result.json"))
    summary = [line for line in proc.stdout.splitlines() if line.endswith(f"| record {path}")]
    assert summary == [
        f"[hpcfsdp] {record['cell_id']}: ok | {record['tokens_per_s_per_gpu']:,.0f} tokens/s per process "
        f"| MFU - | peak memory {record['peak_memory_gib']:.2f} GiB | record {path}"
    ]
    # The comm profile ran under torch.profiler, without its warning about cycles.
    assert "Profiler clears events" not in proc.stdout + proc.stderr
    assert record["timed_steps"] == 3 and len(record["losses"]) == 5
    assert record["step_time_s"] <= record["step_time_p90_s"]
    # tokens/s is the timed window's mean step (docs/metrics.md), not the median step_time_s
    assert record["tokens_per_s"] == pytest.approx(record["tokens_per_step"] / record["window_step_time_s"])
    assert set(record["memory"]) == {"after_model", "after_shard", "after_optimizer", "after_warmup", "end"}
    # gloo collectives were seen by the profiler and cost a fraction of the profiled step (on CPU
    # all of it is exposed); the profiler's start-up step is not part of it.
    assert record["comm_s_per_step"] > 0 and record["comm_profile_step_time_s"] > 0
    assert 0 < record["comm_exposed_fraction"] == record["comm_fraction"] <= 1
    assert record["mfu"] is None  # no GPU peak on CPU
    assert record["versions"]["torch"] and record["versions"]["transformers"] and record["versions"]["hpcfsdp"]
    assert record["launch_id"] and record["schema_version"] >= 1 and record["peak_memory_gib"] > 0
    # torchrun's --nproc-per-node 2 became the spec's shape: no gpus_per_node was given.
    assert (record["spec"]["nodes"], record["spec"]["gpus_per_node"], record["world_size"]) == (1, 2, 2)


def test_profile_trace_on_request(tmp_path):
    record = run_torchrun_cell(tmp_path, 2, strategy="fsdp2_zero3", profile=True, comm_profile_steps=0)
    assert record["status"] == "ok"
    traces = sorted(Path(record["profile_trace_dir"]).glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]  # one TensorBoard trace per rank
    assert '"traceEvents"' in traces[0].read_text()[:4096]


PROFILE_TWO_CYCLES = """
import torch
from torch.profiler import ProfilerActivity, profile, schedule
{quiet}
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=1, repeat=2)) as prof:
    for _ in range(4):
        torch.ones(2).sum()
        prof.step()
"""


def test_the_profilers_warning_about_cycles_is_filtered_where_the_cell_profiles():
    def stderr(quiet: str) -> str:
        code = PROFILE_TWO_CYCLES.format(quiet=quiet)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr

    # torch 2.13 warns when a schedule repeats; 2.11 (the GPU machines) with any schedule at all.
    assert "Profiler clears events at the end of each cycle" in stderr("")
    assert "Profiler clears events" not in stderr(
        "from hpcfsdp.cell.measure.metrics import quiet_profiler; quiet_profiler()"
    )
