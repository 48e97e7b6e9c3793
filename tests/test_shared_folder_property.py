"""A property test (Hypothesis) over a shared sweep folder (issue 51): links, FIFOs, device nodes,
folders and entries of bad names (not UTF-8, a control character) planted at every path the
project touches in a results folder (manifest.json, matrix.yaml, cells/<id>/..., report/, slurm/,
tune/, the history, references, locks), then the whole commands: plan, submit --executor local
(a real smoke sweep of two cells: a cell whose record a planting took away is trained again),
tune (which resumes the module's finished tune from tune/state.json), status, status --json,
collect, history and logs; and, on the real local Slurm cluster (the session's), submit
--executor slurm (a cell whose record was taken away is queued, held: the jobs file asks
`--hold`), status and cancel. The property:

- nothing outside the results folder is read or written: the canary file that planted links lead
  to keeps its content, its times (its access time too: the file system is mounted relatime and
  the canary's access time is set before its change time, so a read would move it) and its inode,
  and no command prints its text or copies it into the results folder;
- no command hangs (each runs under a time limit);
- no command raises (a traceback); a refusal is one `error:` line.

The seed is printed as tests/test_fuzz.py prints it (HPCFSDP_FUZZ_SEED replays it); Hypothesis keeps
no example database. HPCFSDP_SHARED_EXAMPLES sets the examples (default 6: each copies the folder
and runs eight commands, and some train a cell again), HPCFSDP_SHARED_SLURM_EXAMPLES those of the
Slurm case (default 2: each queues one held array and cancels it).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from conftest import slurm
from hpcfsdp.cli import main
from test_fuzz import SEED, within

EXAMPLES = int(os.environ.get("HPCFSDP_SHARED_EXAMPLES", "6"))
SLURM_EXAMPLES = int(os.environ.get("HPCFSDP_SHARED_SLURM_EXAMPLES", "2"))
COMMAND_LIMIT_S = 60.0  # a command that trains a cell again takes about 15 s on a loaded 2-core machine
SHARED = settings(
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
CANARY = f"CANARY-{uuid.uuid4().hex}"
SMOKE = {
    "name": "shared",
    "base": {
        "model": "tiny",
        "device": "cpu",
        "precision": "fp32",
        "seq_len": 32,
        "steps": 2,
        "warmup_steps": 1,
        "comm_profile_steps": 0,
    },
    "matrix": {"strategy": ["ddp", "fsdp2_zero3"]},
    "slurm": {"extra_sbatch": {"hold": True}},  # a cell queued on Slurm waits, held, until cancel ends it
}
# From the sweep folder; {cell} is a cell of the sweep.
PATHS = [
    "manifest.json",
    "matrix.yaml",
    ".submit.lock",
    "collect_job.json",
    "tune.json",
    "cells/{cell}/spec.json",
    "cells/{cell}/result.json",
    "cells/{cell}/log.txt",
    "cells/{cell}/progress.json",
    "cells/{cell}/heartbeats",
    "cells/{cell}/heartbeats/rank0",
    "cells/{cell}/attempts",
    "report",
    "report/index.html",
    "report/summary.md",
    "report/results.csv",
    "report/plots",
    "slurm",
    "tune",
    "tune/state.json",
    "../history.duckdb",
    "../history.duckdb.lock",
    "../references.yaml",
]
# A link of the user's own at these is followed by design (docs/security.md: a team's history or
# references on another disk), and the canary it leads to is the user's: what the property tests
# there is a link another user planted, made so by root; where the tests do not run as root, none.
FOLLOWED_WHEN_OWN = {"../history.duckdb", "../references.yaml"}
NOBODY = 65534
# Folders where an entry of a bad name is planted.
FOLDERS = ["", "cells", "cells/{cell}", "cells/{cell}/attempts", "report", "slurm", "tune", ".."]
# "absent": what stood there is taken away (a record gone: submit trains its cell again).
KINDS = ["link_to_canary", "link_to_outside_folder", "link_to_new_file", "fifo", "device", "folder", "absent"]
BAD_NAMES = [b"\xff\xfe", b"a\x1b]0;owned\x07b", b"new\nline", b"result.json\xff"]
# A tune whose state is taken away starts again and trains every cell (tests/test_tune*.py): not here.
plantings = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(PATHS), st.sampled_from(KINDS)).filter(
            lambda planting: planting != ("tune", "absent") and planting != ("tune/state.json", "absent")
        ),
        st.tuples(st.sampled_from(FOLDERS), st.sampled_from(BAD_NAMES), st.sampled_from(KINDS + ["file"])),
    ),
    min_size=1,
    max_size=3,
)


@pytest.fixture(scope="module", autouse=True)
def printed_seed(request):
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(
            f"\nshared folder property: seed {SEED} (HPCFSDP_FUZZ_SEED={SEED} replays it), {EXAMPLES} examples, "
            f"{SLURM_EXAMPLES} on Slurm"
        )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, Path]:
    """The jobs file and a results folder of a real local run of two cells by tune (the grid's
    cells themselves: probing two cells cannot save), collected, with a reference written from its
    history: a finished tune, which the examples' tune resumes without training."""
    root = tmp_path_factory.mktemp("shared")
    jobs = root / "shared.yaml"
    jobs.write_text(yaml.safe_dump(SMOKE))
    results = root / "results"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(tune(jobs, results)) == 0, err.getvalue()
        history = ["history", "--history", str(results / "history.duckdb")]
        assert main([*history, "--set-reference", "--references", str(results / "references.yaml")]) == 0
    return jobs, results


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put `kind` at path, where nothing stands (what stands there is taken away first)."""
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if any(os.path.lexists(up) and not up.is_dir() for up in path.parents):
        return  # something planted before stands where a folder would have to be
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = {
        "link_to_canary": outside / "canary.txt",
        "link_to_outside_folder": outside / "folder",
        "link_to_new_file": outside / "new.txt",
    }
    if kind in targets:
        path.symlink_to(targets[kind])
    elif kind == "fifo" or (kind == "device" and os.geteuid() != 0):
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's kind
    elif kind == "folder":
        path.mkdir()
    elif kind == "absent":
        return
    else:
        path.write_text("{}")


def outside_state(outside: Path) -> dict[str, tuple]:
    """Each entry outside: kind, inode, size, change and access times, from lstat (nothing read)."""
    seen = {}
    for entry in sorted(os.listdir(outside)) + [f"folder/{name}" for name in sorted(os.listdir(outside / "folder"))]:
        info = os.lstat(outside / entry)
        seen[entry] = (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size, info.st_mtime_ns, info.st_atime_ns)
    return seen


def files_holding(root: Path, text: bytes) -> list[str]:
    """Regular files under root (no link followed) that hold text."""
    found = []
    for folder, _, names in os.walk(os.fsencode(root)):
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode) and text in Path(os.fsdecode(path)).read_bytes():
                found.append(os.fsdecode(path))
    return found


def run(argv: list[str]) -> tuple[int, str, str]:
    """A command in this process, under COMMAND_LIMIT_S; its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with within(COMMAND_LIMIT_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def tune(jobs: Path, results: Path) -> list[str]:
    return ["tune", str(jobs), "--executor", "local", "--results-dir", str(results)]


def locally(jobs: Path, results: Path, sweep: Path, cell: str) -> list[list[str]]:
    """The commands of the local case, in order."""
    return [
        ["plan", str(jobs)],
        ["submit", str(jobs), "--executor", "local", "--results-dir", str(results)],
        tune(jobs, results),
        ["status", str(sweep)],
        ["status", str(sweep), "--json"],
        ["collect", str(sweep), "--no-plots"],
        ["history", "--history", str(results / "history.duckdb")],
        ["logs", str(sweep), cell],
    ]


def on_slurm(jobs: Path, results: Path, sweep: Path, cell: str) -> list[list[str]]:
    """The commands of the Slurm case: the cell whose record was taken away is queued, held
    (SMOKE's slurm:), then cancelled. (No tune here: its final stage would wait for that held
    cell, as `submit --wait` does.)"""
    return [
        ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)],
        ["status", str(sweep)],
        ["cancel", str(sweep)],
    ]


