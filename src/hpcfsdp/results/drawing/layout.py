"""The layout every figure shares: a style per strategy (the same in every figure), one panel per
setting on shared axes, titles and legends that fit the canvas, the batch axis.

matplotlib.figure (and the axes, text and backends it brings: a third of a second) is imported
only where a figure is made (new_figure): a collect that draws nothing (--no-plots, or figures
kept because their input did not change) never loads it.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING, Any

import pandas as pd
from matplotlib import colormaps
from matplotlib.ticker import NullLocator

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_PANELS = 6  # settings drawn per figure; the ones with the most cells are kept
MARKERS = "osD^vP*Xh<>p"
LINESTYLES = ("-", ":", "-.", (0, (3, 1, 1, 1, 1, 1)))  # never dashed: that is a cell ranked nowhere
UNRANKED = "--"  # the line of a cell drawn but ranked nowhere (its figures cannot be trusted)

INCHES_PER_CHAR = 0.085  # how wide a character of a label is at matplotlib's default 10 pt, roughly
TITLE_SIZE = 13


def styles(variants: list[str], unranked: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """A colour, marker and line per variant; the `unranked` ones dashed."""
    names = sorted({str(v) for v in variants if pd.notna(v)})
    colours = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {
        name: {
            "color": colours(i % colours.N),
            "marker": MARKERS[i % len(MARKERS)],
            "linestyle": UNRANKED if name in unranked else LINESTYLES[i % len(LINESTYLES)],
        }
        for i, name in enumerate(names)
    }


def new_figure(**options: Any) -> Figure:
    """A matplotlib Figure (object API, Agg: no display, no global state) of these options."""
    from matplotlib.figure import Figure

    return Figure(**options)


def drawn_rows(configs: pd.DataFrame, column: str, *more: str) -> pd.DataFrame:
    """The configurations with a value of column, and only the columns a faceted figure draws
    (its panels and lines are slices of this frame: of every column it has)."""
    return configs.dropna(subset=[column])[["setting", "variant", "batch_size", column, *more]]


def facets(
    frame: pd.DataFrame,
    title: str,
    panel: tuple[float, float] = (5.0, 3.6),
    labels: float = 0.5,
    legend: float = 2.0,
) -> tuple[Figure, list[tuple[str, Axes, pd.DataFrame]]]:
    """One panel per setting (grad_accum, checkpointing, ...), at most MAX_PANELS of them, on
    shared axes: panels compare at a glance, and only the outer ones carry tick labels. `labels`
    and `legend`: the inches the tick labels take on the left, the legend on the right."""
    grouped = frame.groupby("setting", observed=True, sort=True)
    sizes = list(grouped.size().items())  # (setting, cells): only the panels drawn are cut out of the frame
    if len(sizes) > MAX_PANELS:
        kept = set(sorted(range(len(sizes)), key=lambda i: -sizes[i][1])[:MAX_PANELS])
        title += f"\n({MAX_PANELS} of {len(sizes)} settings, those with the most cells; all are in summary.md)"
        sizes = [size for i, size in enumerate(sizes) if i in kept]
    groups = [(setting, grouped.get_group(setting)) for setting, _ in sizes]
    cols = min(3, len(groups))
    rows = math.ceil(len(groups) / cols)
    figure = new_figure(figsize=(panel[0] * cols + labels + legend, panel[1] * rows + 1.2), layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False, sharex=True, sharey=True).ravel()
    for i in range(len(groups), len(axes)):
        axes[i].set_visible(False)
        axes[i - cols].xaxis.set_tick_params(labelbottom=True)  # now the bottom panel of its column
    figure_title(figure, title, legend)
    return figure, [(str(setting), ax, part) for (setting, part), ax in zip(groups, axes)]


def text_inches(labels: Any) -> float:
    """About how wide the longest of these labels is drawn: what a legend or tick labels take."""
    return INCHES_PER_CHAR * max((len(str(label)) for label in labels), default=0)


def legend_inches(labels: Any) -> float:
    """The width a legend of these labels takes beside the plot (its box and markers included)."""
    return text_inches(labels) + 1.0


def figure_title(figure: Figure, text: str, legend: float) -> None:
    """The figure's title, centred over the plots left of the legend (`legend` inches wide, top
    right) and each line wrapped to that width: a long reference label or a wide legend never
    pushes it past the canvas or over the legend."""
    width = figure.get_figwidth() - legend
    chars = max(30, int(width / (INCHES_PER_CHAR * TITLE_SIZE / 10)))
    wrapped = "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))
    figure.suptitle(wrapped, x=width / 2 / figure.get_figwidth(), fontsize=TITLE_SIZE, fontweight="bold")


def batch_axis(ax: Axes, batches: pd.Series) -> None:
    """Batch sizes usually double: a log2 axis with a tick at each batch run."""
    values = sorted(batches.unique())
    if values[0] > 0 and values[-1] / values[0] >= 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(values, [number_text(v) for v in values])


def number_text(value: Any) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
