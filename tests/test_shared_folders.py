"""Links, FIFOs and device nodes planted in a results folder a team shares (issue 44, item 1), and
what collect, plan and submit say of a folder or YAML they refuse (item 14).

Every planted thing is made inside the test's temporary folder: the files a link leads to, and
the device nodes (made with os.mknod, as root only; /dev/null's numbers, so that even a write
through them would destroy nothing).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from test_history import EARLIER, write_sweep
from test_scripting import PlanAnswer, strict_document

PRECIOUS = "someone's file, not hpcfsdp's to write\n"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="os.mknod of a device node needs root")


def victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    path = tmp_path / "outside" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PRECIOUS)
    return path


def device_node(path: Path) -> Path:
    """A character device of /dev/null's numbers (1, 3), inside the test's folder."""
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def jobs_yaml(tmp_path: Path, name: str = "sf") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nbase: {{model: tiny, device: cpu, steps: 3, warmup_steps: 1}}\nmatrix:\n  batch_size: [1, 2]\n"
    )
    return path


def one_error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    return line


def collected_sweep(tmp_path: Path) -> Path:
    return write_sweep(tmp_path / "results", "s0", 0, {name: values[0] for name, values in EARLIER.items()})


# ---------------------------------------------------------------------------------------------
# Locks: never through a link, never emptying a file hpcfsdp did not make


@pytest.mark.parametrize("planted", ["symlink", "hard_link", "foreign_file"])
def test_a_submit_lock_that_is_a_link_or_someones_file_is_refused_in_one_line_and_left_whole(tmp_path, capsys, planted):
    jobs = jobs_yaml(tmp_path)
    sweep_dir = tmp_path / "results" / "sf"
    sweep_dir.mkdir(parents=True)
    target = victim(tmp_path)
    lock = sweep_dir / ".submit.lock"
    if planted == "symlink":
        lock.symlink_to(target)
    elif planted == "hard_link":
        os.link(target, lock)
    else:
        lock.write_text(PRECIOUS)
    capsys.readouterr()
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {lock}: ") and ("not used as a lock" in line or "symbolic link" in line), line
    assert target.read_text() == PRECIOUS and lock.read_text() == PRECIOUS
    assert not (sweep_dir / "cells").exists()  # refused before anything was written


def test_a_history_lock_that_is_a_link_is_refused_and_the_file_it_leads_to_is_kept(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    target = victim(tmp_path)
    (sweep.parent / "history.duckdb.lock").symlink_to(target)
    capsys.readouterr()
    assert main(["collect", str(sweep), "--no-plots"]) == 3  # the history could not be checked
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "history.duckdb.lock" in line and "symbolic link" in line and "Traceback" not in err
    assert target.read_text() == PRECIOUS and not (sweep.parent / "history.duckdb").exists()


def test_the_lock_message_names_the_command_that_holds_the_sweep_folder(tmp_path):
    """A tune holds the folder: a submit that waits for it says `hpcfsdp tune`, not submit."""
    from hpcfsdp.sweep.launch.lock import sweep_lock

    sweep_dir = tmp_path / "held"
    said: list[str] = []
    with sweep_lock(sweep_dir, said.append, "tune"):
        with open(sweep_dir / ".submit.lock", "rb") as handle:  # a second holder: flock of another open file
            assert handle.read().startswith(b"hpcfsdp tune: pid ")
            with pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        waiting = subprocess.Popen(
            [sys.executable, "-c", WAIT_FOR_LOCK, str(sweep_dir)], env=env, stdout=subprocess.PIPE, text=True
        )
        line = waiting.stdout.readline()
        assert line.startswith(f"another `hpcfsdp tune` of {sweep_dir} is running (pid {os.getpid()} of root on "), line
    assert waiting.wait(timeout=60) == 0
    assert (sweep_dir / ".submit.lock").read_bytes() == b""  # released: no holder named


WAIT_FOR_LOCK = """
import sys
from pathlib import Path
from hpcfsdp.sweep.launch.lock import sweep_lock
with sweep_lock(Path(sys.argv[1]), lambda line: print(line, flush=True), "submit"):
    pass
