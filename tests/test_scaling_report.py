"""The report's scaling table (the FSDP2 blog's 4 -> 8 -> 16 GPU table), from records of one workload
at several GPU counts: scaled against the smallest count that ran ok, with the spread and "within
noise" like the other tables, formatted like them, worded for the machine (issue 54, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcfsdp.results import plots
from hpcfsdp.results.read import label_cells, load_records, ok_configs
from hpcfsdp.results.report import write_report
from hpcfsdp.results.tables import reference_cells
from test_collect import CPU_BASE, GPU_BASE, ok_record, put, rows, section, spec_of

# The scaling table's joins use no keyword pandas has deprecated (rsuffix warned on every collect).
pytestmark = pytest.mark.filterwarnings("error::pandas.errors.Pandas4Warning")


def test_a_sweep_at_one_two_and_four_gpus_reports_each_strategys_efficiency_against_one_gpu(tmp_path):
    sweep = tmp_path / "scaling"
    base = {**GPU_BASE, "batch_size": 2}
    one = spec_of(base, strategy="ddp", gpus_per_node=1)
    put(sweep, ok_record(one, 20_000.0, 40.0))
    for strategy, two, four in (("ddp", 19_000.0, 18_000.0), ("fsdp2_zero3", 18_000.0, 15_000.0)):
        put(sweep, ok_record(spec_of(base, strategy=strategy, gpus_per_node=2), two, 30.0))
        put(sweep, ok_record(spec_of(base, strategy=strategy, nodes=2, gpus_per_node=2), four, 25.0))
    put(sweep, ok_record(spec_of(base, strategy="fsdp2_hsdp", nodes=2, gpus_per_node=2), 16_000.0, 27.0))
    # another workload (batch 4) ran at one GPU count only: no row, nothing to scale against
    put(sweep, ok_record(spec_of({**base, "batch_size": 4}, strategy="ddp", gpus_per_node=2), 21_000.0, 50.0))

    summary = (write_report(sweep, plots=False).directory / "summary.md").read_text()

    scaling = section(summary, "Scaling")
    table = scaling_rows(scaling)
    cells = {(row["strategy"], row["GPUs"]): row["efficiency"] for row in table}
    assert cells == {
        ("ddp", "1"): "1.00x",
        ("ddp", "2"): "0.95x",
        ("fsdp2_zero3", "2"): "0.90x",
        ("ddp", "4"): "0.90x",
        ("fsdp2_hsdp", "4"): "0.80x",
        ("fsdp2_zero3", "4"): "0.75x",
    }, scaling
    assert {row["base GPUs"] for row in table} == {"1"}


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


def test_a_sweep_whose_only_other_gpu_count_ran_out_of_memory_says_why_it_has_no_scaling_table(tmp_path):
    from test_collect import failed_record

    sweep = tmp_path / "unscaled"
    base = {**GPU_BASE, "batch_size": 2}
    put(sweep, failed_record(spec_of(base, strategy="ddp", gpus_per_node=1), "oom", "train", "CUDA out of memory"))
    for strategy in ("fsdp2_zero2", "fsdp2_zero3"):
        put(sweep, ok_record(spec_of(base, strategy=strategy, gpus_per_node=2), 14_000.0, 60.0))
    summary = (write_report(sweep, plots=False).directory / "summary.md").read_text()
    scaling = section(summary, "Scaling")
    assert "Not shown: no workload ran ok at two GPU counts" in scaling and "at 1: 1 oom; at 2: 2 ok" in scaling
    assert "| fsdp2_zero3" not in scaling


def scaling_rows(scaling: str) -> list[dict[str, str]]:
    """The Scaling section's table as one dict per row, by header."""
    header, *body = rows(scaling)
    return [dict(zip(header, row, strict=True)) for row in body]


