"""Figures a user can trust: a cell whose measurement cannot be trusted (contracts/validity.py) ranks
nowhere and is named first among the problems; every tokens/s carries its spread, and the top cells
within each other's spread are said to be within noise (issue 43, items 1 and 4).

Real runs (torchrun with gloo on the CPU, the tiny model) for the record's figures, seed 003's
broken optimizer and tune's repeat; records written by hand for the ranking rules.
"""

from __future__ import annotations

import json
import re
import statistics
import textwrap
from pathlib import Path

import pytest

from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.contracts.validity import invalid_reasons
from hpcfsdp.results.plots import PlotData, loss_curves, memory, memory_stages, throughput
from hpcfsdp.results.read import drawn_configs, label_cells, load_records, ok_configs
from hpcfsdp.results.regressions import compare_sweeps
from hpcfsdp.results.report import recommendation, write_report
from hpcfsdp.results.tables import reference_cells
from hpcfsdp.sweep.define.matrix import load_sweep
from test_collect import GPU_BASE, ok_record, put, spec_of
from test_history import collect, flagged, ids, write_sweep

BROKEN = "the optimizer was built before sharding and does not update the model"
CPU = "model: tiny, device: cpu, precision: fp32, seq_len: 32, comm_profile_steps: 0"


def optimizer_order_jobs(tmp_path: Path, name: str, base: str, seeds: list[int] | None = None) -> Path:
    """The jobs YAML `name` of CPU fsdp2_zero3 cells with the optimizer built after sharding (right)
    and before it (seed 003's bug), each seed of `seeds` where given; `base`: the rest of its base."""
    seed_line = f"\n          seed: {seeds}" if seeds else ""
    path = tmp_path / f"{name}.yaml"
    text = f"""
        name: {name}
        base: {{{CPU}, strategy: fsdp2_zero3, {base}}}
        slurm: {{time_min: 5}}
        matrix:
          optimizer_order: [after_shard, before_shard]{seed_line}
        """
    path.write_text(textwrap.dedent(text))
    return path


def sections(summary: str) -> list[str]:
    return re.findall(r"^## (.+)$", summary, flags=re.M)


def section(summary: str, title: str) -> str:
    """The text of one `## title` section of summary.md, up to the next `## `."""
    start = summary.index(f"## {title}\n")
    end = summary.find("\n## ", start + 1)
    return summary[start : end if end != -1 else None]


# ---------------------------------------------------------------------------------------------
# Seed 003, end to end: `submit --executor local` and `collect` of real cells


@pytest.fixture(scope="module")
def seed_003(tmp_path_factory) -> Path:
    """The optimizer built after sharding (right) and before it (seed 003's bug), each a real cell
    of 2 processes, run by the local executor and collected."""
    root = tmp_path_factory.mktemp("seed003")
    jobs = optimizer_order_jobs(root, "optimizer_order", "gpus_per_node: 2, batch_size: 2, steps: 8, warmup_steps: 2")
    results = root / "results"
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(results)]) == 0
    assert main(["collect", str(results / "optimizer_order"), "--no-plots", "--no-history"]) == 0
    return results / "optimizer_order"


def records_by_order(sweep: Path) -> dict[str, dict]:
    records = [json.loads(path.read_text()) for path in sweep.glob("cells/*/result.json")]
    return {record["spec"]["optimizer_order"]: record for record in records}


