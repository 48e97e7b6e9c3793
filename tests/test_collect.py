"""The collector: records written by hand (no training) -> tables, plots, report, comparison."""

from __future__ import annotations

import base64
import errno
import io
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from PIL import Image

from conftest import GarbageCollections
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import SCHEMA_VERSION, read_record, write_record
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.contracts.validity import record_state
from hpcfsdp.results import plots, read
from hpcfsdp.results.read import Collection, label_cells, load_records, ok_configs
from hpcfsdp.results.regressions import compare_sweeps
from hpcfsdp.results.report import write_report
from hpcfsdp.results.tables import comparison_table, percent_text, reference_cells
from hpcfsdp.sweep.define.matrix import cell_id

H100 = "NVIDIA H100 80GB HBM3"
GPU_BASE = {"model": "qwen2.5-1.5b", "seq_len": 4096, "gpus_per_node": 2, "device": "cuda", "precision": "bf16_mixed"}
CPU_BASE = {"model": "tiny", "seq_len": 64, "gpus_per_node": 2, "device": "cpu", "precision": "fp32"}


# ---------------------------------------------------------------------------------------------
# Records shaped like run.py's _ok_record + _context


def spec_of(base: dict, **fields) -> RunSpec:
    return RunSpec.from_dict({**base, **fields})


def context(spec: RunSpec, device: str) -> dict:
    return {
        "cell_id": cell_id(spec),
        "sweep": "fixture",
        "spec": spec.to_dict(),
        "world_size": spec.world_size,
        "nodes": spec.nodes,
        "device_type": "cpu" if device == "cpu" else "cuda",
        "device_name": device,
        "backend": "gloo" if device == "cpu" else "nccl",
        "hostnames": ["gpu-node-07"],
        "slurm": {"job_id": "4242_1", "array_job_id": "4242", "array_task_id": "1", "job_nodelist": "gpu-node-07"},
        "versions": {
            "hpcfsdp": "0.1.0",
            "torch": "2.11.0+cu128",
            "transformers": "5.0.0",
            "cuda": "12.8",
            "nccl": "2.27.3",
        },
        "git_commit": "0123abcd",
        "started_at": 1.7e9,
        "duration_s": 95.0,
    }


def ok_record(spec: RunSpec, tokens_per_s_per_gpu: float, peak_gib: float, device: str = H100, **extra) -> dict:
    tokens_per_step = spec.batch_size * spec.seq_len * spec.grad_accum * spec.world_size
    step_time = tokens_per_step / (tokens_per_s_per_gpu * spec.world_size)
    if device == "cpu":
        memory = {
            stage: {"cpu_max_rss_gib": peak_gib * f}
            for stage, f in (("after_model", 0.9), ("after_shard_and_optimizer", 0.95), ("end", 1.0))
        }
        mfu = None
    else:
        memory = {
            "after_model": {"allocated_gib": 3.0, "cpu_max_rss_gib": 2.1},
            "after_shard_and_optimizer": {"allocated_gib": 6.0, "cpu_max_rss_gib": 2.2},
            "end": {
                "allocated_gib": 6.5,
                "peak_allocated_gib": peak_gib,
                "reserved_gib": peak_gib + 2,
                "peak_reserved_gib": peak_gib + 2,
                "cpu_max_rss_gib": 2.3,
            },
        }
        mfu = tokens_per_s_per_gpu / 30_000
    losses = [11.0 - 0.1 * step for step in range(spec.steps)]
    record = {
        "status": "ok",
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s_per_gpu * spec.world_size,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "samples_per_s": tokens_per_s_per_gpu * spec.world_size / spec.seq_len,
        "step_time_s": step_time,
        "window_step_time_s": step_time,
        "step_time_p90_s": step_time * 1.05,
        "step_times_s": [step_time] * (spec.steps - spec.warmup_steps),
        "warmup_steps": spec.warmup_steps,
        "timed_steps": spec.steps - spec.warmup_steps,
        "data_time_fraction": 0.02,
        "flops_per_token": 9.3e9,
        "tflops_per_gpu": 1.0,
        "peak_tflops": 989.5 if mfu else 0.0,
        "mfu": mfu,
        "memory": memory,
        "peak_memory_gib": peak_gib,
        "losses": losses,
        "final_loss": losses[-1],
        "flops_tied_lm_head": True,
        "non_embedding_params": 1_300_000_000,
        "optimizer_tracks_model": True,
    }
    return {**record, **context(spec, device), **extra}


def failed_record(spec: RunSpec, status: str, stage: str, error: str, device: str = H100) -> dict:
    return {
        "status": status,
        "stage": stage,
        "error": error,
        "traceback": "Traceback ...",
        "failed_rank": 0,
        **context(spec, device),
    }


def put(sweep: Path, record: dict) -> str:
    write_record(sweep / "cells" / record["cell_id"] / "result.json", record)
    return record["cell_id"]


def gpu_sweep(root: Path) -> Path:
    """Three strategies on 2 x H100 with ok, oom, error, timeout, missing and unreadable cells.

    ok: (tokens/s/gpu, peak GiB)   b1             b2             b4             b8              b16
    ddp          ckpt none         10000, 40      12000, 60      OOM
    fsdp2_zero2  ckpt none         11000, 30      13200, 45      14000, 70      error (shard)
    fsdp2_zero3  ckpt none          9000, 20      11400, 30      12600, 50      OOM
    fsdp2_zero3  ckpt full                                                      9500, 60        timeout
    plus a planned b32 ckpt full cell with spec.json only, a manifest-only cell, a truncated
    record and a record of schema_version 3 (newer than this hpcfsdp).
    """
    sweep = root / "gpu"
    extra = {"comm_exposed_fraction": 0.1, "gpu_util_mean": 85.0}
    table = {
        ("ddp", 1): (10000, 40),
        ("ddp", 2): (12000, 60),
        ("fsdp2_zero2", 1): (11000, 30),
        ("fsdp2_zero2", 2): (13200, 45),
        ("fsdp2_zero2", 4): (14000, 70),
        ("fsdp2_zero3", 1): (9000, 20),
        ("fsdp2_zero3", 2): (11400, 30),
        ("fsdp2_zero3", 4): (12600, 50),
    }
    for (strategy, batch), (tps, peak) in table.items():
        put(sweep, ok_record(spec_of(GPU_BASE, strategy=strategy, batch_size=batch), tps, peak, **extra))
    put(
        sweep,
        ok_record(
            spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=8, activation_checkpointing="full"), 9500, 60, **extra
        ),
    )
    put(
        sweep,
        failed_record(
            spec_of(GPU_BASE, strategy="ddp", batch_size=4), "oom", "train", "OutOfMemoryError: CUDA out of memory"
        ),
    )
    put(
        sweep,
        failed_record(
            spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=8),
            "oom",
            "train",
            "OutOfMemoryError: CUDA out of memory",
        ),
    )
    put(
        sweep,
        failed_record(
            spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=8),
            "error",
            "shard",
            "RuntimeError: NCCL error | unhandled system error\nsecond line",
        ),
    )
    put(
        sweep,
        failed_record(
            spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=16, activation_checkpointing="full"),
            "timeout",
            "train",
            "Slurm time limit reached",
        ),
    )

    planned = spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=32, activation_checkpointing="full")
    (sweep / "cells" / cell_id(planned)).mkdir(parents=True)
    (sweep / "cells" / cell_id(planned) / "spec.json").write_text(
        json.dumps({"cell_id": cell_id(planned), "sweep": "gpu", "spec": planned.to_dict()})
    )
    manifest = {
        path.parent.name: {"executor": "slurm", "job_id": "4242_1"} for path in sweep.glob("cells/*/result.json")
    }
    manifest["ghost-cell"] = {"executor": "slurm", "job_id": "4242_9"}
    (sweep / "manifest.json").write_text(json.dumps(manifest))

    (sweep / "cells" / "corrupt-cell").mkdir()
    (sweep / "cells" / "corrupt-cell" / "result.json").write_text('{"status": "ok", "tokens_per_s')
    (sweep / "cells" / "future-cell").mkdir()
    (sweep / "cells" / "future-cell" / "result.json").write_text(json.dumps({"schema_version": 3, "status": "ok"}))
    return sweep


