"""A launch's fixed cost before and after a change, on this machine (issue 45): the same one-cell
sweep (the tiny model on CPU, 2 gloo processes, 12 steps, the default communication profile)
submitted with `--executor local` from two source trees in turn, ROUNDS times, alternating which
goes first; then the median of each phase (the record's `phases`), of the launch's wall time (the
manifest's submitted_at to ended_at) and of its fixed cost (that wall time less the timed window),
and the median of each round's difference (after less before: the two ran back to back).

    python bench/launch_cost_before_after.py --before <commit> [--rounds 6] [--out DIR]
    python bench/launch_cost_before_after.py --before-src DIR/src --model qwen2.5-1.5b --device cuda \
        --gpus 1 --precision bf16 --seq-len 2048 --batch 2 --steps 10      # a GPU machine (issue 52)
    python bench/launch_cost_before_after.py --tabulate DIR/raw.jsonl [DIR2/raw.jsonl ...]

The "before" tree is `git archive <commit> src`, or a src folder carried to a machine whose .git
is a stale copy (--before-src); "after" is this checkout's src. Raw lines (one
JSON object a launch) go to DIR/raw.jsonl, each submit's output to DIR/logs/, the table to stdout
and DIR/launch_cost.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("launcher_start", "imports", "process_group", "model_build", "warmup", "timed_window", "measurement")
SWEEP = """name: launch_cost
base: {{model: {model}, device: {device}, precision: {precision}, seq_len: {seq_len}, gpus_per_node: {gpus},
        steps: {steps}, batch_size: {batch}}}
slurm: {{time_min: 10}}
matrix:
  strategy: [ddp]
"""


def before_tree(commit: str, out: Path) -> Path:
    """src of `commit`, unpacked under out/before."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out / "before", filter="data")
    return out / "before" / "src"


def launch(side: str, src: Path, jobs: Path, out: Path, index: int) -> dict:
    """One submit of the sweep with `src` first on the path: its cell's phases and wall time."""
    results = out / "results" / f"{side}{index}"
    # src first; what the caller's path holds (a GPU machine's carried wheels in /tmp/site) after it
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "local"]
    with open(out / "logs" / f"{side}{index}.log", "w") as log:
        subprocess.run([*command, "--results-dir", str(results)], stdout=log, stderr=subprocess.STDOUT, env=env)
    (path,) = results.glob("launch_cost/cells/*/result.json")
    record = json.loads(path.read_text())
    entry = json.loads((results / "launch_cost/manifest.json").read_text())[record["cell_id"]]
    phases = record.get("phases") or {}
    wall = entry["ended_at"] - entry["submitted_at"]
    return {
        "side": side,
        "round": index,
        "at": time.strftime("%H:%M:%S", time.gmtime(entry["submitted_at"])),
        "status": record["status"],
        "launch_s": wall,
        "fixed_s": wall - phases.get("timed_window", 0.0),
        "duration_s": record.get("duration_s"),
        "teardown": phases.get("teardown"),
        **{name: phases.get(name) for name in PHASES},
        "tokens_per_s_per_gpu": record.get("tokens_per_s_per_gpu"),
        "comm_s_per_step": record.get("comm_s_per_step"),
        "loadavg_1min": os.getloadavg()[0],
    }


def table(rows: list[dict]) -> str:
    columns = ["launch_s", "fixed_s", "launcher_start", "imports", "measurement", "teardown", "timed_window"]
    lines = [
        "| | launches | " + " | ".join(columns) + " | tokens/s/GPU | comm_s_per_step |",
        "|---|--:|" + "--:|" * (len(columns) + 2),
    ]
    for side in ("before", "after"):
        mine = [row for row in rows if row["side"] == side and row["status"] == "ok"]
        if not mine:
            continue

        def median(key: str, rows: list[dict] = mine) -> float:
            return statistics.median(row[key] for row in rows if row[key] is not None)

        figures = [f"{median(key):.2f}" for key in columns]
        lines.append(
            f"| {side} | {len(mine)} | " + " | ".join(figures) + f" | {median('tokens_per_s_per_gpu'):,.0f} |"
            f" {median('comm_s_per_step'):.4f} |"
        )
    pairs: dict[tuple, dict[str, dict]] = {}  # (batch, round) -> side -> row: the two ran back to back
    for row in rows:
        if row["status"] == "ok":
            pairs.setdefault((row.get("batch"), row["round"]), {})[row["side"]] = row
    both = [pair for pair in pairs.values() if len(pair) == 2]
    if both:
        diffs = [f"{statistics.median(p['after'][key] - p['before'][key] for p in both):+.2f}" for key in columns]
        lines.append(f"| after - before, median of the rounds' pairs | {len(both)} | " + " | ".join(diffs) + " | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="the commit to compare against")
    parser.add_argument("--before-src", type=Path, help="the src folder to compare against, instead of --before")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--gpus", type=int, default=2, help="processes of the one cell (gpus_per_node)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "launch_cost")
    parser.add_argument("--tabulate", type=Path, nargs="+", help="only the table, of these raw.jsonl files")
    args = parser.parse_args()
    if args.tabulate:
        rows = [
            {**json.loads(line), "batch": str(path)} for path in args.tabulate for line in path.read_text().splitlines()
        ]
        print(table(rows))
        return
    if not (args.before or args.before_src):
        parser.error("--before or --before-src is required unless --tabulate")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    jobs = args.out / "launch_cost.yaml"
    shape = {key: getattr(args, key) for key in ("model", "device", "precision", "gpus", "seq_len", "batch", "steps")}
    jobs.write_text(SWEEP.format(**shape))
    before = args.before_src.resolve() if args.before_src else before_tree(args.before, args.out)
    trees = {"before": before, "after": ROOT / "src"}
    rows = []
    with open(args.out / "raw.jsonl", "a") as raw:
        for index in range(args.rounds):
            order = ("before", "after") if index % 2 == 0 else ("after", "before")
            for side in order:
                row = launch(side, trees[side], jobs, args.out, index)
                print(json.dumps(row), file=raw, flush=True)
                print(f"[launch_cost] {row['at']} {side} round {index}: launch {row['launch_s']:.2f} s", flush=True)
                rows.append(row)
    text = table(rows)
    (args.out / "launch_cost.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
