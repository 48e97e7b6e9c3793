"""A launch's fixed cost for the first cell and each later cell of one supervisor process (issue 52):
the node's supervisor imports the ranks' code once and forks each cell's ranks, against the same
supervisor starting every rank as a new interpreter (HPCFSDP_RANK_START=exec, as before the fork),
and, with --before-src, the supervisor of another source tree (`git archive <commit> src`: before);
with --local, `hpcfsdp submit --executor local` of the same cells (local: one supervisor process
kept for the submit's cells, sweep/launch/local.WarmSupervisor); with --bytecode, the fork side
against the same with HPCFSDP_BYTECODE_CACHE=off (nocache), after one process has filled the
supervisor's bytecode folder as an earlier allocation would (cell/supervise/bytecode.py: where the
install has no bytecode, as on the lent GPU image, every first cell compiles torch without it).

Each side of each round is one fresh process (`--drive`) that runs CELLS cells one after another,
as tune's probes run in their Slurm job and a CellJob of several cells would: for each, the launch's
start is exported (as the launching side does), then cell/supervise/entry.supervise_here. The
sides alternate which goes first. A cell's fixed cost is its record's launch_span_s (the launch's
start to the record's write) less its timed window; its wall, the launch's start to
supervise_here's return. Medians per side and position (the first cell, the later ones).

    python bench/launch_cost_warm.py [--rounds 3] [--cells 3] [--before-src DIR/src] [--out DIR]  # CPU, tiny
    python bench/launch_cost_warm.py --model qwen2.5-1.5b --device cuda --precision bf16 \\
        --gpus 1 --seq-len 2048 --batch 2 --steps 10 --rounds 3 --cells 3          # 1 GPU (source bench/gpu_env.sh)
    python bench/launch_cost_warm.py --tabulate DIR/raw.jsonl

Raw lines (one JSON object a cell) go to DIR/raw.jsonl, each side's output to DIR/logs/, the table
to stdout and DIR/launch_cost_warm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = """name: {name}
base: {{model: {model}, device: {device}, precision: {precision}, seq_len: {seq_len}, gpus_per_node: {gpus},
        steps: {steps}, batch_size: {batch}, strategy: ddp, comm_profile_steps: 0}}
slurm: {{time_min: 10}}
matrix:
  seed: {seeds}
"""
SIDES = ("fork", "exec", "before", "local", "nocache")  # HPCFSDP_RANK_START of each side; before: --before-src's tree
FILL = "import os; from hpcfsdp.cell.supervise.bytecode import use_bytecode_cache as use; print(use(os.environ))"


def drive(cells: list[str], processes: int) -> None:
    """In this fresh process: the cells one after another under supervise_here; a JSON line each."""
    from hpcfsdp.cell.supervise.entry import supervise_here

    for index, cell in enumerate(cells):
        started = time.time()
        os.environ["HPCFSDP_LAUNCH_STARTED"] = repr(started)
        code = supervise_here(cell, processes)
        ended = time.time()
        record = json.loads((Path(cell) / "result.json").read_text())
        line = {"position": index, "exit": code, **launch_figures(record, ended - started)}
        print("[warm] " + json.dumps(line), flush=True)


def launch_figures(record: dict, wall_s: float) -> dict:
    """A launch's figures from its record and its wall (the launching side's start to end): the
    fixed cost is the span (or the wall) less the timed window."""
    phases = record.get("phases") or {}
    span = record.get("launch_span_s")
    window = phases.get("timed_window", 0.0)
    return {
        "status": record["status"],
        "fixed_s": span - window if span is not None else None,
        "wall_fixed_s": wall_s - window,
        "launch_span_s": span,
        "launcher_start": phases.get("launcher_start"),
        "imports": phases.get("imports"),
        "timed_window": window,
        "tokens_per_s_per_gpu": record.get("tokens_per_s_per_gpu"),
        "peak_memory_gib": record.get("peak_memory_gib"),
    }


def cell_folders(out: Path, name: str, shape: dict, cells: int) -> list[str]:
    """The sweep's cell folders (spec.json each), written by `submit --executor print`."""
    jobs = out / f"{name}.yaml"
    jobs.write_text(SWEEP.format(name=name, seeds=list(range(1, cells + 1)), **shape))
    results = out / "results"
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "print"]
    subprocess.run([*command, "--results-dir", str(results)], check=True, stdout=subprocess.DEVNULL, env=_env())
    folders = sorted(str(p) for p in (results / name / "cells").iterdir())
    assert len(folders) == cells, folders
    return folders


def _env(src: Path = ROOT / "src", **extra: str) -> dict[str, str]:
    """This environment with `src` first on the path; without OMP_NUM_THREADS unless the caller set
    it, as a Slurm task's (each rank gets its share of the CPUs from its supervisor)."""
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_side(side: str, src: Path, folders: list[str], processes: int, out: Path, index: int) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--drive", "--gpus", str(processes), *folders]
    log = out / "logs" / f"{side}{index}.log"
    start = "exec" if side == "exec" else "fork"
    env = _env(src, HPCFSDP_RANK_START=start, **({"HPCFSDP_BYTECODE_CACHE": "off"} if side == "nocache" else {}))
    with open(log, "w") as written:
        subprocess.run(command, stdout=written, stderr=subprocess.STDOUT, env=env)
    lines = [line[len("[warm] ") :] for line in log.read_text().splitlines() if line.startswith("[warm] ")]
    return [{"side": side, "round": index, **json.loads(line), "loadavg_1min": os.getloadavg()[0]} for line in lines]