@seed(SEED)
@SHARED
@given(planted=plantings)
def test_what_is_planted_in_a_shared_results_folder_never_lets_a_command_reach_outside_hang_or_crash(smoke, planted):
    note(f"seed {SEED}; planted {planted}")
    nothing_reaches_outside(smoke, planted, locally)


@pytest.mark.slurm
@seed(SEED)
@settings(SHARED, max_examples=SLURM_EXAMPLES)
@given(planted=plantings)
def test_what_is_planted_in_a_shared_results_folder_never_lets_submit_to_slurm_reach_outside_hang_or_crash(
    smoke, slurm_cluster, planted
):
    note(f"seed {SEED}; planted {planted}")
    queued = set(slurm("squeue", "--noheader", "--format=%A").split())
    try:
        nothing_reaches_outside(smoke, planted, on_slurm, queued_cell=True)
    finally:  # what cancel could not end (a planted manifest): no job outlives its example
        left = set(slurm("squeue", "--noheader", "--format=%A").split()) - queued
        if left:
            slurm("scancel", *sorted(left))


def nothing_reaches_outside(
    smoke: tuple[Path, Path], planted: list[tuple], commands: Callable, queued_cell: bool = False
) -> None:
    """Plant, run the commands, and check the property (the module's docstring); queued_cell: the
    record of the first cell is taken away first, so that submit queues it."""
    jobs, template = smoke
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(shutil.copytree(template, Path(scratch) / "results", symlinks=True))
        sweep = results / "shared"
        cell = sorted(name for name in os.listdir(sweep / "cells"))[0]
        if queued_cell:
            (sweep / "cells" / cell / "result.json").unlink()
        outside = Path(scratch) / "outside"
        (outside / "folder").mkdir(parents=True)
        (outside / "canary.txt").write_text(CANARY + "\n")
        (outside / "folder" / "canary.txt").write_text(CANARY + "\n")
        for planting in planted:
            if len(planting) == 2:
                path = sweep / planting[0].format(cell=cell)
                plant(path, planting[1], outside)
                if planting[0] in FOLLOWED_WHEN_OWN and path.is_symlink():
                    if os.geteuid() == 0:
                        os.lchown(path, NOBODY, NOBODY)
                    else:
                        path.unlink()
            else:
                folder = sweep / planting[0].format(cell=cell)
                if folder.is_dir() and not folder.is_symlink():
                    plant(folder / os.fsdecode(planting[1]), planting[2], outside)
        for canary in (outside / "canary.txt", outside / "folder" / "canary.txt"):
            info = os.stat(canary)  # an access time before the change time: relatime moves it at a read
            os.utime(canary, ns=(info.st_mtime_ns - 10**12, info.st_mtime_ns))
        before = outside_state(outside)
        printed, seen = "", [f"planted {planted}"]
        for argv in commands(jobs, results, sweep, cell):
            started = time.monotonic()
            code, out, err = run(argv)
            seen.append(f"{argv[0]}: exit {code} in {time.monotonic() - started:.1f} s; {err[-2000:]}")
            assert code in (0, 1, 2, 3, 4), (argv, code, err)  # 4: a cell still in flight (queued, held)
            errors = [line for line in err.splitlines() if line.startswith("error")]
            assert len(errors) <= 2, (argv, err)  # collect: the history's, and the one that stopped it
            assert code != 2 or len(errors) == 1, (argv, err)  # a refusal: its one line
            printed += out + err
        assert outside_state(outside) == before, seen
        assert CANARY not in printed, seen
        assert files_holding(results, CANARY.encode()) == [], seen
        assert (outside / "canary.txt").read_text() == CANARY + "\n"
