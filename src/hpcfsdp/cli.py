"""`hpcfsdp plan | submit | tune | run | status | logs | cancel | collect | history | export | examples | download`:
the parser, and main(), which dispatches to commands.py and prints what stopped a command (a UserError, errors.py)
as one line, in one place."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from . import __version__, commands
from .cliargs import add_json, add_max_cells, docs_line, halving_factor, positive_int
from .contracts.errors import UsageError, UserError, os_error_text
from .contracts.fields import one_line
from .contracts.record import STATUSES
from .contracts.spec import RunSpec
from .progress import error_lines, escaped_output
from .results.defaults import DEFAULT_RESULTS, DEFAULT_TOLERANCE, HISTORY_NAME


@escaped_output()  # no control character of a file's text reaches the terminal
def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    _Parser.json_answers = "--json" in words[: words.index("--")] if "--" in words else "--json" in words
    try:
        args = _parser().parse_args(argv)
        return args.func(args) or 0
    except UserError as exc:
        lines = "\n".join(one_line(line) for line in exc.lines())
        return _failed(lines, one_line(str(exc)), exc.exit_status, answered=exc.json_answered)
    except BrokenPipeError:
        # The reader went away (`hpcfsdp plan x.yaml | head`): stop quietly, and point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # a folder that cannot be written: a file where a folder should be, no permission
        return _failed(f"error: {os_error_text(exc)}", os_error_text(exc), 1)
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        return getattr(exc, "exit_status", 130)


def _failed(line: str, error: str, exit_status: int, answered: bool = False) -> int:
    """An error: its line on stderr; asked for --json, also the one document on stdout (unless the
    command answered with its own)."""
    print(error_lines(line, sys.stderr), file=sys.stderr)
    if _Parser.json_answers and not answered:
        commands.print_json({"error": error, "exit_status": exit_status})
    return exit_status


class _Parser(argparse.ArgumentParser):
    """argparse's parser; under --json a usage error is a UsageError, answered as main answers errors.
    `epilog_of` writes the epilog only when help is shown: run's listing of the RunSpec fields imports
    the sweep side, which a rank parsing `run --cell-dir` does not need."""

    json_answers = False  # set by main from the command line: it asks for --json

    def __init__(self, *args: Any, epilog_of: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epilog_of = epilog_of

    def format_help(self) -> str:
        if self.epilog_of is not None:
            self.epilog = self.epilog_of()
        text = super().format_help()
        return text + docs_line(text)

    def error(self, message: str) -> NoReturn:
        if _Parser.json_answers:
            raise UsageError(self.prog, message)
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hpcfsdp",
        description="Compare DDP / FSDP1 / FSDP2 training setups for a causal LM, as Slurm job arrays.",
    )
    parser.add_argument("--version", action="version", version=f"hpcfsdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="expand a jobs YAML and print its cells, without submitting")
    plan.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    add_max_cells(plan)
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
        help="predicted peak GPU memory per rank and host memory per node of every cell, flagging those "
        "predicted not to fit (slurm.gpu_memory_gib or slurm.gpu_name); batch_size: auto cells show the "
        "batch predicted to be found (docs/submit.md, docs/preflight.md)",
    )
    add_json(plan, "the cells (with --memory their predictions), arrays, bound and problems")
    plan.set_defaults(func=commands.plan)

    submit = sub.add_parser("submit", help="submit a jobs YAML: one job array per resource shape")
    submit.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    add_max_cells(submit)
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
        help="slurm: wait for the arrays to finish, then print the table (local always waits); exit status 3 "
        "when a cell did not finish ok (docs/submit.md, For scripts)",
    )
    rerun = submit.add_mutually_exclusive_group()
    rerun.add_argument(
        "--retry-failed",
        action="store_true",
        help="also rerun cells whose record is not ok (oom, error, timeout, diverged, cancelled, node_fail, "
        "preempted, host_oom, deadline, boot_fail) or is corrupt (cells without one always run; every earlier "
        "record is kept in attempts/)",
    )
    rerun.add_argument("--force", action="store_true", help="rerun every cell (except those still queued or running)")
    submit.add_argument(
        "--skip-predicted-oom",
        action="store_true",
        help="leave out the cells `plan --memory` predicts not to fit in slurm.gpu_memory_gib / gpu_name",
    )
    submit.add_argument(
        "--then-collect",
        action="store_true",
        help="slurm: also queue one small CPU job that runs `collect --fail-on-regression` once the arrays "
        "end (--dependency=afterany); its exit status goes to collect_job.json, mail by slurm.mail_user / "
        "mail_type (docs/submit.md)",
    )
    submit.add_argument(
        "--only-best",
        action="store_true",
        help="run only the setup `hpcfsdp tune` chose (tune.json's best.cell_id in the sweep folder)",
    )
    submit.set_defaults(func=commands.submit)

    tune = sub.add_parser(
        "tune",
        help="find the grid's fastest setup from short probes, several per allocation (docs/tune.md)",
        description="Leave out cells predicted not to fit, probe the rest until each one's tokens/s is stable, "
        "measure the best 1/eta again for longer (successive halving), and run the last few as the grid's own "
        "cells. Stopped, the same command goes on where it was. Writes tune.json in the sweep folder.",
    )
    tune.add_argument("jobs", help="jobs YAML file (e.g. jobs/smoke.yaml)")
    add_max_cells(tune)
    tune.add_argument(
        "--executor",
        choices=("slurm", "local"),
        help="slurm (default when a Slurm controller answers): each stage an array, several probes per "
        "allocation; local: this machine, one probe at a time",
    )
    tune.add_argument(
        "--results-dir", default=DEFAULT_RESULTS, help=f"parent of the sweep folder (default {DEFAULT_RESULTS}/)"
    )
    tune.add_argument(
        "--eta", type=halving_factor, default=3, help="keep the best 1/eta of each stage, 2 or more (default 3)"
    )
    tune.add_argument("--top", type=positive_int, default=3, help="setups the final stage runs as cells (default 3)")
    tune.add_argument("--probes-per-job", type=positive_int, default=8, help="slurm: probes per allocation (default 8)")
    tune.set_defaults(func=commands.tune)

    run = sub.add_parser(
        "run",
        help="train one cell on this process (under torchrun, srun, or alone)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train one cell. Either --cell-dir (written by submit), or KEY=VALUE "
        "RunSpec fields, e.g.\n  torchrun --nproc-per-node 2 -m hpcfsdp run "
        "strategy=fsdp2_zero2 batch_size=4 seq_len=4096\n"
        "nodes and gpus_per_node default to torchrun's shape.",
        epilog_of=_run_fields_help,
    )
    run.add_argument("fields", nargs="*", metavar="KEY=VALUE", help="RunSpec fields (listed below with their defaults)")
    run.add_argument("--cell-dir", help="a cell folder holding spec.json")
    run.add_argument(
        "--results-dir",
        default=DEFAULT_RESULTS,
        help=f"with KEY=VALUE: parent of the sweep folder (default {DEFAULT_RESULTS}/)",
    )
    run.add_argument("--sweep", default="manual", help="with KEY=VALUE: sweep name (default manual)")
    run.set_defaults(func=commands.run)

    status = sub.add_parser(
        "status",
        help="cells by state in a sweep folder, from records and the scheduler",
        description="Count the cells of a sweep folder by state: pending / running (squeue), "
        "else their record's status (ok, oom, error, timeout, diverged, cancelled, node_fail, preempted, "
        "host_oom, deadline, boot_fail), "
        "else missing (no record) or corrupt (a record file that cannot be used, named "
        "in one line); then a row per cell that is not ok. Exit status 0 when every cell is ok, 3 when one "
        "is not (any state but ok, pending and running), else 4 while cells are pending or running.",
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
    add_json(status, "the counts and every cell: state, job, reason, advice")
    status.set_defaults(func=commands.status)

    logs = sub.add_parser(
        "logs",
        help="a cell's Slurm logs: every rank, every job it ran as, newest first",
        description="Print a cell's Slurm stdout (or stderr) log of every rank, of every job the cell ran as "
        "(its latest submit's, then its earlier records'), newest first; for a cell that did not finish ok, "
        "its error and the error lines of its newest job's logs come first. Without CELL: the cells, "
        "their states and jobs, not-ok ones first.",
    )
    logs.add_argument("sweep_dir", help="e.g. results/smoke")
    logs.add_argument("cell", nargs="?", help="a cell id, or a unique beginning of one")
    logs.add_argument("--stderr", action="store_true", help="the stderr logs instead of stdout")
    logs.add_argument(
        "--follow", action="store_true", help="print what the newest job writes as it writes it, until it ends"
    )
    logs.set_defaults(func=commands.logs)

    cancel = sub.add_parser(
        "cancel",
        help="scancel this sweep's queued cells (never other jobs) and record them as cancelled",
        description="scancel the queued jobs (array tasks) of a sweep folder's cells, found from its manifest "
        "and checked against their Slurm job name, so no other job is touched; each cancelled cell's "
        "record says cancelled.",
    )
    cancel.add_argument("sweep_dir", help="e.g. results/smoke")
    cancel.add_argument("--cells", nargs="+", default=[], metavar="CELL", help="only these cells (default: all)")
    cancel.add_argument("--pending-only", action="store_true", help="only cells still pending; running ones run on")
    cancel.set_defaults(func=commands.cancel)

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
    add_json(collect, "every cell (status, job, reason, figures), the regressions and the files written")
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
        help="exit status 1 when a cell regressed against its reference or history (a history that cannot be "
        "updated and checked, e.g. locked past 120 s, makes collect exit 1 in any case)",
    )
    collect.set_defaults(func=commands.collect)

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
    history.add_argument(
        "--status", default="", choices=STATUSES, metavar="STATUS", help="only this status (ok, oom, ...)"
    )
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
    add_json(history, "the runs listed")
    history.set_defaults(func=commands.history)

    export = sub.add_parser(
        "export",
        help="one run per cell in TensorBoard event files, an MLflow store or W&B offline runs (docs/history.md)",
        description="Write each cell record of a sweep as a run: loss per step and step time as series, the spec as "
        "hyperparameters, tokens/s per GPU, MFU and peak memory as final values. Needs the extra of the "
        "target: pip install 'hpcfsdp[tensorboard]', 'hpcfsdp[mlflow]' or 'hpcfsdp[wandb]'.",
    )
    export.add_argument("sweep_dir", help="e.g. results/smoke")
    export.add_argument(
        "--to",
        nargs=2,
        required=True,
        metavar=("TARGET", "DIR"),
        help="tensorboard DIR (event files in DIR/<sweep>/<cell>), mlflow DIR (a local file store; "
        "an MLflow tracking URI works too), or wandb DIR (offline runs in DIR/wandb/, for `wandb sync`)",
    )
    export.set_defaults(func=commands.export)

    examples = sub.add_parser(
        "examples",
        help="the example jobs YAMLs and sbatch script the package carries: list, print or copy one",
        description="Without NAME: list them. With NAME (smoke, smoke.yaml, jobs/smoke.yaml): print it, or with "
        "--copy-to DIR write it there. plan, submit and download take an example's name where no such file is.",
    )
    examples.add_argument("name", nargs="?", metavar="NAME", help="an example, e.g. smoke or fsdp_job.sbatch")
    examples.add_argument("--copy-to", metavar="DIR", help="write the example into DIR (never over a file)")
    examples.set_defaults(func=commands.examples)

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
    config_only = "each hub model's config.json alone: what `plan --memory` predicts from, before any other download"
    download.add_argument("--config-only", action="store_true", help=config_only)
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
    add_max_cells(download)
    download.add_argument(
        "--verify",
        action="store_true",
        help="download nothing: re-hash the cached files (all, or the items named) against the manifest",
    )
    download.add_argument("--force", action="store_true", help="download and rebuild the items again")
    download.add_argument("--num-proc", type=int, metavar="N", help="processes for dataset loading and tokenization")
    download.set_defaults(func=commands.download)
    return parser


def _run_fields_help() -> str:
    from .sweep.define.fielddocs import help_listing

    return "RunSpec fields, their defaults and what they mean (docs/submit.md):\n" + help_listing(RunSpec)
