"""Interleaved before/after wall time of what a rank imports before its cell starts."""

import os
import statistics
import subprocess
import time

PY = "/work/main/.venv/bin/python"
TREES = {"before a3f5631": "/tmp/s49b/base/src", "after (branch s49b)": "/work/wt/s49b/src"}
RANK = (
    "from hpcfsdp.cli import main; main(['run', '--cell-dir', '/nonexistent']); import hpcfsdp.cell.run; "
    "import sys; print(len(sys.modules), sum(m.startswith('hpcfsdp.sweep') for m in sys.modules), file=sys.stderr)"
)
LOGIN = "from hpcfsdp.cli import main; main(['run', '--cell-dir', '/nonexistent'])"


def once(src, code):
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    p = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
    return time.perf_counter() - t, p.stderr.strip().splitlines()[-1]


print(
    "date",
    time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    "| load",
    os.getloadavg(),
    "| host cores",
    os.cpu_count(),
)
for label, code, rounds in (
    ("rank: `run --cell-dir` up to run_cell, torch and transformers included", RANK, 10),
    ("torch-free part: cli, parser and run's own imports (run stops at the missing spec.json)", LOGIN, 20),
):
    times = {k: [] for k in TREES}
    for r in range(rounds):
        order = list(TREES) if r % 2 == 0 else list(TREES)[::-1]
        for k in order:
            s, info = once(TREES[k], code)
            times[k].append(s)
            print(f"  round {r:2d} {k:20s} {s * 1000:7.0f} ms  [{info}]")
    print(label)
    for k, v in times.items():
        print(
            f"  {k:20s} median {statistics.median(v) * 1000:6.0f} ms  min {min(v) * 1000:6.0f}"
            f"  max {max(v) * 1000:6.0f}  (n={len(v)})"
        )
print("load after", os.getloadavg())
