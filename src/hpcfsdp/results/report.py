"""The report of one sweep: report/results.csv (+ .parquet), summary.md, index.html and plots/.

docs/collector.md describes the outputs; render.py turns the sections into Markdown and HTML.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..contracts.files import write_text
from ..contracts.fs.beneath import folder, remove_links_in
from ..contracts.gpus import gpu_memory_gib
from ..sweep.folder.layout import require_inside
from . import plots as plotting
from .read import METRICS, Cells, Collection, describe, drawn_configs, label_cells, load_records, ok_configs
from .render import Section, tables_writing, to_html, to_markdown
from .scaling import scaling_sections
from .tables import (
    DEFAULT_BASELINES,
    baseline_table,
    best_table,
    choose_baseline,
    comparison_table,
    environment_table,
    failures_table,
    fmt,
    frame_rank_words,
    frontier_table,
    metric_name,
    pivot_tables,
    probe_rows,
    reference_cells,
    status_counts,
)
from .trust import WHY, invalid_table, noise_words, setup_words, spread_words
from .tuned import profile_sections, tune_section

ROW_LIMIT = 1000  # longest per-cell table in summary.md / index.html; results.csv has every row


@dataclass(frozen=True)
class Report:
    """What `write_report` wrote, and what `hpcfsdp collect` prints."""

    table: pd.DataFrame  # the cell table (tables.comparison_table), one row per cell, best first
    directory: Path
    files: list[Path]
    unreadable: list[str]
    skipped_plots: dict[str, str]  # plot name -> why it was not drawn
    notes: list[str]  # what the tables could not keep as it was (e.g. a parquet column as text)
    recommendation: list[str] = field(default_factory=list)  # fastest (whole job), most headroom, cheapest
    untrusted: list[str] = field(default_factory=list)  # "<cell>: <why its figures cannot be trusted>", one per reason
    unplanned: list[str] = field(default_factory=list)  # records of cells no submit of the folder made (read.py)


def write_report(
    sweep_dir: str | Path,
    baseline: str | None = None,
    plots: bool = True,
    scheduler_states: dict[str, str] | None = None,
    collection: Collection | None = None,
) -> Report:
    """Write report/: results.csv (+ .parquet), summary.md, index.html and plots/*.png.

    `collection`: the sweep's records when the caller read them already."""
    sweep_dir = Path(sweep_dir)
    collection = collection if collection is not None else load_records(sweep_dir, scheduler_states)
    with report_started(sweep_dir, collection, baseline, plots) as write_rest:
        return write_rest(())


@contextmanager
def report_started(
    sweep_dir: Path, collection: Collection, baseline: str | None = None, plots: bool = True
) -> Iterator[Callable[[tuple[Section, ...]], Report]]:
    """The cells labelled and the figures drawing in worker processes (plots.drawing_plots); what it
    yields writes the rest of the report (its tables and text, then the figures waited for) with the
    sections that go right after the recommendation, which the caller makes meanwhile (collect: the
    over-time checks, while the figures draw on the other core)."""
    cells = label_cells(collection)
    report = report_folder(sweep_dir)
    configs = ok_configs(cells)
    plotted = (
        plotting.drawing_plots(drawn_configs(cells), *reference_cells(cells), report / "plots", probe_rows(cells))
        if plots
        else nullcontext(plotting.nothing_drawn)
    )
    with tables_writing(collection.cells, report) as tables, plotted as drawn:  # the tables first: no worker yet

        def write_rest(first_sections: tuple[Section, ...]) -> Report:
            table = comparison_table(cells.frame, collection.spec_fields)
            # The recommendation and the cells it left out as untrusted first, then first_sections, then the rest.
            lines = recommendation(configs, cells)
            leading, rest = summary_sections(cells, configs, baseline, collection.unreadable, lines)
            if collection.unplanned:
                rest.append(Section("Cells no plan made (not ranked)", items=list(collection.unplanned)))
            tuned = tune_section(sweep_dir)
            after_plots = [
                *pivot_sections(cells, configs),
                *scaling_sections(cells, ROW_LIMIT),
                all_cells_section(table),
                Section("Environment", table=environment_table(collection.frame)),
            ]
            figures, skipped = drawn()
            rest += profile_sections(sweep_dir, list(cells.frame.get("cell_id", [])), report)
            sections = [*leading, *first_sections, *([tuned] if tuned else []), *rest]
            sections += [Section("Plots", text=_plot_note(plots, skipped), images=figures), *after_plots]
            title = f"{sweep_dir.name}: {status_counts(cells, collection.unreadable)}"
            write_text(report / "summary.md", to_markdown(title, sections, relative_to=report))
            write_text(report / "index.html", to_html(title, sections))
            files, notes = tables()
            files += [*(path for _, path in figures), report / "summary.md", report / "index.html"]
            why = invalid_table(cells).rename(columns={WHY: "why"})
            untrusted = [f"{row.cell}: {row.why}" for row in why.itertuples()]
            unplanned = collection.unplanned
            return Report(table, report, files, collection.unreadable, skipped, notes, lines, untrusted, unplanned)

        yield write_rest


def report_folder(sweep_dir: Path) -> Path:
    """<sweep>/report/ (and plots/ in it), made ready to write into without leaving the sweep
    folder: a link left among their files is removed (the file is written afresh in its place),
    and a report/ or plots/ that is itself a link out of the sweep folder is refused."""
    report = sweep_dir / "report"
    for place in (report, report / "plots"):
        require_inside(sweep_dir, place)
        with folder(place, sweep_dir, create=True) as fd:
            remove_links_in(fd)
    return report


def summary_sections(
    cells: Cells, configs: pd.DataFrame, baseline: str | None, unreadable: list[str], lines: list[str]
) -> tuple[list[Section], list[Section]]:
    """The leading sections (the recommendation's `lines`, and the cells whose figures cannot be
    trusted: the first of the problems), then the rest: best configurations, baseline comparison,
    OOM frontier, what did not finish or read."""
    invalid = invalid_table(cells)
    left_out = (
        f" Left out: {cells.invalid['cell_id'].nunique()} cell(s) that ran ok but whose figures cannot be trusted "
        "(next section)."
        if len(invalid)
        else ""
    )
    among = "Among the cells that ran ok." if lines else _none_ok(cells)
    leading = [Section("Recommendation", text=among + left_out, items=lines)]
    if len(invalid):
        text = "They finished ok, but their figures measure something else; no ranking, table or plot counts them."
        leading.append(Section("Cells whose figures cannot be trusted", text=text, table=invalid))
    sections = [
        _best_section(configs, cells),
        _baseline_section(configs, cells, baseline),
        Section(
            "OOM frontier",
            text="Largest per-device batch that ran, per strategy and setting.",
            table=frontier_table(cells),
        ),
    ]
    failures = failures_table(cells)
    if len(failures) > ROW_LIMIT:
        note = f"The first {ROW_LIMIT:,} of {len(failures):,}; results.csv has them all (columns status, stage, error)."
        sections.append(Section("Cells that did not finish ok", text=note, table=failures.head(ROW_LIMIT)))
    elif len(failures):
        sections.append(Section("Cells that did not finish ok", table=failures))
    if unreadable:
        sections.append(Section("Unreadable records (skipped)", items=list(unreadable)))
    return leading, sections


def pivot_sections(cells: Cells, configs: pd.DataFrame) -> list[Section]:
    sections = []
    for metric in METRICS:
        if metric == "mfu" and configs[metric].isna().all():
            sections.append(Section("Pivot: MFU", text="No MFU values (CPU runs, or a GPU without a known peak)."))
            continue
        sections.append(
            Section(
                f"Pivot: {metric_name(metric, cells.frame)}",
                text="Strategy x per-device batch; a cell that did not run ok shows its status.",
            )
        )
        sections += [Section(setting, table=table, level=3) for setting, table in pivot_tables(cells, metric)]
    return sections


def all_cells_section(table: pd.DataFrame) -> Section:
    """The cell table; past ROW_LIMIT rows a page is no place for it: results.csv is."""
    if len(table) > ROW_LIMIT:
        return Section("All cells", text=f"{len(table):,} cells: too many to list here; see results.csv.")
    return Section("All cells", table=table)


def recommendation(configs: pd.DataFrame, cells: Cells) -> list[str]:
    """Three questions, one line each, among the ok configurations:

    - fastest: the highest tokens/s of the whole job (time to train), tokens/s per GPU x GPUs;
    - most memory headroom: GPU memory left at the peak (the lowest peak where the device's size
      is unknown);
    - cheapest: the fewest joules per billion tokens where NVML measured energy for every one of
      them, else the fewest GPU-hours per billion tokens (the highest tokens/s per GPU).

    Fastest and cheapest differ whenever cells use different GPU counts: 4 GPUs at 9,000 tokens/s
    each finish first, 1 GPU at 12,000 costs less per token."""
    # A throughput of 0 (or -0.0: a Figure may be from 0 up) ranks nowhere: it would cost 1e9 / 0
    # GPU-hours per billion tokens.
    ranked = configs[pd.to_numeric(configs["tokens_per_s_per_gpu"], errors="coerce") > 0].copy()
    if ranked.empty:
        return []
    # Records from before gpu_hours_per_billion_tokens existed: the same figure from their throughput.
    ranked["gpu_hours_per_billion_tokens"] = ranked["gpu_hours_per_billion_tokens"].fillna(
        1e9 / (3600 * ranked["tokens_per_s_per_gpu"])
    )
    ranked["gpus"] = ranked["nodes"] * ranked["gpus_per_node"]
    ranked["tokens_per_s"] = ranked["tokens_per_s_per_gpu"] * ranked["gpus"]
    # Figures are finite in every readable record, but a product of two may not be (1e308 tokens/s
    # per GPU on 2 GPUs): no "inf tokens/s" wins.
    ranked = ranked[np.isfinite(pd.to_numeric(ranked["tokens_per_s"], errors="coerce").astype(float))]
    if ranked.empty:
        return []
    named = ranked["device_name"] if "device_name" in ranked else pd.Series(None, index=ranked.index)
    by_name = pd.to_numeric(named.map(lambda n: gpu_memory_gib(str(n)) if pd.notna(n) else None), errors="coerce")
    ranked["capacity"] = ranked["memory_capacity_gib"].fillna(by_name)
    fastest = ranked.loc[ranked["tokens_per_s"].idxmax()]
    ranks = frame_rank_words(cells.frame).count
    lines = [
        f"Fastest: {setup_words(fastest, cells)}: {fmt('tokens_per_s_per_gpu', fastest['tokens_per_s'])} tokens/s "
        f"for the job, {int(fastest['gpus'])} {ranks} x {fmt('tokens_per_s_per_gpu', fastest['tokens_per_s_per_gpu'])} "
        f"{spread_words(fastest)}(cell {fastest['cell_id']}){noise_words(ranked, fastest, cells)}"
    ]
    known = ranked.dropna(subset=["capacity", "peak_memory_gib"])
    if known.empty:
        lowest = ranked.loc[ranked["peak_memory_gib"].idxmin()]
        lines.append(
            f"Most memory headroom: {setup_words(lowest, cells)}: the lowest peak, "
            f"{fmt('peak_memory_gib', lowest['peak_memory_gib'])} GiB (device memory size unknown; "
            f"cell {lowest['cell_id']})"
        )
    else:
        roomy = known.loc[(known["capacity"] - known["peak_memory_gib"]).idxmax()]
        free = roomy["capacity"] - roomy["peak_memory_gib"]
        lines.append(
            f"Most memory headroom: {setup_words(roomy, cells)}: "
            f"peak {fmt('peak_memory_gib', roomy['peak_memory_gib'])} of {roomy['capacity']:.1f} GiB, "
            f"{free:.1f} GiB ({free / roomy['capacity']:.0%}) free (cell {roomy['cell_id']})"
        )
    return [*lines, _cheapest_line(ranked, fastest, cells)]


def _cheapest_line(ranked: pd.DataFrame, fastest: pd.Series, cells: Cells) -> str:
    """By energy where every configuration has it (joules count all GPUs of the job), else by
    GPU-hours; a partial energy measurement adds the least energy among those measured."""
    energy = ranked.dropna(subset=["joules_per_token"])
    by_energy = len(energy) == len(ranked)
    cost = "joules_per_token" if by_energy else "gpu_hours_per_billion_tokens"
    cheapest = ranked.sort_values(cost, kind="stable").iloc[0]  # the first of equals, as idxmin
    same = " (also the fastest)" if cheapest.name == fastest.name else ""
    hours = frame_rank_words(cells.frame).hours
    gpu_hours = f"{cheapest['gpu_hours_per_billion_tokens']:.3g} {hours} per billion tokens"
    if by_energy:
        return (
            f"Cheapest: {setup_words(cheapest, cells)}: {_kwh(cheapest)} kWh per billion tokens "
            f"({cheapest['joules_per_token']:.3g} J per token; {gpu_hours}){same} (cell {cheapest['cell_id']})"
        )
    line = f"Cheapest: {setup_words(cheapest, cells)}: {gpu_hours}{same} (cell {cheapest['cell_id']})"
    if not energy.empty:
        frugal = energy.loc[energy["joules_per_token"].idxmin()]
        line += (
            f"; least energy of the {len(energy)} measured: {setup_words(frugal, cells)}: "
            f"{frugal['joules_per_token']:.3g} J per token ({_kwh(frugal)} kWh per billion tokens)"
        )
    return line


def _kwh(config: pd.Series) -> str:
    return f"{config['joules_per_token'] * 1e9 / 3.6e6:.3g}"


def _none_ok(cells: Cells) -> str:
    return "No cell finished ok with figures that can be trusted." if len(cells.invalid) else "No cell finished ok."


def _best_section(configs: pd.DataFrame, cells: Cells) -> Section:
    if configs["tokens_per_s_per_gpu"].notna().sum() == 0:
        return Section("Best configuration", text=_none_ok(cells))
    top = configs.iloc[int(np.nanargmax(configs["tokens_per_s_per_gpu"].astype(float).to_numpy()))]
    where = describe({"batch_size": top["batch_size"], **{f: top[f] for f in cells.fixed}})
    per = frame_rank_words(cells.frame).one
    text = (
        f"Best overall: {top['variant']} at {where}: {fmt('tokens_per_s_per_gpu', top['tokens_per_s_per_gpu'])} "
        f"tokens/s per {per} (cell {top['cell_id']}). Per strategy, by tokens/s per {per} among ok cells:"
    )
    return Section("Best configuration", text=text, table=best_table(configs, cells))


def _baseline_section(configs: pd.DataFrame, cells: Cells, requested: str | None) -> Section:
    title = "Speed-up and memory saving vs baseline"
    baseline = choose_baseline(configs, requested)
    if baseline is None or baseline not in set(configs["strategy"]):
        wanted = baseline or " or ".join(DEFAULT_BASELINES)
        return Section(title, text=f"No ok cell of {wanted}: pass --baseline with a strategy of this sweep.")
    table = baseline_table(configs, cells, baseline)
    if table.empty:
        return Section(title, text=f"No ok {baseline} cell shares a workload with another strategy's ok cell.")
    per = frame_rank_words(cells.frame).one
    text = (
        f"Baseline: {baseline}, compared at the same model, sequence, batch shape, checkpointing and "
        f"resources. Speed-up = tokens/s per {per} / baseline's; memory saving = 1 - peak / baseline's peak."
    )
    return Section(title, text=text, table=table)


def _plot_note(plots: bool, skipped: dict[str, str]) -> str:
    if not plots:
        return "Plots not drawn (--no-plots)."
    return " ".join(f"Skipped {name}: {why}." for name, why in skipped.items())