def test_the_seed_003_sweep_ends_with_a_report_that_names_the_broken_setup_first(seed_003, capsys):
    broken = records_by_order(seed_003)["before_shard"]
    right = records_by_order(seed_003)["after_shard"]
    assert broken["status"] == right["status"] == "ok" and broken["optimizer_tracks_model"] is False
    summary = (seed_003 / "report" / "summary.md").read_text()
    # The first section after the recommendation names the broken cell, why, and the loss that shows it.
    assert sections(summary)[:2] == ["Recommendation", "Cells whose figures cannot be trusted"]
    untrusted = section(summary, "Cells whose figures cannot be trusted")
    # The evidence is the cell's own count of the parameters its steps moved, not a loss that reads as training.
    assert broken["parameters_changed"] == 0 and broken["parameters_total"] == right["parameters_total"] > 0
    assert right["parameters_changed"] == right["parameters_total"]
    evidence = f"0 of {broken['parameters_total']} parameters changed over 8 steps"
    assert broken["cell_id"] in untrusted and right["cell_id"] not in untrusted
    assert f"{BROKEN}: {evidence}" in untrusted and "loss" not in untrusted
    # It wins nothing: the recommendation, the best configuration, the OOM frontier and the pivots
    # speak of the right cell only.
    recommended = section(summary, "Recommendation")
    assert broken["cell_id"] not in recommended and f"(cell {right['cell_id']})" in recommended
    assert "Left out: 1 cell(s) that ran ok but whose figures cannot be trusted" in recommended
    assert broken["cell_id"] not in section(summary, "Best configuration")
    assert "INVALID" in section(summary, "Pivot: tokens/s/process")  # CPU cells: processes
    cells = label_cells(load_records(seed_003))
    assert list(cells.invalid["cell_id"]) == [broken["cell_id"]]
    # What collect prints begins with it too.
    capsys.readouterr()
    assert main(["collect", str(seed_003), "--no-plots", "--no-history"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"not ranked (its figures cannot be trusted): {broken['cell_id']}: {BROKEN}: {evidence}"
    assert list(ok_configs(cells)["cell_id"]) == [right["cell_id"]]


def test_a_cells_tokens_per_s_is_its_windows_mean_with_the_p10_and_p90_of_its_steps(seed_003):
    for record in records_by_order(seed_003).values():
        per_rank_step = record["tokens_per_step"] / record["world_size"]
        # One statistic: the timed window's mean step, whatever the median step (step_time_s) says.
        assert record["tokens_per_s_per_gpu"] == pytest.approx(per_rank_step / record["window_step_time_s"])
        assert record["step_time_s"] == pytest.approx(statistics.median(record["step_times_s"]))
        rates = sorted(per_rank_step / t for t in record["step_times_s"])  # each step on its slowest rank
        assert len(rates) == record["timed_steps"] == 6
        spread = record["tokens_per_s_spread"]
        assert spread == {"p10": pytest.approx(rates[round(0.1 * 5)]), "p90": pytest.approx(rates[round(0.9 * 5)])}
        assert spread["p10"] <= spread["p90"]
    # The report shows the spread beside tokens/s: in the cell table and the best configuration.
    summary = (seed_003 / "report" / "summary.md").read_text()
    right = records_by_order(seed_003)["after_shard"]["tokens_per_s_spread"]
    shown = f"{right['p10']:,.0f}-{right['p90']:,.0f}"
    assert "p10-p90" in section(summary, "All cells") and shown in section(summary, "All cells")
    assert shown in section(summary, "Best configuration")


# ---------------------------------------------------------------------------------------------
# The ranking rules, on records written by hand


def spread(p10: float, p90: float) -> dict:
    return {"tokens_per_s_spread": {"p10": p10, "p90": p90}}


def test_invalid_reasons_name_each_thing_a_record_tells_that_makes_its_figures_untrustworthy():
    base = ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1), 9000, 20)
    assert invalid_reasons(base) == []
    runaway = {**base, "losses": [10.0, 12.0, 16.0], "final_loss": 16.0}
    assert invalid_reasons(runaway) == [
        "the loss diverged: it grew instead of falling (loss 10 at step 1, 16 at step 3)"
    ]
    shared = {**base, "resource_problems": ["ranks 0 and 1 share GPU GPU-1234 (bus 0000:1A:00.0)"]}
    assert invalid_reasons(shared) == ["resources not as asked: ranks 0 and 1 share GPU GPU-1234 (bus 0000:1A:00.0)"]
    float8 = ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1, float8="tensorwise"), 9000, 20)
    assert invalid_reasons({**float8, "float8_linears": 0}) == [
        "float8: tensorwise was asked, but no Linear layer ran in float8: it measured the model unconverted"
    ]
    assert invalid_reasons({**float8, "float8_linears": 4}) == []
    # A failed record's lost loss is told by its status, not here.
    assert invalid_reasons({**runaway, "status": "diverged"}) == []


def hand_sweep(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """fsdp2_zero3 b1 the fastest trusted cell, fsdp2_zero2 b1 within its noise, ddp b1 clear of
    it, and fsdp2_zero3 b2 the fastest of all but built with seed 003's optimizer order."""
    sweep = tmp_path / "hand"
    flat = [11.0] * 6
    cells = {
        "top": put(
            sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1), 9000, 20, **spread(8800, 9100))
        ),
        "close": put(
            sweep, ok_record(spec_of(GPU_BASE, strategy="fsdp2_zero2", batch_size=1), 8900, 25, **spread(8700, 9050))
        ),
        "clear": put(sweep, ok_record(spec_of(GPU_BASE, strategy="ddp", batch_size=1), 5000, 40, **spread(4900, 5100))),
        "broken": put(
            sweep,
            ok_record(
                spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=2, optimizer_order="before_shard"),
                20000,
                10,
                optimizer_tracks_model=False,
                parameters_changed=0,
                parameters_total=218,
                losses=flat,
                final_loss=11.0,
                **spread(19000, 21000),
            ),
        ),
    }
    return sweep, cells


