"""Figures of a collected sweep, written as PNG files.

Figures use matplotlib's object API (`Figure`, never pyplot): they render with Agg and leave no global
state behind (a login node has no display). A figure whose data is absent raises NoData and is skipped
with a note instead of failing the report; so is one that fails otherwise, with the error as the note.

Input frames come from `collect`: `configs` holds ok cells averaged over repeats, `reference` the ok cells
of one workload run by most strategies, `probes` the batches `batch_size: auto` tried (unjoined markers).

Drawing is most of a large sweep's collection (text layout and PNG encoding), so a collect draws
only when what the figures show changed: plots/drawn.json keeps a digest of the figures' input
(the frames, the drawing code, matplotlib's version) and which figures were skipped and why; a
collect whose digest matches, with every figure still there, keeps them as they are.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from matplotlib import __version__ as matplotlib_version
from matplotlib.ticker import MaxNLocator

from ..contracts.files import RecordError, atomic_output, garbage_collection_paused, read_json_object, write_json
from ..contracts.fs.beneath import remove
from ..contracts.gpus import gpu_memory_gib, rank_words
from ..contracts.record import stage_rank
from .drawing import layout
from .read import MARK
from .scaling import scaling_table

if TYPE_CHECKING:  # imported where a figure is drawn (drawing/layout.py says why)
    from matplotlib.figure import Figure

DPI = 100
LONGEST = {"time_breakdown": 0, "gpu_utilisation": 1, "mfu": 2}  # to draw: drawn first, so the workers end together
DRAWN_NAME = "drawn.json"  # in plots/: {digest, outcomes: {figure: null (drawn) or why skipped}}

UNRANKED_BARS: dict[str, Any] = {"hatch": "//", "edgecolor": "black", "linestyle": "--", "alpha": 0.6}  # dashed
TIME_PARTS = (("compute", "#4c72b0"), ("exposed communication", "#dd8452"), ("data loading", "#55a868"))


class NoData(Exception):
    """The sweep has nothing to draw for this figure; the message says what is missing."""


class NotApplicable(Exception):
    """The figure answers a question this sweep did not ask (scaling, at one GPU count): it is
    neither drawn nor listed as skipped."""


@dataclass(frozen=True)
class PlotData:
    configs: pd.DataFrame
    reference: pd.DataFrame
    reference_label: str
    styles: dict[str, dict[str, Any]]  # variant -> line style, the same in every figure
    probes: pd.DataFrame = field(default_factory=pd.DataFrame)
    on_gpu: bool = False  # some cell ran on a GPU (else the memory is each process's RSS)

    @classmethod
    def of(
        cls, configs: pd.DataFrame, reference: pd.DataFrame, reference_label: str, probes: pd.DataFrame | None = None
    ) -> PlotData:
        probes = probes if probes is not None else pd.DataFrame()
        variants = [*configs["variant"], *reference["variant"], *probes.get("variant", [])]
        marked = [frame["variant"][frame[MARK] != ""] for frame in (configs, reference) if MARK in frame]
        unranked = frozenset(str(v) for part in marked for v in part)
        gpu = bool(configs["device_type"].eq("cuda").any()) if "device_type" in configs else False
        return cls(configs, reference, reference_label, layout.styles(variants, unranked), probes, gpu)


Drawn = tuple[list[tuple[str, Path]], dict[str, str]]  # [(caption, path)] and {name: why skipped}


@contextmanager
def drawing_plots(
    configs: pd.DataFrame,
    reference: pd.DataFrame,
    reference_label: str,
    out_dir: Path,
    probes: pd.DataFrame | None = None,
) -> Iterator[Callable[[], Drawn]]:
    """Draw every figure into out_dir, unless the figures there were drawn from the same input;
    yields a function that waits for them and returns what was drawn (Drawn). Text layout and PNG
    encoding dominate a large sweep's collection: the figures draw in worker processes, one per core,
    while this process writes the tables and the report's text, then draws what no worker has started.
    Workers fork with the collector paused (its passes would walk, and copy the pages of, every
    object of this process: a tenth of their CPU time)."""
    data = PlotData.of(configs, reference, reference_label, probes)
    jobs = [(name, draw, data, out_dir / f"{name}.png") for name, _, draw in PLOTS]
    digest = _input_digest(data)
    kept = _drawn_before(out_dir, digest)
    if kept is not None:
        yield lambda: _listed(jobs, kept)
        return
    remove(out_dir / DRAWN_NAME)  # figures half redrawn are no figures of the old input
    import matplotlib.figure  # noqa: F401  (once here, not in each worker: they fork from this process)

    def recorded(outcomes: list[str | None]) -> Drawn:
        write_json(out_dir / DRAWN_NAME, {"digest": digest, "outcomes": dict(zip([n for n, _, _ in PLOTS], outcomes))})
        return _listed(jobs, outcomes)

    workers = min(len(jobs), os.cpu_count() or 1)
    if workers == 1:  # one core: this process draws them all, once its tables and text are written
        yield lambda: recorded([_draw_and_save(*job) for job in jobs])
        return
    ordered = sorted(jobs, key=lambda j: LONGEST.get(j[0], 3))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        with garbage_collection_paused():
            gc.freeze()
            try:  # every job submitted, every worker forked, now; the LONGEST first
                pending = {job[0]: pool.submit(_draw_and_save, *job) for job in ordered}
            finally:
                gc.unfreeze()

        def helped() -> Drawn:  # the figures no worker has started yet are drawn here, the last first
            with garbage_collection_paused():  # a figure's objects hold cycles: freed once it runs again
                here = {job[0]: _draw_and_save(*job) for job in reversed(ordered) if pending[job[0]].cancel()}
            return recorded([here[name] if name in here else pending[name].result() for name, *_ in jobs])

        yield helped


def nothing_drawn() -> Drawn:  # what drawing_plots yields where no figure is drawn (collect --no-plots)
    return [], {}


def _listed(jobs: list[tuple[str, Any, PlotData, Path]], outcomes: list[str | None]) -> Drawn:
    written, skipped = [], {}
    for (name, caption, _), (_, _, data, path), why in zip(PLOTS, jobs, outcomes):
        if why is None:  # a CPU sweep's memory is each process's RSS, beside no device's capacity
            written.append((CPU_MEMORY_CAPTION if name == "memory" and not data.on_gpu else caption, path))
        elif why:
            skipped[name] = why
    return written, skipped


def _input_digest(data: PlotData) -> str:
    """What the figures are drawn from, as a digest of values (pickle's bytes would depend on
    which equal strings are one object): the frames and styles, the code that draws them (this
    module and drawing/layout.py) and matplotlib's version (another one draws other pixels)."""
    digest = hashlib.blake2b(digest_size=16)
    for frame in (data.configs, data.reference, data.probes):
        digest.update(frame.to_json(orient="split", default_handler=str).encode())
    drawers = [f"{name}={draw.__module__}.{draw.__qualname__}" for name, _, draw in PLOTS]
    digest.update(json.dumps([data.reference_label, data.styles, drawers], sort_keys=True, default=str).encode())
    for code in (__file__, layout.__file__):
        digest.update(Path(code).read_bytes())
    digest.update(matplotlib_version.encode())
    return digest.hexdigest()


