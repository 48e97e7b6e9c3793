"""`hpcfsdp plan | submit | run | status | collect`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import yaml

from .spec import RunSpec, SpecError

DEFAULT_RESULTS = "results"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcfsdp",
        description="Compare DDP / FSDP1 / FSDP2 training setups for a causal LM, as Slurm job arrays.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="expand a jobs YAML and print its cells, without submitting")
    plan.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    plan.set_defaults(func=_plan)

    submit = sub.add_parser("submit", help="submit a jobs YAML: one job array per resource shape")
    submit.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    submit.add_argument("--executor", choices=("slurm", "local", "print"),
                        help="slurm (default when sbatch is on PATH), local (this machine, one cell at a time), "
                             "print (print torchrun commands)")
    submit.add_argument("--results-dir", default=DEFAULT_RESULTS, help=f"parent of the sweep folder (default {DEFAULT_RESULTS}/)")
    submit.add_argument("--wait", action="store_true", help="wait for the arrays to finish, then print the table")
    submit.add_argument("--retry-failed", action="store_true", help="also rerun cells whose record is not ok")
    submit.add_argument("--force", action="store_true", help="rerun every cell")
    submit.set_defaults(func=_submit)

    run = sub.add_parser("run", help="train one cell on this process (under torchrun, srun, or alone)",
                         description="Train one cell. Either --cell-dir (written by submit), or key=value "
                                     "RunSpec fields, e.g. `torchrun --nproc-per-node 2 -m hpcfsdp run "
                                     "strategy=fsdp2_zero2 batch_size=4 seq_len=4096`.")
    run.add_argument("fields", nargs="*", metavar="KEY=VALUE", help="RunSpec fields (see docs/record.md)")
    run.add_argument("--cell-dir", help="a cell folder holding spec.json")
    run.add_argument("--results-dir", default=DEFAULT_RESULTS, help=f"with KEY=VALUE: parent of the sweep folder (default {DEFAULT_RESULTS}/)")
    run.add_argument("--sweep", default="manual", help="with KEY=VALUE: sweep name (default manual)")
    run.set_defaults(func=_run)

    status = sub.add_parser("status", help="counts of cells by state in a sweep folder")
    status.add_argument("sweep_dir", help="e.g. results/smoke")
    status.set_defaults(func=_status)

    collect = sub.add_parser("collect", help="records -> comparison table (report/results.csv, report/summary.md)")
    collect.add_argument("sweep_dir", help="e.g. results/smoke")
    collect.set_defaults(func=_collect)
    return parser


def _plan(args: argparse.Namespace) -> int:
    from .matrix import load_sweep

    sweep = load_sweep(args.jobs)
    groups = sweep.groups()
    shape_index = {shape: i for i, shape in enumerate(groups)}
    print(f"{sweep.name}: {len(sweep.cells)} cell(s) in {len(groups)} array(s)")
    header = f"{'cell':44} {'strategy':20} {'batch':>5} {'accum':>5} {'ckpt':>9} {'nodes x gpus':>12} {'array':>5}"
    print(header)
    for cell in sweep.cells:
        s = cell.spec
        print(f"{cell.id:44} {s.strategy:20} {s.batch_size:5} {s.grad_accum:5} {s.activation_checkpointing:>9} "
              f"{f'{s.nodes} x {s.gpus_per_node}':>12} {shape_index[cell.shape]:5}")
    gpu_hours = sum(c.spec.world_size for c in sweep.cells) * sweep.resources.time_min / 60
    print(f"upper bound: {gpu_hours:.1f} GPU-hours at a {sweep.resources.time_min} min limit per cell")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from .matrix import load_sweep
    from .submit import default_executor, submit, wait_slurm

    sweep = load_sweep(args.jobs)
    executor = args.executor or default_executor()
    if args.executor is None and executor == "local":
        print("note: sbatch not found on PATH; running cells on this machine (--executor local)")
    sub = submit(sweep, Path(args.results_dir), executor, force=args.force, retry_failed=args.retry_failed)
    print(f"sweep folder: {sub.sweep_dir}")
    if executor == "slurm" and args.wait and sub.jobs:
        states = wait_slurm(sub)
        bad = {cid: st for cid, st in states.items() if st != "COMPLETED"}
        for cid, st in bad.items():
            print(f"  {cid}: Slurm state {st}")
    if executor == "local" or (args.wait and executor == "slurm"):
        return _print_collection(sub.sweep_dir)
    return 0


def _run(args: argparse.Namespace) -> int:
    from .matrix import Cell
    from .run import run_cell, run_cell_dir

    if args.cell_dir:
        if args.fields:
            raise SpecError("run: give either --cell-dir or KEY=VALUE fields, not both")
        status = run_cell_dir(Path(args.cell_dir))
    else:
        values = {}
        for item in args.fields:
            key, sep, value = item.partition("=")
            if not sep:
                raise SpecError(f"run: {item!r}: expected KEY=VALUE")
            values[key] = yaml.safe_load(value)
        spec = RunSpec.from_dict(values, where="run arguments")
        cell = Cell.of(spec)
        status = run_cell(spec, Path(args.results_dir) / args.sweep / "cells" / cell.id, cell.id, args.sweep)
    return 0 if status == "ok" else 1


def _status(args: argparse.Namespace) -> int:
    from .collect import load_records
    from .submit import read_manifest

    sweep_dir = Path(args.sweep_dir)
    manifest = read_manifest(sweep_dir)
    collection = load_records(sweep_dir)
    states = Counter(collection.frame["status"]) if not collection.frame.empty else Counter()
    finished = set(collection.frame["cell_id"]) if not collection.frame.empty else set()
    pending = [cid for cid in manifest if cid not in finished]
    states["pending or lost"] = len(pending)
    print(f"{sweep_dir}: " + ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
    for cid in pending:
        print(f"  {cid}: no record yet (job {manifest[cid].get('job_id')})")
    return 0


def _collect(args: argparse.Namespace) -> int:
    return _print_collection(Path(args.sweep_dir))


def _print_collection(sweep_dir: Path) -> int:
    from .collect import markdown_table, write_report

    if not sweep_dir.is_dir():
        raise SpecError(f"{sweep_dir}: no such sweep folder")
    table, report, unreadable = write_report(sweep_dir)
    print(markdown_table(table))
    for message in unreadable:
        print(f"warning: skipped {message}", file=sys.stderr)
    print(f"wrote {report / 'results.csv'} and {report / 'summary.md'}")
    return 0
