"""batch_size: auto: the search's rule, and a real search under torchrun (gloo, CPU) against a
memory budget the CPU path enforces: HPCFSDP_FAULT=train_step:oom>N raises torch.OutOfMemoryError
in every probe (and cell) above a per-device batch of N."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import run_torchrun_cell, torchrun_cell
from hpcfsdp.cell.batch_search import Probe, largest_batch_for, next_batch
from hpcfsdp.cli import main
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.results.read import label_cells, load_records
from hpcfsdp.results.report import write_report
from hpcfsdp.results.tables import frontier_table


def search(
    fits,
    first: int = 1,
    cap: int = 256,
    limit_gib: float | None = None,
    gib_per_sample: float = 0.0,
    predicted: bool = False,
) -> list[int]:
    """The batches next_batch tries when a batch fits iff fits(batch); peaks grow by gib_per_sample."""
    probes: list[Probe] = []
    while (batch := next_batch(probes, first, cap, limit_gib, predicted)) is not None:
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


def test_from_a_predicted_batch_the_search_brackets_it_in_two_probes_when_right_and_three_when_one_off():
    assert search(lambda b: b <= 21, first=21, predicted=True) == [21, 22]
    assert search(lambda b: b <= 22, first=21, predicted=True) == [21, 22, 24, 23]
    assert search(lambda b: b <= 20, first=21, predicted=True) == [21, 20]
    assert search(lambda b: b <= 19, first=21, predicted=True) == [21, 20, 18, 19]
    assert search(lambda b: b <= 3, first=21, predicted=True) == [21, 20, 18, 14, 6, 1, 3, 4]  # far off: halving
    assert search(lambda b: True, first=21, cap=22, predicted=True) == [21, 22]  # the cap ends it
    assert search(lambda b: False, first=2, predicted=True) == [2, 1]


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
    """Rank 1 alone runs out of memory above batch 5, after its first step: rank 0 goes on into the
    next step's collective, where rank 1 never comes (under NCCL it would wait there for ever). Each
    probe's own processes end with it; the cell's go on to the next probe and measure batch 5."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>5:1")
    record, proc = torchrun_cell(
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
    cell = tmp_path / "results" / "t" / "cells" / record["cell_id"]
    assert json.loads((cell / "batch_search" / "3-rank1.json").read_text())["status"] == "oom"  # batch 8
    assert proc.returncode == 0
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


def test_a_submitted_auto_cell_probes_the_predicted_batch_first_and_finds_its_batch_in_two_probes(
    tmp_path, monkeypatch
):
    """submit writes the memory prediction into the cell's spec.json; the cell starts its search at
    the batch predicted to fit the sweep's GPU memory (tiny, 2.0025 GiB less the 2 GiB reserve:
    batch 3), and, with batch 4 out of memory, stops after two probes where
    the search from 1 took four (1, 2, 4, 3)."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>3")
    jobs = tmp_path / "auto.yaml"
    jobs.write_text(
        "name: auto\nbase: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1,"
        " gpus_per_node: 2, strategy: fsdp2_zero3, batch_size: auto, max_batch_size: 8, comm_profile_steps: 0}\n"
        "slurm: {gpu_memory_gib: 2.0025}\n"
    )
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("auto/cells/*/result.json")
    search = json.loads(path.read_text())["batch_search"]
    assert search["predicted_batch"] == 3 == search["first_batch"]
    assert [(p["batch_size"], p["status"]) for p in search["probes"]] == [(3, "ok"), (4, "oom")]
    assert search["chosen_batch_size"] == 3


def test_when_not_even_the_first_batch_fits_the_cell_records_oom_with_its_probes(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:oom>0")
    record = run_torchrun_cell(tmp_path, 1, strategy="fsdp2_zero3", batch_size="auto", comm_profile_steps=0)
    assert record["status"] == "oom" and record["stage"] == "batch_search"
    assert "no batch fits" in record["error"]
    assert [(p["batch_size"], p["status"]) for p in record["batch_search"]["probes"]] == [(1, "oom")]
    assert record["spec"]["auto_batch"] and record["spec"]["batch_size"] == 1  # the planned spec: nothing was chosen


def test_a_cuda_error_that_says_out_of_memory_on_one_rank_is_a_probe_that_did_not_fit(tmp_path, monkeypatch):
    """A CUDA error (torch.AcceleratorError, not the allocator's OutOfMemoryError) on one rank: the
    probe did not fit; a probe that fails otherwise ends the cell with an error that names it."""
    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:cuda_oom>1:1")
    record = run_torchrun_cell(tmp_path, 2, strategy="ddp", batch_size="auto", max_batch_size=4, comm_profile_steps=0)
    assert record["status"] == "ok", record.get("error")
    assert [(p["batch_size"], p["status"]) for p in record["batch_search"]["probes"]] == [(1, "ok"), (2, "oom")]
    assert "AcceleratorError: CUDA error: out of memory" in record["batch_search"]["probes"][1]["error"]

    monkeypatch.setenv("HPCFSDP_FAULT", "train_step:error>1:1")
    failed = run_torchrun_cell(tmp_path / "error", 2, strategy="ddp", batch_size="auto", comm_profile_steps=0)
    assert (failed["status"], failed["stage"]) == ("error", "batch_search")
    assert "the probe at batch 2 failed: RuntimeError: injected fault at train_step" in failed["error"]
    assert [(p["batch_size"], p["status"]) for p in failed["batch_search"]["probes"]] == [(1, "ok")]


def test_a_probe_ended_for_its_peers_failure_after_writing_that_it_ran_out_of_memory_still_says_so(tmp_path):
    """The probe that ran out of memory writes its result, then leaves; its peer's probe sees the
    connection close, fails, and may be the first failure the ranks hear of. Ended between its write
    and its end, the probe's own outcome (oom) is read, not lost to the peer's "Connection closed by
    peer" error (which ended the cell as an error under load, in a bare-machine run of 2026-11-27)."""
    import subprocess
    import sys
    import textwrap

    from hpcfsdp.cell.batch_search import _result_if_written

    def probe(path, writes: bool) -> subprocess.Popen:
        write = f"write_json({str(path)!r}, {{'status': 'oom', 'peak_memory_gib': 1.5, 'peak_reserved_gib': None, "
        write += "'step_s': 0.0, 'error': 'OutOfMemoryError: injected', 'failed_at': 1.0})"
        code = textwrap.dedent(f"""
            import sys, time
            from hpcfsdp.contracts.files import write_json
            {write if writes else ""}
            print('ready', flush=True)
            time.sleep(60)
        """)
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True
        )
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        return child

    wrote = probe(tmp_path / "0-rank1.json", writes=True)
    result = _result_if_written(wrote, tmp_path / "0-rank1.json")
    assert wrote.returncode is not None and result is not None
    assert result["status"] == "oom" and result["error"] == "OutOfMemoryError: injected"

    silent = probe(tmp_path / "0-rank0.json", writes=False)
    assert _result_if_written(silent, tmp_path / "0-rank0.json") is None and silent.returncode is not None


def test_a_lone_rank_forked_by_its_supervisor_forks_its_probes_though_torch_runs_two_threads_there(
    tmp_path, monkeypatch
):
    """A rank forked by its supervisor sets torch's threads (OMP_NUM_THREADS, here the user's 2)
    only after it forked its probe starter: torch starts them at once, and a process with threads
    is refused the fork. Before: the lone rank's probes were exec'd ("2 threads in the rank's process")."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("HPCFSDP_RANK_START", raising=False)
    jobs = tmp_path / "lone.yaml"
    jobs.write_text(
        "name: lone\nbase: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, gpus_per_node: 1,\n"
        "       strategy: ddp, batch_size: auto, max_batch_size: 2, comm_profile_steps: 0}\n"
    )
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 0
    (cell,) = (tmp_path / "lone" / "cells").iterdir()
    record = json.loads((cell / "result.json").read_text())
    assert record["status"] == "ok" and record["environment"]["OMP_NUM_THREADS"] == "2", record.get("error")
    log = (cell / "log.txt").read_text()
    assert "rank(s) forked after" in log and "probe processes forked by the probe starter" in log, log[-3000:]


@pytest.mark.parametrize(("start", "max_batch"), [("fork", 2), ("exec", 1)])
def test_probes_are_forked_by_the_ranks_probe_starter_or_started_by_exec_when_asked(
    tmp_path, monkeypatch, start, max_batch
):
    """The rank forks its probe starter before its process group forms; the starter forks each
    probe (no imports paid), and ends with the rank. HPCFSDP_RANK_START=exec starts each probe as a
    new interpreter of the rank's, as before, and the log says why."""
    monkeypatch.setenv("HPCFSDP_RANK_START", start)
    record, proc = torchrun_cell(
        tmp_path, 1, strategy="ddp", batch_size="auto", max_batch_size=max_batch, comm_profile_steps=0
    )
    assert record["status"] == "ok", record.get("error")
    assert [p["status"] for p in record["batch_search"]["probes"]] == ["ok"] * max_batch
    cell = tmp_path / "results" / "t" / "cells" / record["cell_id"]
    parents = {json.loads(path.read_text())["parent_pid"] for path in (cell / "batch_search").glob("*-rank0.json")}
    if start == "fork":
        said = re.search(
            r"probe processes forked by the probe starter \(pid (\d+)\) of this rank \(pid (\d+)\)", proc.stdout
        )
        assert said, proc.stdout[-3000:]
        starter, rank = int(said[1]), int(said[2])
        assert parents == {starter} != {rank}  # both probes, from the one starter
        assert not Path(f"/proc/{starter}").exists()  # the rank ended it with the search, and reaped it
    else:
        said = re.search(
            r"probe processes started by exec from this rank \(pid (\d+)\): HPCFSDP_RANK_START=exec", proc.stdout
        )
        assert said, proc.stdout[-3000:]
        assert parents == {int(said[1])}