def _drawn_before(out_dir: Path, digest: str) -> list[str | None] | None:
    """Each figure's outcome (None: drawn; else why skipped) when out_dir holds every figure drawn
    from input of this digest; None when they must be drawn."""
    try:
        drawn = read_json_object(out_dir / DRAWN_NAME, kind="list of drawn figures")
    except (FileNotFoundError, RecordError):
        return None
    outcomes, names = drawn.get("outcomes"), [name for name, _, _ in PLOTS]
    if drawn.get("digest") != digest or not isinstance(outcomes, dict) or sorted(outcomes) != sorted(names):
        return None
    kept = [outcomes[name] for name in names]
    if not all(why is None or isinstance(why, str) for why in kept):
        return None
    if any(why is None and not (out_dir / f"{name}.png").is_file() for name, why in zip(names, kept)):
        return None
    return kept


def _draw_and_save(name: str, draw: Callable[[PlotData], Figure], data: PlotData, path: Path) -> str | None:
    """Write one figure; return why it was skipped, "" where it does not apply, or None. A figure
    that fails (values no figure was written for) is skipped like one without data: the report and
    the other figures matter more than one figure."""
    try:
        # A fast zlib level: the default spends seconds compressing large multi-panel PNGs.
        with atomic_output(path) as tmp:
            draw(data).savefig(tmp, format="png", dpi=DPI, pil_kwargs={"compress_level": 1})
        return None
    except NoData as exc:
        why = str(exc)
    except NotApplicable:
        why = ""
    except OSError:  # a full disk: not the figure's fault; collect names the file and fails
        raise
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    remove(path)  # neither half a figure nor one of an earlier collection
    return why


def throughput(data: PlotData) -> Figure:
    per = rank_words(data.configs.get("device_type", ())).per  # per process on the CPU
    return _lines(data, "tokens_per_s_per_gpu", f"tokens/s {per}", f"Throughput {per} vs per-device batch")