def cpu_sweep(root: Path) -> Path:
    """The smoke sweep's shape: CPU, no MFU, no exposed-communication or utilisation fields."""
    sweep = root / "cpu"
    for strategy, batch, tps in (
        ("ddp", 1, 2800.0),
        ("ddp", 2, 7400.0),
        ("fsdp2_zero3", 1, 1200.0),
        ("fsdp2_zero3", 2, 2400.0),
    ):
        put(sweep, ok_record(spec_of(CPU_BASE, strategy=strategy, batch_size=batch), tps, 0.38, device="cpu"))
    return sweep


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> Path:
    return gpu_sweep(tmp_path_factory.mktemp("sweeps"))


@pytest.fixture(scope="module")
def gpu_report(gpu):
    return write_report(gpu)


def section(markdown: str, title: str) -> str:
    """The text of one '## title' section of summary.md."""
    return markdown.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def rows(markdown_table: str) -> list[list[str]]:
    return [
        [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in markdown_table.splitlines()
        if line.startswith("|") and not line.startswith("|:")
    ]


# ---------------------------------------------------------------------------------------------
# Reading


def test_mixed_statuses_unreadable_and_missing_cells(gpu):
    collection = load_records(gpu)
    assert collection.frame["status"].value_counts().to_dict() == {"ok": 9, "oom": 2, "error": 1, "timeout": 1}
    assert len(collection.unreadable) == 2
    corrupt, future = sorted(collection.unreadable)
    assert str(gpu / "cells" / "corrupt-cell" / "result.json") in corrupt and "unreadable record" in corrupt
    assert str(gpu / "cells" / "future-cell" / "result.json") in future and "schema_version 3" in future
    missing = collection.missing.set_index("cell_id")
    planned_id = cell_id(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=32, activation_checkpointing="full"))
    assert set(missing.index) == {"ghost-cell", planned_id}
    assert "Slurm job 4242_9" in missing.loc["ghost-cell", "error"]
    planned = missing.loc[planned_id]
    assert (planned["strategy"], planned["batch_size"], planned["activation_checkpointing"]) == (
        "fsdp2_zero3",
        32,
        "full",
    )


def test_results_csv_has_one_row_per_cell_with_spec_and_metrics(gpu, gpu_report):
    table = pd.read_csv(gpu_report.directory / "results.csv")
    assert len(table) == 13 + 2  # records + missing cells; unreadable files are not cells
    for column in (
        "cell_id",
        "status",
        "error",
        "strategy",
        "batch_size",
        "grad_accum",
        "activation_checkpointing",
        "seq_len",
        "tokens_per_s_per_gpu",
        "mfu",
        "peak_memory_gib",
        "memory.end.peak_allocated_gib",
        "versions.torch",
    ):
        assert column in table.columns, column
    assert "traceback" not in table.columns
    assert json.loads(table.loc[table["status"] == "ok", "losses"].iloc[0])[0] == 11.0
    assert table.loc[table["cell_id"] == "ghost-cell", "status"].item() == "missing"
    pytest.importorskip("pyarrow")
    parquet = pd.read_parquet(gpu_report.directory / "results.parquet")
    assert len(parquet) == len(table) and set(parquet.columns) == set(table.columns)


def with_changes(record: dict, **changes) -> dict:
    """record with top-level fields replaced, and spec fields replaced by `spec_<name>` keywords."""
    spec = {**record["spec"], **{k.removeprefix("spec_"): v for k, v in changes.items() if k.startswith("spec_")}}
    return {**record, "spec": spec, **{k: v for k, v in changes.items() if not k.startswith("spec_")}}


# Records that parse as JSON but hold values the collector cannot compute with: cell folder ->
# (the change, what the unreadable-record note says after the path).
WRONG_VALUES = {
    "metric-text": ({"tokens_per_s_per_gpu": "fast"}, 'tokens_per_s_per_gpu: expected a number or null, got "fast"'),
    "metric-bool": ({"mfu": True}, "mfu: expected a number or null, got true"),
    "losses-text": ({"losses": "oops"}, 'losses: expected a list of numbers or nulls, got "oops"'),
    "losses-mixed": ({"losses": [11.0, "x"]}, 'losses: expected a list of numbers or nulls, got [11.0, "x"]'),
    "spec-text": ({"spec": "ddp"}, 'spec: expected an object (the run\'s RunSpec), got "ddp"'),
    "spec-empty": ({"spec": {}}, "spec.strategy: missing"),
    "batch-text": ({"spec_batch_size": "4"}, 'spec.batch_size: expected an integer, got "4"'),
    "spec-list": ({"spec_seq_len": [4096]}, "spec.seq_len: expected an integer, got [4096]"),
    "spec-text-number": ({"spec_seq_len": "4096"}, 'spec.seq_len: expected an integer, got "4096"'),
    "spec-unknown-choice": (
        {"spec_precision": "fp8"},
        'spec.precision: expected one of fp32, bf16_mixed, bf16, got "fp8"',
    ),
    "spec-newer-field-list": ({"spec_new_knob": [1]}, "spec.new_knob: expected text, a number or true/false, got [1]"),
}


def test_records_with_wrong_values_are_named_and_skipped(gpu, tmp_path):
    sweep = shutil.copytree(gpu, tmp_path / "wrong")
    for batch, (folder, (changes, _)) in enumerate(WRONG_VALUES.items(), start=64):
        record = with_changes(ok_record(spec_of(GPU_BASE, strategy="ddp", batch_size=batch), 9000, 30), **changes)
        write_record(sweep / "cells" / folder / "result.json", record)
    planned = sweep / "cells" / "planned-batch-text"
    planned.mkdir()
    (planned / "spec.json").write_text(json.dumps({"spec": {"strategy": "ddp", "batch_size": "4"}}))

    report = write_report(sweep)  # with plots: an empty spec used to break the throughput figure
    expected = {f"{sweep / 'cells' / folder / 'result.json'}: {note}" for folder, (_, note) in WRONG_VALUES.items()}
    expected.add(f'{planned / "spec.json"}: spec.batch_size: expected an integer, got "4"')
    assert expected <= set(report.unreadable) and len(report.unreadable) == len(expected) + 2  # + the fixture's two
    assert report.skipped_plots == {}
    table = pd.read_csv(report.directory / "results.csv")
    assert (
        len(table) == 13 + 3 and table["status"].value_counts()["missing"] == 3
    )  # records + missing; none of the above
    assert (
        table.loc[table["cell_id"] == "planned-batch-text", "batch_size"].isna().all()
    )  # listed, without its bad spec
    pytest.importorskip("pyarrow")
    assert len(pd.read_parquet(report.directory / "results.parquet")) == len(table)


