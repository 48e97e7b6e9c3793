"""`hpcfsdp plan | submit | run | status | collect | history | export | download`."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import yaml

from .record import RECORD_NAME, SPEC_NAME, STATUSES, RecordError
from .spec import RunSpec, SpecError, check_folder_name, one_line

# Constants of the login-side modules that the parser shows; those modules load pandas, so the
# values are repeated here and a test keeps them equal (tests/test_history.py).
HISTORY_NAME = "history.duckdb"
REFERENCES_NAME = "references.yaml"
DEFAULT_TOLERANCE = 0.10

if TYPE_CHECKING:  # for annotations only: each command imports what it uses
    from .sweep.matrix import Cell, Sweep
    from .sweep.status import StatusReport

DEFAULT_RESULTS = "results"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except SpecError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`hpcfsdp plan x.yaml | head`): stop quietly, and point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except RecordError as exc:  # a sweep file that cannot be read where it must be (a cell's spec.json)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a folder that cannot be written: a file where a folder should be, no permission
        print(f"error: {_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


def _os_error(exc: OSError) -> str:
    """'<path>: <what the system said>', as one line."""
    paths = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
    what = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) and exc.filename and not os.path.isdir(exc.filename):
        what = "a file is where a folder is needed"  # mkdir(exist_ok=True) of a path that is a file
    return f"{paths}: {what}" if paths else what


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcfsdp",
        description="Compare DDP / FSDP1 / FSDP2 training setups for a causal LM, as Slurm job arrays.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="expand a jobs YAML and print its cells, without submitting")
    plan.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    _add_max_cells(plan)
    plan.add_argument(
        "--sbatch",
        action="store_true",
        help="print the sbatch script of each array instead (as submit would write it for a fresh sweep)",
    )
    plan.add_argument(
        "--results-dir",
        default=DEFAULT_RESULTS,
        help=f"with --sbatch: parent of the sweep folder (default {DEFAULT_RESULTS}/)",
    )
    plan.add_argument(
        "--memory",
        action="store_true",
        help="predicted peak GPU memory per rank of every cell, flagging those predicted not to fit "
        "(slurm.gpu_memory_gib or slurm.gpu_name); batch_size: auto cells show the batch predicted "
        "to be found (docs/submit.md)",
    )
    plan.set_defaults(func=_plan)

    submit = sub.add_parser("submit", help="submit a jobs YAML: one job array per resource shape")
    submit.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    _add_max_cells(submit)
    submit.add_argument(
        "--executor",
        choices=("slurm", "local", "print"),
        help="slurm (default when a Slurm controller answers), local (this machine, one cell at a "
        "time), print (print one shell command per cell, run nothing)",
    )
    submit.add_argument(
        "--results-dir", default=DEFAULT_RESULTS, help=f"parent of the sweep folder (default {DEFAULT_RESULTS}/)"
    )
    submit.add_argument(
        "--wait",
        action="store_true",
        help="slurm: wait for the arrays to finish, then print the table (local always waits)",
    )
    rerun = submit.add_mutually_exclusive_group()
    rerun.add_argument(
        "--retry-failed",
        action="store_true",
        help="also rerun cells whose record is not ok (oom, error, timeout, diverged, cancelled, node_fail) or "
        "is corrupt (cells without one always run; every earlier record is kept in attempts/)",
    )
    rerun.add_argument("--force", action="store_true", help="rerun every cell (except those still queued or running)")
    submit.add_argument(
        "--skip-predicted-oom",
        action="store_true",
        help="leave out the cells `plan --memory` predicts not to fit in slurm.gpu_memory_gib / gpu_name",
    )
    submit.set_defaults(func=_submit)

    run = sub.add_parser(
        "run",
        help="train one cell on this process (under torchrun, srun, or alone)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train one cell. Either --cell-dir (written by submit), or KEY=VALUE "
        "RunSpec fields, e.g.\n  torchrun --nproc-per-node 2 -m hpcfsdp run "
        "strategy=fsdp2_zero2 batch_size=4 seq_len=4096\n"
        "nodes and gpus_per_node default to torchrun's shape.",
        epilog=_run_fields_help(),
    )
    run.add_argument("fields", nargs="*", metavar="KEY=VALUE", help="RunSpec fields (listed below with their defaults)")
    run.add_argument("--cell-dir", help="a cell folder holding spec.json")
    run.add_argument(
        "--results-dir",
        default=DEFAULT_RESULTS,
        help=f"with KEY=VALUE: parent of the sweep folder (default {DEFAULT_RESULTS}/)",
    )
    run.add_argument("--sweep", default="manual", help="with KEY=VALUE: sweep name (default manual)")
    run.set_defaults(func=_run)

    status = sub.add_parser(
        "status",
        help="cells by state in a sweep folder, from records and the scheduler",
        description="Count the cells of a sweep folder by state: pending / running (squeue), "
        "else their record's status (ok, oom, error, timeout, diverged, cancelled, node_fail), "
        "else missing (no record) or corrupt (a record file that cannot be used, named "
        "in one line); then a row per cell that is not ok.",
    )
    status.add_argument("sweep_dir", help="e.g. results/smoke")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=10.0,
        metavar="SECONDS",
        help="redraw a progress bar every SECONDS (default 10) until no cell is pending or running",
    )
    status.set_defaults(func=_status)

    collect = sub.add_parser(
        "collect",
        help="records -> tables, plots and report/index.html (docs/collector.md)",
        description="Read every cells/*/result.json of a sweep folder and write report/: "
        "results.csv (and .parquet with pyarrow), summary.md, plots/*.png and a "
        "self-contained index.html; print the cell table. Unreadable records are "
        "named and skipped.",
    )
    collect.add_argument("sweep_dir", help="e.g. results/smoke")
    collect.add_argument(
        "--baseline",
        metavar="STRATEGY",
        help="strategy for speed-ups and memory savings (default ddp, or fsdp2_zero3 without ddp cells)",
    )
    collect.add_argument(
        "--compare",
        metavar="REFERENCE_SWEEP_DIR",
        help="print per-cell deltas against another sweep, write report/compare.md and flag "
        "regressions (exit status 1 if any)",
    )
    collect.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="with --compare: relative change counted as a regression (default 0.05, i.e. 5%%)",
    )
    collect.add_argument("--no-plots", action="store_true", help="write tables and the report without plots")
    over_time = collect.add_argument_group("over time (docs/history.md)")
    where = over_time.add_mutually_exclusive_group()
    where.add_argument(
        "--history",
        metavar="PATH",
        help="the history file this collect appends to and checks against (default: history.duckdb "
        "beside the sweep folder, e.g. results/history.duckdb)",
    )
    where.add_argument("--no-history", action="store_true", help="neither append to nor check against a history")
    over_time.add_argument(
        "--references",
        metavar="PATH",
        help="a references YAML (default: references.yaml beside the sweep folder, where it exists)",
    )
    over_time.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        metavar="FRACTION",
        help="how far below its reference or its history's median a cell may fall "
        f"(default {DEFAULT_TOLERANCE}, i.e. {DEFAULT_TOLERANCE * 100:.0f}%%; a reference may "
        "set its own)",
    )
    over_time.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="exit status 1 when a cell regressed against its reference or history",
    )
    collect.set_defaults(func=_collect)

    history = sub.add_parser(
        "history",
        help="list the history of runs that collect appended to (docs/history.md)",
        description="Print the runs in the history file, filtered; or, with --set-reference, write each "
        "setup's median tokens/s per GPU and peak memory (per cluster and GPU) to a references file.",
    )
    history.add_argument(
        "--history",
        default=str(Path(DEFAULT_RESULTS) / HISTORY_NAME),
        metavar="PATH",
        help=f"the history file (default {Path(DEFAULT_RESULTS) / HISTORY_NAME})",
    )
    history.add_argument("--model", default="", help="only this model")
    history.add_argument("--strategy", default="", help="only this strategy")
    history.add_argument("--system", default="", metavar="TEXT", help="only clusters or GPUs whose name contains TEXT")
    history.add_argument("--setup", default="", metavar="KEY", help="only this setup (a key or its beginning)")
    history.add_argument("--sweep", default="", help="only this sweep name")
    history.add_argument("--status", default="", help="only this status (ok, oom, error, timeout)")
    history.add_argument("--since", metavar="DATE", help="only runs started on or after DATE (YYYY-MM-DD, UTC)")
    history.add_argument("--until", metavar="DATE", help="only runs started up to DATE, that day included (UTC)")
    history.add_argument("--limit", type=int, default=0, metavar="N", help="only the latest N runs")
    history.add_argument(
        "--set-reference",
        action="store_true",
        help="write the median of each setup's ok runs (of those filtered) as its reference",
    )
    history.add_argument(
        "--references",
        metavar="PATH",
        help="with --set-reference: the file to write (default: references.yaml beside the history file)",
    )
    history.add_argument(
        "--tolerance",
        type=float,
        metavar="FRACTION",
        help="with --set-reference: the tolerance written into each new reference",
    )
    history.set_defaults(func=_history)

    export = sub.add_parser(
        "export",
        help="one run per cell in TensorBoard event files or an MLflow store (docs/history.md)",
        description="Write each cell record of a sweep as a run: loss per step and step time as series, the spec as "
        "hyperparameters, tokens/s per GPU, MFU and peak memory as final values. Needs the extra of the "
        "target: pip install 'hpcfsdp[tensorboard]' or 'hpcfsdp[mlflow]'.",
    )
    export.add_argument("sweep_dir", help="e.g. results/smoke")
    export.add_argument(
        "--to",
        nargs=2,
        required=True,
        metavar=("TARGET", "DIR"),
        help="tensorboard DIR (event files in DIR/<sweep>/<cell>), or mlflow DIR (a local file store; "
        "an MLflow tracking URI works too)",
    )
    export.set_defaults(func=_export)

    download = sub.add_parser(
        "download",
        help="pre-download models, tokenizers and datasets into the cache (where there is internet)",
        description="Fetch what a jobs YAML's cells need (hub models ORG/NAME[@REV]), or the items named by "
        "--model / --dataset, into the cache folder that compute nodes read offline; record "
        "them in manifest.json. Rerun the same command to resume. Tokens: HF_TOKEN or `hf auth login`.",
    )
    download.add_argument("jobs", nargs="?", help="jobs YAML file: fetch the hub models (and datasets) of its cells")
    download.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="ORG/NAME[@REV]",
        help="a hub model: config and tokenizer files (repeatable)",
    )
    download.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="ORG/NAME[:CONFIG][@SPLIT]",
        help="a hub dataset split (default split train) or a preset: tinystories, chess (repeatable)",
    )
    download.add_argument("--weights", action="store_true", help="also the *.safetensors weights (pretrained init)")
    download.add_argument(
        "--tokenize-for",
        action="append",
        default=[],
        metavar="ORG/NAME[@REV]",
        help="also tokenize each --dataset with this model's tokenizer, packed into --seq-len blocks",
    )
    download.add_argument(
        "--seq-len",
        action="append",
        default=[],
        type=int,
        metavar="N",
        help="block length for --tokenize-for (repeatable)",
    )
    download.add_argument(
        "--text-column",
        metavar="COLUMN",
        help="with --tokenize-for: the --dataset column to tokenize (default: the preset's, "
        "chess: Moves, else text); a list of strings is joined with spaces",
    )
    download.add_argument(
        "--allow-pattern",
        action="append",
        default=[],
        metavar="GLOB",
        help="extra model files to fetch, e.g. '*.bin' (repeatable)",
    )
    download.add_argument("--cache-dir", help="the cache folder (default $HPCFSDP_CACHE, else ~/.cache/hpcfsdp)")
    _add_max_cells(download)
    download.add_argument(
        "--verify",
        action="store_true",
        help="download nothing: re-hash the cached files (all, or the items named) against the manifest",
    )
    download.add_argument("--force", action="store_true", help="download and rebuild the items again")
    download.add_argument("--num-proc", type=int, metavar="N", help="processes for dataset loading and tokenization")
    download.set_defaults(func=_download)
    return parser


def _add_max_cells(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-cells",
        type=_positive_int,
        metavar="N",
        help="refuse a jobs YAML of more than N cells, counted before expanding it (default 100,000)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _load_sweep(args: argparse.Namespace) -> Sweep:
    from .sweep.matrix import MAX_CELLS, load_sweep

    return load_sweep(args.jobs, args.max_cells or MAX_CELLS)


def _run_fields_help() -> str:
    import textwrap

    from .spec import field_names
    from .sweep.matrix import plain_value

    defaults = RunSpec().to_dict()
    listing = ", ".join(f"{name}={plain_value(defaults[name]) or chr(34) * 2}" for name in field_names(RunSpec))
    return "RunSpec fields and defaults (docs/submit.md, src/hpcfsdp/spec.py):\n" + textwrap.fill(
        listing, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
    )


# Always shown by plan; any other RunSpec field gets a column when its value varies across the sweep.
PLAN_FIELDS = ("strategy", "batch_size", "grad_accum", "activation_checkpointing", "nodes", "gpus_per_node")
WAIT_POLL_S = 3.0  # submit --wait: seconds between looks at squeue


def _plan(args: argparse.Namespace) -> int:
    from .sweep.cluster import array_size_limit
    from .sweep.matrix import arrays

    sweep = _load_sweep(args)
    res = sweep.resources
    size = array_size_limit(res.max_array_size)
    planned = arrays(sweep.cells, size)
    if args.sbatch:
        return _print_sbatch(sweep, planned, Path(args.results_dir))
    print(f"{sweep.name}: {len(sweep.cells)} cell(s) in {len(planned)} array(s)")
    sys.stdout.write("\n".join(_memory_table(sweep) if args.memory else _plan_table(sweep, planned)) + "\n")
    for index, ((nodes, gpus), cells) in enumerate(planned):
        print(f"array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s)")
    if len(planned) > len(sweep.groups()):
        limit = "slurm.max_array_size" if size == res.max_array_size else "the cluster's MaxArraySize"
        print(f"(an array holds at most {size} cells: {limit})")
    runs = 1 + res.max_requeue  # every requeue may use a whole time limit again
    gpu_hours = sum(c.spec.world_size for c in sweep.cells) * res.time_min * runs / 60
    requeues = f", {res.max_requeue} requeue(s)" if res.max_requeue else ""
    print(f"upper bound: {gpu_hours:.1f} GPU-hours at a {res.time_min} min limit per cell{requeues}")
    problems = _cache_misses(sweep) + _cluster_problems(sweep)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def _cache_misses(sweep: Sweep) -> list[str]:
    """Hub models and datasets the cells need but the pre-download cache lacks."""
    from .cache.plan import cache_misses

    return cache_misses(sweep, sweep.resources.cache_dir or None)


def _cluster_problems(sweep: Sweep) -> list[str]:
    """Shapes of the sweep that its partition can never run; none where no Slurm answers."""
    from .sweep.preflight import cluster_problems

    return cluster_problems(sweep)


def _plan_table(sweep: Sweep, planned: list[tuple[tuple[int, int], list[Cell]]]) -> list[str]:
    from .spec import field_names
    from .sweep.matrix import plain_value

    cells = sweep.cells
    array_of = {cell.id: index for index, (_, members) in enumerate(planned) for cell in members}
    varying = [
        name
        for name in field_names(RunSpec)
        if name not in PLAN_FIELDS and len({getattr(c.spec, name) for c in cells}) > 1
    ]
    columns = {name: [plain_value(getattr(c.spec, name)) for c in cells] for name in varying}
    widths = {name: max(len(name), *map(len, values)) for name, values in columns.items()}
    id_width = max(4, *(len(c.id) for c in cells))
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>5} {'accum':>5} {'ckpt':>9} {'nodes x gpus':>12} {'array':>5}"
        + "".join(f" {name:>{widths[name]}}" for name in varying)
    ]
    for row, cell in enumerate(cells):
        s = cell.spec
        lines.append(
            f"{cell.id:{id_width}} {s.strategy:19} {s.batch_size:5} {s.grad_accum:5} {s.activation_checkpointing:>9} "
            f"{f'{s.nodes} x {s.gpus_per_node}':>12} {array_of[cell.id]:5}"
            + "".join(f" {columns[name][row]:>{widths[name]}}" for name in varying)
        )
    return lines


def _memory_table(sweep: Sweep) -> list[str]:
    """`plan --memory`: the predicted memory of every cell, GiB per GPU (hpcfsdp/memory.py)."""
    from .memory import RUNTIME_RESERVE_GIB, predict_cells, usable_gib

    res = sweep.resources
    capacity = _capacity(sweep)
    rows = predict_cells(sweep.cells, capacity, res.cache_dir or None)
    id_width = max(4, *(len(r.cell_id) for r in rows))
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>9} {'ckpt':>9} {'seq':>6} {'states':>7} {'gathered':>8} "
        f"{'activ.':>7} {'loss':>7} {'peak GiB':>8} {'peak at':>9} fit"
    ]
    for row in rows:
        s, p = row.spec, row.prediction
        batch = f"auto:{row.batch}" if s.auto_batch and capacity and s.device != "cpu" else str(row.batch)
        figures = (
            (
                f"{p.states_gib:7.2f} {p.gathered_gib:8.2f} {p.activations_gib:7.2f} {p.loss_gib:7.2f} "
                f"{p.peak_gib:8.2f} {p.peak_moment:>9}"
            )
            if p
            else f"{'-':>7} {'-':>8} {'-':>7} {'-':>7} {'-':>8} {'-':>9}"
        )
        fit = {"oom": "OOM", "": "n/a (cpu)" if s.device == "cpu" else "-"}.get(row.fit, row.fit)
        lines.append(
            f"{row.cell_id:{id_width}} {s.strategy:19} {batch:>9} {s.activation_checkpointing:>9} {s.seq_len:6} "
            f"{figures} {fit}" + (f"  ({row.note})" if row.note else "")
        )
    if capacity is None:
        lines.append("GPU memory unknown: set slurm.gpu_memory_gib or slurm.gpu_name to flag cells that do not fit")
    else:
        lines.append(
            f"GPU memory {capacity:g} GiB, {usable_gib(capacity):g} usable after a {RUNTIME_RESERVE_GIB:g} GiB "
            f"runtime reserve: {sum(r.fit == 'oom' for r in rows)} cell(s) predicted not to fit, "
            f"{sum(r.fit == 'tight' for r in rows)} tight (above 90%)"
        )
    return lines


def _capacity(sweep: Sweep) -> float | None:
    from .memory import capacity_gib

    return capacity_gib(sweep.resources.gpu_memory_gib, sweep.resources.gpu_name)


def _print_sbatch(sweep: Sweep, planned: list[tuple[tuple[int, int], list[Cell]]], results_dir: Path) -> int:
    from .sweep.submit import sbatch_script

    for index, ((nodes, gpus), cells) in enumerate(planned):
        print(f"# ===== array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s) =====")
        print(sbatch_script(sweep, results_dir / sweep.name, nodes, gpus, len(cells)))
    return 0


def _submit(args: argparse.Namespace) -> int:
    from .sweep.interrupts import Interrupted
    from .sweep.status import SchedulerError, blocked_message
    from .sweep.submit import SubmitError, default_executor, still_queued, submit, wait_for

    sweep = _load_sweep(args)
    misses = _cache_misses(sweep)
    if misses:
        more = f" (and {len(misses) - 1} more: `hpcfsdp plan` lists them)" if len(misses) > 1 else ""
        raise SpecError(f"{sweep.source}: {misses[0]}{more}")
    executor, why = (args.executor, "") if args.executor else default_executor()
    # With --executor print, stdout holds only the commands (a shell script); messages go to stderr.
    log = _to_stderr if executor == "print" else print
    if args.skip_predicted_oom:
        sweep = _without_predicted_oom(sweep, log)
    if why:
        log(f"note: {why}; running the cells on this machine, one at a time (--executor local)")
    try:
        sub = submit(
            sweep,
            Path(args.results_dir),
            executor,
            force=args.force,
            retry_failed=args.retry_failed,
            log=log,
            room_poll_s=WAIT_POLL_S if args.wait else None,
        )
    except SchedulerError as exc:
        print(f"error: cannot tell which cells are still queued ({exc}); nothing submitted", file=sys.stderr)
        return 1
    except SubmitError as exc:
        print(
            f"error: {exc}; the cells of that array and any after it were not queued "
            f"(arrays queued before it are in {Path(args.results_dir) / sweep.name / 'manifest.json'})",
            file=sys.stderr,
        )
        return 1
    except RecordError as exc:  # the manifest: which jobs are the sweep's
        print(
            f"error: {exc}; it names the sweep's queued jobs: repair or remove it (`squeue --name "
            f"hpcfsdp-{sweep.name}` lists them); nothing submitted",
            file=sys.stderr,
        )
        return 1
    except Interrupted as exc:
        done = (
            "the running cell was stopped and its earlier record is current again"
            if executor == "local"
            else "arrays queued before it are in manifest.json; the cells not queued keep their records"
        )
        print(f"interrupted ({exc}): {done}; run the same command again to go on", file=sys.stderr)
        return exc.exit_status
    log(f"sweep folder: {sub.sweep_dir}")
    # Exit status 1 when a cell did not finish ok: what a scheduled (cron, CI) run checks.
    if executor == "slurm" and args.wait:
        try:
            report = wait_for(sub, WAIT_POLL_S, log)
        except KeyboardInterrupt as exc:  # the jobs run on
            queued = still_queued(sub)
            print(
                f"stopped waiting; {'?' if queued is None else queued} cells still queued; "
                f"`hpcfsdp status {sub.sweep_dir}`",
                file=sys.stderr,
            )
            return getattr(exc, "exit_status", 130)
        _print_status(report, summary=False)
        if report.stuck:  # every cell left waits on a reason that cannot clear
            if not all(c.blocked for c in report.cells):  # some cells finished: their table
                _print_collection(sub.sweep_dir)
            print(f"error: {blocked_message(report.blocked)}", file=sys.stderr)
            return 1
        failed = sum(c.state != "ok" for c in report.cells)
    elif executor == "local":
        failed = sum(status != "ok" for status in sub.outcomes.values())
    else:
        return 0
    code = _print_collection(sub.sweep_dir)
    if failed:
        print(f"{failed} cell(s) did not finish ok", file=sys.stderr)
    return 1 if failed else code


def _without_predicted_oom(sweep: Sweep, log) -> Sweep:
    import dataclasses

    from .memory import predict_cells

    capacity = _capacity(sweep)
    if capacity is None:
        raise SpecError(
            sweep.source,
            "slurm.gpu_memory_gib",
            "--skip-predicted-oom needs the GPU's memory: set slurm.gpu_memory_gib or slurm.gpu_name",
        )
    oom = {
        row.cell_id: row
        for row in predict_cells(sweep.cells, capacity, sweep.resources.cache_dir or None)
        if row.fit == "oom"
    }
    for row in oom.values():
        needed = f"{row.prediction.required_gib:.1f}" if row.prediction else "?"
        log(
            f"skipping {row.cell_id}: predicted {needed} GiB per GPU of {capacity:g} GiB "
            f"(--skip-predicted-oom; `hpcfsdp plan --memory` shows why)"
        )
    kept = tuple(cell for cell in sweep.cells if cell.id not in oom)
    if not kept:
        raise SpecError(sweep.source, "", f"every cell is predicted not to fit in {capacity:g} GiB: nothing to submit")
    return dataclasses.replace(sweep, cells=kept)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _run(args: argparse.Namespace) -> NoReturn:
    from .cell.distributed import launched_shape
    from .cell.run import run_cell, run_cell_dir
    from .sweep.matrix import Cell

    if args.cell_dir:
        if args.fields:
            raise SpecError("run: give either --cell-dir or KEY=VALUE fields, not both")
        if not (Path(args.cell_dir) / SPEC_NAME).is_file():
            raise SpecError(
                f"{args.cell_dir}: no {SPEC_NAME} here (--cell-dir takes a cells/<id> folder written by submit)"
            )
        status = run_cell_dir(Path(args.cell_dir))
    else:
        values = {}
        for item in args.fields:
            key, sep, value = item.partition("=")
            if not sep:
                raise SpecError(f"run: {item!r}: expected KEY=VALUE")
            values[key] = yaml.safe_load(value)
        spec = RunSpec.from_dict({**launched_shape(), **values}, where="run arguments")
        cell = Cell.of(spec)
        check_folder_name("run", "--sweep", args.sweep)
        status = run_cell(spec, Path(args.results_dir) / args.sweep / "cells" / cell.id, cell.id, args.sweep)
    _exit_worker(0 if status == "ok" else 1)


def _exit_worker(code: int) -> NoReturn:
    """End a training worker at once, skipping the interpreter's finalization.

    By now the record is written and the process group destroyed, so finalization has nothing
    left to do, and it can hang: Gloo's and autograd's C++ threads race the interpreter's teardown
    (pytorch/pytorch#190489). Seen here about once in 130 two-process CPU runs: the record said ok
    and torchrun waited on a worker that never exited.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _status(args: argparse.Namespace) -> int:
    from .sweep.status import blocked_message, sweep_status, watch

    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "cells").is_dir():
        raise SpecError(f"{sweep_dir}: not a sweep folder (no cells/ inside; e.g. results/<name> of a jobs YAML)")
    if args.watch is not None and args.watch <= 0:
        raise SpecError(f"status: --watch: expected a positive number of seconds, got {args.watch}")
    report = watch(sweep_dir, args.watch) if args.watch else sweep_status(sweep_dir)
    _print_status(report)
    _note_accounting(sweep_dir, {c.cell_id: c.job_id for c in report.cells if c.job_id and c.state in STATUSES})
    if report.stuck and args.watch:  # the watch ended with cells still queued
        print(f"error: {blocked_message(report.blocked)}", file=sys.stderr)
        return 1
    if report.blocked:
        print(f"warning: {blocked_message(report.blocked)}", file=sys.stderr)
    return 0


