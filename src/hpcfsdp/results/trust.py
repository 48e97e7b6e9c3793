"""How far the report's figures can be trusted: the cells left out of every ranking
(contracts/validity.py's reasons, one row each) and the words for a spread (tokens/s at the p10
and p90 step) and for the configurations within noise of the fastest."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..contracts.validity import within_noise
from .read import INVALID, SPREAD, Cells, describe, value_text
from .tables import fmt

WHY = "why its figures cannot be trusted"  # invalid_table's reason column


def invalid_table(cells: Cells) -> pd.DataFrame:
    """The cells that finished ok with figures that cannot be trusted, each reason on its own row."""
    invalid = cells.invalid
    rows = [
        {
            "cell": cell["cell_id"],
            "strategy": value_text(cell["variant"]),
            "batch": value_text(cell["batch_size"]),
            "setting": str(cell["setting"]),
            WHY: reason,
        }
        for _, cell in invalid.sort_values("cell_id").iterrows()
        for reason in cell[INVALID]
    ]
    return pd.DataFrame(rows, columns=["cell", "strategy", "batch", "setting", WHY])


def noise_of(ranked: pd.DataFrame, fastest: pd.Series) -> pd.DataFrame:
    """The other configurations whose tokens/s for the job, between its p10 and p90 step, overlaps
    the fastest's (validity.within_noise): the data cannot tell them apart. Rows without a spread
    are never within noise."""
    top = _job_spread(*(fastest[column] for column in (*SPREAD, "gpus")))
    rows = zip(ranked.index, *(ranked[column] for column in (*SPREAD, "gpus")))  # a column at a time: no row Series
    close = [name != fastest.name and within_noise(top, _job_spread(*spread)) for name, *spread in rows]
    return ranked[close].sort_values("tokens_per_s", ascending=False)


def _job_spread(p10: Any, p90: Any, gpus: Any) -> dict[str, float] | None:
    low, high = float(p10), float(p90)  # numbers: read.EXTRA_NUMBERS
    return None if pd.isna(low) or pd.isna(high) else {"p10": low * gpus, "p90": high * gpus}


def noise_words(ranked: pd.DataFrame, fastest: pd.Series, cells: Cells) -> str:
    """The fastest line's end: the configurations within noise of it, named; "" where none is."""
    close = noise_of(ranked, fastest)
    if close.empty:
        return ""
    named = "; ".join(
        f"{setup_words(row, cells)} ({fmt('tokens_per_s_per_gpu', row['tokens_per_s'])}, cell {row['cell_id']})"
        for _, row in close.iterrows()
    )
    return f"; within noise of it (their p10-p90 steps overlap, so this run cannot tell them apart): {named}"


def spread_words(config: pd.Series) -> str:
    """ "(p10-p90 a-b per rank) " where the configuration has a spread, else ""."""
    low, high = (config.get(column) for column in SPREAD)
    if pd.isna(low) or pd.isna(high):
        return ""
    return f"(p10-p90 {fmt('tokens_per_s_per_gpu', low)}-{fmt('tokens_per_s_per_gpu', high)} per rank) "


def setup_words(config: pd.Series, cells: Cells) -> str:
    """A configuration as the recommendation names it: variant, batch ("(auto)" where searched), setting."""
    batch = value_text(config["batch_size"]) + (" (auto)" if config.get("auto_batch") == True else "")  # noqa: E712 (numpy bool or NaN)
    return f"{config['variant']} at {describe({'batch_size': batch, **{f: config[f] for f in cells.fixed}})}"