def run_local_side(out: Path, shape: dict, cells: int, index: int) -> list[dict]:
    """The cells in one `submit --executor local`: a row each, in the order they ran; the wall from
    the manifest's submitted_at to ended_at (the local executor's own bounds of a launch)."""
    name = f"local{index}"
    jobs = out / f"{name}.yaml"
    jobs.write_text(SWEEP.format(name=name, seeds=list(range(1, cells + 1)), **shape))
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "local"]
    with open(out / "logs" / f"{name}.log", "w") as written:
        subprocess.run(
            [*command, "--results-dir", str(out / "results")], stdout=written, stderr=subprocess.STDOUT, env=_env()
        )
    manifest = json.loads((out / "results" / name / "manifest.json").read_text())
    records = sorted(
        (json.loads(path.read_text()) for path in (out / "results" / name / "cells").glob("*/result.json")),
        key=lambda record: manifest[record["cell_id"]]["submitted_at"],
    )
    entries = [manifest[record["cell_id"]] for record in records]
    walls = [entry["ended_at"] - entry["submitted_at"] for entry in entries]
    return [
        {
            "side": "local",
            "round": index,
            "position": position,
            "exit": None,
            **launch_figures(
                record, manifest[record["cell_id"]]["ended_at"] - manifest[record["cell_id"]]["submitted_at"]
            ),
            "loadavg_1min": os.getloadavg()[0],
        }
        for position, (record, wall) in enumerate(zip(records, walls, strict=True))
    ]


def table(rows: list[dict]) -> str:
    columns = ["fixed_s", "wall_fixed_s", "launch_span_s", "launcher_start", "imports", "timed_window"]
    lines = [
        "| side | cell | launches | " + " | ".join(columns) + " | tokens/s/GPU |",
        "|---|---|--:|" + "--:|" * (len(columns) + 1),
    ]
    for side in SIDES:
        for label, first in (("first", True), ("later", False)):
            mine = [r for r in rows if r["side"] == side and (r["position"] == 0) == first and r["status"] == "ok"]
            if not mine:
                continue

            def median(key: str, rows: list[dict] = mine) -> float:
                values = [row[key] for row in rows if row.get(key) is not None]
                return statistics.median(values) if values else float("nan")

            figures = " | ".join(f"{median(key):.2f}" for key in columns)
            lines.append(f"| {side} | {label} | {len(mine)} | {figures} | {median('tokens_per_s_per_gpu'):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--gpus", type=int, default=1, help="processes of each cell (gpus_per_node)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cells", type=int, default=3, help="cells one supervisor process runs (>= 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "launch_cost_warm")
    parser.add_argument("--before-src", type=Path, help="a third side: the supervisor of this src folder")
    parser.add_argument("--local", action="store_true", help="a side more: the cells in one local submit")
    parser.add_argument(
        "--bytecode", action="store_true", help="fork against fork without the bytecode folder (no exec side)"
    )
    parser.add_argument("--tabulate", type=Path, help="only the table of this raw.jsonl")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("folders", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args.folders, args.gpus)
        return
    if args.tabulate:
        print(table([json.loads(line) for line in args.tabulate.read_text().splitlines()]))
        return
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    shape = {key: getattr(args, key) for key in ("model", "device", "precision", "gpus", "seq_len", "batch", "steps")}
    trees = {"fork": ROOT / "src", "exec": ROOT / "src"}
    if args.before_src:
        trees["before"] = args.before_src.resolve()
    if args.local:
        trees["local"] = ROOT / "src"
    if args.bytecode:  # fork against nocache only
        trees.pop("exec")
        trees["nocache"] = ROOT / "src"
        started = time.time()
        filled = subprocess.run(
            [sys.executable, "-c", FILL + "; from hpcfsdp.cell import run"], env=_env(), text=True, capture_output=True
        )
        print(
            f"[launch_cost_warm] bytecode folder filled in {time.time() - started:.1f} s: {filled.stdout.strip()!r} "
            f"(exit {filled.returncode}) {filled.stderr[-500:]}",
            flush=True,
        )
    rows = []
    with open(args.out / "raw.jsonl", "a") as raw:
        for index in range(args.rounds):
            for side in list(trees)[index % len(trees) :] + list(trees)[: index % len(trees)]:  # turns go first
                if side == "local":
                    side_rows = run_local_side(args.out, shape, args.cells, index)
                else:
                    folders = cell_folders(args.out, f"{side}{index}", shape, args.cells)
                    side_rows = run_side(side, trees[side], folders, args.gpus, args.out, index)
                for row in side_rows:
                    print(json.dumps(row), file=raw, flush=True)
                    print(f"[launch_cost_warm] {side} round {index} cell {row['position']}: {row}", flush=True)
                    rows.append(row)
    text = table(rows)
    (args.out / "launch_cost_warm.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