def test_a_cell_whose_optimizer_does_not_update_the_model_wins_nothing_and_is_named_first(tmp_path):
    sweep, cells = hand_sweep(tmp_path)
    report = write_report(sweep, plots=False)
    lines = report.recommendation
    assert [line.split(":")[0] for line in lines] == ["Fastest", "Most memory headroom", "Cheapest"]
    assert all(cells["broken"] not in line for line in lines)  # the fastest, the lowest peak, the cheapest
    assert f"(cell {cells['top']})" in lines[0]
    summary = (report.directory / "summary.md").read_text()
    assert sections(summary)[:3] == ["Recommendation", "Cells whose figures cannot be trusted", "Best configuration"]
    untrusted = section(summary, "Cells whose figures cannot be trusted")
    assert re.search(rf"\| {cells['broken']} +\| fsdp2_zero3 \(optimizer_order=before_shard\) +\| 2 ", untrusted)
    assert f"{BROKEN}: 0 of 218 parameters changed over 6 steps" in untrusted
    for title in ("Best configuration", "Speed-up and memory saving vs baseline"):
        assert "before_shard" not in section(summary, title)
    # Its batch 2 is no batch that fits: the frontier's largest ok batch stays 1 for fsdp2_zero3.
    frontier = section(summary, "OOM frontier")
    assert re.search(r"\| fsdp2_zero3 \(optimizer_order=after_shard\) +\| none \| 1 +\|", frontier)
    assert re.search(r"\| fsdp2_zero3 \(optimizer_order=before_shard\) \| none \| none +\|", frontier)
    assert "INVALID" in section(summary, "Pivot: tokens/s/gpu")
    # The cell table keeps it, after the trusted cells, as `invalid`.
    statuses = list(report.table["status"])
    assert statuses == ["ok", "ok", "ok", "invalid"] and list(report.table["cell"])[-1] == cells["broken"]


def test_every_cell_is_drawn_and_one_whose_model_did_not_train_is_dashed_and_labelled_not_updating(tmp_path):
    sweep = tmp_path / "orders"
    spec = spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1)
    right = put(sweep, ok_record(spec, 9000, 20, parameters_changed=218, parameters_total=218))
    broken_spec = spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1, optimizer_order="before_shard")
    flat = [11.0] * broken_spec.steps
    record = ok_record(broken_spec, 9500, 30, optimizer_tracks_model=False, losses=flat, final_loss=11.0)
    broken = put(sweep, {**record, "parameters_changed": 0, "parameters_total": 218})
    cells = label_cells(load_records(sweep))
    data = PlotData.of(drawn_configs(cells), *reference_cells(cells))
    label = "fsdp2_zero3 (optimizer_order=before_shard): not updating"
    for figure in (loss_curves(data), throughput(data), memory(data)):
        styles = {line.get_label(): line.get_linestyle() for ax in figure.axes for line in ax.get_lines()}
        assert styles[label] == "--" and styles["fsdp2_zero3 (optimizer_order=after_shard)"] != "--"
    bars = {bar.get_label(): bar for bar in memory_stages(data).axes[0].containers}
    assert (
        bars[label].patches[0].get_hatch() == "//"
        and not bars["fsdp2_zero3 (optimizer_order=after_shard)"].patches[0].get_hatch()
    )
    # Drawn, and still ranked nowhere.
    report = write_report(sweep, plots=True)
    assert (report.directory / "plots" / "loss.png").is_file()
    assert all(broken not in line for line in report.recommendation) and right in report.recommendation[0]


def test_the_recommendation_names_the_cells_within_noise_of_the_fastest(tmp_path):
    sweep, cells = hand_sweep(tmp_path)
    frame = label_cells(load_records(sweep))
    fastest = recommendation(ok_configs(frame), frame)[0]
    assert "p10-p90 8,800-9,100 per rank" in fastest
    noise = fastest.partition("; within noise of it")[2]
    assert cells["close"] in noise and "fsdp2_zero2 at batch 1" in noise
    assert cells["clear"] not in noise and cells["broken"] not in noise
    # Without a spread (a GPU cell without per-step sync) nothing is said to be within noise.
    for path in sweep.glob("cells/*/result.json"):
        record = json.loads(path.read_text())
        write_record(path, {**record, "tokens_per_s_spread": None})
    frame = label_cells(load_records(sweep))
    assert "within noise" not in recommendation(ok_configs(frame), frame)[0]


