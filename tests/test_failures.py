"""A failing cell ends all ranks promptly and leaves a record saying why (oom / error / timeout).

The faults are real exception types (torch.OutOfMemoryError, RuntimeError) or a real SIGTERM,
raised at a chosen stage and rank through the runner's HPCFSDP_FAULT test hook.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import run_torchrun_cell


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
    record = run_torchrun_cell(tmp_path, 2, strategy="fsdp2_zero3", comm_profile_steps=0)
    assert time.monotonic() - started < 120  # the other rank did not hang in a collective
    assert record["status"] == status and record["stage"] == stage and record["failed_rank"] == rank
    assert "injected" in record["error"] or "SIGTERM" in record["error"]
    assert record["memory_at_failure"]["cpu_max_rss_gib"] > 0
    assert record["spec"]["strategy"] == "fsdp2_zero3" and record["world_size"] == 2


def test_measurements_of_an_ok_cell(tmp_path):
    record = run_torchrun_cell(tmp_path, 2, strategy="fsdp2_zero2", steps=5, warmup_steps=2)
    assert record["status"] == "ok"
    assert record["timed_steps"] == 3 and len(record["losses"]) == 5
    assert record["step_time_s"] <= record["step_time_p90_s"]
    assert record["tokens_per_s"] == pytest.approx(record["tokens_per_step"] / record["step_time_s"])
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
