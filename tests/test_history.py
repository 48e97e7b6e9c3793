"""Over time: the history that every collect appends to, references, and regression flags.

Records with known throughput are written with the project's record writer; every collection goes
through the real `hpcfsdp collect` and `hpcfsdp history` commands and a real DuckDB file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.record import write_record
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.results import defaults, references, regressions
from hpcfsdp.results import history as history_store
from hpcfsdp.results.history_rows import history_rows, setup_fields, setup_key, spec_values
from hpcfsdp.results.read import Collection
from hpcfsdp.sweep.define.matrix import cell_id
from hpcfsdp.sweep.track.accounting import parse_sacct
from test_collect import GPU_BASE, H100, failed_record, ok_record, spec_of

H200 = "NVIDIA H200"
DAY = 86_400.0
T0 = datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc).timestamp()  # sweep k starts on 2026-11-0(2+k)

# The setups of the test, by name: spec fields over GPU_BASE.
SETUPS = {
    "a": {"strategy": "fsdp2_zero3", "batch_size": 1},
    "b": {"strategy": "fsdp2_zero3", "batch_size": 2},
    "c": {"strategy": "ddp", "batch_size": 1},
    "d": {"strategy": "fsdp2_zero2", "batch_size": 1},
    "e": {"strategy": "fsdp2_zero2", "batch_size": 2},
    # a's setup measured differently (more steps, another seed): the same setup to the history
    "a_again": {"strategy": "fsdp2_zero3", "batch_size": 1, "steps": 20, "seed": 1},
}
# Sweeps 0-2 on alps / H100: tokens/s per GPU per setup. Sweep 3 is the one checked.
EARLIER = {"a": (1000, 1010, 990), "b": (2000, 2000, 2000), "c": (1500, 1500, 1500), "d": (800, 800, 800)}


def write_sweep(
    results: Path,
    name: str,
    index: int,
    cells: dict[str, float | str],
    cluster: str = "alps",
    gpu: str = H100,
    peak: float = 30.0,
) -> Path:
    """A sweep folder whose cells (setup name -> tokens/s per GPU, or a failed status) started on
    day `index`, on the given system."""
    sweep = results / name
    for number, (setup, value) in enumerate(cells.items()):
        spec = spec_of(GPU_BASE, **SETUPS[setup])
        if isinstance(value, str):
            record = failed_record(spec, value, "train", "OutOfMemoryError: CUDA out of memory")
        else:
            record = ok_record(spec, value, peak)
        record.update(
            sweep=name,
            started_at=T0 + index * DAY + number,
            device_name=gpu,
            hostnames=["node-1"],
            launch_id=f"slurm-{1000 + 10 * index + number}-0",
            slurm={
                "job_id": str(1000 + 10 * index + number),
                "array_job_id": None,
                "array_task_id": None,
                "job_nodelist": "node-1",
                "cluster_name": cluster,
                "job_partition": "gpu",
            },
        )
        write_record(sweep / "cells" / record["cell_id"] / "result.json", record)
    return sweep


def collect(sweep: Path, *flags: str) -> int:
    return main(["collect", str(sweep), "--no-plots", *flags])


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A results folder with sweeps 0-2 collected into its history.duckdb."""
    results = tmp_path_factory.mktemp("history") / "results"
    for index in range(3):
        cells = {name: values[index] for name, values in EARLIER.items()}
        sweep = write_sweep(results, f"nightly-{index}", index, cells)
        assert collect(sweep) == 0
    return results


@pytest.fixture
def results(earlier, tmp_path) -> Path:
    """A copy of the earlier results, for a test to add to."""
    return Path(shutil.copytree(earlier, tmp_path / "results"))


