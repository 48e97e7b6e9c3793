"""batch_size: auto: the search's rule, and a real search under torchrun (gloo, CPU) against a
memory budget the CPU path enforces: HPCFSDP_FAULT=train_step:oom>N raises torch.OutOfMemoryError
in every probe (and cell) above a per-device batch of N."""

from __future__ import annotations

import pytest

from conftest import run_torchrun_cell
from hpcfsdp.cell.batch_search import Probe, largest_batch_for, next_batch
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.results.read import label_cells, load_records
from hpcfsdp.results.report import write_report
from hpcfsdp.results.tables import frontier_table


def search(
    fits, first: int = 1, cap: int = 256, limit_gib: float | None = None, gib_per_sample: float = 0.0
) -> list[int]:
    """The batches next_batch tries when a batch fits iff fits(batch); peaks grow by gib_per_sample."""
    probes: list[Probe] = []
    while (batch := next_batch(probes, first, cap, limit_gib)) is not None:
        ok = fits(batch)
        peak = 1.0 + gib_per_sample * batch
        probes.append(Probe(batch, "ok" if ok else "oom", peak, peak if gib_per_sample else None, None, 0.0))
    return [p.batch_size for p in probes]


def test_the_search_doubles_until_oom_then_halves_the_gap_to_the_largest_batch_that_fits():
    assert search(lambda b: b <= 5) == [1, 2, 4, 8, 6, 5]
    assert search(lambda b: b <= 17) == [1, 2, 4, 8, 16, 32, 24, 20, 18, 17]
    assert search(lambda b: b <= 12, first=3) == [3, 6, 12, 24, 18, 15, 13]
    assert search(lambda b: b <= 2, first=8) == [8, 4, 2, 3]  # the first batch too large: down from it
    assert search(lambda b: False) == [1]
    assert search(lambda b: True, cap=20) == [1, 2, 4, 8, 16, 20]  # the cap ends it


def test_with_a_memory_limit_the_gap_is_narrowed_where_the_peaks_line_meets_it():
    # 1 GiB fixed + 7 GiB per sample against a 130 GiB limit: batch 18 (127 GiB) fits, 19 does not.
    tried = search(lambda b: 1 + 7 * b <= 130, limit_gib=130.0, gib_per_sample=7.0)
    assert tried == [1, 2, 4, 8, 16, 32, 18, 19]  # halving would take 24, 20, 18, 19


def test_with_global_batch_size_the_measured_batch_divides_the_per_rank_share():
    spec = RunSpec.from_dict({"batch_size": "auto", "global_batch_size": 24, "gpus_per_node": 2, "device": "cpu"})
    assert spec.batch_cap == 12 and spec.grad_accum == 1
    assert [largest_batch_for(spec, b) for b in (12, 7, 5, 1)] == [12, 6, 4, 1]
    assert spec.with_batch_size(4).grad_accum == 3


def test_batch_size_auto_finds_the_budget_keeps_every_probe_and_measures_after_the_ooms(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>5")
    record = run_torchrun_cell(
        tmp_path, 2, strategy="fsdp2_zero3", batch_size="auto", global_batch_size=20, comm_profile_steps=0
    )
    assert record["status"] == "ok", record.get("error")
    search = record["batch_search"]
    assert [(p["batch_size"], p["status"]) for p in search["probes"]] == [
        (1, "ok"),
        (2, "ok"),
        (4, "ok"),
        (8, "oom"),
        (6, "oom"),
        (5, "ok"),
    ]
    assert all("injected out-of-memory" in p["error"] for p in search["probes"] if p["status"] == "oom")
    fitted = [p for p in search["probes"] if p["status"] == "ok"]
    assert all(p["tokens_per_s_per_gpu"] > 0 and p["peak_memory_gib"] > 0 for p in fitted)
    assert (search["largest_fitting_batch"], search["smallest_failing_batch"], search["chosen_batch_size"]) == (5, 6, 5)
    assert search["cap"] == 10 and not search["capped"] and search["capacity_gib"] is None  # no device memory on CPU
    # The cell then trained at the batch found, in the same processes after two OOMs: its record
    # is an ordinary measurement, with grad_accum derived from global_batch_size = 5 x 2 ranks x 2.
    spec = record["spec"]
    assert (spec["batch_size"], spec["grad_accum"], spec["auto_batch"]) == (5, 2, True)
    assert record["cell_id"].startswith("fsdp2_zero3-bauto-")
    assert len(record["losses"]) == 4 and all(0 < loss < 20 for loss in record["losses"])
    assert record["tokens_per_step"] == 5 * 32 * 2 * 2
    assert record["gpu_hours_per_billion_tokens"] == pytest.approx(1e9 / (3600 * record["tokens_per_s_per_gpu"]))
    assert record["energy_j"] is None and record["joules_per_token"] is None  # NVML has none on a CPU

    sweep = tmp_path / "results" / "t"
    frontier = frontier_table(label_cells(load_records(sweep))).iloc[0]
    assert (frontier["largest ok batch"], frontier["smallest OOM batch"]) == ("5", "6")
    assert frontier["batches run"] == "1, 2, 4, 5, 6, 8"
    report = write_report(sweep, plots=False)
    assert report.recommendation[0].startswith("Fastest: fsdp2_zero3 at batch 5 (auto), accum 2")


def test_when_not_even_the_first_batch_fits_the_cell_records_oom_with_its_probes(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>0")
    record = run_torchrun_cell(tmp_path, 1, strategy="fsdp2_zero3", batch_size="auto", comm_profile_steps=0)
    assert record["status"] == "oom" and record["stage"] == "batch_search"
    assert "no batch fits" in record["error"]
    assert [(p["batch_size"], p["status"]) for p in record["batch_search"]["probes"]] == [(1, "oom")]
    assert record["spec"]["auto_batch"] and record["spec"]["batch_size"] == 1  # the planned spec: nothing was chosen


LEAK_CHECK = """
import gc, os, sys, weakref
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  HPCFSDP_FAULT="train_step:oom>3")
from hpcfsdp.cell import build as building
from hpcfsdp.cell.stopping import faults
from hpcfsdp.cell.batch_search import BatchSearch, search_batch_size
from hpcfsdp.cell.ranks.distributed import init_distributed
from hpcfsdp.contracts.spec import RunSpec
env = init_distributed("cpu", 300)
for strategy in ("ddp", "fsdp2_zero3"):
    spec = RunSpec.from_dict({"batch_size": "auto", "device": "cpu", "precision": "fp32", "seq_len": 32,
                              "strategy": strategy, "activation_checkpointing": "full"})
    built = []
    def build(probe):
        model, optimizer, vocab = building.build_probe(probe, env)
        built.extend([weakref.ref(model), weakref.ref(optimizer)])
        return model, optimizer, vocab
    search = BatchSearch(1, spec.batch_cap, 0.0, 2)
    def fault(batch):
        faults.inject_fault("train_step", env, batch)

    chosen = search_batch_size(search, spec, env, None, build, fault, print)
    print(strategy, chosen.batch_size, len(built), sum(ref() is not None for ref in built))
"""


def test_no_probe_model_or_optimizer_outlives_its_probe(tmp_path):
    """Each probe's model and optimizer, those that ran out of memory included, are gone (not
    merely unreferenced: FSDP and DDP hold reference cycles) before the next probe builds."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", LEAK_CHECK, str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line.split() for line in proc.stdout.splitlines() if line.startswith(("ddp ", "fsdp2_zero3 "))]
    assert results == [["ddp", "3", "8", "0"], ["fsdp2_zero3", "3", "8", "0"]]  # 4 probes each; none alive
