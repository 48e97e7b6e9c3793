"""`hpcfsdp plan | submit | run | status | collect | download`."""

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

    collect = sub.add_parser("collect", help="records -> tables, plots and report/index.html (docs/collector.md)")
    collect.add_argument("sweep_dir", help="e.g. results/smoke")
    collect.add_argument("--baseline", metavar="STRATEGY",
                         help="strategy for speed-ups and memory savings (default ddp, or fsdp2_zero3 without ddp cells)")
    collect.add_argument("--compare", metavar="REFERENCE_SWEEP_DIR",
                         help="print per-cell deltas against another sweep and flag regressions (exit status 1 if any)")
    collect.add_argument("--threshold", type=float, default=0.05,
                         help="with --compare: relative change counted as a regression (default 0.05)")
    collect.add_argument("--no-plots", action="store_true", help="write tables and the report without plots")
    collect.set_defaults(func=_collect)

    download = sub.add_parser(
        "download", help="pre-download models, tokenizers and datasets into the cache (where there is internet)",
        description="Fetch what a jobs YAML's cells need (hub models ORG/NAME[@REV]), or the items named by "
                    "--model / --dataset, into the cache folder that compute nodes read offline; record "
                    "them in manifest.json. Rerun the same command to resume. Tokens: HF_TOKEN or `hf auth login`.")
    download.add_argument("jobs", nargs="?", help="jobs YAML file: fetch the hub models (and datasets) of its cells")
    download.add_argument("--model", action="append", default=[], metavar="ORG/NAME[@REV]",
                          help="a hub model: config and tokenizer files (repeatable)")
    download.add_argument("--dataset", action="append", default=[], metavar="ORG/NAME[:CONFIG][@SPLIT]",
                          help="a hub dataset split (default split train) or a preset: tinystories, chess (repeatable)")
    download.add_argument("--weights", action="store_true", help="also the *.safetensors weights (pretrained init)")
    download.add_argument("--tokenize-for", action="append", default=[], metavar="ORG/NAME[@REV]",
                          help="also tokenize each --dataset with this model's tokenizer, packed into --seq-len blocks")
    download.add_argument("--seq-len", action="append", default=[], type=int, metavar="N",
                          help="block length for --tokenize-for (repeatable)")
    download.add_argument("--text-column", default="text", help="the dataset column to tokenize (default text)")
    download.add_argument("--allow-pattern", action="append", default=[], metavar="GLOB",
                          help="extra model files to fetch, e.g. '*.bin' (repeatable)")
    download.add_argument("--cache-dir", help="the cache folder (default $HPCFSDP_CACHE, else ~/.cache/hpcfsdp)")
    download.add_argument("--verify", action="store_true",
                          help="download nothing: re-hash the cached files (all, or the items named) against the manifest")
    download.add_argument("--force", action="store_true", help="download and rebuild the items again")
    download.add_argument("--num-proc", type=int, help="processes for dataset loading and tokenization")
    download.set_defaults(func=_download)
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
        print("note: no Slurm controller answers here; running cells on this machine (--executor local)")
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
    if not 0 < args.threshold < 1:
        raise SpecError(f"collect: --threshold: expected a fraction between 0 and 1, got {args.threshold}")
    return _print_collection(Path(args.sweep_dir), baseline=args.baseline, plots=not args.no_plots,
                             compare=Path(args.compare) if args.compare else None, threshold=args.threshold)


def _print_collection(sweep_dir: Path, baseline: str | None = None, plots: bool = True,
                      compare: Path | None = None, threshold: float = 0.05) -> int:
    """Write the report, print the comparison against `compare` if given, then the cell table."""
    from .collect import markdown_table, write_comparison, write_report

    for folder in (sweep_dir, compare):
        if folder is not None and not folder.is_dir():
            raise SpecError(f"{folder}: no such sweep folder")
    report = write_report(sweep_dir, baseline=baseline, plots=plots)
    for message in report.unreadable:
        print(f"warning: skipped {message}", file=sys.stderr)
    regressions = 0
    if compare is not None:
        comparison, text, path = write_comparison(sweep_dir, compare, threshold)
        regressions = len(comparison.regressions)
        print(text)
        print(f"wrote {path}\n")
    print(markdown_table(report.table))
    tables = [p.name for p in report.files if p.suffix != ".png"]
    plots_drawn = len(report.files) - len(tables)
    skipped = "".join(f"; no {name} plot: {why}" for name, why in report.skipped_plots.items())
    print(f"wrote {report.directory}/: {', '.join(tables)}, {plots_drawn} plot(s) in plots/{skipped}")
    return 1 if regressions else 0


def _download(args: argparse.Namespace) -> int:
    from .download import DownloadError, download_main
    from .hubcache import CacheMissError

    try:
        return download_main(
            jobs=args.jobs, models=args.model, datasets=args.dataset, weights=args.weights,
            tokenize_for=args.tokenize_for, seq_lens=args.seq_len, cache_dir=args.cache_dir,
            verify_only=args.verify, allow_patterns=args.allow_pattern, text_column=args.text_column,
            num_proc=args.num_proc, force=args.force,
        )
    except (DownloadError, CacheMissError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume (complete files are kept)", file=sys.stderr)
        return 130