def memory(data: PlotData) -> Figure:
    ylabel = "peak allocated (GiB)" if data.on_gpu else "peak process RSS (GiB)"
    names: list[str] = list(data.configs["device_name"].dropna().unique()) if "device_name" in data.configs else []
    capacities = {name: gib for name in names if (gib := gpu_memory_gib(str(name)))}
    title = "Peak memory per device vs per-device batch"
    if data.on_gpu and not capacities:
        title += "\n(device memory size unknown: no capacity line)"
    return _lines(data, "peak_memory_gib", ylabel, title, {f"{name}: {g:g} GiB": g for name, g in capacities.items()})


def mfu(data: PlotData) -> Figure:
    return _heatmap(data, "mfu", "Model FLOPs utilisation by strategy and per-device batch", "MFU", "{x:.0%}")


def gpu_utilisation(data: PlotData) -> Figure:
    return _heatmap(
        data, "gpu_util_mean", "Mean GPU utilisation by strategy and per-device batch", "GPU utilisation (%)", "{x:.0f}"
    )


def time_breakdown(data: PlotData) -> Figure:
    frame = layout.drawn_rows(data.configs, "data_time_fraction", "comm_exposed_fraction")
    if frame.empty:
        raise NoData("no ok cell recorded data_time_fraction")
    has_comm = frame["comm_exposed_fraction"].notna().any()
    data_part = frame["data_time_fraction"].clip(0, 1)
    comm_part = frame["comm_exposed_fraction"].fillna(0).clip(0, 1)
    parts = pd.DataFrame(
        {
            "compute": (1 - data_part - comm_part).clip(lower=0),
            "exposed communication": comm_part,
            "data loading": data_part,
            "variant": frame["variant"],
            "batch_size": frame["batch_size"],
        }
    )
    title = "Step time breakdown" + ("" if has_comm else "\n(exposed communication not recorded: shown as 0)")
    rows = pd.MultiIndex.from_frame(
        frame[["variant", "batch_size"]].drop_duplicates().sort_values(["variant", "batch_size"])
    )
    row_labels = [f"{v}, b{layout.number_text(b)}" for v, b in rows]
    legend = layout.legend_inches(name for name, _ in TIME_PARTS)
    panel = (5.5, 0.25 * len(rows) + 1.2)
    figure, panels = layout.facets(frame, title, panel=panel, labels=layout.text_inches(row_labels), legend=legend)
    for setting, ax, part in panels:
        shares = parts.loc[part.index].groupby(["variant", "batch_size"]).mean().reindex(rows).fillna(0)
        left = np.zeros(len(rows))
        for name, colour in TIME_PARTS:
            ax.barh(np.arange(len(rows)), shares[name].to_numpy(), left=left, color=colour, height=0.75)
            left += shares[name].to_numpy()
        ax.set(xlim=(0, 1), title=setting)
    ax.set_yticks(np.arange(len(rows)), row_labels)
    ax.invert_yaxis()  # shared: the first row at the top of every panel
    figure.supxlabel("fraction of step time")
    from matplotlib.patches import Patch  # with the figure (drawing/layout.py)

    figure.legend(handles=[Patch(color=c, label=n) for n, c in TIME_PARTS], loc="outside right upper")
    return figure


