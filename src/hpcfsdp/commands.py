"""One function per `hpcfsdp` command (cli.py parses and dispatches): it checks the options that
only make sense together, and calls the side that does the work (sweep/, results/, cache/, cell/),
imported lazily so that a login-node command loads no torch. What stops a command is a UserError
(errors.py), which cli.main prints."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import yaml

from .contracts.errors import Stopped, UserError
from .contracts.fields import SpecError, check_folder_name, one_line
from .contracts.record import SPEC_NAME, STATUSES
from .contracts.spec import RunSpec
from .results.defaults import REFERENCES_NAME

if TYPE_CHECKING:  # for annotations only: each command imports what it uses
    from .sweep.define.matrix import Sweep

WAIT_POLL_S = 3.0  # submit --wait: seconds between looks at squeue


def _load_sweep(args: argparse.Namespace) -> Sweep:
    """The jobs YAML, refused in one line where a cell asks for a lever whose package is missing."""
    from .sweep.define.examples import jobs_file
    from .sweep.define.matrix import MAX_CELLS, load_sweep
    from .sweep.launch.packages import package_problems

    sweep = load_sweep(jobs_file(args.jobs), args.max_cells or MAX_CELLS)
    missing = package_problems(sweep)
    if missing:
        raise SpecError(missing[0] + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return sweep


def plan(args: argparse.Namespace) -> int:
    from .sweep.launch.plan import print_plan, print_sbatch_scripts

    try:
        sweep = _load_sweep(args)
    except UserError as exc:
        if args.json:  # scripts get the one shape of answer: the document, with the refusal as its problem
            from .sweep.launch.plan import refused_document

            print_json(refused_document(one_line(str(exc)), exc.exit_status))
            exc.json_answered = True
        raise
    if args.sbatch:
        if args.json:
            raise SpecError("plan: --json and --sbatch: give one (--sbatch prints shell scripts)")
        return print_sbatch_scripts(sweep, Path(args.results_dir))
    if args.json:
        from .sweep.launch.plan import plan_document

        document = plan_document(sweep, memory=args.memory)
        print_json(document)
        return int(document["exit_status"])
    return print_plan(sweep, memory=args.memory)


def submit(args: argparse.Namespace) -> int:
    from .cache.plan import cache_misses
    from .results.collect import collect
    from .sweep.launch.environment import fault_hook_warning
    from .sweep.launch.plan import predicted_oom_warning, without_predicted_oom
    from .sweep.launch.submit import default_executor, still_queued, submit, wait_for
    from .sweep.track.status import blocked_message, cells_exit_status, print_status

    sweep = _load_sweep(args)
    misses = cache_misses(sweep, sweep.resources.cache_dir or None)
    if misses:
        more = f" (and {len(misses) - 1} more: `hpcfsdp plan` lists them)" if len(misses) > 1 else ""
        raise SpecError(f"{sweep.source}: {misses[0]}{more}")
    executor, why = (args.executor, "") if args.executor else default_executor(sweep.resources.clusters)
    if args.then_collect and executor != "slurm":
        raise SpecError(f"submit: --then-collect queues a Slurm job: it needs the slurm executor, not {executor}")
    # With --executor print, stdout holds only the commands (a shell script), with local only the
    # table its collect prints: messages and the [i/n] progress go to stderr.
    log = _to_stderr if executor in ("print", "local") else print
    if args.skip_predicted_oom:
        sweep = without_predicted_oom(sweep, log)
    elif warning := predicted_oom_warning(sweep):
        log(warning)
    if args.only_best:
        from .tune.output import best_only

        sweep = best_only(sweep, Path(args.results_dir), log)
    if warning := fault_hook_warning():
        log(warning)
    if why:
        log(f"note: {why}; running the cells on this machine, one at a time (--executor local)")
    sub = submit(
        sweep,
        Path(args.results_dir),
        executor,
        force=args.force,
        retry_failed=args.retry_failed,
        log=log,
        room_poll_s=WAIT_POLL_S if args.wait else None,
    )
    log(f"sweep folder: {sub.sweep_dir}")
    if args.then_collect:
        from .sweep.launch.collect_job import queue_collect

        queue_collect(sweep, sub.sweep_dir, [*sub.job_ids.values(), *sub.in_flight.values()], log)
    # Exit status 3 when a cell did not finish ok (errors.py): what a scheduled (cron, CI) run checks.
    if executor == "slurm" and args.wait:
        try:
            report = wait_for(sub, WAIT_POLL_S, log)
        except KeyboardInterrupt as exc:  # the jobs run on
            queued = still_queued(sub)
            raise Stopped(
                f"stopped waiting; {'?' if queued is None else queued} cells still queued; "
                f"`hpcfsdp status {sub.sweep_dir}`",
                getattr(exc, "exit_status", 130),
            ) from None
        print_status(report, summary=False)
        if report.stuck:  # every cell left waits on a reason that cannot clear
            if not all(c.blocked for c in report.cells):  # some cells finished: their table
                collect(sub.sweep_dir)
            raise UserError(blocked_message(report.blocked, report.cluster))
        states = [c.state for c in report.cells]
    elif executor == "local":
        states = list(sub.outcomes.values())
    else:
        if executor == "slurm" and (sub.job_ids or sub.in_flight):
            log(_next_commands(sub.sweep_dir, args.then_collect))
        return 0
    collected = collect(sub.sweep_dir)
    if failed := sum(state != "ok" for state in states):
        print(f"{failed} cell(s) did not finish ok", file=sys.stderr)
    return cells_exit_status(states) or collected


def _next_commands(sweep_dir: Path, then_collect: bool) -> str:
    """What to run once submit has queued cells and returned: watch them, then the tables."""
    tables = f"then `hpcfsdp collect {sweep_dir}`" if not then_collect else "the collect job writes the tables"
    return f"next: `hpcfsdp status {sweep_dir} --watch` (progress until the cells end), {tables}"


def tune(args: argparse.Namespace) -> int:
    from .cache.plan import cache_misses
    from .results.collect import collect
    from .sweep.launch.submit import default_executor
    from .tune.output import summary_lines
    from .tune.stages import Settings, tune

    sweep = _load_sweep(args)
    misses = cache_misses(sweep, sweep.resources.cache_dir or None)
    if misses:
        raise SpecError(f"{sweep.source}: {misses[0]}" + (f" (and {len(misses) - 1} more)" if len(misses) > 1 else ""))
    executor, why = (args.executor, "") if args.executor else default_executor(sweep.resources.clusters)
    if why:
        print(f"note: {why}; probing on this machine, one at a time (--executor local)")
    settings = Settings(executor, args.eta, args.top, args.probes_per_job, WAIT_POLL_S)
    found = tune(sweep, Path(args.results_dir), settings)
    sweep_dir = Path(args.results_dir) / sweep.name
    if found["best"]:
        collect(sweep_dir)  # the final stage's cells, and the report's tune section
    print("\n".join(summary_lines(found)))
    print(f"tune.json: {sweep_dir / 'tune.json'}")
    return 0 if found["best"] else 1


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def print_json(document: dict) -> None:
    """A `--json` answer: one strict JSON document on stdout (NaN as null)."""
    from .contracts.jsontypes import strict_json

    print(strict_json(document))


def run(args: argparse.Namespace) -> NoReturn:
    from .cell.ranks.forking import NO_ALLOCATOR_THREAD
    from .cell.stopping import early_signals

    for name, value in NO_ALLOCATOR_THREAD.items():  # before the imports: one thread, to fork the probe starter
        os.environ.setdefault(name, value)

    with early_signals.held():  # from before torch is imported: a signal now still ends in a record
        status = _run_one_cell(args)
    _exit_worker(0 if status == "ok" else 1)


def _run_one_cell(args: argparse.Namespace) -> str:
    """The cell's arguments are checked before torch is imported (seconds): a mistyped field is one
    `error:` line at once, as from every other command."""
    if args.cell_dir:
        if args.fields:
            raise SpecError("run: give either --cell-dir or KEY=VALUE fields, not both")
        if not (Path(args.cell_dir) / SPEC_NAME).is_file():
            raise SpecError(
                f"{args.cell_dir}: no {SPEC_NAME} here (--cell-dir takes a cells/<id> folder written by submit)"
            )
        from .cell.run import run_cell_dir

        return run_cell_dir(Path(args.cell_dir))
    values = {}
    for item in args.fields:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"run: {item!r}: expected KEY=VALUE")
        values[key] = yaml.safe_load(value)
    # here, not for --cell-dir: a rank that submit or tune started reads its cell from spec.json
    from .sweep.define.matrix import Cell
    from .sweep.folder.layout import cell_dir

    spec, sources = RunSpec.resolved({**_torchrun_shape(), **values}, where="run arguments")
    cell = Cell.of(spec, sources)
    check_folder_name("run", "--sweep", args.sweep)
    from .cell.run import run_cell

    return run_cell(spec, cell_dir(Path(args.results_dir) / args.sweep, cell), cell.id, args.sweep, sources)


def _torchrun_shape() -> dict[str, int]:
    """nodes and gpus_per_node as torchrun launched this process; empty when not under torchrun.

    Lets `torchrun --nproc-per-node 2 -m hpcfsdp run strategy=...` work without repeating the
    process count as RunSpec fields.
    """
    if "WORLD_SIZE" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return {}
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return {"nodes": max(1, world // per_node), "gpus_per_node": per_node}


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


def status(args: argparse.Namespace) -> int:
    from .sweep.folder.guards import require_sweep_folder
    from .sweep.launch.collect_job import collect_line
    from .sweep.track.accounting import note_accounting
    from .sweep.track.status import blocked_message, print_status, status_document, sweep_status
    from .sweep.track.watch import watch

    sweep_dir = Path(args.sweep_dir)
    require_sweep_folder(sweep_dir)
    if args.watch is not None and args.watch <= 0:
        raise SpecError(f"status: --watch: expected a positive number of seconds, got {args.watch}")
    report = watch(sweep_dir, args.watch) if args.watch else sweep_status(sweep_dir)
    if report.unknown:
        raise UserError(report.unknown_message())
    # Accounting may correct a record's status (a rank's `cancelled` that sacct says was NODE_FAIL).
    if note_accounting(sweep_dir, {c.cell_id: c.job_id for c in report.cells if c.job_id and c.state in STATUSES}):
        report = sweep_status(sweep_dir)
    if args.json:
        print_json({**status_document(report), "collect_job": collect_line(sweep_dir) or ""})
    else:
        print_status(report)
        if line := collect_line(sweep_dir):
            print(line)
    if report.stuck and args.watch:  # the watch ended with cells still queued
        raise UserError(blocked_message(report.blocked, report.cluster))
    if report.blocked:
        print(f"warning: {blocked_message(report.blocked, report.cluster)}", file=sys.stderr)
    return report.exit_status


def logs(args: argparse.Namespace) -> int:
    from .sweep.folder.guards import require_sweep_folder
    from .sweep.track.logs import Stream, cell_index, find_cell, follow, print_logs

    sweep_dir = Path(args.sweep_dir)
    require_sweep_folder(sweep_dir)
    stream: Stream = "stderr" if args.stderr else "stdout"
    if not args.cell:
        print("\n".join(cell_index(sweep_dir)))
        return 0
    cell = find_cell(sweep_dir, args.cell)
    return follow(sweep_dir, cell, stream) if args.follow else print_logs(sweep_dir, cell, stream)


def cancel(args: argparse.Namespace) -> int:
    from .sweep.folder.guards import require_sweep_folder
    from .sweep.track.cancel import cancel_sweep

    sweep_dir = Path(args.sweep_dir)
    require_sweep_folder(sweep_dir)
    done = cancel_sweep(sweep_dir, args.cells, args.pending_only)
    for what, cells in (("pending", done.pending), ("running", done.running)):
        for cid, jid in cells.items():
            along = ", not named: in the task of a cell named" if cid in done.taken_along else ""
            print(f"cancelled {cid} (job {jid}, {what}{along})")
    if done.left_running:
        print(f"left {len(done.left_running)} running cell(s) as they are (--pending-only)")
    if done.still_queued:
        jobs = " ".join(done.still_queued.values())
        print(f"warning: {len(done.still_queued)} cancelled job(s) still in the queue: {jobs}", file=sys.stderr)
    print(f"{len(done.pending) + len(done.running)} cell(s) cancelled; {len(done.not_queued)} had no queued job")
    return 0


def collect(args: argparse.Namespace) -> int:
    from .results.collect import collect, over_time_options

    for flag, value in (("--threshold", args.threshold), ("--tolerance", args.tolerance)):
        if not 0 < value < 1:
            raise SpecError(f"collect: {flag}: expected a fraction between 0 and 1, got {value}")
    if args.references and not Path(args.references).is_file():
        raise SpecError(f"collect: --references: {args.references}: no such file")
    sweep_dir = Path(args.sweep_dir)
    options = over_time_options(
        sweep_dir,
        Path(args.history) if args.history else None,
        args.references,
        args.tolerance,
        use_history=not args.no_history,
    )
    return collect(
        sweep_dir,
        baseline=args.baseline,
        plots=not args.no_plots,
        compare=Path(args.compare) if args.compare else None,
        threshold=args.threshold,
        over_time=options,
        fail_on_regression=args.fail_on_regression,
        as_json=args.json,
    )


def history(args: argparse.Namespace) -> int:
    from .results.history import Filters, History, parse_day
    from .results.history_rows import history_document, history_table, medians_by_setup
    from .results.references import references_of, write_references
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
    with History(Path(args.history), read_only=True) as store:
        rows = store.select(filters)
    if args.set_reference:
        path = Path(args.references) if args.references else Path(args.history).parent / REFERENCES_NAME
        new = references_of(medians_by_setup(rows), args.tolerance)
        merged = write_references(path, new)
        print(f"wrote {len(new)} reference(s) to {path} ({len(merged.entries)} in the file)")
        return 0
    if args.limit:
        rows = rows.tail(args.limit)
    if args.json:
        print_json({"history": args.history, "exit_status": 0, **history_document(rows)})
        return 0
    print(markdown_table(printable(history_table(rows))) if len(rows) else "(no records)")
    print(f"{len(rows)} run(s) of {rows['setup'].nunique()} setup(s) in {args.history}")
    return 0


def export(args: argparse.Namespace) -> int:
    from .results.exports.export import TARGETS, export_sweep
    from .sweep.folder.guards import require_sweep_folder

    target, destination = args.to
    if target not in TARGETS:
        raise SpecError("export", "--to", f"{target}: expected one of {', '.join(TARGETS)}")
    sweep_dir = Path(args.sweep_dir)
    require_sweep_folder(sweep_dir)
    written, skipped = export_sweep(sweep_dir, target, destination)
    already = f" ({skipped} exported before, left as they were)" if skipped else ""
    print(f"exported {written} run(s) of {sweep_dir} to {target} at {destination}{already}")
    return 0


def examples(args: argparse.Namespace) -> int:
    from .sweep.define.examples import copy_example, example, listing

    if args.copy_to and not args.name:
        raise SpecError("examples", "--copy-to", "name the example to copy (`hpcfsdp examples` lists them)")
    if not args.name:
        print("\n".join(listing()))
    elif args.copy_to:
        print(f"wrote {copy_example(args.name, Path(args.copy_to))}")
    else:
        sys.stdout.write(example(args.name).read_text())
    return 0


def download(args: argparse.Namespace) -> int:
    from .cache.download import download_main
    from .cache.plan import Request

    sweep = _load_sweep(args) if args.jobs else None
    request = Request(
        sweep=sweep,
        models=tuple(args.model),
        datasets=tuple(args.dataset),
        weights=args.weights,
        tokenize_for=tuple(args.tokenize_for),
        seq_lens=tuple(args.seq_len),
    )
    try:
        return download_main(
            request,
            # The cache the jobs read: --cache-dir, else the YAML's slurm.cache_dir, else $HPCFSDP_CACHE.
            cache_dir=args.cache_dir or (sweep.resources.cache_dir if sweep else None),
            verify_only=args.verify,
            allow_patterns=args.allow_pattern,
            text_column=args.text_column,
            num_proc=args.num_proc,
            force=args.force,
            config_only=args.config_only,
        )
    except KeyboardInterrupt:
        raise Stopped("interrupted: rerun the same command to resume (complete files are kept)") from None
