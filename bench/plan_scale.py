"""How long `hpcfsdp plan` takes on a 10,000-cell matrix (target: under 2 s).

Writes the jobs YAML into a temporary folder, then times load_sweep (expand + validate + ids) and
the plan table in this process (best of --repeat), and the whole `hpcfsdp plan` command in a
fresh interpreter. Usage: python bench/plan_scale.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcfsdp.cli import main
from hpcfsdp.sweep.define.matrix import load_sweep

# 4 x 5 x 5 x 5 x 2 x 2 x 5 = 10,000 cells, in 2 arrays (1 and 2 nodes).
JOBS = """
name: plan_scale
base: {model: qwen2.5-1.5b, gpus_per_node: 4, steps: 20, warmup_steps: 5}
slurm: {time_min: 20, max_requeue: 1}
matrix:
  strategy: [ddp, fsdp2_zero2, fsdp2_zero3, fsdp2_hsdp]
  batch_size: [1, 2, 4, 8, 16]
  grad_accum: [1, 2, 4, 8, 16]
  seq_len: [512, 1024, 2048, 4096, 8192]
  activation_checkpointing: [none, full]
  nodes: [1, 2]
  seed: [0, 1, 2, 3, 4]
"""


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def plan_quietly(path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", str(path)]) == 0


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan_scale.yaml"
        path.write_text(JOBS)
        cells = len(load_sweep(path).cells)
        load_s = best_of(args.repeat, lambda: load_sweep(path))
        plan_s = best_of(args.repeat, lambda: plan_quietly(path))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hpcfsdp", "plan", str(path)], check=True, stdout=subprocess.DEVNULL)
        command_s = time.perf_counter() - start
    print(
        f"{cells} cells: load_sweep {load_s:.2f} s; load_sweep + plan table {plan_s:.2f} s (best of {args.repeat}); "
        f"`python -m hpcfsdp plan` in a new interpreter {command_s:.2f} s"
    )


if __name__ == "__main__":
    main_bench()
