#!/usr/bin/env python3
"""Collect 10,000 records and plan 10,000 cells with two versions of hpcfsdp, interleaved, on a
shared machine (issue 45 item 4: collect under 5 s, plan under 1 s beyond the CLI's start-up).

Each version is a source tree (a commit exported with `git archive`, or this checkout's src/).
Rounds alternate the versions (before, after, after, before, ...), so that load from other users
of the machine hits both alike; each round times, in fresh processes:

- `hpcfsdp collect` of a fresh copy of the sweep (every plot drawn), then again on the same folder
  (nothing changed: a version that keeps unchanged plots draws none), and `--no-plots`;
- `plan` of the 10,000-cell matrix of bench/plan_scale.py, from after the CLI's import to its
  end (what the command costs beyond start-up), and the CLI's start-up itself.

Wall seconds and CPU seconds (user + system of the child and its children) for each; the CPU
seconds are what other load changes least. Prints one line per run and a median table.

First, once per version, a fresh collect in the same folder: what it wrote and printed must be the
same bytes (the report's files, stdout, stderr less its progress lines and timing, the history's rows less
`collected_at`; `plots/drawn.json` by its outcomes, as its digest covers the drawing code); the
script names what differs and exits 1 (`--allow-different` goes on to the timings).

    python bench/collect_plan_before_after.py --before /tmp/before/src --after src [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import collect_scale  # noqa: E402  (bench/ is not a package)
import plan_scale  # noqa: E402

PLAN_BEYOND_STARTUP = (
    "import sys, time, contextlib, io\n"
    "from hpcfsdp.cli import main\n"
    "start = time.perf_counter()\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    code = main(['plan', sys.argv[1]])\n"
    "print(time.perf_counter() - start)\n"
    "sys.exit(code)\n"
)


def timed(args: list[str], src: Path) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the child and what it waited for) and stdout of one run."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def fresh_outputs(src: Path, pristine: Path, scratch: Path) -> dict[str, str]:
    """What a fresh collect by this version writes and prints, each output by its digest."""
    import duckdb

    folder = scratch / "outputs" / "results"  # the same path for every version: the outputs name it
    shutil.rmtree(folder.parent, ignore_errors=True)
    sweep = folder / "scale"
    shutil.copytree(pristine, sweep)
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, "-m", "hpcfsdp", "collect", str(sweep)], env=env, capture_output=True)
    # Progress lines come with the clock: counts, a stage's line (only once a second has passed), the time taken.
    timing = rb"(?m)^[a-z ]+: [0-9,]+/[0-9,]+\n|^[A-Za-z ]+ \.\.\.\n|done in [0-9.]+ s"
    found = {"stdout": proc.stdout, "stderr": re.sub(timing, b"", proc.stderr)}
    for path in sorted((sweep / "report").rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            found[str(path.relative_to(sweep))] = (
                json.dumps(json.loads(data)["outcomes"]).encode() if path.name == "drawn.json" else data
            )
    with duckdb.connect(str(folder / "history.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT * EXCLUDE (collected_at) FROM runs ORDER BY cell_id, attempt").fetchall()
    found["history rows"] = repr(rows).encode()
    return {name: hashlib.sha256(data).hexdigest() for name, data in found.items()}


def one_round(name: str, src: Path, pristine: Path, jobs: Path, scratch: Path) -> dict[str, tuple[float, float]]:
    folder = scratch / name / "results"  # collect keeps a history beside the sweep: one per run
    shutil.rmtree(folder.parent, ignore_errors=True)
    sweep = folder / "scale"
    shutil.copytree(pristine, sweep)
    collect = [sys.executable, "-m", "hpcfsdp", "collect", str(sweep)]
    runs = {
        "collect (fresh folder)": timed(collect, src)[:2],
        "collect again (nothing changed)": timed(collect, src)[:2],
        "collect --no-plots": timed([*collect, "--no-plots"], src)[:2],
    }
    _, cpu, out = timed([sys.executable, "-c", PLAN_BEYOND_STARTUP, str(jobs)], src)
    runs["plan beyond start-up"] = (float(out.strip().splitlines()[-1]), cpu)
    runs["CLI start-up (--help)"] = timed([sys.executable, "-m", "hpcfsdp", "--help"], src)[:2]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the src/ folder of the version before")
    parser.add_argument("--after", type=Path, required=True, help="the src/ folder of the version after")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each version (default: %(default)s)")
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--allow-different", action="store_true", help="time versions whose outputs differ")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hpcfsdp-before-after-"))
    try:
        pristine = collect_scale.write_sweep(scratch / "pristine", args.cells)
        jobs = scratch / "plan_scale.yaml"
        jobs.write_text(plan_scale.JOBS)
        print(f"machine: {os.cpu_count()} CPU(s), load average {os.getloadavg()}, Python {sys.version.split()[0]}")
        versions = {"before": args.before.resolve(), "after": args.after.resolve()}
        before, after = (fresh_outputs(versions[name], pristine, scratch) for name in ("before", "after"))
        different = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        print(f"outputs of a fresh collect: {len(before)} compared, different: {', '.join(different) or 'none'}")
        if different and not args.allow_different:
            return 1
        pairs = (("before", "after"), ("after", "before"))  # alternated: neither always runs first
        order = [name for index in range(args.rounds) for name in pairs[index % 2]]
        results: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in versions}
        for index, name in enumerate(order):
            runs = one_round(name, versions[name], pristine, jobs, scratch)
            results[name].append(runs)
            load = os.getloadavg()[0]
            for what, (wall, cpu) in runs.items():
                print(f"round {index // 2 + 1} {name:6} {what:32} {wall:7.2f} s wall {cpu:7.2f} s CPU, load {load:.1f}")
            sys.stdout.flush()
        print()
        print("| what | before: wall / CPU s | after: wall / CPU s | after / before (wall, CPU) |")
        print("| --- | --- | --- | --- |")
        for what in results["before"][0]:
            med = {
                name: tuple(statistics.median(run[what][i] for run in results[name]) for i in (0, 1))
                for name in versions
            }
            (bw, bc), (aw, ac) = med["before"], med["after"]
            print(f"| {what} | {bw:.2f} / {bc:.2f} | {aw:.2f} / {ac:.2f} | {aw / bw:.2f}, {ac / bc:.2f} |")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