def test_a_bulk_read_runs_no_garbage_collection_and_leaves_the_collector_as_its_caller_had_it():
    """garbage_collection_paused (collect's reading of the records, a rank's reading of its profile):
    no collection inside however much is made, the collector running again after the block, after
    one that raised too, and still paused where its caller had paused it."""
    import gc

    from hpcfsdp.contracts.files import RecordError, garbage_collection_paused

    with GarbageCollections() as collections, garbage_collection_paused():
        made = [{"row": [k]} for k in range(100_000)]  # 200,000 tracked objects: past every threshold
        assert not gc.isenabled()
    assert collections == [] and gc.isenabled() and len(made) == 100_000
    with pytest.raises(RecordError), garbage_collection_paused():
        raise RecordError("a refused record")
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_sweep_read_in_two_processes_gives_the_rows_and_refusals_of_one_in_the_same_order(
    tmp_path, monkeypatch, capsys
):
    """Above SPLIT_MIN_RECORDS a forked worker reads the second half of the records: what collect
    reads, writes and prints (the same rows, the same refusal lines in path order, from both
    halves) is what one process reading them all gives."""
    split_at = read.SPLIT_MIN_RECORDS
    count = split_at + 20
    sweep = tmp_path / "results" / "split"
    for k in range(count):
        spec = spec_of(GPU_BASE, strategy=("ddp", "fsdp2_zero3")[k % 2], seed=k)
        put(sweep, failed_record(spec, "oom", "train", "OOM") if k % 7 == 0 else ok_record(spec, 1000 + k, 30))
    paths = sorted((sweep / "cells").glob("*/result.json"))
    spoiled = [3, count // 2 - 1, count // 2, count // 2 + 7, count - 2]  # both halves, either side of the split
    for position, (changes, _) in zip(spoiled, WRONG_VALUES.values(), strict=False):
        write_record(paths[position], with_changes(read_record(paths[position]), **changes))
    shutil.copy(paths[0], paths[count - 40])  # another cell's record
    paths[count // 2 + 1].write_text(paths[count // 2 + 1].read_text()[:40])  # truncated

    def collected(split_above: int) -> tuple[Collection, list[str], bytes]:
        """What load_records reads; what collect prints (but its progress lines, which come with the
        clock) and writes to results.csv."""
        monkeypatch.setattr(read, "SPLIT_MIN_RECORDS", split_above)
        collection = load_records(sweep)
        assert main(["collect", str(sweep), "--no-plots", "--no-history"]) == 0
        out, err = capsys.readouterr()
        printed = [*out.splitlines(), *(line for line in err.splitlines() if line.startswith("warning: "))]
        return collection, printed, (sweep / "report" / "results.csv").read_bytes()

    one, one_printed, one_csv = collected(count + 1)
    two, two_printed, two_csv = collected(split_at)
    assert len(one.frame) == count - 7 and len(one.unreadable) == 7
    assert two.unreadable == one.unreadable and two_printed == one_printed
    refused = sorted([*spoiled, count - 40, count // 2 + 1])
    assert [line.split(": ")[0] for line in one.unreadable] == [str(paths[i]) for i in refused]
    assert [f"warning: skipped {line}" for line in one.unreadable] == [
        line for line in one_printed if line.startswith("warning: skipped ")
    ]
    pd.testing.assert_frame_equal(two.frame, one.frame, check_exact=True)
    assert two.spec_fields == one.spec_fields and two_csv == one_csv

    def no_fork() -> int:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")  # as at a process limit

    monkeypatch.setattr(os, "fork", no_fork)  # collect's process then reads them all
    alone, alone_printed, alone_csv = collected(split_at)
    pd.testing.assert_frame_equal(alone.frame, one.frame, check_exact=True)
    assert (alone.unreadable, alone_printed, alone_csv) == (one.unreadable, one_printed, one_csv)


def test_a_column_of_mixed_types_is_written_to_parquet_as_text(tmp_path):
    """device_type is not a field the collector or the history reads, so a number there is kept."""
    pytest.importorskip("pyarrow")
    sweep = tmp_path / "mixed"
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp"), 1000.0, 20.0))
    put(sweep, {**ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3"), 1100.0, 10.0), "device_type": 7})
    report = write_report(sweep, plots=False)
    assert report.notes == [
        f"{report.directory / 'results.parquet'}: column(s) device_type hold values of more "
        "than one type; written as text"
    ]
    assert report.unreadable == []
    parquet = pd.read_parquet(report.directory / "results.parquet").set_index("strategy")
    assert parquet["device_type"].to_dict() == {"ddp": "cuda", "fsdp2_zero3": "7"}
    assert set(pd.read_csv(report.directory / "results.csv")["device_type"]) == {"cuda", "7"}


def test_a_cpu_sweeps_parquet_types_the_gpu_columns_it_has_no_value_for_as_the_record_declares(tmp_path):
    """mfu, energy_j and the GPU's memory are null in every CPU record: Arrow would type them
    `null`, which some readers refuse; they are float64 (and a text field text) as declared."""
    pyarrow = pytest.importorskip("pyarrow.parquet")
    sweep = cpu_sweep(tmp_path)
    for path in (sweep / "cells").glob("*/result.json"):  # as a CPU cell writes them: null where there is no GPU
        record = json.loads(path.read_text())
        write_record(path, {**record, "energy_j": None, "memory_capacity_gib": None, "slurm": {"job_id": None}})
    report = write_report(sweep, plots=False)
    schema = pyarrow.read_schema(report.directory / "results.parquet")
    assert [field.name for field in schema if str(field.type) == "null"] == []
    types = {name: str(schema.field(name).type) for name in ("mfu", "energy_j", "memory_capacity_gib", "slurm.job_id")}
    assert types == {"mfu": "double", "energy_j": "double", "memory_capacity_gib": "double", "slurm.job_id": "string"}
    assert pd.read_parquet(report.directory / "results.parquet")["mfu"].isna().all()


def test_parquet_types_an_all_ok_sweep_and_one_with_failures_alike_and_polars_reads_both_together(tmp_path):
    """A failed record lacks world_size's companions (timed_steps, tokens_per_step, ...): pandas
    makes such an int column float; the file keeps it int64, null where a record has none."""
    pyarrow = pytest.importorskip("pyarrow.parquet")
    polars = pytest.importorskip("polars")
    all_ok = write_report(cpu_sweep(tmp_path / "a"), plots=False).directory / "results.parquet"
    mixed = cpu_sweep(tmp_path / "b")
    put(mixed, failed_record(spec_of(CPU_BASE, strategy="fsdp2_zero2"), "oom", "train", "OutOfMemoryError", "cpu"))
    with_failure = write_report(mixed, plots=False).directory / "results.parquet"
    ok_types, mixed_types = ({f.name: str(f.type) for f in pyarrow.read_schema(p)} for p in (all_ok, with_failure))
    assert ok_types["timed_steps"] == mixed_types["timed_steps"] == "int64"
    assert {
        name: (kind, mixed_types[name]) for name, kind in ok_types.items() if mixed_types.get(name, kind) != kind
    } == {}
    both = polars.concat([polars.read_parquet(all_ok), polars.read_parquet(with_failure)], how="diagonal")
    assert both.height == 9 and both["timed_steps"].null_count() == 1 and both["world_size"].dtype == polars.Int64


def test_records_of_an_older_or_no_schema_version_are_named_unreadable(tmp_path):
    """read_record accepts the schema versions it knows (READ_SCHEMA_VERSIONS) only: what the
    fields of another one mean is not defined, so it is named and skipped, never guessed at."""
    sweep = cpu_sweep(tmp_path)
    record = ok_record(spec_of(CPU_BASE, strategy="ddp", batch_size=4), 9000.0, 0.4, device="cpu")
    paths = {}
    for folder, version in (("older", {"schema_version": 0}), ("unversioned", {})):
        paths[folder] = sweep / "cells" / folder / "result.json"
        paths[folder].parent.mkdir()
        paths[folder].write_text(json.dumps({**version, **record}))
    collection = load_records(sweep)
    assert sorted(collection.unreadable) == [
        f"{paths['older']}: schema_version 0 is not supported (expected 1 or 2)",
        f"{paths['unversioned']}: schema_version null or missing is not supported (expected 1 or 2)",
    ]
    assert len(collection.frame) == 4 and collection.missing.empty  # the cpu sweep's records; not missing either


def test_a_schema_1_record_with_a_bare_nan_reads_as_before_and_is_strict_json_once_written_again(tmp_path):
    """Schema 1 wrote a loss that was not finite as a bare NaN (Python's json took it, no other
    parser does): such a record still reads, NaN and all; written again (collect adding Slurm
    accounting does) it is schema 2: null in `losses`, the step in `nonfinite_steps`."""
    sweep = cpu_sweep(tmp_path)
    spec = spec_of(CPU_BASE, strategy="ddp", batch_size=4)
    old = {
        **failed_record(spec, "diverged", "train", "Diverged: loss is nan at step 2"),
        "schema_version": 1,
        "diverged_step": 2,
        "losses": [10.5, math.nan],
    }
    path = sweep / "cells" / cell_id(spec) / "result.json"
    path.parent.mkdir()
    path.write_text(json.dumps(old))
    assert "NaN" in path.read_text()
    read = read_record(path)
    assert read["schema_version"] == 1 and read["losses"][0] == 10.5 and math.isnan(read["losses"][1])
    assert cell_id(spec) in set(load_records(sweep).frame["cell_id"])

    write_record(path, read)

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    again = json.loads(path.read_text(), parse_constant=refuse)
    assert again["schema_version"] == SCHEMA_VERSION == 2
    assert again["losses"] == [10.5, None] and again["nonfinite_steps"] == [2]
    assert read_record(path)["losses"] == [10.5, None]


# ---------------------------------------------------------------------------------------------
# summary.md: numbers computed by hand from the fixture's table


def test_summary_baseline_speedup_and_memory_saving(gpu_report):
    summary = (gpu_report.directory / "summary.md").read_text()
    body = section(summary, "Speed-up and memory saving vs baseline")
    assert "Baseline: ddp" in body
    got = {(r[0], r[1]): (r[-4], r[-1]) for r in rows(body)[1:]}
    assert got == {
        ("fsdp2_zero2", "1"): ("1.10x", "25.0%"),  # 11000 / 10000, 1 - 30 / 40
        ("fsdp2_zero2", "2"): ("1.10x", "25.0%"),  # 13200 / 12000, 1 - 45 / 60
        ("fsdp2_zero3", "1"): ("0.90x", "50.0%"),  # 9000 / 10000, 1 - 20 / 40
        ("fsdp2_zero3", "2"): ("0.95x", "50.0%"),  # 11400 / 12000, 1 - 30 / 60
    }


def test_summary_oom_frontier_and_best(gpu_report):
    summary = (gpu_report.directory / "summary.md").read_text()
    frontier = {(r[0], r[1]): (r[2], r[3]) for r in rows(section(summary, "OOM frontier"))[1:]}
    assert frontier == {
        ("ddp", "none"): ("2", "4"),
        ("fsdp2_zero2", "none"): ("4", "-"),
        ("fsdp2_zero3", "full"): ("8", "-"),
        ("fsdp2_zero3", "none"): ("4", "8"),
    }
    best = section(summary, "Best configuration")
    assert "Best overall: fsdp2_zero2 at batch 4, accum 1, ckpt none: 14,000 tokens/s per GPU" in best
    assert {r[0]: r[4] for r in rows(best)[1:]} == {"ddp": "12,000", "fsdp2_zero2": "14,000", "fsdp2_zero3": "12,600"}


def test_summary_pivots_show_values_and_failures(gpu_report):
    summary = (gpu_report.directory / "summary.md").read_text()
    pivot = section(summary, "Pivot: tokens/s/gpu").split("### accum 1, ckpt none\n", 1)[1].split("###", 1)[0]
    grid = {r[0]: r[1:] for r in rows(pivot)}
    assert grid["strategy"] == ["b1", "b2", "b4", "b8"]
    assert grid["ddp"] == ["10,000", "12,000", "OOM", ""]
    assert grid["fsdp2_zero2"] == ["11,000", "13,200", "14,000", "ERROR"]
    assert "### accum 1, ckpt full" in section(summary, "Pivot: MFU")
    assert "### accum 1, ckpt full" in section(summary, "Pivot: peak GiB")


def test_summary_lists_failed_missing_and_unreadable_cells_with_reasons(gpu, gpu_report):
    summary = (gpu_report.directory / "summary.md").read_text()
    failures = {r[0]: r for r in rows(section(summary, "Cells that did not finish ok"))[1:]}
    assert {r[1] for r in failures.values()} == {"oom", "error", "timeout", "missing"}
    error = next(r for r in failures.values() if r[1] == "error")
    assert error[6:] == ["shard", r"RuntimeError: NCCL error \| unhandled system error"]  # first line, pipe escaped
    assert failures["ghost-cell"][2] == "4242_9" and "Slurm job 4242_9" in failures["ghost-cell"][7]
    unreadable = section(summary, "Unreadable records (skipped)")
    assert "corrupt-cell/result.json" in unreadable and "schema_version 3" in unreadable
    assert summary.startswith(
        "# gpu: 15 cell(s): 9 ok, 2 oom, 1 error, 1 timeout, 2 missing; 2 unreadable record file(s)"
    )


def test_the_failed_cells_table_names_an_array_task_as_status_and_squeue_do(tmp_path):
    sweep = tmp_path / "jobs"
    failed = failed_record(spec_of(CPU_BASE, strategy="ddp"), "timeout", "train", "received SIGTERM", device="cpu")
    put(sweep, {**failed, "slurm": {"job_id": "41", "array_job_id": "40", "array_task_id": "0"}})
    summary = write_report(sweep, plots=False).directory.joinpath("summary.md").read_text()
    assert [r[2] for r in rows(section(summary, "Cells that did not finish ok"))[1:]] == ["40_0"]


def test_the_report_links_each_profiled_cells_traces_and_says_how_to_open_them(tmp_path):
    sweep = cpu_sweep(tmp_path)
    cell = sorted((sweep / "cells").iterdir())[0]
    (cell / "profile").mkdir()
    (cell / "profile" / "rank0.1700000000.pt.trace.json").write_text("{}")
    (cell / "profile" / "notes.txt").write_text("not a trace")
    report = write_report(sweep, plots=False)
    summary = (report.directory / "summary.md").read_text()
    link = f"../cells/{cell.name}/profile/rank0.1700000000.pt.trace.json"
    assert f"]({'<'}{link}>)" in section(summary, "Profiles") and "notes.txt" not in summary
    assert "ui.perfetto.dev" in section(summary, "Profiles") and "tensorboard --logdir" in summary
    page = (report.directory / "index.html").read_text()
    assert f'href="{link}"' in page


def test_baseline_falls_back_to_zero3_and_can_be_chosen(tmp_path):
    sweep = tmp_path / "nodp"
    for strategy, tps in (("fsdp2_zero2", 1100.0), ("fsdp2_zero3", 1000.0)):
        put(sweep, ok_record(spec_of(GPU_BASE, strategy=strategy, batch_size=1), tps, 10.0))
    fallback = section(
        write_report(sweep, plots=False).directory.joinpath("summary.md").read_text(),
        "Speed-up and memory saving vs baseline",
    )
    assert "Baseline: fsdp2_zero3" in fallback and "1.10x" in fallback
    chosen = section(
        write_report(sweep, baseline="fsdp2_zero2", plots=False).directory.joinpath("summary.md").read_text(),
        "Speed-up and memory saving vs baseline",
    )
    assert "Baseline: fsdp2_zero2" in chosen and "0.91x" in chosen
    absent = section(
        write_report(sweep, baseline="ddp", plots=False).directory.joinpath("summary.md").read_text(),
        "Speed-up and memory saving vs baseline",
    )
    assert "No ok cell of ddp" in absent


def test_record_without_a_newer_spec_field_still_matches_its_baseline(tmp_path):
    """A record written before a spec field existed (schema unchanged) lacks it in `spec`."""
    sweep = tmp_path / "old"
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3"), 1100.0, 10.0))
    old = ok_record(spec_of(GPU_BASE, strategy="ddp"), 1000.0, 20.0)
    old["spec"] = {k: v for k, v in old["spec"].items() if k != "adamw_impl"}
    put(sweep, old)
    summary = write_report(sweep, plots=False).directory.joinpath("summary.md").read_text()
    assert "1.10x" in section(summary, "Speed-up and memory saving vs baseline")


def test_a_knob_varied_within_a_strategy_names_a_variant(tmp_path):
    sweep = tmp_path / "knobs"
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp"), 1000.0, 20.0))
    for depth, tps in ((0, 1100.0), (2, 1200.0)):
        put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", prefetch_depth=depth), tps, 10.0))
    cells = label_cells(load_records(sweep))
    assert set(cells.frame["variant"]) == {"ddp", "fsdp2_zero3 (prefetch_depth=0)", "fsdp2_zero3 (prefetch_depth=2)"}
    summary = write_report(sweep, plots=False).directory.joinpath("summary.md").read_text()
    speedups = {r[0]: r[-4] for r in rows(section(summary, "Speed-up and memory saving vs baseline"))[1:]}
    assert speedups == {"fsdp2_zero3 (prefetch_depth=0)": "1.10x", "fsdp2_zero3 (prefetch_depth=2)": "1.20x"}


# ---------------------------------------------------------------------------------------------
# Plots and the HTML page


def distinct_colours(path: Path) -> int:
    with Image.open(path) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24))


def plot_data(sweep: Path) -> plots.PlotData:
    """What write_report hands the figures of a sweep."""
    cells = label_cells(load_records(sweep))
    reference, label = reference_cells(cells)
    return plots.PlotData.of(ok_configs(cells), reference, label)


def shows_a_value(artist: Artist) -> bool:
    """A line with a finite point, an image with a finite pixel, a bar or mesh of some size."""
    if isinstance(artist, Line2D):
        return bool(np.isfinite(artist.get_xydata()).all(axis=1).any())
    if isinstance(artist, AxesImage):
        return np.ma.masked_invalid(artist.get_array()).count() > 0
    if isinstance(artist, Patch):
        extent = artist.get_window_extent()
        return extent.width > 0 and extent.height > 0
    return len(artist.get_paths()) > 0  # a collection


def data_artists(ax: Axes) -> list[Artist]:
    """What an axes draws from data: artists placed in data coordinates that show a value. A
    reference line (axhline: x in axes coordinates), the grid, text and the background do not count."""
    return [
        artist
        for artist in (*ax.lines, *ax.images, *ax.patches, *ax.collections)
        if artist.get_transform().contains_branch(ax.transData) and shows_a_value(artist)
    ]


def test_every_plot_is_drawn_and_shows_data(gpu, gpu_report):
    assert gpu_report.skipped_plots == {}
    drawn = {path.stem: path for path in gpu_report.files if path.suffix == ".png"}
    # the sweep ran at one GPU count: no scaling figure (tests/test_scaling_report.py draws one)
    assert set(drawn) == {name for name, _, _ in plots.PLOTS} - {"scaling"}
    for name, path in drawn.items():
        with Image.open(path) as image:
            assert image.width >= 600 and image.height >= 300, name
        assert distinct_colours(path) > 50, name  # text, lines and fills, not a blank canvas
    data = plot_data(gpu)
    for name, _, draw in plots.PLOTS:  # the functions that drew those files, from the same records
        if name not in drawn:
            continue
        panels = [ax for ax in draw(data).axes if ax.get_visible()]  # a colour bar is one too: it shows its map
        assert panels, name
        assert [ax.get_title() for ax in panels if not data_artists(ax)] == [], name


def broken_figure(data: plots.PlotData) -> Figure:
    raise ValueError("cannot draw this")


def test_a_failing_figure_is_skipped_with_its_error_and_the_others_are_drawn(gpu, gpu_report, tmp_path, monkeypatch):
    sweep = shutil.copytree(gpu, tmp_path / "copy")
    assert (sweep / "report" / "plots" / "mfu.png").exists()  # drawn by gpu_report
    monkeypatch.setattr(
        plots,
        "PLOTS",
        tuple((name, caption, broken_figure if name == "mfu" else draw) for name, caption, draw in plots.PLOTS),
    )
    report = write_report(sweep)
    assert report.skipped_plots == {"mfu": "ValueError: cannot draw this"}
    assert {path.stem for path in report.files if path.suffix == ".png"} == {name for name, _, _ in plots.PLOTS} - {
        "mfu",
        "scaling",  # one GPU count: not drawn, not skipped
    }
    assert not (report.directory / "plots" / "mfu.png").exists()  # no figure of the earlier collection left
    assert "Skipped mfu: ValueError: cannot draw this." in (report.directory / "summary.md").read_text()


def test_memory_plot_draws_the_gpu_capacity_and_time_plot_uses_comm(gpu):
    data = plot_data(gpu)
    legend = [text.get_text() for text in plots.memory(data).legends[0].get_texts()]
    assert f"{H100}: 79.6 GiB" in legend
    assert "not recorded" not in plots.time_breakdown(data).get_suptitle()
    assert plots.gpu_memory_gib("NVIDIA H200") == 140.4 and plots.gpu_memory_gib("NVIDIA A100-SXM4-40GB") == 40.0
    assert plots.gpu_memory_gib("cpu") is None


def test_cpu_sweep_skips_gpu_only_plots_with_a_note(tmp_path):
    report = write_report(cpu_sweep(tmp_path))
    assert set(report.skipped_plots) == {"mfu", "gpu_utilisation"}
    assert "mfu" in report.skipped_plots["mfu"]
    summary = (report.directory / "summary.md").read_text()
    assert "No MFU values" in summary and "Skipped mfu: no ok cell recorded mfu." in summary
    data = plot_data(tmp_path / "cpu")
    assert "exposed communication not recorded: shown as 0" in plots.time_breakdown(data).get_suptitle()
    assert len(plots.memory(data).legends[0].get_texts()) == 2  # the strategies; no capacity line on CPU
    assert distinct_colours(report.directory / "plots" / "memory_stages.png") > 50


def test_a_cpu_sweeps_memory_plot_caption_speaks_of_process_memory_not_a_gpus_capacity(tmp_path):
    report = write_report(cpu_sweep(tmp_path))
    summary = (report.directory / "summary.md").read_text()
    assert "Peak memory (each process's RSS) vs per-device batch" in summary
    assert "capacity" not in summary and "GPU's" not in summary


def test_ddp_rows_leave_the_fsdp_only_knobs_blank_and_no_saving_reads_minus_zero(tmp_path):
    sweep = tmp_path / "knobs"
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp"), 1000.0, 20.0))
    for depth, peak in ((0, 20.0004), (2, 10.0)):  # 20.0004 GiB against 20: a saving of -0.002%
        put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", prefetch_depth=depth), 1100.0, peak))
    table = comparison_table(load_records(sweep).frame, tuple(RunSpec.__dataclass_fields__))
    assert "prefetch_depth" in table.columns
    assert table.set_index("strategy").loc["ddp", "prefetch_depth"] == ""  # DDP has no prefetch
    assert set(table[table["strategy"] != "ddp"]["prefetch_depth"]) == {"0", "2"}
    summary = write_report(sweep, plots=False, baseline="ddp").directory.joinpath("summary.md").read_text()
    savings = [r[-1] for r in rows(section(summary, "Speed-up and memory saving vs baseline"))[1:]]
    assert sorted(savings) == ["0.0%", "50.0%"] and percent_text(-0.0001) == "0.0%"


def test_empty_sweep_writes_a_report_and_skips_every_plot(tmp_path):
    (tmp_path / "empty" / "cells").mkdir(parents=True)
    report = write_report(tmp_path / "empty")
    assert set(report.skipped_plots) == {name for name, _, _ in plots.PLOTS} - {"scaling"}  # not skipped: not asked
    assert (report.directory / "index.html").exists()
    assert "No cell finished ok" in (report.directory / "summary.md").read_text()


class PageReferences(HTMLParser):
    """The src of every <img> of a page, every src and href, and the ids an #anchor can name."""

    def __init__(self, page: str):
        super().__init__()
        self.images: list[str] = []
        self.references: list[str] = []
        self.ids: set[str] = set()
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "img":
            self.images.append(values.get("src", ""))
        self.references += [values[name] for name in ("src", "href") if name in values]
        if "id" in values:
            self.ids.add(values["id"])


def test_index_html_is_self_contained(gpu_report):
    page = (gpu_report.directory / "index.html").read_text()
    found = PageReferences(page)
    embedded = []
    for src in found.images:
        assert src.startswith("data:image/png;base64,"), src[:80]
        embedded.append(base64.b64decode(src.split(",", 1)[1], validate=True))
        with Image.open(io.BytesIO(embedded[-1])) as image:
            image.verify()  # a PNG signature, chunks and checksums, not just any base64
    assert sorted(embedded) == sorted(path.read_bytes() for path in gpu_report.files if path.suffix == ".png")
    outside = [
        ref for ref in found.references if not ref.startswith("data:") and ref.removeprefix("#") not in found.ids
    ]
    assert outside == []  # only embedded data and anchors of this page
    for text in (H100, "2.11.0+cu128", "gpu-node-07", "nccl", "OOM frontier", "1.10x", "corrupt-cell"):
        assert text in page, text


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_index_html_renders_in_headless_chromium(gpu_report, tmp_path):
    shot = tmp_path / "page.png"
    profile = tempfile.mkdtemp(dir=tmp_path)
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--screenshot={shot}",
            "--window-size=1280,2000",
            (gpu_report.directory / "index.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    with Image.open(shot) as image:
        assert image.size == (1280, 2000)
        pixels = np.asarray(image.convert("RGB"))
    inked_rows = (pixels < 200).any(axis=2).any(axis=1).mean()
    assert inked_rows > 0.3  # headings, text and tables down the page (a one-line page inks 0.4% of rows)
    assert distinct_colours(shot) > 100


# ---------------------------------------------------------------------------------------------
# Comparing sweeps


def slower_copy(gpu: Path, root: Path) -> tuple[Path, str, str]:
    """The fixture sweep again, with one cell 20% slower, one 3% larger and one now OOM."""
    sweep = root / "again"
    shutil.copytree(gpu, sweep)
    slow = cell_id(spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=2))
    broken = cell_id(spec_of(GPU_BASE, strategy="ddp", batch_size=1))
    put(
        sweep,
        ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=2), 13200 * 0.8, 45, comm_exposed_fraction=0.1),
    )
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1), 9000, 20 * 1.03))
    put(sweep, failed_record(spec_of(GPU_BASE, strategy="ddp", batch_size=1), "oom", "train", "OutOfMemoryError"))
    return sweep, slow, broken