def flagged(out: str) -> dict[str, list[str]]:
    """Cell id -> the regression lines printed for it."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("regression: "):
            cell, _, why = line.removeprefix("regression: ").partition(": ")
            found.setdefault(cell, []).append(why)
    return found


def ids(*names: str) -> set[str]:
    return {cell_id(spec_of(GPU_BASE, **SETUPS[name])) for name in names}


def test_collect_flags_exactly_the_cells_slower_than_their_history_or_failing_where_they_ran_ok(results, capsys):
    capsys.readouterr()
    # a: 15% below the median 1000; b: 5% below 2000 (within 10%); c: out of memory after 3 ok runs;
    # d: as before; a_again (a's setup, other steps and seed): 1% above; a on another cluster: no history there.
    sweep = write_sweep(results, "nightly-3", 3, {"a": 850, "b": 1900, "c": "oom", "d": 800, "a_again": 1010})
    other = write_sweep(results, "elsewhere", 3, {"a": 500}, cluster="daint")
    assert collect(sweep) == 0  # flags are reported; only --fail-on-regression fails
    out = capsys.readouterr().out
    got = flagged(out)
    assert set(got) == ids("a", "c")
    assert got[cell_id(spec_of(GPU_BASE, **SETUPS["a"]))] == [
        f"tokens/s/gpu 850 is 15.0% below the median 1,000 of 3 earlier run(s) of setup "
        f"{setup_key(spec_of(GPU_BASE, **SETUPS['a']).to_dict())} on alps / {H100} (tolerance 10%)"
    ]
    assert got[cell_id(spec_of(GPU_BASE, **SETUPS["c"]))] == [
        f"status oom; its setup ran ok 3 time(s) before on alps / {H100}"
    ]
    assert "5 cell(s) checked, 2 with a regression; 0 with neither" in out

    summary = (sweep / "report" / "summary.md").read_text()
    page = (sweep / "report" / "index.html").read_text()
    for text in (summary, page):
        assert "Over time" in text and "is 15.0% below the median 1,000" in text and "status oom" in text
    assert summary.count("REGRESSION") == 2

    assert collect(other) == 0
    out = capsys.readouterr().out
    assert not flagged(out) and "0 cell(s) checked, 0 with a regression; 1 with neither" in out
    assert collect(sweep, "--fail-on-regression") == 1
    assert set(flagged(capsys.readouterr().out)) == ids("a", "c")
    assert collect(other, "--fail-on-regression") == 0


def test_collecting_the_same_sweep_again_adds_no_rows_and_rerunning_a_cell_adds_one(results, capsys):
    path = results / "history.duckdb"

    def rows() -> int:
        with duckdb.connect(str(path), read_only=True) as con:
            return con.execute("SELECT count(*) FROM runs").fetchone()[0]

    assert rows() == 12  # 3 sweeps x 4 cells
    sweep = write_sweep(results, "nightly-3", 3, {"a": 850, "b": 1900})
    assert collect(sweep) == 0 and rows() == 14
    assert collect(sweep) == 0 and rows() == 14
    assert "History: 0 new row(s)" in capsys.readouterr().out
    write_sweep(results, "nightly-3", 4, {"a": 1000})  # cell a rerun in the same folder, a day later
    assert collect(sweep) == 0 and rows() == 15
    out = capsys.readouterr().out
    assert "History: 1 new row(s)" in out
    assert not flagged(out)  # the 850 of the first attempt is history now: median of 1000, 1010, 990, 850 is 995


def test_references_flag_cells_below_or_above_memory_and_name_faster_ones(results, capsys):
    (results / "references.yaml").write_text(
        "tolerance: 0.05\n"
        "references:\n"
        f"  - gpu: {H100}\n"
        "    match: {strategy: fsdp2_zero2, batch_size: 1}\n"
        "    tokens_per_s_per_gpu: 1000\n"
        "  - match: {strategy: fsdp2_zero2, batch_size: 2}\n"
        "    tokens_per_s_per_gpu: 1000\n"
        "    peak_memory_gib: 20\n"
        "    tolerance: 0.2\n"
        "  - match: {strategy: fsdp2_zero3, batch_size: 2}\n"
        "    tokens_per_s_per_gpu: 1700\n"
        f"  - gpu: {H200}\n"
        "    match: {strategy: ddp}\n"
        "    tokens_per_s_per_gpu: 99999\n"
    )
    capsys.readouterr()
    # d: 800 vs 1000 (-20%, tolerance 5%); e: 1100 vs 1000 (+10% within 20%) but 30 GiB vs 20 (+50%);
    # b: 2000 vs 1700 (+18%): faster, a hint; c: the H200 reference is not for this H100 cell.
    sweep = write_sweep(results, "nightly-3", 3, {"b": 2000, "c": 1500, "d": 800, "e": 1100})
    assert collect(sweep, "--fail-on-regression") == 1
    out = capsys.readouterr().out
    got = flagged(out)
    assert set(got) == ids("d", "e")
    (d_line,) = got[cell_id(spec_of(GPU_BASE, **SETUPS["d"]))]
    assert re.fullmatch(
        r"tokens/s/gpu 800 is 20\.0% below its reference 1,000 "
        r"\(tolerance 5%; .*references\.yaml:5\)",
        d_line,
    )
    (e_line,) = got[cell_id(spec_of(GPU_BASE, **SETUPS["e"]))]
    assert e_line.startswith("peak memory 30.00 GiB is 50.0% above its reference 20.00 GiB (tolerance 20%")
    hint = f"note: {cell_id(spec_of(GPU_BASE, **SETUPS['b']))}: tokens/s/gpu 2,000 is 17.6% above its reference 1,700"
    assert hint in out and "faster" in (sweep / "report" / "summary.md").read_text()


def test_history_lists_and_filters_runs(results, capsys):
    write_sweep(results, "h200-0", 3, {"a": 1800, "c": 2500}, cluster="alps", gpu=H200)
    assert collect(results / "h200-0") == 0
    path = str(results / "history.duckdb")
    capsys.readouterr()

    def listed(*flags: str) -> list[str]:
        assert main(["history", "--history", path, *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        return [line for line in lines if line.startswith("| 2026")]

    assert len(listed()) == 14
    assert len(listed("--strategy", "ddp")) == 4
    h200 = listed("--system", "h200")
    assert len(h200) == 2 and all(H200 in line for line in h200)
    assert len(listed("--model", "qwen2.5-1.5b", "--since", "2026-11-03", "--until", "2026-11-04")) == 8
    assert len(listed("--until", "2026-11-02")) == 4
    key = setup_key(spec_of(GPU_BASE, **SETUPS["c"]).to_dict())
    assert len(listed("--setup", key[:6])) == 4
    assert len(listed("--limit", "3")) == 3
    assert listed("--strategy", "fsdp1_full_shard") == []

    assert main(["history", "--history", path, "--since", "November"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: history: --since: expected a date YYYY-MM-DD or YYYY-MM-DDTHH:MM, got 'November'"
    )
    assert main(["history", "--history", str(results / "nothing.duckdb")]) == 1
    assert "no history here yet" in capsys.readouterr().err


def test_set_reference_writes_each_setups_median_and_collect_then_checks_against_it(results, capsys):
    path = results / "history.duckdb"
    assert (
        main(["history", "--history", str(path), "--strategy", "fsdp2_zero3", "--set-reference", "--tolerance", "0.04"])
        == 0
    )
    written = results / "references.yaml"
    assert "wrote 2 reference(s)" in capsys.readouterr().out
    refs = references.load_references(written)
    by_setup = {ref.setup: ref for ref in refs.entries}
    a, b = (spec_of(GPU_BASE, **SETUPS[name]).to_dict() for name in ("a", "b"))
    assert by_setup[setup_key(a)].tokens_per_s_per_gpu == 1000 and by_setup[setup_key(b)].tokens_per_s_per_gpu == 2000
    # fsdp2_zero3 and bf16_mixed are defaults: a setup is named by the fields that differ from them
    assert by_setup[setup_key(b)].match == {
        "batch_size": 2,
        "device": "cuda",
        "gpus_per_node": 2,
        "model": "qwen2.5-1.5b",
        "seq_len": 4096,
    }
    systems = {(ref.cluster, ref.gpu, ref.tolerance, ref.extra["runs"]) for ref in refs.entries}
    assert systems == {("alps", H100, 0.04, 3)}

    # b at 1900 is 5% below its median: within the history's 10%, outside the reference's 4%.
    sweep = write_sweep(results, "nightly-3", 3, {"a": 990, "b": 1900})
    assert collect(sweep, "--fail-on-regression") == 1
    assert set(flagged(capsys.readouterr().out)) == ids("b")
    # Setting it again replaces the entries of the same system and setup instead of adding to them.
    assert main(["history", "--history", str(path), "--strategy", "fsdp2_zero3", "--set-reference"]) == 0
    assert "(2 in the file)" in capsys.readouterr().out


def test_no_history_appends_nothing_and_checks_references_only(results, capsys):
    before = (results / "history.duckdb").stat().st_mtime_ns
    sweep = write_sweep(results, "nightly-3", 3, {"a": 500})
    assert collect(sweep, "--no-history", "--fail-on-regression") == 0
    assert "0 cell(s) checked" in capsys.readouterr().out
    assert (results / "history.duckdb").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "references:\n  - match: {strategy: ddp}\n    tokens_per_s_per_gpu: fast\n",
            "references.yaml:3: references[0].tokens_per_s_per_gpu: expected a positive number, got 'fast'",
        ),
        (
            "references:\n  - match: {strategy: ddp}\n    tokens_per_s_per_gpu: 10\n    tolerence: 0.1\n",
            "references.yaml:4: references[0].tolerence: unknown key; did you mean 'tolerance'?",
        ),
        (
            "references:\n  - gpu: x\n    tokens_per_s_per_gpu: 10\n",
            "references.yaml:2: references[0]: expected a setup key or a match of spec fields "
            "(an entry for every cell is a mistake)",
        ),
        (
            "references:\n  - tokens_per_s_per_gpu: 10\n    match: {batch_size: two}\n",
            "references.yaml:3: references[0].match.batch_size: expected an integer or auto, got 'two'",
        ),
        (
            "tolerance: 10\nreferences: []\n",
            "references.yaml:1: tolerance: expected a fraction between 0 and 1 (0.1 is 10%), got 10",
        ),
        ("references:\n  - [1, 2\n", "references.yaml:3: not valid YAML (expected ',' or ']', but got '<stream end>')"),
    ],
)
def test_a_bad_references_file_is_one_line_naming_file_line_and_key(results, capsys, text, message):
    (results / "references.yaml").write_text(text)
    assert collect(results / "nightly-0") == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {results}/{message}"


def test_the_parser_shows_the_results_defaults_without_loading_pandas(capsys):
    probe = (
        "import sys; from hpcfsdp.cli import _parser; text = _parser().format_help(); "
        "print('pandas' in sys.modules, 'duckdb' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False"], proc.stderr[-2000:]
    with pytest.raises(SystemExit):
        main(["history", "--help"])
    assert re.search(rf"default\s+results/{defaults.HISTORY_NAME}", capsys.readouterr().out)
    assert regressions.DEFAULT_TOLERANCE == defaults.DEFAULT_TOLERANCE


# ---------------------------------------------------------------------------------------------
# Slurm accounting


def test_sacct_lines_give_elapsed_queue_wait_and_energy_for_ended_jobs_only():
    # sacct --noheader --parsable2 --allocations --format=JobID,State,Submit,Start,End,ElapsedRaw,ConsumedEnergyRaw
    text = (
        "4242_0|COMPLETED|2026-11-23T10:00:00|2026-11-23T10:02:30|2026-11-23T10:12:30|600|183000\n"
        "4242_1|CANCELLED by 1000|2026-11-23T10:00:00|2026-11-23T10:00:05|2026-11-23T10:01:05|60|0\n"
        "4242_2|RUNNING|2026-11-23T10:00:00|2026-11-23T10:03:00|Unknown|120|\n"
        "4243|PENDING|2026-11-23T10:00:00|Unknown|Unknown|0|\n"
    )
    got = parse_sacct(text)
    assert set(got) == {"4242_0", "4242_1"}
    assert got["4242_0"] == {
        "state": "COMPLETED",
        "submit": "2026-11-23T10:00:00",
        "start": "2026-11-23T10:02:30",
        "end": "2026-11-23T10:12:30",
        "elapsed_s": 600,
        "queue_wait_s": 150.0,
        "consumed_energy_j": 183000,
    }
    assert got["4242_1"]["state"] == "CANCELLED" and got["4242_1"]["consumed_energy_j"] is None


def test_collect_without_slurm_accounting_says_so_in_one_line_and_carries_on(results, capsys):
    # The records have Slurm job ids; sacct cannot tell: it is not installed, or it reaches no cluster
    # (only tests that ask for the local cluster, which keeps accounting, see its SLURM_CONF).
    assert collect(results / "nightly-0") == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "no Slurm accounting" in line]
    assert len(notes) == 1, err
    assert re.fullmatch(
        r"note: no Slurm accounting \((sacct not found|sacct: .+)\): elapsed time, queue wait and "
        r"energy not added to 4 record\(s\)",
        notes[0],
    )


def test_status_without_slurm_accounting_says_so_in_one_line(results, capsys):
    sweep = results / "nightly-0"
    manifest = {}
    for path in sweep.glob("cells/*/result.json"):  # as submit leaves them: spec.json and a manifest entry
        record = json.loads(path.read_text())
        (path.parent / "spec.json").write_text(json.dumps({key: record[key] for key in ("cell_id", "sweep", "spec")}))
        manifest[record["cell_id"]] = {"executor": "slurm", "job_id": record["slurm"]["job_id"]}
    (sweep / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["status", str(sweep)]) == 0
    out, err = capsys.readouterr()
    assert "4 cell(s): ok 4" in out
    assert len([line for line in err.splitlines() if line.startswith("note: no Slurm accounting (")]) == 1, err


# ---------------------------------------------------------------------------------------------
# The file every DuckDB of the supported range opens (history.STORAGE_VERSION)


def storage_version_number(path: Path) -> int:
    """The storage version in a DuckDB file's header: 8 bytes of checksum, b"DUCK", then the
    version as a little-endian 64-bit integer. DuckDB 1.0 to 1.4 write 64 (format v1.0.0, which
    is also v1.1.0's); DuckDB 1.1 reads 64 only; DuckDB 2.0 writes a newer one by default."""
    head = path.read_bytes()[:20]
    assert head[8:12] == b"DUCK", head
    return struct.unpack("<Q", head[12:20])[0]


def test_the_history_is_written_for_duckdb_1_1_also_over_one_duckdb_2_wrote_in_its_own_format(results, capsys):
    history = results / "history.duckdb"
    assert storage_version_number(history) == 64
    # As an older hpcfsdp left it: DuckDB's newest format, which DuckDB 1.5 and older cannot open.
    newest = results / "newest.duckdb"
    with duckdb.connect() as con:
        con.execute(f"ATTACH '{history}' AS old (READ_ONLY)")
        con.execute(f"ATTACH '{newest}' AS new (STORAGE_VERSION 'latest')")
        con.execute("COPY FROM DATABASE old TO new")
    if storage_version_number(newest) == 64:
        pytest.skip(f"duckdb {duckdb.__version__} writes no newer format than 64")
    newest.replace(history)
    assert storage_version_number(history) != 64
    assert collect(write_sweep(results, "nightly-3", 3, {"a": 1000})) == 0
    assert storage_version_number(history) == 64
    with duckdb.connect(str(history), read_only=True) as con:  # every row, and the key that keeps them one per attempt
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (13,)
        keys = con.execute(
            "SELECT constraint_column_names FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY'"
        )
        assert keys.fetchall() == [(["sweep_dir", "cell_id", "attempt"],)]
    assert not list(results.glob(".history.duckdb*")) and "History: 1 new row(s)" in capsys.readouterr().out


def test_a_history_already_in_storage_version_64_is_updated_without_being_written_anew(results, monkeypatch):
    """Every collect leaves the history at 64; the next one updates it as it is: writing the whole
    database anew was 0.3 s of every collect of 10,000 records (issue 54)."""
    history = results / "history.duckdb"
    assert storage_version_number(history) == 64

    def written_anew(copy: Path) -> None:
        raise AssertionError(f"{copy}: written anew")

    monkeypatch.setattr(history_store, "_rewrite_at_storage_version", written_anew)
    assert collect(write_sweep(results, "nightly-3", 3, {"a": 1000})) == 0
    assert storage_version_number(history) == 64
    with duckdb.connect(str(history), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (13,)


def lowest_pinned_duckdb() -> str:
    """The lowest duckdb release pyproject.toml takes (`duckdb>=X,<Y`)."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"duckdb>=([0-9.]+),<[0-9.]+"', text).group(1)


def installed_duckdb(version: str, folder: Path) -> Path:
    """That duckdb release, installed alone into a folder of its own (put first on PYTHONPATH)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(folder), f"duckdb=={version}"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return folder


# What a reader of another duckdb release sees in a history: its version, the file's rows and
# the storage version it reports in the database's tags (1.5 reports one; 1.1 has no tags).
READER = """
import duckdb, json, sys
con = duckdb.connect(sys.argv[1], read_only=True)
rows = con.execute("SELECT count(*), count(DISTINCT sweep) FROM runs").fetchone()
found = con.execute("SELECT * FROM duckdb_databases() WHERE database_name = current_database()")
database = dict(zip([column[0] for column in found.description], found.fetchone()))
storage = (database.get("tags") or {}).get("storage_version")
# a time as Python gets it: DuckDB before 1.5 makes a TIMESTAMPTZ a datetime with pytz (a dependency)
first = con.execute("SELECT min(started_at) FROM runs").fetchone()[0]
utc = str(first.utcoffset())
print(json.dumps({"version": duckdb.__version__, "rows": list(rows), "storage": storage, "utc": utc}))
"""


@pytest.mark.network
def test_duckdb_1_1_and_1_5_open_a_history_written_by_the_lowest_and_the_installed_duckdb(tmp_path, capsys):
    """The range the docs promise: a history written by the lowest duckdb pyproject takes, then
    updated by the one installed here, and one the installed duckdb makes, are opened by DuckDB
    1.1.3 (the oldest 1.1 with a wheel for every Python the project takes: 1.1.0 has none for
    3.13) and 1.5.6 (the newest 1.x, which cannot read DuckDB 2.0's own format)."""
    results = tmp_path / "results"
    history = results / "history.duckdb"
    lowest = lowest_pinned_duckdb()
    writer = installed_duckdb(lowest, tmp_path / f"duckdb-{lowest}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(writer), str(ROOT / "src")])}
    sweep = write_sweep(results, "nightly-0", 0, {"a": 1000, "b": 2000})
    probe = "import duckdb, sys; from hpcfsdp.cli import main; print(duckdb.__version__); sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", probe, "collect", str(sweep), "--no-plots"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == lowest, proc.stdout + proc.stderr[-2000:]
    readers = {version: installed_duckdb(version, tmp_path / f"duckdb-{version}") for version in ("1.1.3", "1.5.6")}

    def read(version: str, history: Path = history) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", READER, str(history)],
            env={**os.environ, "PYTHONPATH": str(readers[version])},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    assert read("1.1.3") == {"version": "1.1.3", "rows": [2, 1], "storage": None, "utc": "0:00:00"}
    assert read("1.5.6") == {"version": "1.5.6", "rows": [2, 1], "storage": "v1.0.0+", "utc": "0:00:00"}
    assert collect(write_sweep(results, "nightly-1", 1, {"a": 1010})) == 0  # the duckdb installed here
    assert read("1.1.3")["rows"] == [3, 2] and read("1.5.6")["rows"] == [3, 2]
    fresh = tmp_path / "fresh.duckdb"  # a history the duckdb installed here makes
    assert collect(results / "nightly-1", "--history", str(fresh)) == 0
    assert read("1.1.3", fresh)["rows"] == [1, 1] and read("1.5.6", fresh)["rows"] == [1, 1]


def test_the_historys_times_carry_their_zone_and_an_older_files_zoneless_utc_is_read_as_utc(results, capsys):
    """started_at and collected_at are TIMESTAMPTZ: DuckDB, pandas or any client reads the moment,
    never a local-looking time; a file an earlier hpcfsdp wrote (TIMESTAMP, UTC by convention) is
    converted as UTC by the next collect, its times unchanged."""
    import duckdb

    path = results / "history.duckdb"
    query = "SELECT column_name, data_type FROM information_schema.columns WHERE column_name LIKE '%ed_at'"
    older = duckdb.connect(str(path))
    older.execute("SET TimeZone = 'UTC'")
    before = older.execute("SELECT cell_id, attempt, epoch(started_at) FROM runs ORDER BY ALL").fetchall()
    for column in ("started_at", "collected_at"):  # as an earlier hpcfsdp wrote them
        older.execute(f"ALTER TABLE runs ALTER {column} SET DATA TYPE TIMESTAMP")
    older.execute("SET TimeZone = 'America/New_York'")  # the reader's own zone plays no part
    assert dict(older.execute(query).fetchall()) == {"started_at": "TIMESTAMP", "collected_at": "TIMESTAMP"}
    older.close()
    write_sweep(results, "later", 3, {"a": 1800}, cluster="alps", gpu=H100)
    assert collect(results / "later") == 0
    with duckdb.connect(str(path), read_only=True) as con:
        zoned = "TIMESTAMP WITH TIME ZONE"
        assert dict(con.execute(query).fetchall()) == {"started_at": zoned, "collected_at": zoned}
        after = con.execute("SELECT cell_id, attempt, epoch(started_at) FROM runs ORDER BY ALL").fetchall()
    assert set(before) < set(after) and len(after) == len(before) + 1
    capsys.readouterr()
    assert main(["history", "--history", str(path), "--json", "--limit", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["started_at"].endswith("+00:00")


def test_the_historys_spec_setup_and_setup_key_of_each_row_are_those_of_the_row_by_row_rules_for_every_kind_of_value(
    tmp_path,
):
    """history_rows spells each field's value once per distinct value and joins a row's texts: each
    row's spec, setup fields and setup key are still exactly json.dumps of spec_values and
    setup_fields, and setup_key, the rules `hpcfsdp export` tags runs with. True and 1, 0.0 and
    -0.0 are equal but spelt apart; 3e-05 is spelt as json spells it; a list (unhashable), an absent
    value, a float of an integer field and a measurement field (seed: in the spec, not the setup)."""
    default = RunSpec().to_dict()
    rows = [
        {"compile": True, "weight_decay": 0.0, "lr": 3e-05, "seq_len": 4096.0, "seed": 1, "model": "qwén"},
        {"compile": 1, "weight_decay": -0.0, "lr": 3e-04, "seq_len": None, "seed": 2, "model": "qwén"},
        {"compile": False, "weight_decay": 0.1, "lr": float("nan"), "seq_len": 2048.0, "seed": 1, "model": [1, 2]},
        {"compile": default["compile"], "weight_decay": -0.0, "lr": 1e-07, "seq_len": 4096.0, "seed": 3, "model": "m"},
    ]
    fields = tuple(rows[0])
    frame = pd.DataFrame([{"cell_id": f"c{k}", "status": "ok", **row} for k, row in enumerate(rows)])
    made = history_rows(Collection(frame, [], spec_fields=fields), tmp_path)

    canonical = {"sort_keys": True, "separators": (",", ":")}
    specs = [{name: frame[name].tolist()[k] for name in fields} for k in range(len(rows))]
    assert made["spec"].tolist() == [json.dumps(spec_values(spec), **canonical) for spec in specs]
    assert made["setup_fields"].tolist() == [json.dumps(setup_fields(spec), **canonical) for spec in specs]
    assert made["setup"].tolist() == [setup_key(spec) for spec in specs]
    first, second = made["spec"][0], made["spec"][1]
    assert '"compile":true' in first and '"compile":1' in second and '"weight_decay":-0.0' in second
    assert '"lr":3e-05' in first and '"model":"qw\\u00e9n"' in first and '"seed"' not in made["setup_fields"][0]


def test_collect_where_duckdb_cannot_be_imported_says_so_in_one_line_and_writes_the_report(results, tmp_path):
    """duckdb is a dependency, but a wheelhouse carried to a node may lack it (the GPU acceptance of
    2026-11-29 did): collect then fails the history check in one line, not a traceback, and still
    writes its tables. Before: ModuleNotFoundError's traceback, and no report."""
    sweep = write_sweep(results, "nightly-3", 3, {"a": 500})
    blocked = (
        "import sys; sys.modules['duckdb'] = None; from hpcfsdp.cli import main; raise SystemExit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocked, "collect", str(sweep), "--no-plots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert (
        f"{results / 'history.duckdb'}: not updated: duckdb is not installed (pip install duckdb)"
        in proc.stdout + proc.stderr
    )
    assert (sweep / "report" / "results.csv").is_file()
