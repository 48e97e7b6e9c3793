"""A property-based fuzzer (Hypothesis) over what a careless or hostile hand can leave in a sweep
folder or a jobs file (issue 33).

- Records: a valid record mutated (a field of another type, out of range, NaN or Infinity, an
  integer past 64 bits, deep nesting, a field removed) or replaced by an odd file (a FIFO, a link
  to /dev/zero or out of the folder, a folder, nothing, bytes) goes through the readers and the
  code of status, collect (tables, recommendation, results.csv and .parquet), history (its rows,
  into a real DuckDB file), export (its runs, a real TensorBoard writer) and logs, in-process: each
  ends in bounded time, never raises anything but the one-line UserError, and no such record is
  ever named as a best setup.
- Cell folders of any name (bytes that are not UTF-8, another cell's name) and text with lone
  surrogates go through status (its --json answer read by a strict parser), collect and export.
- Jobs files: a valid YAML tree mutated (lone surrogates too) goes through `plan`, `plan --memory`
  and `plan --sbatch`: valid, or refused in lines naming the file (one per problem).
- A few whole commands in processes of their own, under a memory and time limit, for the
  guarantee that nothing prints a traceback.
- Shared folders (issue 44): links, hard links, FIFOs, device nodes and folders planted at a
  sweep's lock, history, references, report and manifest, through collect and the sweep's lock:
  nothing outside the folder changes. And tune's state.json and tune.json mutated, through tune's
  state reader, the report's tune section and --only-best's reader.

Hypothesis keeps no example database (database=None); the seed is printed before the first test of the
run (`fuzz seed N`) and HPCFSDP_FUZZ_SEED=N replays it. HPCFSDP_FUZZ_EXAMPLES sets the examples per
property (default 200).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, get_origin

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.files import parse_json
from hpcfsdp.contracts.jsontypes import INT64_MAX, INT64_MIN
from hpcfsdp.contracts.record import (
    CHECKED_FIELDS,
    CORRUPT,
    MISSING,
    RECORD_NAME,
    SPEC_NAME,
    STATUSES,
    _compiled_record_check,
    _record_problem,
)
from hpcfsdp.contracts.validity import record_state
from hpcfsdp.results.exports.runs import exported_runs
from hpcfsdp.results.history import History
from hpcfsdp.results.history_rows import history_rows
from hpcfsdp.results.read import label_cells, load_records, ok_configs
from hpcfsdp.results.render import write_tables
from hpcfsdp.results.report import recommendation, report_folder
from hpcfsdp.sweep.track.logs import print_logs
from test_history import write_sweep

SEED = int(os.environ.get("HPCFSDP_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
EXAMPLES = int(os.environ.get("HPCFSDP_FUZZ_EXAMPLES", "200"))
EXAMPLE_LIMIT_S = 30.0  # one example's commands on a loaded 2-core machine take about a second
FUZZ = settings(
    database=None,  # nothing written into the repository (.hypothesis/ is ignored too)
    max_examples=EXAMPLES,
    deadline=None,  # timed by the test itself, with a bound that a loaded machine keeps
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)


@pytest.fixture(scope="module", autouse=True)
def printed_seed(request):
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\nfuzz seed {SEED} (HPCFSDP_FUZZ_SEED={SEED} replays it), {EXAMPLES} examples per property")


# ---------------------------------------------------------------------------------------------
# Values

BIG_INTEGERS = [2**63, 2**63 - 1, 2**64, -(2**63) - 1, 10**30, 10**400, -(10**20)]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e300, -1e12]
FORMULAS = ["=1+1", "+cmd", "-2", "@SUM(A1)", '=HYPERLINK("x")', "", " ", "\n", "é", "\u202e", "../../etc"]
SURROGATES = ["\ud800", "x\udcff", "\udfff\ud800", "\ud83d\ude00"]  # lone ones (issue 44), and a pair: one emoji
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(BIG_INTEGERS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(ODD_FLOATS),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(FORMULAS + SURROGATES))
scalars = st.one_of(numbers, st.none(), st.booleans(), texts)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
values = st.one_of(numbers, scalars, json_values)  # single values more often than nested ones

# The fields a mutation aims at: every top-level field a record may have, spec fields, nested ones.
RECORD_FIELDS = [
    "status",
    "schema_version",
    "cell_id",
    "sweep",
    "spec",
    "world_size",
    "nodes",
    "device_name",
    "hostnames",
    "slurm",
    "versions",
    "started_at",
    "duration_s",
    "slurm_accounting",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "step_time_s",
    "step_times_s",
    "mfu",
    "memory",
    "peak_memory_gib",
    "memory_capacity_gib",
    "gpu_hours_per_billion_tokens",
    "joules_per_token",
    "losses",
    "final_loss",
    "error",
    "stage",
    "batch_search",
    "new_field",
]
SPEC_FIELDS = ["strategy", "batch_size", "grad_accum", "nodes", "gpus_per_node", "seq_len", "seed", "lr", "model"]
NESTED = ["slurm_accounting.elapsed_s", "slurm_accounting.queue_wait_s", "slurm.job_id", "memory.end.x"]
ODD_FILES = ["fifo", "dev_zero", "link_out", "folder", "empty", "bytes", "deep", "long_digits"]

# The record's fields with a range (Figure, Moment), read off the record's declared shape.
RANGED_FIELDS = sorted(name for name, hint in CHECKED_FIELDS.items() if get_origin(hint) is Annotated)
mutations = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(RANGED_FIELDS), numbers),
        st.tuples(st.just("set"), st.just("status"), st.sampled_from([*STATUSES, "weird", 1])),
        st.tuples(st.just("set"), st.sampled_from(RECORD_FIELDS), values),
        st.tuples(st.just("set"), st.sampled_from([f"spec.{f}" for f in SPEC_FIELDS] + NESTED), values),
        st.tuples(st.just("delete"), st.sampled_from(RECORD_FIELDS + [f"spec.{f}" for f in SPEC_FIELDS]), st.none()),
    ),
    min_size=1,
    max_size=4,
)
mutation = st.tuples(st.just("mutate"), mutations)
odd_file = st.tuples(st.just("odd"), st.sampled_from(ODD_FILES))
hostile = st.integers(min_value=0, max_value=4).flatmap(lambda k: odd_file if k == 0 else mutation)  # 1 in 5 odd


def mutated(record: dict, changes: list) -> dict:
    record = json.loads(json.dumps(record))
    for action, dotted, value in changes:
        *parents, last = dotted.split(".")
        target = record
        for part in parents:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        if action == "delete":
            target.pop(last, None)
        else:
            target[last] = value
    return record


def write_odd(path: Path, odd: str, outside: Path) -> None:
    path.unlink()
    if odd == "fifo":
        os.mkfifo(path)
    elif odd == "dev_zero":
        path.symlink_to("/dev/zero")
    elif odd == "link_out":
        path.symlink_to(outside)
    elif odd == "folder":
        path.mkdir()
    elif odd == "empty":
        path.write_bytes(b"")
    elif odd == "bytes":
        path.write_bytes(bytes(range(256)) * 4)
    elif odd == "deep":
        path.write_text('{"status": "ok", "spec": ' + "[" * 5000 + "]" * 5000 + "}")
    else:
        path.write_text('{"status": "ok", "schema_version": 1, "seed": ' + "9" * 5000 + "}")


# ---------------------------------------------------------------------------------------------
# Records


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A sweep of an ok, an oom and another ok record (the one the examples spoil), each with its
    spec.json and a log, and no Slurm job id (so that no example waits on sacct)."""
    results = tmp_path_factory.mktemp("fuzz") / "results"
    sweep = write_sweep(results, "fuzz", 0, {"a": 1000.0, "c": "oom", "b": 2000.0})
    for path in sweep.glob(f"cells/*/{RECORD_NAME}"):
        record = json.loads(path.read_text())
        record["slurm"] = None
        path.write_text(json.dumps(record))
        spec = {"cell_id": path.parent.name, "sweep": "fuzz", "spec": record["spec"]}
        (path.parent / SPEC_NAME).write_text(json.dumps(spec))
        (path.parent / "log.txt").write_text("a local run's log\n")
    return sweep


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One history for every example (an example's rows are added to it, as collect adds them)."""
    with History(tmp_path_factory.mktemp("fuzz-history") / "history.duckdb") as history:
        yield history


def quiet(call, *args) -> tuple[Any, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = call(*args)
    return result, out.getvalue(), err.getvalue()


@seed(SEED)
@FUZZ
@given(change=hostile)
def test_hostile_records_never_crash_hang_or_win(template, store, change):
    started = time.monotonic()
    with within(EXAMPLE_LIMIT_S), tempfile.TemporaryDirectory() as scratch:
        sweep = Path(shutil.copytree(template, Path(scratch) / "fuzz", symlinks=True))
        victim = sorted(sweep.glob(f"cells/*/{RECORD_NAME}"))[-1]  # b, the fastest of the three
        original = json.loads(victim.read_text())
        outside = Path(scratch) / "elsewhere.json"
        outside.write_text(json.dumps(original))
        if change[0] == "odd":
            write_odd(victim, change[1], outside)
        else:
            text = json.dumps(mutated(original, change[1]))  # NaN and Infinity as Python writes them
            victim.write_text(text)
        note(f"seed {SEED}; {change}")

        state = record_state(victim, root=sweep, cell_id=victim.parent.name)  # what status, collect, export read
        assert state.status in (*STATUSES, CORRUPT, MISSING)
        if change[0] == "mutate":  # the validator compiled from the declarations never passes what the walk refuses
            parsed = parse_json(victim.read_bytes())
            assert not _compiled_record_check()(parsed) or _record_problem(parsed) is None, _record_problem(parsed)
        if state.status == CORRUPT:
            assert state.problem.startswith(str(victim)) and "\n" not in state.problem
        elif state.record is not None:
            assert_in_range(state.record)

        code, _out, err = quiet(main, ["status", str(sweep)])
        assert code in (0, 1, 3, 4) and "Traceback" not in err, err  # 3: a cell not ok (a corrupt record)
        _code, out, _err = quiet(main, ["status", str(sweep), "--json"])
        orjson.loads(out.encode())  # strict UTF-8 JSON, whatever text the record held
        winner = victim.parent.name
        code, _out, err = quiet(print_logs, sweep, winner, "stdout")
        assert code in (0, 1)

        collection = load_records(sweep, {})
        assert set(collection.unreadable) == ({state.problem} if state.problem else set())
        if state.record is None:  # skipped: the tables, the history and exports hold only the others
            assert winner not in set(collection.frame["cell_id"])
        else:
            through_tables_history_and_export(sweep, collection, store, winner, state.status)
    assert time.monotonic() - started < EXAMPLE_LIMIT_S


class Hung(Exception):
    """An example past its time limit. Not TimeoutError, which is an OSError: the commands take an
    OSError for a refusal of their own (cli.main: an `error:` line, exit 1), and slurm.ask for a
    Slurm client that could not run (a watch then asks again), so a hang would pass as either."""


@contextlib.contextmanager
def within(seconds: float):
    """A hang (a FIFO opened, /dev/zero read, a wait that never ends) becomes a failure of the
    example after `seconds` (Hung)."""

    def expire(signum, frame):
        raise Hung(f"an example ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def through_tables_history_and_export(sweep: Path, collection: Any, store: History, cell: str, status: str) -> None:
    """What collect and export do with a readable record: the recommendation (which never names a
    cell that is not ok), results.csv and .parquet, the history's rows, the exported runs."""
    cells = label_cells(collection)
    lines = recommendation(ok_configs(cells), cells)
    if status != "ok":
        assert not any(cell in line for line in lines), lines
    for line in lines:
        assert "inf " not in line and "nan" not in line, line
    write_tables(collection.cells, report_folder(sweep))
    store.append(history_rows(collection, sweep))
    runs = list(exported_runs(sweep, collection.frame, collection.spec_fields))
    # A step whose loss was not finite is NaN at its own step (issue 34); never an infinity, and
    # every headline figure a tracker gets is a finite number.
    assert all(not math.isinf(loss) for run in runs for _, loss in run.losses)
    assert all(math.isfinite(value) for run in runs for value in run.figures.values())


def assert_in_range(record: dict) -> None:
    """What read_record promises of a record it lets through: every integer fits 64 bits and the
    figures the tables rank by are from 0 to 1e15."""
    stack = [record]
    while stack:
        item = stack.pop()
        if type(item) is int:
            assert INT64_MIN <= item <= INT64_MAX
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    for name in RANGED_FIELDS:
        value = record.get(name)
        for number in value if isinstance(value, list) else [value]:
            assert number is None or (math.isfinite(number) and 0 <= number <= 1e15), (name, value)
    started = record.get("started_at")
    assert started is None or 946_684_800 <= started <= time.time() + 86_400, started


# Names of a cell folder: any bytes a file name may hold (not UTF-8 too), and names of other cells.
folder_names = st.one_of(
    st.binary(min_size=1, max_size=16).filter(lambda name: b"/" not in name and b"\0" not in name),
    st.sampled_from([b"caf\xe9", b"\xff\xfe", b"\xed\xa0\x80", "é".encode(), b"..."]),
).filter(lambda name: name not in (b".", b".."))


@seed(SEED)
@FUZZ
@given(name=folder_names)
def test_a_cell_folder_of_any_name_never_crashes_status_collect_or_export(template, name):
    """A copy of a cell in a folder of that name (issue 44, item 4): a name that is not UTF-8 is a
    corrupt cell, named escaped; a UTF-8 one holds another cell's record (item 10), corrupt too."""
    with within(EXAMPLE_LIMIT_S), tempfile.TemporaryDirectory() as scratch:
        sweep = Path(shutil.copytree(template, Path(scratch) / "fuzz", symlinks=True))
        cells = sorted(path.name for path in (sweep / "cells").iterdir())
        source = sweep / "cells" / cells[0]
        shutil.copytree(source, os.fsdecode(os.fsencode(sweep / "cells") + b"/" + name))
        note(f"seed {SEED}; {name!r}")
        code, out, err = quiet(main, ["status", str(sweep), "--json"])
        assert code == 3 and "Traceback" not in err, err
        document = orjson.loads(out.encode())
        assert sum(cell["status"] == CORRUPT for cell in document["cells"]) == 1
        collection = load_records(sweep, {})
        assert len(collection.unreadable) == 1 and "\n" not in collection.unreadable[0]
        collection.unreadable[0].encode("utf-8")  # printable, and writable into a report
        assert sorted(collection.frame["cell_id"]) == cells
        write_tables(collection.cells, report_folder(sweep))
        assert len(list(exported_runs(sweep, collection.frame, collection.spec_fields))) == 3


# ---------------------------------------------------------------------------------------------
# Jobs files

VALID_JOBS = {
    "name": "fuzzed",
    "base": {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 4, "warmup_steps": 1},
    "slurm": {"partition": "gpu", "time_min": 10, "cpus_per_task": 1},
    "matrix": {"strategy": ["ddp", "fsdp2_zero3"], "batch_size": [1, 2]},
    "include": [{"strategy": "fsdp2_zero3", "batch_size": 2, "grad_accum": 2}],
}
SECTIONS = ["name", "base", "slurm", "matrix", "include", "exclude", "setup", "extra"]
KEYS = [
    "model",
    "device",
    "precision",
    "seq_len",
    "steps",
    "warmup_steps",
    "strategy",
    "batch_size",
    "grad_accum",
    "nodes",
    "gpus_per_node",
    "seed",
    "lr",
    "global_batch_size",
    "data",
    "tokenizer",
    "partition",
    "time_min",
    "mem_gb",
    "cpus_per_task",
    "extra_sbatch",
    "gpu_name",
    "cache_dir",
    "container",
    "account",
]
yaml_values = st.one_of(
    values.filter(lambda v: not _has_nan(v)),  # YAML writes .nan; kept, but not inside keys' lists
    st.sampled_from(["auto", "~nosuchuser/x", "~/x", "/nonexistent", "H200", "a\u0301", "fsdp1_hybrid_shard"]),
    st.sampled_from(SURROGATES),  # a lone surrogate: refused on the line that writes it (issue 44)
    st.lists(st.integers(min_value=-3, max_value=2**65), min_size=0, max_size=3),
)
yaml_mutations = st.lists(
    st.tuples(st.sampled_from(SECTIONS), st.sampled_from([*KEYS, None]), yaml_values), min_size=1, max_size=4
)


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return value != value
    if isinstance(value, list):
        return any(map(_has_nan, value))
    if isinstance(value, dict):
        return any(map(_has_nan, value.values()))
    return False


def mutated_jobs(changes: list) -> Any:
    jobs: Any = json.loads(json.dumps(VALID_JOBS))
    for section, key, value in changes:
        if key is None:
            jobs[section] = value
        elif isinstance(jobs.get(section), dict):
            jobs[section][key] = value
        elif isinstance(jobs.get(section), list) and jobs[section] and isinstance(jobs[section][0], dict):
            jobs[section][0][key] = value
        else:
            jobs[section] = {key: value}
    return jobs


@seed(SEED)
@FUZZ
@given(changes=yaml_mutations)
def test_mutated_jobs_files_plan_or_are_refused_in_one_line(tmp_path, changes):
    started = time.monotonic()
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(mutated_jobs(changes), allow_unicode=True))
    note(f"seed {SEED}; {changes}")
    for flags in ([], ["--memory"], ["--sbatch"]):
        code, _out, err = quiet(main, ["plan", str(path), *flags, "--results-dir", str(tmp_path / "results")])
        lines = [line for line in err.strip().splitlines() if not line.startswith("note: ")]  # checks skipped
        if code == 0:
            assert not [line for line in lines if line.startswith("error")], err
        else:  # a line per problem, each naming the file (the first 20, then how many more)
            assert code in (1, 2) and lines, (code, err)
            assert all(line.startswith((f"error: {path}", "error: ... and ")) for line in lines), (code, err)
    assert time.monotonic() - started < EXAMPLE_LIMIT_S


# ---------------------------------------------------------------------------------------------
# Whole commands, each in a process of its own under a limit: no traceback, ever


ADDRESS_SPACE = 3 << 30  # RLIMIT_AS of each command: a blow-up ends in MemoryError, which the test sees
COMMAND_LIMIT_S = 120
RECOMMENDED = ("Fastest", "Most memory", "Cheapest")  # the report's best setups, as collect prints them


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def test_whole_commands_over_a_folder_of_hostile_records_print_no_traceback(template, tmp_path):
    sweep = Path(shutil.copytree(template, tmp_path / "fuzz", symlinks=True))
    original = json.loads(sorted(sweep.glob(f"cells/*/{RECORD_NAME}"))[0].read_text())
    draw = random.Random(SEED)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(original))
    for index in range(24):
        folder = sweep / "cells" / f"hostile-{index}"
        folder.mkdir()
        path = folder / RECORD_NAME
        path.write_text("{}")
        (folder / SPEC_NAME).write_text(json.dumps({"cell_id": folder.name, "sweep": "fuzz", "spec": original["spec"]}))
        if index < len(ODD_FILES):
            write_odd(path, ODD_FILES[index], outside)
        else:
            field = draw.choice(RECORD_FIELDS)
            value = draw.choice([*BIG_INTEGERS, *ODD_FLOATS, *FORMULAS, [[[[1]]]], {"x": {"y": math.nan}}])
            path.write_text(json.dumps(mutated(original, [("set", field, value)])))
    corrupt = [p.parent.name for p in sweep.glob(f"cells/*/{RECORD_NAME}") if record_state(p, sweep).status == CORRUPT]
    assert len(corrupt) >= len(ODD_FILES)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    history = tmp_path / "history.duckdb"
    for argv in (
        ["status", str(sweep)],
        ["collect", str(sweep), "--history", str(history)],
        ["history", "--history", str(history)],
        ["export", str(sweep), "--to", "tensorboard", str(tmp_path / "tb")],
        ["logs", str(sweep)],
        ["logs", str(sweep), "hostile-0"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "hpcfsdp", *argv],
            capture_output=True,
            text=True,
            timeout=COMMAND_LIMIT_S,
            env=env,
            preexec_fn=_limited,
        )
        assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, (argv, done.stderr[-3000:])
        # 3: some cell not ok, or a history collect could not check; 4: some cell still in flight
        assert done.returncode in (0, 1, 3, 4), (argv, done.returncode, done.stderr[-2000:])
        errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
        assert len(errors) <= 1, errors
        if argv[0] == "collect":
            best = [
                line for line in done.stdout.splitlines() if line.startswith(("Fastest", "Most memory", "Cheapest"))
            ]
            assert best and not any(f"(cell {cell})" in line for line in best for cell in corrupt), best


def test_the_fuzzer_keeps_no_example_database_in_the_repository():
    assert FUZZ.database is None
    assert ".hypothesis/" in (ROOT / ".gitignore").read_text().splitlines()


# ---------------------------------------------------------------------------------------------
# Links, FIFOs and devices planted in a shared sweep folder (issue 44): collect and the sweep's
# lock never reach a thing out of the folder. Everything planted is made in the example's own
# temporary folder (device nodes: /dev/null's numbers, made with os.mknod, as root only).

# Where a hand plants something, from the sweep folder: its lock, its files, and those beside it.
PLANTED_AT = [
    ".submit.lock",
    "../history.duckdb",
    "../history.duckdb.lock",
    "../references.yaml",
    "report",
    "report/summary.md",
    "tune.json",
    "manifest.json",
]
PLANTED = ["link_to_file", "link_to_fifo", "link_to_folder", "link_to_nothing", "hard_link", "fifo", "device", "folder"]
plantings = st.lists(st.tuples(st.sampled_from(PLANTED_AT), st.sampled_from(PLANTED)), min_size=1, max_size=3)
# Each example runs a whole collect (the history in DuckDB, the report): some seconds on a loaded
# machine, and 8 x 8 plantings are few: a quarter of the examples.
FUZZ_PLANTED = settings(FUZZ, max_examples=max(10, EXAMPLES // 4))


def plant(path: Path, what: str, outside: Path) -> None:
    """Put `what` at path (nothing there before), leading to or made of things in `outside`."""
    if os.path.lexists(path) or any(os.path.lexists(up) and not up.is_dir() for up in path.parents):
        return  # something planted before stands where a folder would have to be
    path.parent.mkdir(parents=True, exist_ok=True)
    kinds = {"file": outside / "file.txt", "fifo": outside / "fifo", "folder": outside / "folder"}
    if what.startswith("link_to_"):
        path.symlink_to(kinds.get(what.removeprefix("link_to_"), outside / "nothing" / "x"))
    elif what == "hard_link":
        os.link(kinds["file"], path)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "device" and os.geteuid() == 0:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    elif what == "folder":
        path.mkdir()


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under folder: its kind, inode, size and (a regular file's) content."""
    seen = {}
    for path in sorted(folder.rglob("*")):
        info = os.lstat(path)
        content = path.read_bytes() if stat.S_ISREG(info.st_mode) else b""
        seen[str(path.relative_to(folder))] = (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size, content)
    return seen


@seed(SEED)
@FUZZ_PLANTED
@given(planted=plantings)
def test_links_and_devices_planted_in_a_sweep_folder_never_let_collect_or_the_lock_touch_what_is_outside(
    template, planted
):
    from hpcfsdp.contracts.errors import UserError
    from hpcfsdp.sweep.launch.lock import sweep_lock

    started = time.monotonic()
    with within(EXAMPLE_LIMIT_S), tempfile.TemporaryDirectory() as scratch:
        sweep = Path(shutil.copytree(template, Path(scratch) / "results" / "fuzz", symlinks=True))
        outside = Path(scratch) / "outside"
        (outside / "folder").mkdir(parents=True)
        (outside / "file.txt").write_text("someone's file\n")
        os.mkfifo(outside / "fifo")
        for where, what in planted:
            plant(sweep / where, what, outside)
        note(f"seed {SEED}; {planted}")
        before = snapshot(outside)
        code, _out, err = quiet(main, ["collect", str(sweep), "--no-plots"])
        assert "Traceback" not in err and code in (0, 1, 2, 3), (code, err)
        # at most the history's (collect goes on without it) and the one that stopped collect
        assert len([line for line in err.splitlines() if line.startswith("error")]) <= 2, err
        try:
            with sweep_lock(sweep, lambda line: None, "submit"):
                pass
        except UserError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"{sweep}/"), exc  # the lock, or a folder of it
        assert snapshot(outside) == before
    assert time.monotonic() - started < EXAMPLE_LIMIT_S


# ---------------------------------------------------------------------------------------------
# tune's own files: state.json and tune.json mutated go through tune's state reader, the report's
# tune section and --only-best's reader: a state, a section, or one line; never a traceback, never
# a run id that is a path, never a figure out of range.

TUNE_STATE_PATHS = [
    "sweep",
    "grid",
    "grid.0",
    "pruned",
    "computed",
    "version",
    "stages",
    "stages.0",
    "stages.0.name",
    "stages.0.runs",
    "stages.0.jobs",
    "stages.1",
]
TUNE_OUTCOME_PATHS = [
    "best",
    "best.tokens_per_s_per_gpu",
    "best.setup",
    "best.cell_id",
    "ranking",
    "ranking.0",
    "ranking.0.tokens_per_s_per_gpu",
    "ranking.0.runs_tokens_per_s_per_gpu",
    "ranking.0.runs_tokens_per_s_per_gpu.0",
    "ranking.0.setup.batch_size",
    "oom_frontier",
    "pruned",
    "notes",
    "spend",
    "spend.tune_gpu_hours",
    "spend.by_stage",
    "spend.by_stage.stage0",
    "spend.launches",
    "spend.grid_estimate_gpu_hours",
]
tune_values = st.one_of(values, st.sampled_from(["/etc", "../../x", "stage9", "final", "ddp-b1-a1-0123456789"]))
tune_changes = st.tuples(
    st.lists(st.tuples(st.sampled_from(TUNE_STATE_PATHS), tune_values), max_size=3),
    st.lists(st.tuples(st.sampled_from(TUNE_OUTCOME_PATHS), tune_values), max_size=3),
)


def set_at(document: Any, dotted: str, value: Any) -> Any:
    """document with the value at a dotted path (list indices as numbers) replaced, or added."""
    document = json.loads(json.dumps(document))
    *parents, last = dotted.split(".")
    target = document
    for part in parents:
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and isinstance(target.get(part), (dict, list)):
            target = target[part]
        else:
            return document
    if isinstance(target, list) and last.isdigit():
        target.append(value) if int(last) >= len(target) else target.__setitem__(int(last), value)
    elif isinstance(target, dict):
        target[last] = value
    return document


@pytest.fixture(scope="module")
def tune_folder(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A sweep folder whose search began (its state as tune writes it: the first stage's probes),
    and a tune.json as tune writes one."""
    from hpcfsdp.sweep.define.matrix import load_sweep
    from hpcfsdp.tune.stages import _probe_stage, new_state
    from hpcfsdp.tune.state import save_state
    from test_tune_files import jobs_yaml, tune_outcome

    root = tmp_path_factory.mktemp("fuzz-tune")
    sweep = load_sweep(jobs_yaml(root))
    sweep_dir = root / "results" / "tf"
    state, _ = new_state(sweep, lambda line: None)
    state.stages.append(_probe_stage(sweep_dir, sweep, list(sweep.cells), 0, 3))
    save_state(sweep_dir, state)
    return sweep_dir, json.loads((sweep_dir / "tune" / "state.json").read_text()), tune_outcome(sweep.cells[0].id)


@seed(SEED)
@FUZZ
@given(changes=tune_changes)
def test_hostile_tune_files_are_a_state_a_report_section_or_one_line(tune_folder, changes):
    from hpcfsdp.contracts.files import RecordError
    from hpcfsdp.contracts.jsontypes import FIGURE_MAX
    from hpcfsdp.results.tuned import tune_section
    from hpcfsdp.sweep.define.matrix import is_cell_id
    from hpcfsdp.sweep.folder.tune_outcome import read_outcome
    from hpcfsdp.tune.state import load_state

    sweep_dir, valid_state, valid_outcome = tune_folder
    state_changes, outcome_changes = changes
    note(f"seed {SEED}; {changes}")
    state_doc, outcome_doc = valid_state, valid_outcome
    for dotted, value in state_changes:
        state_doc = set_at(state_doc, dotted, value)
    for dotted, value in outcome_changes:
        outcome_doc = set_at(outcome_doc, dotted, value)
    (sweep_dir / "tune" / "state.json").write_text(json.dumps(state_doc))
    (sweep_dir / "tune.json").write_text(json.dumps(outcome_doc))
    try:
        state = load_state(sweep_dir)
    except RecordError as exc:
        assert "\n" not in str(exc) and str(exc).endswith("remove tune/ to start again"), exc
    else:
        assert state is not None
        runs = [run for stage in state.stages for run in stage.runs]
        assert all(is_cell_id(run) for run in runs) and set(state.pruned) <= set(state.grid)
        assert all(grid_id in state.grid for stage in state.stages for grid_id in stage.runs.values())
    section = tune_section(sweep_dir)  # never raises: a section, which says so when the file is unusable
    assert section is not None and section.title == "Tune"
    try:
        found = read_outcome(sweep_dir)
    except RecordError as exc:
        assert "\n" not in str(exc) and section.text.startswith("Not shown: ")
    else:
        for row in [found.get("best") or {}, *(found.get("ranking") or [])]:
            for speed in [row.get("tokens_per_s_per_gpu"), *(row.get("runs_tokens_per_s_per_gpu") or [])]:
                assert speed is None or (math.isfinite(speed) and 0 <= speed <= FIGURE_MAX)