def loss_curves(data: PlotData) -> Figure:
    cells = data.reference
    if cells.empty or "losses" not in cells:
        raise NoData("no ok cell recorded losses")
    cells = cells[cells["losses"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    if cells.empty:
        raise NoData("no ok cell recorded losses")
    legend = layout.legend_inches(cells["variant"])
    figure = layout.new_figure(figsize=(7 + legend, 5), layout="constrained")
    ax = figure.subplots()
    for variant, group in cells.groupby("variant", sort=True):
        for i, losses in enumerate(group["losses"]):
            values = pd.to_numeric(pd.Series(losses), errors="coerce")
            ax.plot(
                np.arange(1, len(values) + 1),
                values,
                **data.styles[variant],
                markersize=4,
                label=variant if i == 0 else "_nolegend_",
            )
    workload = "(the workload most strategies ran; one line per cell)"
    layout.figure_title(figure, f"Training loss per step at {data.reference_label}\n{workload}", legend)
    ax.set(xlabel="step", ylabel="training loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    figure.legend(loc="outside right upper", title="strategy")
    return figure


def memory_stages(data: PlotData) -> Figure:
    cells = data.reference
    columns = [
        c for c in cells.columns if c.startswith("memory.") and pd.to_numeric(cells[c], errors="coerce").notna().any()
    ]
    on_gpu = any(c.endswith(".allocated_gib") for c in columns)
    key = "allocated_gib" if on_gpu else "cpu_max_rss_gib"
    stages = sorted(dict.fromkeys(c.split(".")[1] for c in columns), key=stage_rank)  # run order
    bars = [(stage, f"memory.{stage}.{key}") for stage in stages if f"memory.{stage}.{key}" in columns]
    if on_gpu and "memory.end.peak_allocated_gib" in columns:
        bars.append(("training peak", "memory.end.peak_allocated_gib"))
    if not bars:
        raise NoData("no ok cell recorded memory by stage")
    means = cells[[c for _, c in bars]].apply(pd.to_numeric, errors="coerce").groupby(cells["variant"]).mean()
    legend = layout.legend_inches(means.index)
    figure = layout.new_figure(figsize=(max(6.0, 0.4 * len(bars) * len(means) + 2) + legend, 5), layout="constrained")
    ax = figure.subplots()
    width = 0.8 / len(means)
    for i, (variant, row) in enumerate(means.iterrows()):
        unranked = data.styles[variant]["linestyle"] == layout.UNRANKED
        ax.bar(
            np.arange(len(bars)) + (i - (len(means) - 1) / 2) * width,
            row.to_numpy(),
            width,
            color=data.styles[variant]["color"],
            label=variant,
            **(UNRANKED_BARS if unranked else {}),
        )
    ax.set_xticks(np.arange(len(bars)), [stage.replace("_", " ") for stage, _ in bars])
    what = "allocated GPU memory (GiB)" if on_gpu else "process max RSS (GiB)"
    note = "" if on_gpu else " (CPU run: max RSS only grows)"
    layout.figure_title(figure, f"Memory by stage at {data.reference_label}{note}", legend)
    ax.set(xlabel="stage", ylabel=what)
    ax.grid(axis="y", alpha=0.3)
    figure.legend(loc="outside right upper", title="strategy")
    return figure


def scaling(data: PlotData) -> Figure:
    """Tokens/s per GPU vs GPUs, a line per strategy, a panel per model: results/scaling.py's table."""
    configs = data.configs[data.configs[MARK] == ""] if MARK in data.configs else data.configs
    if {"nodes", "gpus_per_node"} <= set(configs.columns):
        configs = configs.assign(world_size=configs["nodes"] * configs["gpus_per_node"])
    table = scaling_table(configs)
    if table.empty:
        raise NotApplicable
    words = rank_words(configs.get("device_type", ()))
    many = "GPUs" if words.one == "GPU" else "processes"
    models = list(table["model"].unique())
    figure = layout.new_figure(figsize=(5.0 * len(models) + 2.5, 4.4), layout="constrained")
    axes = figure.subplots(1, len(models), squeeze=False, sharey=True).ravel()
    for ax, model in zip(axes, models):
        part = table[table["model"] == model]
        for strategy, rows in part.groupby("strategy", sort=True):
            ax.plot(rows["world_size"], rows["tokens_per_s_per_gpu"], marker="o", label=str(strategy))
        ax.set(xscale="log", title=str(model), xlabel=many)
        ax.set_xticks(counts := sorted(part["world_size"].unique()), [f"{g:.0f}" for g in counts])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"tokens/s {words.per}")
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
    figure.suptitle(f"Tokens/s {words.per} vs {many} (fixed per-device batch)", fontsize=13, fontweight="bold")
    return figure


CPU_MEMORY_CAPTION = "Peak memory (each process's RSS) vs per-device batch, per strategy"
PLOTS: tuple[tuple[str, str, Callable[[PlotData], Figure]], ...] = (
    ("throughput", "Tokens/s per rank (a GPU, or a process on the CPU) vs per-device batch, per strategy", throughput),
    ("memory", "Peak memory vs per-device batch, with the GPU's capacity when known", memory),
    ("mfu", "MFU heatmap: strategy x per-device batch", mfu),
    ("gpu_utilisation", "Mean GPU utilisation: strategy x per-device batch", gpu_utilisation),
    ("time_breakdown", "Step time: compute, exposed communication, data loading", time_breakdown),
    ("loss", "Training loss per strategy at one common workload (dashed: a cell ranked nowhere)", loss_curves),
    ("memory_stages", "Memory by stage per strategy at one common workload", memory_stages),
    ("scaling", "Tokens/s per GPU vs GPUs, per strategy and model (the scaling table)", scaling),
)


# ---------------------------------------------------------------------------------------------
# Shared pieces (the layout of every figure: drawing/layout.py)


def _lines(data: PlotData, column: str, ylabel: str, title: str, levels: dict[str, float] | None = None) -> Figure:
    """column vs per-device batch, one line per strategy, one panel per setting; `levels` are
    labelled horizontal lines (a GPU's memory capacity). Batch-search probes that fitted are
    hollow markers; those that ran out of memory are crosses at their peak up to the failure."""
    frame = layout.drawn_rows(data.configs, column)
    probes = data.probes.dropna(subset=[column]) if column in data.probes else pd.DataFrame()
    if frame.empty:
        raise NoData(f"no ok cell recorded {column}")
    legend = [*frame["variant"], *(levels or {}), *(["search probe: did not fit"] if not probes.empty else [])]
    figure, panels = layout.facets(frame, title, legend=layout.legend_inches(legend))
    for setting, ax, part in panels:
        for variant, line in part.groupby("variant", sort=True):
            line = line.sort_values("batch_size")
            ax.plot(line["batch_size"], line[column], **data.styles[str(variant)], label=variant)
        for (variant, fitted), points in (
            probes[probes["setting"] == setting].groupby(["variant", probes["status"] == "ok"])
            if not probes.empty
            else []
        ):
            colour = data.styles[variant]["color"]
            marker = dict(marker=data.styles[variant]["marker"], markerfacecolor="none") if fitted else dict(marker="x")
            ax.plot(points["batch_size"], points[column], linestyle="none", color=colour, markersize=8, **marker)
        for level in (levels or {}).values():
            ax.axhline(level, color="crimson", linestyle="--", linewidth=1.2)
        ax.set_title(setting)
        ax.grid(alpha=0.3)
    layout.batch_axis(ax, pd.concat([frame["batch_size"], probes.get("batch_size", pd.Series(dtype=float))]))
    top = max([frame[column].max(), *(probes[column] if not probes.empty else []), *(levels or {}).values()])
    ax.set_ylim(0, 1.08 * top)  # from 0, headroom over every panel
    figure.supxlabel("per-device batch size")
    figure.supylabel(ylabel)
    from matplotlib.lines import Line2D  # with the figure (drawing/layout.py)

    handles = [Line2D([], [], **data.styles[name], label=name) for name in sorted(set(frame["variant"]))]
    if not probes.empty:
        handles += [
            Line2D(
                [], [], color="grey", marker="o", markerfacecolor="none", linestyle="none", label="search probe: fitted"
            ),
            Line2D([], [], color="grey", marker="x", linestyle="none", label="search probe: did not fit"),
        ]
    handles += [Line2D([], [], color="crimson", linestyle="--", label=label) for label in (levels or {})]
    figure.legend(handles=handles, loc="outside right upper", title="strategy")
    return figure


def _heatmap(data: PlotData, column: str, title: str, label: str, cell_format: str) -> Figure:
    """column as a strategy x batch grid per setting; cell_format ("{x:.0%}") labels cells and colour bar."""
    frame = layout.drawn_rows(data.configs, column)
    if frame.empty:
        raise NoData(f"no ok cell recorded {column}")
    low, high = frame[column].min(), frame[column].max()
    if low == high:  # one value everywhere: centre it in the colour map instead of an undefined scale
        low, high = low - (abs(low) * 0.05 or 1.0), high + (abs(high) * 0.05 or 1.0)
    variants, batches = sorted(frame["variant"].unique()), sorted(frame["batch_size"].unique())
    panel = (0.75 * len(batches) + 1.5, 0.4 * len(variants) + 1.0)
    figure, panels = layout.facets(frame, title, panel=panel, labels=layout.text_inches(variants), legend=2.0)
    for setting, ax, part in panels:
        grid = part.pivot_table(index="variant", columns="batch_size", values=column, aggfunc="mean")
        values = grid.reindex(index=variants, columns=batches).to_numpy(dtype=float)
        image = ax.imshow(values, cmap="viridis", vmin=low, vmax=high, aspect="auto")
        for (i, j), value in np.ndenumerate(values):
            if not np.isnan(value):
                colour = "white" if value < (low + high) / 2 else "black"
                ax.text(j, i, cell_format.format(x=value), ha="center", va="center", fontsize=8, color=colour)
        ax.set_title(setting)
    ax.set_xticks(np.arange(len(batches)), [layout.number_text(b) for b in batches])
    ax.set_yticks(np.arange(len(variants)), variants)
    figure.supxlabel("per-device batch size")
    figure.colorbar(image, ax=[ax for _, ax, _ in panels], label=label, shrink=0.85, format=cell_format)
    return figure
