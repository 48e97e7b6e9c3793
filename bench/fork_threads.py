"""Which imports start a thread or load the CUDA driver in the supervisor's process (cell/supervise/
start.py then starts ranks by exec, not fork): after each module of hpcfsdp's compute side and the
libraries it uses, the threads of this process by name and whether libcuda is mapped, on the
machine it runs on. `python bench/fork_threads.py` (source bench/gpu_env.sh on the GPU machine)."""

import importlib
import os
import time

from hpcfsdp.cell.supervise.start import IMPORTING_ENV

STEPS = (
    "torch",
    "transformers",
    "pyarrow",
    "datasets",
    "triton",
    "torchao",
    "cut_cross_entropy",
    "hpcfsdp.cell.data",
    "hpcfsdp.cell.models",
    "hpcfsdp.cell.levers",
    "hpcfsdp.cell.strategies",
    "hpcfsdp.cell.train",
    "hpcfsdp.cell.run",
)


def state() -> str:
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    with open("/proc/self/maps") as f:
        cuda = any("libcuda.so" in line for line in f)
    return f"{len(names)} thread(s) [{' '.join(names)}], libcuda mapped: {cuda}"


os.environ.update(IMPORTING_ENV)
print("IMPORTING_ENV", IMPORTING_ENV, "|", state(), flush=True)
for name in STEPS:
    started = time.time()
    try:
        importlib.import_module(name)
        print(f"{name} ({time.time() - started:.1f} s): {state()}", flush=True)
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})", flush=True)