def blog_sweep(root: Path) -> Path:
    """Seed 004's table: a model that fits no single GPU, at 4, 8 and 16 GPUs; fsdp2_zero2's
    8-GPU steps overlap its 4-GPU ones, fsdp2_zero3's 16-GPU ones do not."""
    sweep = root / "blog"
    base = {**GPU_BASE, "batch_size": 1, "gpus_per_node": 4}
    for strategy, figures in (
        ("fsdp2_zero2", ((1, 2100.0, (2050, 2150)), (2, 2080.0, (2040, 2120)), (4, 1900.0, (1880, 1920)))),
        ("fsdp2_zero3", ((1, 2050.0, (2000, 2100)), (2, 2000.0, (1950, 2040)), (4, 1800.0, (1780, 1820)))),
    ):
        for nodes, rate, (p10, p90) in figures:
            spec = spec_of(base, strategy=strategy, nodes=nodes)
            put(sweep, ok_record(spec, rate, 24.0, tokens_per_s_spread={"p10": p10, "p90": p90}))
    return sweep


def test_a_model_that_fits_no_single_gpu_scales_against_its_smallest_gpu_count_with_spread_and_noise(tmp_path):
    summary = (write_report(blog_sweep(tmp_path), plots=False).directory / "summary.md").read_text()
    scaling = section(summary, "Scaling")
    assert "smallest GPU count that ran ok (4 GPUs" in scaling  # each strategy against its own 4-GPU cell
    table = {(row["strategy"], row["GPUs"]): row for row in scaling_rows(scaling)}
    assert set(table) == {(s, n) for s in ("fsdp2_zero2", "fsdp2_zero3") for n in ("4", "8", "16")}
    assert {row["base GPUs"] for row in table.values()} == {"4"}
    zero2_8, zero3_16 = table["fsdp2_zero2", "8"], table["fsdp2_zero3", "16"]
    # Formatted like the other tables: thousands, the p10-p90 spread, MFU as a percentage.
    assert zero2_8["tokens/s/gpu"] == "2,080" and zero2_8["p10-p90"] == "2,040-2,120"
    assert zero2_8["efficiency"] == "0.99x" and zero2_8["within noise of base"] == "yes"
    assert zero3_16["efficiency"] == "0.88x" and zero3_16["within noise of base"] == "no"
    assert table["fsdp2_zero2", "4"]["within noise of base"] == "base"
    assert zero2_8["MFU"].endswith("%") and zero2_8["peak GiB"] == "24.00"
    assert "e-0" not in scaling and "0.0693" not in scaling


def test_a_cpu_sweeps_scaling_speaks_of_processes_and_its_plot_draws_tokens_per_process(tmp_path):
    sweep = tmp_path / "cpu"
    for world, rate in ((1, 900.0), (2, 850.0)):
        spec = spec_of({**CPU_BASE, "batch_size": 2}, strategy="ddp", gpus_per_node=world)
        put(sweep, ok_record(spec, rate, 0.4, device="cpu"))
    report = write_report(sweep).directory
    scaling = section((report / "summary.md").read_text(), "Scaling")
    assert "GPU" not in scaling and "processes" in scaling
    assert [row["processes"] for row in scaling_rows(scaling)] == ["1", "2"]
    cells = label_cells(load_records(sweep))
    figure = plots.scaling(plots.PlotData.of(ok_configs(cells), *reference_cells(cells)))
    assert figure.axes[0].get_xlabel() == "processes" and figure.axes[0].get_ylabel() == "tokens/s per process"
    assert (report / "plots" / "scaling.png").stat().st_size > 0


def test_the_scaling_plot_draws_the_blogs_four_to_sixteen_gpus(tmp_path):
    cells = label_cells(load_records(blog_sweep(tmp_path)))
    figure = plots.scaling(plots.PlotData.of(ok_configs(cells), *reference_cells(cells)))
    lines = {line.get_label(): list(line.get_xdata()) for line in figure.axes[0].get_lines()}
    assert lines == {"fsdp2_zero2": [4, 8, 16], "fsdp2_zero3": [4, 8, 16]}
    assert figure.axes[0].get_xlabel() == "GPUs"
