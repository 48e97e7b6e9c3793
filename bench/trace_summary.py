"""Where a training step's GPU time goes, from torch.profiler chrome traces, side by side.

    python bench/trace_summary.py NAME=TRACE [NAME=TRACE ...] > trace_summary.md

Each TRACE is a chrome trace (.json or .json.gz) of one rank, as torchtitan's profiler and
`hpcfsdp run profile=true` write them. Per profiled step (the `ProfilerStep#N` annotations) it
gives: the GPU's busy time (union of kernels, memcpys and memsets), the idle time inside the steps'
GPU span, the kernel time per category, and the kernels that take the most time. The first trace
is the reference of the difference columns. Used by bench/versus_torchtitan.sh with PROFILE=1.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# First match wins: the order puts the specific names before the generic ones.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("communication (nccl)", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn|sdpa", re.I)),
    ("matmul (float8 / bf16 gemm)", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|scaled_mm|sm90_|sm100_", re.I)),
    ("optimizer (fused adamw)", re.compile(r"adam|multi_tensor", re.I)),
    ("triton (inductor-fused)", re.compile(r"^triton_", re.I)),
    ("cross-entropy / softmax (eager)", re.compile(r"softmax|cross_entropy|nll_loss|log_softmax", re.I)),
    ("copy / cast / cat (eager)", re.compile(r"copy|cast|cat_|CatArray|Memcpy|memcpy|to_copy", re.I)),
    ("reduction (eager)", re.compile(r"reduce_kernel|Reduce", re.I)),
    ("memset", re.compile(r"memset", re.I)),
    ("elementwise (eager)", re.compile(r"elementwise|vectorized|unrolled", re.I)),
]
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    steps = [e for e in steps if e.get("cat") in ("user_annotation", "cpu_op", None) or "gpu" not in str(e.get("cat"))]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise SystemExit("trace_summary: no GPU events in the trace (a CPU run?)")
    # The GPU work of the profiled steps: every GPU event launched from inside a step annotation.
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    windows = [(s["ts"], s["ts"] + s["dur"]) for s in steps]

    def in_steps(event: dict) -> bool:
        launch = launches.get(event.get("args", {}).get("correlation"))
        at = launch["ts"] if launch else event["ts"]
        return any(start <= at <= stop for start, stop in windows)

    work = [e for e in gpu if in_steps(e)] if windows else gpu
    n_steps = max(len(windows), 1)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in work]
    busy = union_length(spans)
    span = max(s for _, s in spans) - min(s for s, _ in spans)
    by_category: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in work:
        by_category[category(e["name"])] += e["dur"]
        by_kernel[e["name"]][0] += e["dur"]
        by_kernel[e["name"]][1] += 1
    ms = 1e-3 / n_steps  # microseconds over the trace -> milliseconds per step
    return {
        "steps": n_steps,
        "busy_ms": busy * ms,
        "span_ms": span * ms,
        "idle_ms": (span - busy) * ms,
        "kernels": len(work) / n_steps,
        "categories": {k: v * ms for k, v in by_category.items()},
        "top": {k: (v[0] * ms, v[1] / n_steps) for k, v in by_kernel.items()},
    }


def main(argv: list[str]) -> None:
    if not argv or any("=" not in a for a in argv):
        raise SystemExit(__doc__)
    named = [a.split("=", 1) for a in argv]
    results = {name: summarise(load(Path(path))) for name, path in named}
    names = list(results)
    ref = results[names[0]]
    print("| per step (ms) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key, label in [
        ("span_ms", "GPU span of the step"),
        ("busy_ms", "GPU busy"),
        ("idle_ms", "GPU idle inside the span"),
    ]:
        print(f"| {label} | " + " | ".join(f"{results[n][key]:.1f}" for n in names) + " |")
    print("| kernels launched | " + " | ".join(f"{results[n]['kernels']:.0f}" for n in names) + " |")
    labels = sorted({c for r in results.values() for c in r["categories"]}, key=lambda c: -ref["categories"].get(c, 0))
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{results[n]['categories'].get(label, 0.0):.1f}" for n in names) + " |")
    profiled = ", ".join(f"{n} {results[n]['steps']}" for n in names)
    print(
        f"\nSteps profiled: {profiled}. "
        "Kernel times are summed, so categories may add up to more than the busy time where streams overlap."
    )
    for name in names:
        print(f"\n**{name}: the 25 kernels with the most time per step**\n")
        print("| ms/step | calls/step | kernel |")
        print("|---|---|---|")
        top = sorted(results[name]["top"].items(), key=lambda kv: -kv[1][0])[:25]
        for kernel, (ms_per_step, calls) in top:
            short = kernel if len(kernel) < 110 else kernel[:107] + "..."
            print(f"| {ms_per_step:.2f} | {calls:.0f} | `{short.replace('|', '/')}` |")


if __name__ == "__main__":
    main(sys.argv[1:])
