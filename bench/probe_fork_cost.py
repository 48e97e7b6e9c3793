"""What a `batch_size: auto` probe costs when it is forked by its rank's probe starter against a new
interpreter per probe (issue 52; cell/probe_start.py): the same one-cell sweep through
`hpcfsdp submit --executor local`, with HPCFSDP_RANK_START unset (forked) and `exec` (every rank and
probe a new interpreter), sides alternating which goes first each round. Per side: the probes the
search ran, the median probe's wall (its build, steps and release, as the search times it), the
search's wall and the batch it found, from each record's batch_search.

    python bench/probe_fork_cost.py [--rounds 2] [--out DIR]                          # CPU, tiny
    python bench/probe_fork_cost.py --model qwen2.5-1.5b --device cuda --precision bf16 \\
        --seq-len 2048 --max-batch 16 --rounds 2                                       # 1 GPU

Raw lines (one JSON object a probe) go to DIR/raw.jsonl, the table to stdout and DIR/probe_fork_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = """name: {name}
base: {{model: {model}, device: {device}, precision: {precision}, seq_len: {seq_len}, gpus_per_node: 1,
        steps: 6, batch_size: auto, max_batch_size: {max_batch}, strategy: ddp, comm_profile_steps: 0}}
slurm: {{time_min: 10}}
"""


def run_side(side: str, out: Path, shape: dict, index: int) -> list[dict]:
    name = f"{side}{index}"
    jobs = out / f"{name}.yaml"
    jobs.write_text(SWEEP.format(name=name, **shape))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("HPCFSDP_RANK_START", None)
    if side == "exec":
        env["HPCFSDP_RANK_START"] = "exec"
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", "local", "--results-dir"]
    with open(out / "logs" / f"{name}.log", "w") as written:
        subprocess.run([*command, str(out / "results")], stdout=written, stderr=subprocess.STDOUT, env=env)
    (path,) = (out / "results" / name / "cells").glob("*/result.json")
    record = json.loads(path.read_text())
    search = record.get("batch_search") or {}
    return [
        {
            "side": side,
            "round": index,
            "status": record["status"],
            "batch_found": search.get("chosen_batch_size"),
            "search_wall_s": search.get("wall_s"),
            "probe": position,
            **probe,
        }
        for position, probe in enumerate(search.get("probes") or [])
    ]


def table(rows: list[dict]) -> str:
    lines = [
        "| side | searches | probes | median probe wall, s | median search wall, s | batch found |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for side in ("fork", "exec"):
        mine = [row for row in rows if row["side"] == side]
        if not mine:
            continue
        searches = {row["round"]: row for row in mine}
        walls = [row["wall_s"] for row in mine if isinstance(row.get("wall_s"), (int, float))]
        search_walls = [row["search_wall_s"] for row in searches.values() if row.get("search_wall_s")]
        found = sorted({str(row["batch_found"]) for row in searches.values()})
        lines.append(
            f"| {side} | {len(searches)} | {len(mine)} | {statistics.median(walls):.2f} | "
            f"{statistics.median(search_walls):.2f} | {', '.join(found)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "probe_fork_cost")
    args = parser.parse_args()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    shape = {"model": args.model, "device": args.device, "precision": args.precision}
    shape |= {"seq_len": args.seq_len, "max_batch": args.max_batch}
    rows = []
    with open(args.out / "raw.jsonl", "a") as raw:
        for index in range(args.rounds):
            for side in ("fork", "exec") if index % 2 == 0 else ("exec", "fork"):
                for row in run_side(side, args.out, shape, index):
                    print(json.dumps(row), file=raw, flush=True)
                    print(f"[probe_fork_cost] {json.dumps(row)}", flush=True)
                    rows.append(row)
    text = table(rows)
    (args.out / "probe_fork_cost.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
