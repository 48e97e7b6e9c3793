"""What the search found and spent: tune.json in the sweep folder (its best.cell_id is the grid's
cell id of the pick, so `submit --only-best` and the report find it) and the lines `tune` prints.

Spend is GPU-hours from the launches (launcher start to end, times its GPUs); what the grid would
have spent is estimated cell by cell from the probes' launches (gridcost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..contracts.files import RecordError, write_json
from ..contracts.gpus import rank_words_named
from ..contracts.record import RECORD_NAME, read_record
from ..contracts.validity import invalid_reasons, within_noise
from ..sweep.define.matrix import Cell, Sweep, cells_rank_words
from ..sweep.folder.layout import TUNE_NAME, cell_dir
from ..sweep.launch.plan import PLAN_FIELDS
from . import gridcost
from .accumulation import computed_speed
from .prune import prune
from .state import FINAL, REPEAT, Stage, TuneState, read_launches, run_record, stage_dir


def outcome(sweep: Sweep, sweep_dir: Path, state: TuneState) -> dict[str, Any]:
    cells = {cell.id: cell for cell in sweep.cells}
    show = _setup_fields(sweep)
    rows: dict[str, dict[str, Any]] = {}  # grid id -> its furthest stage's result
    for depth, stage in enumerate(state.stages):
        for run, grid_id in stage.runs.items():
            row = _row(sweep_dir, stage, run, grid_id, depth, cells[grid_id], show)
            rows[grid_id] = _repeated(rows[grid_id], row) if stage.name == REPEAT else row
    first = state.stages[0] if state.stages else None
    probe_of = {grid_id: run for run, grid_id in first.runs.items()} if first else {}
    for grid_id, source in state.computed.items():
        if grid_id not in rows and first:
            rows[grid_id] = _computed_row(sweep_dir, first.name, probe_of.get(source, ""), source, cells[grid_id], show)
    ranked = sorted(
        rows.values(),
        key=lambda r: (r["status"] != "ok", -r["depth"], -(r.get("tokens_per_s_per_gpu") or 0.0)),
    )
    final_ok = [r for r in ranked if r["stage"] in (FINAL, REPEAT) and r["status"] == "ok"]
    best = dict(final_ok[0]) if final_ok else None
    if best:
        spread = best.get("tokens_per_s_spread")
        best["within_noise_of"] = [
            r["cell_id"] for r in final_ok[1:] if within_noise(spread, r.get("tokens_per_s_spread"))
        ]
    launches = read_launches(sweep_dir)
    by_stage: dict[str, float] = {}
    for launch in launches:
        by_stage[launch.stage] = by_stage.get(launch.stage, 0.0) + launch.gpu_hours
    grid_estimate = gridcost.grid_estimate(cells, sweep_dir, state)
    spent = sum(by_stage.values())
    return {
        "sweep": sweep.name,
        "rank": cells_rank_words(sweep.cells).one,  # what tokens/s and hours are per: GPU, or process on the CPU
        "best": best,
        "ranking": ranked,
        "oom_frontier": [r for r in ranked if r["status"] == "oom"],
        "failed": [r for r in ranked if r["status"] not in ("ok", "oom", "invalid")],
        "invalid": [r for r in ranked if r["status"] == "invalid"],
        "pruned": state.pruned,
        "notes": [*prune(sweep).notes, *_grid_note(state)],
        "spend": {
            "tune_gpu_hours": spent,
            "by_stage": by_stage,
            "launches": len(launches),
            "grid_cells": len(sweep.cells),
            "grid_estimate_gpu_hours": grid_estimate,
            "grid_estimate_basis": gridcost.BASIS if grid_estimate else "no probe launched to estimate from",
            "fraction_of_grid": spent / grid_estimate if grid_estimate else None,
        },
        "stages": [{"name": s.name, "runs": len(s.runs), "jobs": sorted(s.jobs)} for s in state.stages],
    }


def _repeated(final: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """A setup run in the final stage and once more: tokens/s per GPU the mean of both runs (each
    in `runs_tokens_per_s_per_gpu`), its spread from the lower p10 to the higher p90; as the
    repeat's run says where either did not finish ok with trusted figures."""
    if final.get("status") != "ok" or again.get("status") != "ok":
        return again
    speeds = [final["tokens_per_s_per_gpu"], again["tokens_per_s_per_gpu"]]
    spreads = [s for s in (final.get("tokens_per_s_spread"), again.get("tokens_per_s_spread")) if s]
    merged = (
        {"p10": min(s["p10"] for s in spreads), "p90": max(s["p90"] for s in spreads)} if len(spreads) == 2 else None
    )
    return {
        **again,
        "tokens_per_s_per_gpu": sum(speeds) / 2,
        "runs_tokens_per_s_per_gpu": speeds,
        "tokens_per_s_spread": merged,
    }


def _grid_note(state: TuneState) -> list[str]:
    """Say so where the search ran the grid's cells themselves, no probe (stages.search)."""
    if [stage.name for stage in state.stages] != [FINAL]:
        return []
    return [f"no probes: the grid's {len(state.stages[0].runs)} cell(s) ran themselves (probing could not save)"]


def _setup_fields(sweep: Sweep) -> tuple[str, ...]:
    varying = [name for name in sweep.cells[0].spec.to_dict() if len({getattr(c.spec, name) for c in sweep.cells}) > 1]
    return tuple(dict.fromkeys([*PLAN_FIELDS[:4], *varying]))


