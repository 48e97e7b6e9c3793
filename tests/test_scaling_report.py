"""The report's scaling table (the FSDP2 blog's 1 -> 2 -> 4 GPU table), from records of one workload
at several GPU counts."""

from __future__ import annotations

from hpcfsdp.results import plots
from hpcfsdp.results.read import label_cells, load_records, ok_configs
from hpcfsdp.results.report import write_report
from hpcfsdp.results.tables import reference_cells
from test_collect import GPU_BASE, ok_record, put, section, spec_of


def test_a_sweep_at_one_two_and_four_gpus_reports_each_strategys_efficiency_against_one_gpu(tmp_path):
    sweep = tmp_path / "scaling"
    base = {**GPU_BASE, "batch_size": 2}
    one = spec_of(base, strategy="ddp", gpus_per_node=1)
    put(sweep, ok_record(one, 20_000.0, 40.0))
    for strategy, two, four in (("ddp", 19_000.0, 18_000.0), ("fsdp2_zero3", 18_000.0, 15_000.0)):
        put(sweep, ok_record(spec_of(base, strategy=strategy, gpus_per_node=2), two, 30.0))
        put(sweep, ok_record(spec_of(base, strategy=strategy, nodes=2, gpus_per_node=2), four, 25.0))
    put(sweep, ok_record(spec_of(base, strategy="fsdp2_hsdp", nodes=2, gpus_per_node=2), 16_000.0, 27.0))
    # another workload (batch 4) with no one-GPU cell has no row: nothing to scale against
    put(sweep, ok_record(spec_of({**base, "batch_size": 4}, strategy="ddp", gpus_per_node=2), 21_000.0, 50.0))

    summary = (write_report(sweep, plots=False).directory / "summary.md").read_text()

    scaling = section(summary, "Scaling")
    rows = [line for line in scaling.splitlines() if line.startswith("| qwen2.5-1.5b")]
    cells = {(r.split("|")[2].strip(), r.split("|")[4].strip()): r.split("|")[6].strip() for r in rows}
    assert cells == {
        ("ddp", "1"): "1",
        ("ddp", "2"): "0.95",
        ("fsdp2_zero3", "2"): "0.9",
        ("ddp", "4"): "0.9",
        ("fsdp2_hsdp", "4"): "0.8",
        ("fsdp2_zero3", "4"): "0.75",
    }, scaling


def test_a_sweep_at_one_gpu_count_has_no_scaling_section(tmp_path):
    sweep = tmp_path / "flat"
    for strategy in ("ddp", "fsdp2_zero3"):
        put(sweep, ok_record(spec_of({**GPU_BASE, "batch_size": 2}, strategy=strategy), 20_000.0, 40.0))
    summary = (write_report(sweep, plots=False).directory / "summary.md").read_text()
    assert "## Scaling" not in summary and "## Pivot" in summary


def test_the_scaling_plot_draws_one_line_per_strategy_over_the_gpu_counts(tmp_path):
    sweep = tmp_path / "scaling"
    base = {**GPU_BASE, "batch_size": 2}
    put(sweep, ok_record(spec_of(base, strategy="ddp", gpus_per_node=1), 20_000.0, 40.0))
    for strategy in ("ddp", "fsdp2_zero3"):
        put(sweep, ok_record(spec_of(base, strategy=strategy, gpus_per_node=2), 18_000.0, 30.0))
        put(sweep, ok_record(spec_of(base, strategy=strategy, nodes=2, gpus_per_node=2), 15_000.0, 25.0))
    cells = label_cells(load_records(sweep))
    data = plots.PlotData.of(ok_configs(cells), *reference_cells(cells))
    figure = plots.scaling(data)
    lines = {line.get_label(): list(line.get_xdata()) for line in figure.axes[0].get_lines()}
    assert lines == {"ddp": [1, 2, 4], "fsdp2_zero3": [2, 4]}
    report = write_report(sweep).directory
    assert (report / "plots" / "scaling.png").stat().st_size > 0


def test_a_sweep_at_several_gpu_counts_whose_one_gpu_cell_ran_out_of_memory_says_why_it_has_no_scaling_table(tmp_path):
    from test_collect import failed_record

    sweep = tmp_path / "unscaled"
    base = {**GPU_BASE, "batch_size": 2}
    put(sweep, failed_record(spec_of(base, strategy="ddp", gpus_per_node=1), "oom", "train", "CUDA out of memory"))
    for strategy in ("fsdp2_zero2", "fsdp2_zero3"):
        put(sweep, ok_record(spec_of(base, strategy=strategy, gpus_per_node=2), 14_000.0, 60.0))
    summary = (write_report(sweep, plots=False).directory / "summary.md").read_text()
    scaling = section(summary, "Scaling")
    assert "Not shown: no one-GPU cell ran ok to scale against (the one-GPU cells: 1 oom)" in scaling, scaling
    assert "| fsdp2_zero3" not in scaling