def test_compare_flags_a_planted_regression(gpu, tmp_path):
    again, slow, broken = slower_copy(gpu, tmp_path)
    comparison = compare_sweeps(again, gpu, threshold=0.05)
    assert len(comparison.table) == 13
    flagged = set(comparison.table.loc[comparison.table["regression"] != "", "cell"])
    # The slower cell: tokens/s and MFU dropped 20%; the OOM cell lost its status; +3% memory is within 5%.
    assert flagged == {slow, broken}
    assert f"{slow}: tokens/s/gpu 13,200 -> 10,560 (-20.0%)" in comparison.regressions
    assert f"{broken}: status ok -> oom" in comparison.regressions
    assert any("noise unknown" in note for note in comparison.notes)
    assert not compare_sweeps(gpu, gpu).regressions


def test_compare_flags_ok_cells_that_have_no_record_now(gpu, tmp_path):
    again = shutil.copytree(gpu, tmp_path / "again")
    pending = cell_id(spec_of(GPU_BASE, strategy="ddp", batch_size=2))  # ok before; planned now, no record
    gone = cell_id(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=4))  # ok before; not in this sweep at all
    was_oom = cell_id(spec_of(GPU_BASE, strategy="ddp", batch_size=4))  # not ok before: no regression
    (again / "cells" / pending / "result.json").unlink()
    for cell in (gone, was_oom):
        shutil.rmtree(again / "cells" / cell)
    manifest = json.loads((again / "manifest.json").read_text())
    (again / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k not in (gone, was_oom)}))

    comparison = compare_sweeps(again, gpu)
    assert comparison.regressions == [f"{pending}: status ok -> missing"]  # `gone` was never this sweep's
    table = comparison.table.set_index("cell")
    assert len(table) == 13  # every record of the reference
    assert table.loc[[pending, gone, was_oom], "status"].tolist() == [
        "ok -> missing",
        "ok; not in the current sweep",
        "oom; not in the current sweep",
    ]
    assert table.loc[[pending, gone, was_oom], "regression"].tolist() == ["REGRESSION", "", ""]
    assert table.loc[gone, "tokens/s/gpu"] == "12,600 -> -"
    text = comparison.render("again", "gpu")
    assert text.startswith("# again vs gpu: 13 reference cell(s), 1 regression(s)")
    assert f"- {pending}: status ok -> missing" in section(text, "Regressions") and gone not in section(
        text, "Regressions"
    )