def _note_accounting(sweep_dir: Path, jobs: dict[str, str]) -> dict[str, dict]:
    """Add Slurm accounting to the records of these jobs (cell id -> job id) where it exists; one
    line where it does not."""
    from .sweep.accounting import add_accounting

    added, note = add_accounting(sweep_dir, jobs)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return added


def _print_status(report: StatusReport, summary: bool = True) -> None:
    """Counts by state, then one row per cell that is not ok (yet) with Slurm's word for it (and
    why it is pending), and where Slurm logs are."""
    from .sweep.status import IN_FLIGHT, problem_lines

    if report.note:
        print(f"warning: {report.note}", file=sys.stderr)
    for line in problem_lines(report.problems):
        print(f"warning: {line}", file=sys.stderr)
    counts = report.counts()
    if summary:
        print(
            f"{report.sweep_dir}: {len(report.cells)} cell(s): "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
    rows = [c for c in report.cells if c.state != "ok"]
    if not rows:
        return
    width = max(4, *(len(c.cell_id) for c in rows))
    print(f"{'cell':{width}} {'strategy':19} {'state':8} {'job':12} slurm")
    for c in rows:
        slurm = f"{c.slurm} ({c.reason})" if c.reason else c.slurm or "-"
        print(f"{c.cell_id:{width}} {c.strategy:19} {c.state:8} {c.job_id or '-':12} {slurm}")
    if any(c.job_id and c.state not in IN_FLIGHT for c in rows):
        print(f"logs: {report.sweep_dir / 'slurm' / '<job>' / '<job>_<rank>_log.err'}")


def _collect(args: argparse.Namespace) -> int:
    for flag, value in (("--threshold", args.threshold), ("--tolerance", args.tolerance)):
        if not 0 < value < 1:
            raise SpecError(f"collect: {flag}: expected a fraction between 0 and 1, got {value}")
    if args.references and not Path(args.references).is_file():
        raise SpecError(f"collect: --references: {args.references}: no such file")
    sweep_dir = Path(args.sweep_dir)
    options = _over_time_options(
        sweep_dir,
        Path(args.history) if args.history else None,
        args.references,
        args.tolerance,
        use_history=not args.no_history,
    )
    return _print_collection(
        sweep_dir,
        baseline=args.baseline,
        plots=not args.no_plots,
        compare=Path(args.compare) if args.compare else None,
        threshold=args.threshold,
        over_time=options,
        fail_on_regression=args.fail_on_regression,
    )


def _over_time_options(
    sweep_dir: Path,
    history: Path | None = None,
    references: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    use_history: bool = True,
):
    """The history and references a collection of sweep_dir uses: those given, else the defaults
    beside the sweep folder (results/history.duckdb, results/references.yaml where it exists)."""
    from .results.references import References, load_references
    from .results.regressions import OverTimeOptions

    beside = sweep_dir.resolve().parent
    path = Path(references) if references else beside / REFERENCES_NAME
    return OverTimeOptions(
        history=(history or beside / HISTORY_NAME) if use_history else None,
        references=load_references(path) if path.is_file() else References(),
        tolerance=tolerance,
    )


def _print_collection(
    sweep_dir: Path,
    baseline: str | None = None,
    plots: bool = True,
    compare: Path | None = None,
    threshold: float = 0.05,
    over_time=None,
    fail_on_regression: bool = False,
) -> int:
    """Add Slurm accounting, append to the history and check each cell over time, write the report;
    print the comparison against `compare` if given, the cell table, the regressions, and what was written."""
    from .results.compare import write_comparison
    from .results.history import accounting_jobs, merge_accounting
    from .results.read import load_records
    from .results.regressions import over_time as check_over_time
    from .results.report import write_report
    from .results.tables import printed_comparison

    for folder in (sweep_dir, compare):
        if folder is not None and not folder.is_dir():
            raise SpecError(f"{folder}: no such sweep folder")
    options = over_time or _over_time_options(sweep_dir)  # a bad references file stops here, before any writing
    collection = load_records(sweep_dir, _scheduler_states(sweep_dir))
    merge_accounting(collection.frame, _note_accounting(sweep_dir, accounting_jobs(collection.frame)))
    checked = check_over_time(collection, sweep_dir, options)
    report = write_report(
        sweep_dir, baseline=baseline, plots=plots, collection=collection, first_sections=(checked.section(),)
    )
    for message in report.unreadable:
        print(f"warning: skipped {message}", file=sys.stderr)
    for note in report.notes:
        print(f"warning: {note}", file=sys.stderr)
    regressions = 0
    if compare is not None:
        comparison, text, path = write_comparison(sweep_dir, compare, threshold, collection)
        regressions = len(comparison.regressions)
        print(text)
        print(f"wrote {path}\n")
    for line in report.recommendation:
        print(line)
    print(printed_comparison(report.table, report.directory / "results.csv"))
    print("over time: " + " ".join(checked.notes))
    for line in checked.regressions:
        print(f"regression: {line}")
    for line in checked.hints:
        print(f"note: {line}")
    tables = [p.name for p in report.files if p.suffix != ".png"]
    plots_drawn = len(report.files) - len(tables)
    skipped = "".join(f"; no {name} plot: {why}" for name, why in report.skipped_plots.items())
    print(f"wrote {report.directory}/: {', '.join(tables)}, {plots_drawn} plot(s) in plots/{skipped}")
    return 1 if regressions or (fail_on_regression and checked.regressions) else 0


def _history(args: argparse.Namespace) -> int:
    from .results.history import Filters, History, HistoryError, medians_by_setup, parse_day
    from .results.render import markdown_table
    from .results.tables import printable

    filters = Filters(
        model=args.model,
        strategy=args.strategy,
        system=args.system,
        setup=args.setup,
        sweep=args.sweep,
        status=args.status,
        since=parse_day(args.since, "--since") if args.since else None,
        until=parse_day(args.until, "--until", end_of_day=True) if args.until else None,
    )
    if args.tolerance is not None and not 0 < args.tolerance < 1:
        raise SpecError(f"history: --tolerance: expected a fraction between 0 and 1, got {args.tolerance}")
    if args.limit < 0:
        raise SpecError(f"history: --limit: expected a number of runs >= 0, got {args.limit}")
    try:
        with History(Path(args.history), read_only=True) as store:
            rows = store.select(filters)
    except HistoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.set_reference:
        return _set_reference(
            medians_by_setup(rows),
            Path(args.references) if args.references else Path(args.history).parent / REFERENCES_NAME,
            args.tolerance,
        )
    if args.limit:
        rows = rows.tail(args.limit)
    print(markdown_table(printable(_history_table(rows))) if len(rows) else "(no records)")
    print(f"{len(rows)} run(s) of {rows['setup'].nunique()} setup(s) in {args.history}")
    return 0


# Columns of the printed history: (history column, header).
HISTORY_COLUMNS = (
    ("started_at", "started (UTC)"),
    ("sweep", "sweep"),
    ("cluster", "cluster"),
    ("gpu", "gpu"),
    ("model", "model"),
    ("strategy", "strategy"),
    ("batch_size", "batch"),
    ("grad_accum", "accum"),
    ("world_size", "ranks"),
    ("status", "status"),
    ("tokens_per_s_per_gpu", "tokens/s/gpu"),
    ("mfu", "MFU"),
    ("peak_memory_gib", "peak GiB"),
    ("torch_version", "torch"),
    ("setup", "setup"),
    ("cell_id", "cell"),
)


def _history_table(rows):
    table = rows[[column for column, _ in HISTORY_COLUMNS]].rename(columns=dict(HISTORY_COLUMNS))
    table["started (UTC)"] = table["started (UTC)"].dt.strftime("%Y-%m-%d %H:%M")
    return table


def _set_reference(medians, path: Path, tolerance: float | None) -> int:
    import datetime

    from .results.references import Reference, write_references

    if medians.empty:
        print("error: no ok run matches these filters: no reference written", file=sys.stderr)
        return 1
    today = datetime.date.today().isoformat()
    new = [
        Reference(
            tokens_per_s_per_gpu=round(float(row.tokens_per_s_per_gpu), 1),
            cluster=_text_or_none(row.cluster),
            gpu=_text_or_none(row.gpu),
            setup=row.setup,
            match=json.loads(row.setup_fields),
            peak_memory_gib=None if math.isnan(row.peak_memory_gib) else round(float(row.peak_memory_gib), 3),
            tolerance=tolerance,
            extra={"runs": int(row.runs), "set_at": today},
        )
        for row in medians.itertuples(index=False)
    ]
    merged = write_references(path, new)
    print(f"wrote {len(new)} reference(s) to {path} ({len(merged.entries)} in the file)")
    return 0


def _text_or_none(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _export(args: argparse.Namespace) -> int:
    from .results.export import ExportError, export_sweep

    sweep_dir = Path(args.sweep_dir)
    if not (sweep_dir / "cells").is_dir():
        raise SpecError(f"{sweep_dir}: not a sweep folder (no cells/ inside; e.g. results/<name> of a jobs YAML)")
    target, destination = args.to
    try:
        written, skipped = export_sweep(sweep_dir, target, destination)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    already = f" ({skipped} exported before, left as they were)" if skipped else ""
    print(f"exported {written} run(s) of {sweep_dir} to {target} at {destination}{already}")
    return 0


def _scheduler_states(sweep_dir: Path) -> dict[str, str] | None:
    """Cell id -> Slurm's state of its latest job, for the sweep's Slurm cells without a record;
    None when squeue does not answer (collect then says it does not know)."""
    from .sweep.status import read_manifest, slurm_job_ids, sweep_status

    recorded = {path.parent.name for path in sweep_dir.glob(f"cells/*/{RECORD_NAME}")}
    try:
        cell_ids = [cid for cid in read_manifest(sweep_dir) if cid not in recorded]
    except RecordError:  # collect names the broken manifest itself
        return {}
    if not slurm_job_ids(sweep_dir, cell_ids):
        return {}
    report = sweep_status(sweep_dir, cell_ids)
    return (
        None
        if report.note
        else {c.cell_id: f"{c.slurm} ({c.reason})" if c.reason else c.slurm for c in report.cells if c.job_id}
    )


def _download(args: argparse.Namespace) -> int:
    from .cache.download import download_main
    from .cache.hub import CacheMissError
    from .cache.plan import DownloadError, Request

    request = Request(
        jobs=args.jobs,
        max_cells=args.max_cells,
        models=tuple(args.model),
        datasets=tuple(args.dataset),
        weights=args.weights,
        tokenize_for=tuple(args.tokenize_for),
        seq_lens=tuple(args.seq_len),
    )
    try:
        return download_main(
            request,
            cache_dir=args.cache_dir,
            verify_only=args.verify,
            allow_patterns=args.allow_pattern,
            text_column=args.text_column,
            num_proc=args.num_proc,
            force=args.force,
        )
    except (DownloadError, CacheMissError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume (complete files are kept)", file=sys.stderr)
        return 130