"""


# ---------------------------------------------------------------------------------------------
# The history (and references) through a link: a DuckDB file or none, never a device or FIFO


@pytest.mark.parametrize("leads_to", ["fifo", "folder", "text_file", pytest.param("device", marks=as_root)])
def test_a_history_link_to_anything_but_a_duckdb_file_is_refused_and_left_as_it_is(tmp_path, capsys, leads_to):
    sweep = collected_sweep(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "thing"
    if leads_to == "fifo":
        os.mkfifo(target)
    elif leads_to == "folder":
        target.mkdir()
    elif leads_to == "device":
        device_node(target)
    else:
        target.write_text(PRECIOUS)
    before = os.lstat(target)
    (sweep.parent / "history.duckdb").symlink_to(target)
    capsys.readouterr()
    assert main(["collect", str(sweep), "--no-plots"]) == 3
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert str(sweep.parent / "history.duckdb") in line and "not updated" in line, line
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino, after.st_size) == (before.st_mode, before.st_ino, before.st_size)
    if leads_to == "text_file":
        assert target.read_text() == PRECIOUS
    assert sorted(p.name for p in outside.iterdir()) == ["thing"]  # no scratch copy, no lock left beside it


def test_a_history_link_to_a_missing_file_in_a_folder_makes_the_history_there(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    (sweep.parent / "history.duckdb").symlink_to(shared / "history.duckdb")
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    with duckdb.connect(str(shared / "history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (4,)
    assert (sweep.parent / "history.duckdb").is_symlink()


@as_root
def test_a_history_that_is_a_device_node_is_refused_and_stays_a_device(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    node = device_node(sweep.parent / "history.duckdb")
    assert main(["collect", str(sweep), "--no-plots"]) == 3
    assert "not updated" in capsys.readouterr().err
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_references_through_a_link_to_a_fifo_are_refused_in_one_line(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    fifo = tmp_path / "outside" / "fifo"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    references = sweep.parent / "references.yaml"
    references.symlink_to(fifo)
    capsys.readouterr()
    argv = ["history", "--history", str(sweep.parent / "history.duckdb"), "--set-reference"]
    argv += ["--references", str(references)]
    started = time.monotonic()
    assert main(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {references}: a link to {fifo}, not a regular file"), line
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and time.monotonic() - started < 60


# ---------------------------------------------------------------------------------------------
# 14: a folder that is no sweep, and plan --json of a refused YAML


def test_collect_refuses_a_folder_that_is_no_sweep_as_status_does_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "results" / "notes"
    folder.mkdir(parents=True)
    (folder / "readme.txt").write_text("not a sweep\n")
    for command in ("status", "collect"):
        assert main([command, str(folder)]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            f"error: {folder}: not a sweep folder (no cells/ inside; e.g. results/<name> of a jobs YAML)"
        )
    assert sorted(p.name for p in folder.iterdir()) == ["readme.txt"]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["notes"]  # no history beside it


def test_plan_json_of_a_refused_yaml_prints_a_json_answer_with_the_refusal(tmp_path, capsys):
    jobs = tmp_path / "bad.yaml"
    jobs.write_text("name: bad\nbase: {model: tiny, device: cpu, batch_size: -1}\n")
    assert main(["plan", str(jobs), "--json"]) == 2
    out, err = capsys.readouterr()
    document = PlanAnswer.model_validate(strict_document(out)).model_dump()  # the shape scripts read
    line = one_error_line(err)
    assert (
        document["exit_status"] == 2
        and document["cells"] == []
        and document["problems"] == [line.removeprefix("error: ")]
    )
    assert str(jobs) in document["problems"][0]


def test_a_cache_lock_that_is_a_link_is_refused_and_the_file_it_leads_to_is_kept(tmp_path):
    """The pre-download cache is often shared too. Its locks were filelock's, whose behaviour is its
    version's (3.x opens a lock with O_TRUNC through a link; 4.3 refuses it with an OSError): now
    they are taken by the project's one rule, and refused in one line."""
    from hpcfsdp.cache.manifest import LOCKS_DIR, add_to_manifest
    from hpcfsdp.contracts.files import RecordError

    cache = tmp_path / "cache"
    (cache / LOCKS_DIR).mkdir(parents=True)
    target = victim(tmp_path)
    (cache / LOCKS_DIR / "manifest.lock").symlink_to(target)
    with pytest.raises(RecordError, match="symbolic link where a lock file belongs"):
        add_to_manifest(cache, {"key": "model:x", "kind": "model", "item": "x", "files": []})
    assert target.read_text() == PRECIOUS and not (cache / "manifest.json").exists()


def test_files_written_by_rename_replace_a_planted_link_and_a_cell_folder_out_of_the_sweep_is_refused(tmp_path, capsys):
    from hpcfsdp.sweep.define.matrix import load_sweep

    jobs = jobs_yaml(tmp_path)
    results = tmp_path / "results"
    first, second = load_sweep(jobs).cells
    sweep_dir = results / "sf"
    (sweep_dir / "cells" / first.id).mkdir(parents=True)
    target = victim(tmp_path)
    (sweep_dir / "matrix.yaml").symlink_to(target)
    (sweep_dir / "cells" / first.id / "spec.json").symlink_to(target)
    argv = ["submit", str(jobs), "--executor", "print", "--results-dir", str(results)]
    assert main(argv) == 0
    assert target.read_text() == PRECIOUS  # each link replaced by the file, never written through
    assert not (sweep_dir / "matrix.yaml").is_symlink() and "batch_size" in (sweep_dir / "matrix.yaml").read_text()
    assert json.loads((sweep_dir / "cells" / first.id / "spec.json").read_text())["cell_id"] == first.id
    # A cell's folder that is a link out of the sweep folder: refused, nothing written there.
    (tmp_path / "outside" / "cell").mkdir()
    (sweep_dir / "cells" / second.id / "spec.json").unlink()
    (sweep_dir / "cells" / second.id).rmdir()
    (sweep_dir / "cells" / second.id).symlink_to(tmp_path / "outside" / "cell")
    capsys.readouterr()
    assert main([*argv, "--force"]) == 2
    err = capsys.readouterr().err  # its record is named unreadable (a link out), then the refusal
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {sweep_dir / 'cells' / second.id}: a link to {tmp_path / 'outside' / 'cell'}")
    assert list((tmp_path / "outside" / "cell").iterdir()) == []