def test_compare_cli_prints_deltas_and_fails_on_regression(gpu, tmp_path, capsys):
    again, slow, _ = slower_copy(gpu, tmp_path)
    assert main(["collect", str(again), "--compare", str(gpu), "--threshold", "0.1", "--no-plots"]) == 1
    out = capsys.readouterr().out
    assert f"{slow}: tokens/s/gpu 13,200 -> 10,560 (-20.0%)" in out
    assert "REGRESSION" in out and (again / "report" / "compare.md").exists()
    same = Path(shutil.copytree(gpu, tmp_path / "same"))  # gpu's own report stays the one gpu_report wrote
    assert main(["collect", str(same), "--compare", str(same), "--no-plots"]) == 0


def test_compare_reports_run_to_run_noise_from_repeated_seeds(tmp_path):
    for name in ("a", "b"):
        for seed, tps in ((0, 1000.0), (1, 1100.0)):
            put(tmp_path / name, ok_record(spec_of(GPU_BASE, strategy="ddp", seed=seed), tps, 10.0))
    notes = " ".join(compare_sweeps(tmp_path / "a", tmp_path / "b").notes)
    # std(1000, 1100) / mean = 70.71 / 1050 = 6.7%: above half the 5% threshold, so a warning too.
    assert "current 6.7% (median CV of tokens/s/gpu over 1 config(s)" in notes and "reference 6.7%" in notes
    assert "expect false alarms" in notes