def test_the_regression_gate_neither_checks_an_untrusted_cell_nor_checks_against_one(tmp_path, capsys):
    results = tmp_path / "results"
    for index in range(3):
        assert collect(write_sweep(results, f"nightly-{index}", index, {"a": 1000, "b": 2000})) == 0
    shared = ["ranks 0 and 1 share GPU GPU-1234 (bus 0000:1A:00.0)"]
    # Night 3: a at half its speed on a shared GPU, and e (new) at 5000 on a shared GPU.
    night = write_sweep(results, "nightly-3", 3, {"a": 500, "e": 5000})
    for path in night.glob("cells/*/result.json"):
        write_record(path, {**json.loads(path.read_text()), "resource_problems": shared})
    capsys.readouterr()
    assert collect(night, "--fail-on-regression") == 0
    out = capsys.readouterr().out
    assert not flagged(out) and "Not checked: 2 cell(s) whose figures cannot be trusted" in out
    # Night 4: e at 2000 on GPUs as asked: night 3's 5000 is no history to fall short of.
    assert collect(write_sweep(results, "nightly-4", 4, {"e": 2000, "a": 1000}), "--fail-on-regression") == 0
    out = capsys.readouterr().out
    assert not flagged(out) and "1 cell(s) checked, 0 with a regression; 1 with neither" in out
    # The gate still works: a at 850 on night 5 falls 15% below its trusted median.
    assert collect(write_sweep(results, "nightly-5", 5, {"a": 850}), "--fail-on-regression") == 1
    assert set(flagged(capsys.readouterr().out)) == ids("a")


# ---------------------------------------------------------------------------------------------
# tune: an untrusted probe is never promoted; the final stage's cells within noise run again


def test_tune_never_promotes_a_broken_setup_and_repeats_its_final_cells_within_noise(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs = optimizer_order_jobs(tmp_path, "tn", "gpus_per_node: 1, batch_size: 1, steps: 40, warmup_steps: 1", [0, 1])
    argv = ["tune", str(jobs), "--executor", "local", "--results-dir", str(tmp_path), "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    grid = {(c.spec.optimizer_order, c.spec.seed): c.id for c in load_sweep(jobs).cells}
    sweep_dir = tmp_path / "tn"
    state = json.loads((sweep_dir / "tune" / "state.json").read_text())
    final = {stage["name"]: set(stage["runs"].values()) for stage in state["stages"]}
    right = {grid["after_shard", 0], grid["after_shard", 1]}
    # Only the two seeds of the right order reach the final stage, though --top 3 leaves room (40 steps a
    # cell: probing saves, so tune probes rather than run the grid's cells: gridcost.probing_cannot_save).
    assert final["final"] == right
    found = json.loads((sweep_dir / "tune.json").read_text())
    assert {row["cell_id"] for row in found["invalid"]} == {grid["before_shard", 0], grid["before_shard", 1]}
    assert all(BROKEN in row["invalid_reasons"][0] for row in found["invalid"])
    best = found["best"]
    assert best["cell_id"] in right and f"not ranked (figures cannot be trusted): {grid['before_shard', 0]}" in out
    # Two seeds of one setup run the same work: within noise, so both ran once more and the pick
    # is the better mean of two runs, and says it.
    final_records = {c: json.loads((sweep_dir / "cells" / c / "result.json").read_text()) for c in right}
    low, high = ([r["tokens_per_s_spread"][p] for r in final_records.values()] for p in ("p10", "p90"))
    if high[0] < low[1] or high[1] < low[0]:  # this run told the two seeds apart: no repeat
        assert "repeat" not in final and "(mean of 2 runs: " not in out
        return
    assert final["repeat"] == right
    for cell in right:
        again = json.loads((sweep_dir / "tune" / "repeat" / "cells" / cell / "result.json").read_text())
        assert again["status"] == "ok" and again["spec"] == final_records[cell]["spec"]
    runs = best["runs_tokens_per_s_per_gpu"]
    assert runs[0] == pytest.approx(final_records[best["cell_id"]]["tokens_per_s_per_gpu"])
    assert best["tokens_per_s_per_gpu"] == pytest.approx(sum(runs) / 2)
    assert f"chosen: {best['cell_id']}" in out and "(mean of 2 runs: " in out


def test_compare_calls_a_cell_that_became_untrusted_a_lost_ok_and_compares_no_figure_of_it(tmp_path):
    spec = spec_of(GPU_BASE, strategy="fsdp2_zero3", batch_size=1)
    before, after = tmp_path / "before", tmp_path / "after"
    put(before, ok_record(spec, 9000, 20))
    cell = put(after, ok_record(spec, 4000, 30, resource_problems=["2 GPUs per node asked, 1 visible on n1"]))
    comparison = compare_sweeps(after, before)
    assert comparison.regressions == [f"{cell}: status ok -> invalid"]
    assert list(comparison.table["tokens/s/gpu"]) == ["9,000 -> -"]
    # The other way round (an untrusted reference) nothing is flagged: it was no figure to keep.
    assert compare_sweeps(before, after).regressions == []
