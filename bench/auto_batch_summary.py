"""The table of bench/auto_batch.sh: per `batch_size: auto` cell, the batch found, the check that
the next batch up does not fit, the search's wall time against a hand grid's, and the measured
peak beside the predicted one (hpcfsdp.sweep.predict.memory, as `plan --memory` prints it). Torch-free.

    PYTHONPATH=src python bench/auto_batch_summary.py SWEEP_DIR TIMINGS GPU_MEMORY_GIB

TIMINGS has one line per torchrun call: `<label> <wall seconds> <exit code>` (exit code -1: not
started, the time budget was spent). A cell's label is strategy/checkpointing, plus /snapshot for
the memory-snapshot cell and /grid for a fresh cell at the batch above the one found. The hand grid is
one cell per batch 1 .. found+1, each a fresh launch at this run's steps; a cell's cost is
estimated from this run's own figures: what the measured cell took beside its search (launch,
set-up, build, its steps), its steps rescaled to the grid cell's batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memory_prediction import spec_of  # bench/, beside this script

from hpcfsdp.contracts.sources import model_source
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.sweep.predict.memory import largest_fitting_batch, predict
from hpcfsdp.sweep.predict.modelshape import load_shape


def grid_seconds(record: dict, cell_wall: float) -> float | None:
    """Estimated wall time of a hand grid that finds the same frontier: batches 1 .. b+1, one launch each."""
    search = record.get("batch_search") or {}
    found = search.get("largest_fitting_batch")
    if record["status"] != "ok" or not found or not cell_wall:
        return None
    steps = record["spec"]["steps"]
    step_time = record["step_time_s"]
    overhead = max(0.0, cell_wall - search["wall_s"] - steps * step_time)
    cells = [overhead + steps * step_time * batch / found for batch in range(1, found + 1)]
    return sum(cells) + overhead + step_time  # batch b+1 fails in its first step


def next_batch_check(search: dict) -> str:
    found, probes = search["largest_fitting_batch"], {p["batch_size"]: p["status"] for p in search["probes"]}
    if search["capped"]:
        return f"capped at {search['cap']}: {found + 1} not tried"
    if probes.get(found + 1) in ("oom", "over_margin"):
        return f"{found + 1} {probes[found + 1]} (probe)"
    return f"{found + 1} not probed"


def label_of(spec: RunSpec) -> str:
    kind = "/snapshot" if spec.memory_snapshot else ("" if spec.auto_batch else "/grid")
    return f"{spec.strategy}/{spec.activation_checkpointing}{kind}"


def rows(sweep_dir: Path, timings: dict[str, tuple[float, int]], capacity: float | None) -> list[list[str]]:
    out, seen = [], set()
    for path in sorted(sweep_dir.glob("cells/*/result.json")):
        record = json.loads(path.read_text())
        spec, search = spec_of(record["spec"]), record.get("batch_search")
        label = label_of(spec)
        seen.add(label)
        wall, _ = timings.get(label, (0.0, 0))
        shape = load_shape(model_source(spec.model))
        predicted_b = (
            str(largest_fitting_batch(spec.replace(batch_size=search["first_batch"]), shape, capacity))
            if search and capacity
            else "-"
        )
        ok = record["status"] == "ok"
        peak = record.get("peak_memory_gib") if ok else None
        predicted = predict(spec, shape).peak_gib if record.get("device_type") == "cuda" else None
        grid = grid_seconds(record, wall) if search else None
        batch = str(spec.batch_size) if ok or not search else "-"
        out.append(
            [
                label,
                record["status"],
                batch,
                predicted_b,
                next_batch_check(search) if search and ok else "-",
                str(len(search["probes"])) if search else "-",
                f"{search['wall_s']:.0f}" if search else "-",
                f"{wall:.0f}",
                f"{grid:.0f}" if grid else "-",
                f"{record['tokens_per_s_per_gpu']:,.0f}" if ok else "-",
                f"{peak:.2f}" if peak else "-",
                f"{predicted:.2f}" if predicted else "-",
                f"{predicted / peak - 1:+.1%}" if peak and predicted else "-",
                f"{record['energy_j']:.0f}" if ok and record.get("energy_j") else "-",
            ]
        )
    for label, (wall, code) in timings.items():
        if label not in seen:
            why = (
                "not started (time budget)"
                if code < 0
                else "killed (time budget)"
                if code in (124, 137)
                else f"no record (exit {code})"
            )
            out.append([label, why, *["-"] * 5, f"{wall:.0f}", *["-"] * 6])
    return sorted(out, key=lambda row: row[0])


HEADERS = [
    "cell",
    "status",
    "batch found",
    "predicted",
    "next batch",
    "probes",
    "search s",
    "cell s",
    "hand grid s (est.)",
    "tokens/s/GPU",
    "peak GiB",
    "predicted GiB",
    "error",
    "energy J",
]


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table])


def main(argv: list[str]) -> int:
    sweep_dir, timings_path, capacity = Path(argv[0]), Path(argv[1]), float(argv[2]) or None
    timings = {}
    for line in timings_path.read_text().splitlines():
        label, wall, code = line.split()
        timings[label] = (float(wall), int(code))
    print(markdown(rows(sweep_dir, timings, capacity)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