# ---------------------------------------------------------------------------------------------
# The command


def test_collect_command_prints_the_recommendation_then_the_cell_table(gpu, tmp_path, capsys):
    gpu = Path(shutil.copytree(gpu, tmp_path / "gpu"))  # a copy: gpu_report's plots stay in the shared folder
    assert main(["collect", str(gpu), "--no-plots"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[-1].startswith(f"wrote {gpu / 'report'}/: results.csv")
    assert [line.split(":")[0] for line in lines[:3]] == ["Fastest", "Most memory headroom", "Cheapest"]
    assert lines[3].startswith("| strategy") and len([line for line in lines if line.startswith("|")]) == 2 + 15
    assert "warning: skipped" in captured.err and "corrupt-cell" in captured.err


def test_the_report_opens_with_one_recommendation_line_each_for_speed_headroom_and_cost(gpu_report):
    summary = (gpu_report.directory / "summary.md").read_text()
    assert summary.split("\n## ")[1].startswith("Recommendation")
    fastest, roomy, cheapest = gpu_report.recommendation
    zero2_b4 = cell_id(spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=4))
    zero3_b1 = cell_id(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1))
    assert fastest == (
        f"Fastest: fsdp2_zero2 at batch 4, accum 1, ckpt none: 28,000 tokens/s for the job, 2 GPU(s) x 14,000 "
        f"(cell {zero2_b4})"
    )
    # The H100's 79.6 GiB from its name (these records predate memory_capacity_gib); 20 GiB peak.
    assert roomy == (
        f"Most memory headroom: fsdp2_zero3 at batch 1, accum 1, ckpt none: peak 20.00 of 79.6 GiB, "
        f"59.6 GiB (75%) free (cell {zero3_b1})"
    )
    assert cheapest == (
        f"Cheapest: fsdp2_zero2 at batch 4, accum 1, ckpt none: 19.8 GPU-hours per billion tokens (also the fastest) "
        f"(cell {zero2_b4})"
    )
    assert all(line in summary for line in gpu_report.recommendation)
    assert "Recommendation" in (gpu_report.directory / "index.html").read_text().split("Best configuration")[0]