def _row(sweep_dir: Path, stage: Stage, run: str, grid_id: str, depth: int, cell: Cell, show: tuple) -> dict:
    row: dict[str, Any] = {
        "cell_id": grid_id,
        "stage": stage.name,
        "depth": depth,
        "run": run,
        "setup": {name: getattr(cell.spec, name) for name in show},
    }
    try:
        record = read_record(cell_dir(stage_dir(sweep_dir, stage.name), run) / RECORD_NAME)
    except (RecordError, FileNotFoundError):
        return {**row, "status": "missing"}
    row["status"] = record["status"]
    ran = record.get("spec") or {}
    if cell.spec.auto_batch and "batch_size" in row["setup"] and isinstance(ran.get("batch_size"), int):
        row["setup"]["batch_size"] = ran["batch_size"]  # the batch its search chose, which it ran at
    reasons = invalid_reasons(record) if record["status"] == "ok" else []
    if reasons:  # it ran, but its figures rank nowhere
        row.update(status="invalid", invalid_reasons=reasons)
    elif record["status"] == "ok":
        row.update(
            tokens_per_s_per_gpu=record["tokens_per_s_per_gpu"],
            tokens_per_s_spread=record.get("tokens_per_s_spread"),
            timed_steps=record.get("timed_steps"),
            peak_memory_gib=record.get("peak_memory_gib"),
        )
    else:
        row["error"] = str(record.get("error", ""))[:300]
    return row


def _computed_row(sweep_dir: Path, stage: str, run: str, source: str, cell: Cell, show: tuple) -> dict:
    """A setup the first stage did not probe: its figures from the probe of `source` (the same
    setup at a smaller accumulation); out of memory where that probe was."""
    record = run_record(sweep_dir, stage, run)
    row: dict[str, Any] = {
        "cell_id": cell.id,
        "stage": stage,
        "depth": 0,
        "computed_from": source,
        "setup": {name: getattr(cell.spec, name) for name in show},
        "status": record["status"] if record else "missing",
    }
    speed = computed_speed(record, cell.spec.grad_accum) if record and record["status"] == "ok" else None
    if speed is not None:
        row["tokens_per_s_per_gpu"] = speed
    elif row["status"] == "ok":
        row["status"] = "missing"  # the probe has no optimizer time to compute from
    return row


def write_outcome(sweep_dir: Path, found: dict[str, Any]) -> Path:
    return write_json(Path(sweep_dir) / TUNE_NAME, found)


def summary_lines(found: dict[str, Any]) -> list[str]:
    words = rank_words_named(found.get("rank"))  # GPU, or process on the CPU
    lines = [*(f"note: {note}" for note in found["notes"])]
    best = found["best"]
    if best:
        setup = " ".join(f"{k}={v}" for k, v in best["setup"].items())
        speed = f"{best['tokens_per_s_per_gpu']:,.1f} tokens/s {words.per}"
        lines.append(f"chosen: {best['cell_id']} ({setup}): {speed}{_sureness(best)}")
    else:
        lines.append("chosen: none (no setup finished its final stage ok)")
    lines.append(f"ranking (furthest stage first, then tokens/s {words.per}):")
    for rank, row in enumerate(found["ranking"], 1):
        speed = f"{row['tokens_per_s_per_gpu']:>12,.1f}" if row["status"] == "ok" else f"{row['status']:>12}"
        setup = " ".join(f"{k}={v}" for k, v in row["setup"].items())
        computed = f"  (computed from {row['computed_from']})" if row.get("computed_from") else ""
        lines.append(f"  {rank:3} {row['cell_id']:40} {row['stage']:7} {speed}  {setup}{computed}")
    for row in found.get("invalid", []):
        lines.append(f"not ranked (figures cannot be trusted): {row['cell_id']}: {'; '.join(row['invalid_reasons'])}")
    if found["oom_frontier"]:
        lines.append("OOM frontier (ran out of memory): " + ", ".join(r["cell_id"] for r in found["oom_frontier"]))
    for cell_id, why in found["pruned"].items():
        lines.append(f"left out before running: {cell_id}: {why}")
    spend = found["spend"]
    grid = spend["grid_estimate_gpu_hours"]
    versus = f" against about {grid:.4f} for the grid ({spend['grid_estimate_basis']})" if grid else ""
    lines.append(f"spent {spend['tune_gpu_hours']:.4f} {words.hours} in {spend['launches']} launch(es){versus}")
    return lines


def _sureness(best: dict[str, Any]) -> str:
    """How sure the pick is: its runs, and the setups it could not be told apart from."""
    runs = best.get("runs_tokens_per_s_per_gpu")
    text = f" (mean of {len(runs)} runs: {', '.join(f'{v:,.1f}' for v in runs)})" if runs else ""
    close = best.get("within_noise_of") or []
    if close:
        again = "after a repeat, " if runs else ""
        text += f"; {again}within noise of {', '.join(close)}: these runs cannot tell them apart"
    return text


def best_only(sweep: Sweep, results_dir: Path, log) -> Sweep:
    """`submit --only-best`: the sweep less every cell but the one tune.json names."""
    import dataclasses

    from ..contracts.fields import SpecError
    from ..sweep.folder.tune_outcome import read_outcome

    path = Path(results_dir) / sweep.name / TUNE_NAME
    try:
        best = (read_outcome(path.parent).get("best") or {}).get("cell_id")
    except FileNotFoundError:
        raise SpecError(str(path), "", "no tune outcome: run `hpcfsdp tune` on this YAML first") from None
    if best is None:
        raise SpecError(str(path), "best", "the search chose no setup (none finished its final stage ok)")
    kept = tuple(cell for cell in sweep.cells if cell.id == best)
    if not kept:
        raise SpecError(str(path), "best.cell_id", f"{best!r} is no cell of {sweep.source}")
    log(f"--only-best: {best} (from {path})")
    return dataclasses.replace(sweep, cells=kept)