def test_cheapest_is_the_least_energy_per_token_where_nvml_measured_it(tmp_path):
    sweep = tmp_path / "energy"
    for strategy, tps, joules in (("ddp", 12000, 0.05), ("fsdp2_zero3", 11000, 0.04)):
        spec = spec_of(GPU_BASE, strategy=strategy, batch_size=2)
        put(
            sweep,
            ok_record(
                spec,
                tps,
                50,
                joules_per_token=joules,
                memory_capacity_gib=139.8,
                gpu_hours_per_billion_tokens=1e9 / (3600 * tps),
            ),
        )
    fastest, roomy, cheapest = write_report(sweep, plots=False).recommendation
    assert fastest.startswith("Fastest: ddp at batch 2") and "of 139.8 GiB, 89.8 GiB (64%) free" in roomy
    assert cheapest.startswith(
        "Cheapest: fsdp2_zero3 at batch 2, accum 1, ckpt none: 11.1 kWh per billion tokens (0.04 J per token; "
        "25.3 GPU-hours per billion tokens) (cell "
    )
    # Energy measured for one cell only: GPU-hours decide, and the measured one is named beside.
    put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=2), 10000, 50))
    cheapest = write_report(sweep, plots=False).recommendation[2]
    assert cheapest.startswith("Cheapest: ddp at batch 2, accum 1, ckpt none: 23.1 GPU-hours per billion tokens")
    assert cheapest.endswith(
        "least energy of the 2 measured: fsdp2_zero3 at batch 2, accum 1, ckpt none: 0.04 J per token "
        "(11.1 kWh per billion tokens)"
    )


def test_fastest_and_cheapest_differ_when_cells_use_different_gpu_counts(tmp_path, capsys):
    """4 GPUs at 9,000 tokens/s each finish first (36,000 for the job); 1 GPU at 12,000 costs
    fewest GPU-hours per token; the 8-GPU ZeRO-3 cell has the most memory left."""
    sweep = tmp_path / "counts"
    one = put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp", gpus_per_node=1), 12000, 60))
    four = put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero2", gpus_per_node=4), 9000, 40))
    eight = put(sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", nodes=2, gpus_per_node=4), 4000, 20))
    assert main(["collect", str(sweep), "--no-plots", "--no-history"]) == 0
    fastest, roomy, cheapest = capsys.readouterr().out.splitlines()[:3]
    assert fastest == (
        "Fastest: fsdp2_zero2 at batch 1, accum 1, ckpt none, gpus/node 4, nodes 1: 36,000 tokens/s for the job, "
        f"4 GPU(s) x 9,000 (cell {four})"
    )
    assert cheapest == (
        "Cheapest: ddp at batch 1, accum 1, ckpt none, gpus/node 1, nodes 1: 23.1 GPU-hours per billion tokens "
        f"(cell {one})"
    )
    assert roomy.startswith("Most memory headroom: fsdp2_zero3 at batch 1") and roomy.endswith(f"(cell {eight})")
    summary = (sweep / "report" / "summary.md").read_text()
    assert summary.split("\n## ")[1].startswith("Recommendation") and fastest in summary and cheapest in summary


def test_the_printed_cell_table_has_a_column_for_each_field_the_sweep_varies(tmp_path, capsys):
    sweep = tmp_path / "seq"
    for seq_len, tps in ((2048, 15000), (4096, 13000)):
        put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp", batch_size=2, seq_len=seq_len), tps, 30))
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    printed = rows(capsys.readouterr().out)
    assert printed[0][:3] == ["strategy", "seq", "status"]  # batch_size is the same in both cells: no column
    assert [row[1] for row in printed[1:]] == ["2048", "4096"]  # fastest first


def test_collect_prints_the_best_30_of_40_cells_and_says_where_the_rest_are(tmp_path, capsys):
    sweep = tmp_path / "forty"
    for batch in range(1, 36):
        put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp", batch_size=batch), 10000 + batch, 30))
    for batch in range(36, 41):
        spec = spec_of(GPU_BASE, strategy="ddp", batch_size=batch)
        put(sweep, failed_record(spec, "oom", "train", "OutOfMemoryError"))
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    lines = capsys.readouterr().out.splitlines()
    printed = rows("\n".join(lines))
    assert len(printed) == 1 + 30 and printed[1][1] == "35" and printed[-1][1] == "6"  # best tokens/s first
    assert f"10 more row(s) not shown (of 40); the full table: {sweep / 'report' / 'results.csv'}" in lines
    assert len(pd.read_csv(sweep / "report" / "results.csv")) == 40


def long_named_sweep(root: Path) -> Path:
    """CPU cells whose strategies differ in four knobs: long legend labels."""
    sweep = root / "long"
    knobs = {"optimizer_order": "before_shard_fixed", "reduce_dtype": "bf16", "prefetch_depth": 2}
    for strategy, extra, tps in (("ddp", {}, 2800.0), ("fsdp2_zero3", {}, 1200.0), ("fsdp2_zero3", knobs, 1100.0)):
        for batch in (1, 2):
            spec = spec_of(CPU_BASE, strategy=strategy, batch_size=batch, **extra)
            put(sweep, ok_record(spec, tps * batch, 0.38, device="cpu"))
    return sweep


def test_no_figure_cuts_its_title_or_legend_at_the_canvas_edge_when_the_strategy_names_are_long(tmp_path):
    data = plot_data(long_named_sweep(tmp_path))
    assert max(map(len, data.configs["variant"])) > 60
    for name, _, draw in plots.PLOTS:
        try:
            figure = draw(data)
        except (plots.NoData, plots.NotApplicable):  # nothing drawn: nothing to cut (scaling at one GPU count)
            continue
        canvas = FigureCanvasAgg(figure)
        canvas.draw()  # the layout and the text as the PNG gets them
        renderer = canvas.get_renderer()
        drawn = figure.get_tightbbox(renderer)  # inches: everything drawn, wherever it lands
        width, height = figure.get_size_inches()
        assert drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= width and drawn.y1 <= height, (name, drawn.bounds)


def test_memory_by_stage_is_in_the_order_a_cell_takes_its_readings(tmp_path):
    """The record file sorts its keys (after_model, after_optimizer, after_shard, ...); the table's
    columns and the figure's bars are in run order: the model, sharding, the optimizer, ..."""
    for batch in (1, 2):
        record = ok_record(spec_of(CPU_BASE, batch_size=batch), 1000.0, 0.38, device="cpu")
        stages = ("after_model", "after_shard", "after_optimizer", "after_warmup", "end")
        record["memory"] = {stage: {"cpu_max_rss_gib": 0.3 + i / 10} for i, stage in enumerate(stages)}
        put(tmp_path / "order", record)
    frame = load_records(tmp_path / "order").frame
    assert [c.split(".")[1] for c in frame.columns if c.startswith("memory.")] == list(stages)
    figure = plots.memory_stages(plot_data(tmp_path / "order"))
    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == ["after model", "after shard", "after optimizer", "after warmup", "end"]


def test_a_cpu_sweep_speaks_of_processes_in_every_table_and_figure(tmp_path):
    """One rule (contracts.gpus.rank_words) for every count, rate and cost of ranks: on the CPU a
    rank is a process, in the summary's sections, its tables, the figures and the printed table."""
    report = write_report(cpu_sweep(tmp_path))
    summary = (report.directory / "summary.md").read_text()
    for gpu_word in ("tokens/s/gpu", "per GPU", "GPU-hours", "GPU(s)"):
        assert gpu_word not in summary, gpu_word
    assert "## Pivot: tokens/s/process" in summary and "tokens/s per process" in summary
    assert "process-hours per billion tokens" in summary
    figure = plots.throughput(plot_data(tmp_path / "cpu"))
    assert "per process" in figure.get_suptitle() and "per process" in figure.get_supylabel()


def test_a_second_collect_of_unchanged_records_keeps_the_figures_and_a_changed_record_redraws_them(gpu, tmp_path):
    sweep = shutil.copytree(gpu, tmp_path / "copy")
    shutil.rmtree(sweep / "report", ignore_errors=True)  # drawn by gpu_report, when it ran first
    first = write_report(sweep)
    figures = {path: path.stat().st_mtime_ns for path in first.files if path.suffix == ".png"}
    assert {path.stem for path in figures} == {name for name, _, _ in plots.PLOTS} - {"scaling"}  # one GPU count
    again = write_report(sweep)
    assert again.skipped_plots == first.skipped_plots
    assert {path: path.stat().st_mtime_ns for path in figures} == figures  # not drawn again
    records = sorted(sweep.glob("cells/*/result.json"))
    record_path = next(path for path in records if record_state(path).status == "ok")
    record = read_record(record_path)
    write_record(record_path, {**record, "tokens_per_s_per_gpu": record["tokens_per_s_per_gpu"] * 3})
    write_report(sweep)
    assert all(path.stat().st_mtime_ns != drawn for path, drawn in figures.items() if path.stem == "throughput")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: the figures draw in collect's own process")
def test_collect_checks_the_history_while_a_worker_draws_the_figures(gpu, tmp_path, monkeypatch):
    """The figure workers (one per core) are forked before the history is checked, so that they draw
    on the core the check leaves idle: when the check starts, they are there; and every figure is
    drawn, by them or by collect's process once its tables and text are written."""
    import multiprocessing

    from hpcfsdp.results import regressions

    sweep = shutil.copytree(gpu, tmp_path / "results" / "copy")
    shutil.rmtree(sweep / "report", ignore_errors=True)  # drawn by gpu_report, when it ran first
    workers: list[int] = []
    check = regressions.over_time

    def over_time(*args, **kwargs):
        workers.extend(child.pid for child in multiprocessing.active_children())
        return check(*args, **kwargs)

    monkeypatch.setattr(regressions, "over_time", over_time)
    assert main(["collect", str(sweep)]) == 0
    assert len(workers) == min(len(plots.PLOTS), os.cpu_count() or 1) and os.getpid() not in workers
    assert "## Over time" in (sweep / "report" / "summary.md").read_text()
    drawn = {path.stem for path in (sweep / "report" / "plots").glob("*.png")}
    assert drawn == {name for name, _, _ in plots.PLOTS} - {"scaling"}  # one GPU count


def test_results_csv_writes_list_fields_as_json_dumps_spells_them_for_every_kind_of_number(tmp_path):
    """The list fields' JSON text comes from pydantic-core's writer where it is numbers alone: it
    must still be json.dumps' bytes, for the numbers that writer spells otherwise (1e-05 to 1e-04,
    exponents) and for lists of anything else (text, null, NaN, true, objects)."""
    import csv
    import random

    from hpcfsdp.results.render import write_tables

    rng = random.Random(45)
    tricky = [1.5e-05, 1e-05, 9.99e-05, 0.0001, 1e-07, 5e-324, 1e16, 1.5e16, 1e15, -0.0, 0.1, 2**70, -(2**63) - 1]
    spread = [rng.random() * 10.0**exponent for exponent in range(-30, 30) for _ in range(40)]
    values = [
        tricky,
        [[1, [2.5, []]], []],
        [],
        ["gpu001", "a, b: c", "é"],
        [None, True, False],
        [float("nan"), float("inf")],
        {"p10": 1e-05, "p90": 2.0},
        *[spread[i : i + 20] for i in range(0, len(spread), 20)],
    ]
    frame = pd.DataFrame({"cell_id": [f"c{i}" for i in range(len(values))], "losses": values})
    write_tables(frame, tmp_path)
    with open(tmp_path / "results.csv", newline="") as file:
        written = [row["losses"] for row in csv.DictReader(file)]
    assert written == [json.dumps(value) for value in values]


def test_the_tables_a_forked_worker_writes_are_those_this_process_writes_and_its_errors_are_raised_here(tmp_path):
    """collect writes results.csv and results.parquet in a forked process at 2,000 records or more
    (render.tables_writing): the same bytes as write_tables in this process; where the worker
    fails (a file where the report folder belongs), the error is this process's own, as write_tables raises it."""
    from hpcfsdp.results.render import tables_writing, write_tables

    frame = pd.DataFrame(
        {
            "cell_id": [f"c{i}" for i in range(2_000)],
            "tokens_per_s_per_gpu": [float(i) for i in range(2_000)],
            "error": ["=HYPERLINK(x)" if i % 7 == 0 else None for i in range(2_000)],
            "losses": [[1.0, 0.5 * i] for i in range(2_000)],
        }
    )
    here, forked = tmp_path / "here", tmp_path / "forked"
    here.mkdir()
    forked.mkdir()
    expected = write_tables(frame, here)
    with tables_writing(frame, forked) as tables:
        files, notes = tables()
    assert ([path.name for path in files], notes) == ([path.name for path in expected[0]], expected[1])
    for name in ("results.csv", "results.parquet"):
        assert (forked / name).read_bytes() == (here / name).read_bytes()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match="a_file"), tables_writing(frame, tmp_path / "a_file") as tables:
        tables()
