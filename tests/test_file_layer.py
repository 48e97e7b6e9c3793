"""One rule for every file hpcfsdp touches in a folder others may write (issue 51): no link
followed, regular files only, temporary files a killed process left removed, locks no one else can
hold, and folders that are the user's own (ssh's StrictModes).

The co-user is a real second uid (`hpcfsdp-co`, made with useradd where missing; the tests run as
root in CI) acting through setpriv. A link "planted" by that user is one whose owner is that uid
(os.lchown), as a link the co-user made would be.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.attempts import keep_as_attempt
from hpcfsdp.results.render import Section, to_html
from test_history import EARLIER, write_sweep
from test_shared_folders import PRECIOUS, collected_sweep, jobs_yaml, one_error_line, victim

CO_USER = "hpcfsdp-co"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (useradd, setpriv, lchown)")


@pytest.fixture(scope="session")
def co_user() -> pwd.struct_passwd:
    """The second user: made once (a system user without a home) where it is missing."""
    try:
        return pwd.getpwnam(CO_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", CO_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(CO_USER)


@pytest.fixture
def shared_space() -> Iterator[Path]:
    """A project folder both users reach (pytest's own folders are root's alone, 0700)."""
    space = Path(tempfile.mkdtemp(prefix="hpcfsdp-shared-", dir="/tmp"))
    os.chmod(space, 0o755)
    try:
        yield space
    finally:
        shutil.rmtree(space, ignore_errors=True)


def as_co_user(user: pwd.struct_passwd, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )


def planted_link(user: pwd.struct_passwd, link: Path, target: Path) -> Path:
    link.symlink_to(target)
    os.lchown(link, user.pw_uid, user.pw_gid)
    return link


# ---------------------------------------------------------------------------------------------
# Item 2: a figure replaced by a link is never embedded in index.html


def test_a_figure_replaced_by_a_link_is_not_embedded_in_the_report(tmp_path):
    secret = victim(tmp_path, "id_ed25519")
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    plots = tmp_path / "report" / "plots"
    plots.mkdir(parents=True)
    (plots / "throughput.png").symlink_to(secret)
    page = to_html("sweep", [Section("Figures", images=[("throughput", plots / "throughput.png")])])
    assert "b3BlbnNzaC" not in page and "LS0tLS1CRUdJTiBPUEVOU1NI" not in page  # no base64 of the key
    assert "throughput: not embedded (a symbolic link, not followed)" in page


# ---------------------------------------------------------------------------------------------
# Items 3 and the history variant: a link another user put there is never written through


@as_root
def test_set_reference_never_writes_through_a_dangling_link_another_user_planted(tmp_path, capsys, co_user):
    sweep = collected_sweep(tmp_path)
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    sourced = tmp_path / "home" / ".bashrc.d"
    sourced.mkdir(parents=True)
    references = planted_link(co_user, sweep.parent / "references.yaml", sourced / "hpcfsdp.sh")
    capsys.readouterr()
    argv = ["history", "--history", str(sweep.parent / "history.duckdb"), "--set-reference"]
    assert main([*argv, "--references", str(references)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {references}: a link to {sourced / 'hpcfsdp.sh'} that {CO_USER} made"), line
    assert list(sourced.iterdir()) == []


@as_root
def test_a_history_link_another_user_planted_never_rewrites_the_database_it_leads_to(tmp_path, capsys, co_user):
    mine = write_sweep(tmp_path / "mine", "s0", 0, {name: values[0] for name, values in EARLIER.items()})
    assert main(["collect", str(mine), "--no-plots"]) == 0
    other = mine.parent / "history.duckdb"
    before = other.read_bytes()
    sweep = write_sweep(tmp_path / "shared", "s1", 1, {name: values[1] for name, values in EARLIER.items()})
    link = planted_link(co_user, sweep.parent / "history.duckdb", other)
    capsys.readouterr()
    assert main(["collect", str(sweep), "--no-plots"]) == 3
    err = capsys.readouterr().err
    assert f"{link}: a link to {other} that {CO_USER} made, not you; not followed" in err, err
    assert other.read_bytes() == before


@as_root
def test_history_never_reads_a_database_through_a_link_another_user_planted(tmp_path, capsys, co_user):
    """`hpcfsdp history` followed any link to the file it opens: another user's link in a shared
    results folder made it read (and show) the database the link led to, the user's other history.
    It follows a link as collect does: the user's own only."""
    mine = write_sweep(tmp_path / "mine", "s0", 0, {name: values[0] for name, values in EARLIER.items()})
    assert main(["collect", str(mine), "--no-plots"]) == 0
    other = mine.parent / "history.duckdb"
    shared = tmp_path / "shared"
    shared.mkdir()
    link = planted_link(co_user, shared / "history.duckdb", other)
    capsys.readouterr()
    assert main(["history", "--history", str(link)]) == 1
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert line.startswith(f"error: {link}: a link to {other} that {CO_USER} made, not you; not followed"), line
    assert line.endswith("; not read") and "s0" not in captured.out, captured
    os.unlink(link)
    os.symlink(other, link)  # the user's own link (a team's history on another disk) is read where it leads
    assert main(["history", "--history", str(link)]) == 0
    assert "s0" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Item 4: log.txt and heartbeats/rank<r>.fault are never opened through a link


def test_a_ranks_fault_file_is_never_opened_through_a_link(tmp_path):
    target = victim(tmp_path)
    beats = tmp_path / "cell" / "heartbeats"
    beats.mkdir(parents=True)
    (beats / "rank0.fault").symlink_to(target)
    code = "from pathlib import Path; import sys; from hpcfsdp.cell.stopping.heartbeats import Heartbeat\n"
    code += "Heartbeat(Path(sys.argv[1]), 'launch', 0, 'n1')"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "cell")], check=True, timeout=60)
    assert target.read_text() == PRECIOUS
    assert stat.S_ISREG(os.lstat(beats / "rank0.fault").st_mode)


def test_a_rerun_follows_neither_a_log_link_nor_an_attempts_link(tmp_path, capsys):
    jobs = tmp_path / "rr.yaml"
    jobs.write_text("name: rr\nbase: {model: tiny, device: cpu, steps: 2, warmup_steps: 1, seq_len: 32}\n")
    argv = ["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 0
    (cell,) = (tmp_path / "results" / "rr" / "cells").iterdir()
    record = (cell / "result.json").read_bytes()
    target = victim(tmp_path)
    (cell / "log.txt").unlink()
    (cell / "log.txt").symlink_to(target)
    outside = tmp_path / "outside" / "attempts"
    outside.mkdir()
    (cell / "attempts").symlink_to(outside)
    capsys.readouterr()
    assert main([*argv, "--force"]) == 1  # the record cannot be set aside: nothing runs, nothing moves
    line = capsys.readouterr().err.splitlines()[-1]
    assert f"{cell / 'attempts'}: not a folder" in line, line
    assert (cell / "result.json").read_bytes() == record and list(outside.iterdir()) == []
    (cell / "attempts").unlink()
    assert main([*argv, "--force"]) == 0
    assert target.read_text() == PRECIOUS  # the rerun's log replaced the link, never wrote through it
    assert stat.S_ISREG(os.lstat(cell / "log.txt").st_mode) and (cell / "log.txt").stat().st_size
    assert [p.name for p in (cell / "attempts").iterdir()] == ["1.json"]


def test_keep_as_attempt_never_moves_a_record_through_an_attempts_link(tmp_path):
    cell = tmp_path / "cells" / "c1"
    cell.mkdir(parents=True)
    (cell / "result.json").write_text('{"status": "ok"}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (cell / "attempts").symlink_to(outside)
    with pytest.raises(Exception, match="not a folder"):
        keep_as_attempt(cell)
    assert (cell / "result.json").is_file() and list(outside.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Item 9: a lock no one else can hold, a bounded wait, and a line that names the holder


@as_root
def test_a_sweep_lock_is_the_users_alone_and_a_long_wait_names_the_holders_pid_and_user(
    tmp_path, capsys, monkeypatch, co_user, shared_space
):
    jobs = jobs_yaml(tmp_path)
    argv = ["submit", str(jobs), "--executor", "print", "--results-dir", str(shared_space / "results")]
    assert main(argv) == 0
    lock = shared_space / "results" / "sf" / ".submit.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    tried = as_co_user(co_user, sys.executable, "-c", f"open({str(lock)!r})")
    assert "Permission denied" in tried.stderr
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr("hpcfsdp.sweep.launch.lock.WAIT_S", 1.0)
        started = time.monotonic()
        capsys.readouterr()
        assert main(argv) == 1
        waiting, line = capsys.readouterr().err.splitlines()
        assert waiting.startswith(
            f"another `hpcfsdp submit or tune` of {lock.parent} is running (pid {holder.pid} of root"
        )
        assert time.monotonic() - started < 30
        assert f"{lock}: held by pid {holder.pid} of root" in line and "for over 1 s; nothing done" in line, line
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


# ---------------------------------------------------------------------------------------------
# Item 10: a FIFO at .submit.lock, a link to a huge file at .local_run.json


def test_status_neither_hangs_on_a_fifo_lock_nor_reads_a_huge_local_run_file(tmp_path):
    jobs = jobs_yaml(tmp_path)
    assert main(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == 0
    sweep = tmp_path / "results" / "sf"
    (sweep / ".submit.lock").unlink()
    os.mkfifo(sweep / ".submit.lock")
    (sweep / ".local_run.json").write_text(json.dumps({"holder": "pid 1 on x", "running": "a", "waiting": []}))
    huge = tmp_path / "outside" / "huge.json"
    huge.parent.mkdir()
    with huge.open("wb") as out:
        out.truncate(1 << 30)
    for argv in (["status", str(sweep)], ["status", str(sweep), "--json"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "hpcfsdp", *argv], capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 30 and "Traceback" not in done.stderr, done.stderr
    (sweep / ".local_run.json").unlink()
    (sweep / ".local_run.json").symlink_to(huge)
    # The bytes the process read (/proc/self/io's rchar: every read, imports included), not its
    # memory, which its imports alone make vary by hundreds of MB from one run to another.
    code = "import sys; from hpcfsdp.cli import main; main(sys.argv[1:]); "
    code += "print(open('/proc/self/io').read().split()[1])"
    done = subprocess.run(
        [sys.executable, "-c", code, "status", str(sweep)], capture_output=True, text=True, timeout=60
    )
    assert int(done.stdout.split()[-1]) < 256 << 20, done.stdout  # never the 1 GiB file read


# ---------------------------------------------------------------------------------------------
# Item 12: the copy of the history a killed collect left is removed by the next one


def test_the_history_copy_a_killed_collect_left_is_removed_by_the_next_collect(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    results = sweep.parent
    script = (
        "import os, sys, time\nfrom pathlib import Path\nfrom hpcfsdp.results.history import updated_history\n"
        "with updated_history(Path(sys.argv[1]), print) as store:\n"
        "    print('copying', flush=True); time.sleep(600)\n"
    )
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    killed = subprocess.Popen(
        [sys.executable, "-c", script, str(results / "history.duckdb")], stdout=subprocess.PIPE, text=True
    )
    assert killed.stdout.readline().strip() == "copying"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left = [p.name for p in results.iterdir() if re.fullmatch(r"\.history\.duckdb\.[0-9]+\.[0-9a-f]{8}", p.name)]
    assert len(left) == 1, sorted(p.name for p in results.iterdir())  # what fe5d9d3 kept for good
    time.sleep(1.1)  # beneath.FRESH_S: a temporary file made this instant is never taken for a killed writer's
    assert main(["collect", str(sweep), "--no-plots"]) == 0
    assert sorted(p.name for p in results.iterdir() if p.name.startswith(".")) == []
    with duckdb.connect(str(results / "history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (4,)


def test_a_temporary_file_still_being_written_is_never_removed(tmp_path):
    from hpcfsdp.contracts.fs.beneath import clean_temps, new_temp

    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd, name = new_temp(folder, "result.json")
        (tmp_path / ".result.json.1.0123abcd").write_text("a killed writer's")
        time.sleep(1.1)
        assert clean_temps(folder, "result.json") == [".result.json.1.0123abcd"]
        assert (tmp_path / name).exists()
        os.close(fd)
    finally:
        os.close(folder)


# ---------------------------------------------------------------------------------------------
# Ownership: a folder another user owns or can write is refused in one line


@as_root
@pytest.mark.parametrize("command", ["status", "collect", "submit"])
def test_a_sweep_folder_another_user_made_is_refused_in_one_line(tmp_path, capsys, co_user, shared_space, command):
    results = shared_space / "results"
    results.mkdir()
    os.chmod(results, 0o777)  # a project space both may write in
    made = as_co_user(co_user, "mkdir", "-p", str(results / "sf" / "cells" / "c1"))
    assert made.returncode == 0, made.stderr
    sweep = results / "sf"
    argv = {
        "status": ["status", str(sweep)],
        "collect": ["collect", str(sweep), "--no-plots", "--no-history"],
        "submit": ["submit", str(jobs_yaml(tmp_path)), "--executor", "print", "--results-dir", str(results)],
    }[command]
    capsys.readouterr()
    assert main(argv) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {sweep}: owned by {CO_USER}, not by root (owner {CO_USER}:"), line
    assert "mode 0755" in line and "HPCFSDP_SHARED_GROUP" in line, line


@as_root
def test_a_group_writable_cells_folder_is_refused_unless_its_group_shares_it_on_purpose(
    tmp_path, capsys, monkeypatch, co_user
):
    sweep = collected_sweep(tmp_path)
    team = grp.getgrgid(co_user.pw_gid).gr_name
    os.chown(sweep / "cells", 0, co_user.pw_gid)
    os.chmod(sweep / "cells", 0o775)
    capsys.readouterr()
    assert main(["status", str(sweep)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {sweep / 'cells'}: writable by the group {team} (owner root:{team}, mode 0775)")
    monkeypatch.setenv("HPCFSDP_SHARED_GROUP", team)
    assert main(["status", str(sweep)]) in (0, 3)
    os.chmod(sweep / "cells", 0o777)
    capsys.readouterr()
    assert main(["status", str(sweep)]) == 1
    assert "writable by everyone" in one_error_line(capsys.readouterr().err)


@as_root
def test_a_slurm_folder_that_is_a_link_is_refused(tmp_path, capsys):
    sweep = collected_sweep(tmp_path)
    (tmp_path / "theirs").mkdir()
    (sweep / "slurm").symlink_to(tmp_path / "theirs")
    assert main(["status", str(sweep)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {sweep / 'slurm'}: a symbolic link where hpcfsdp keeps a folder of its own"), line


def test_a_cell_folder_that_is_a_link_is_no_cell_and_is_named_and_a_cells_link_lists_none(tmp_path):
    """layout.cell_ids_with, which status, collect and logs list cells by: a cells/<id> that is a
    link (to a folder holding a spec and a record) is passed over and named as not read; a cells/
    that is a link lists nothing. Before, both were followed."""
    from hpcfsdp.sweep.folder import layout
    from hpcfsdp.sweep.folder.layout import cell_ids_with, planned_cell_ids

    sweep = tmp_path / "sweep"
    theirs = tmp_path / "theirs"
    for folder in (sweep / "cells" / "mine", theirs / "cells" / "linked"):
        folder.mkdir(parents=True)
        (folder / "spec.json").write_text("{}")
        (folder / "result.json").write_text("{}")
    (sweep / "cells" / "linked").symlink_to(theirs / "cells" / "linked")
    assert planned_cell_ids(sweep) == ["mine"] and cell_ids_with(sweep, "result.json") == ["mine"]
    assert layout.unusable_cell_folders(sweep) == {
        "linked": f"{sweep}/cells/linked: a symbolic link where a cell folder belongs (hpcfsdp follows none); not read"
    }
    linked = tmp_path / "linked-cells"
    linked.mkdir()
    (linked / "cells").symlink_to(theirs / "cells")
    assert planned_cell_ids(linked) == [] and cell_ids_with(linked, "result.json") == []


# ---------------------------------------------------------------------------------------------
# The rule itself: no other module opens a path of those folders another way


# What opens files by name outside the file layer (contracts/fs/, contracts/files.py), and why that is
# no path under a sweep folder, the history, the references, the cache or tune's state.
NOT_FOLDER_FILES = {
    "cli.py": "os.devnull",
    "cache/verify.py": "the hub cache's snapshots are links into its blobs/ by design (huggingface_hub's layout); "
    "cache/hub.py refuses a path that leads out of the cache",
    "commands.py": "example(...): package data",
    "recordschema.py": "docs/record.schema.json, a file of the source tree",
    "sweep/define/yamlfile.py": "the jobs YAML the user names",
    "sweep/define/examples.py": "package data, and the copy `hpcfsdp examples` writes where the user says",
    "sweep/define/fielddocs.py": "docs/*.md of the source tree",
    "contracts/sources.py": "presets and shipped tokenizers: package data; a model folder the user names",
    "sweep/predict/modelshape.py": "a model's config.json (package data, or a model folder the user names)",
    "cell/models.py": "a model's config.json (package data, or a model folder the user names)",
    "cell/data.py": "a data file the user names",
    "cell/supervise/cgroup.py": "the cgroup's memory.events under /sys/fs/cgroup, a file of the kernel",
    "cell/supervise/bytecode.py": "the installed torch's own .pyc header; the user's bytecode folder, never under a "
    "sweep folder or the cache, made 0700 and held to its owner and mode by lstat (no link) before Python uses it",
    "results/plots.py": "the drawing code's own source (its digest)",
    "results/exports/wandb.py": "W&B's own folder under the export's destination",
    "results/exports/tensorboard.py": "TensorBoard's own folder under the export's destination",
}
OPENERS = re.compile(
    r"\bopen\(|\.open\(|\.(read_text|write_text|read_bytes|write_bytes|unlink|rename|mkdir|touch|symlink_to|rmdir|iterdir|glob)\("
    r"|\bos\.(open|remove|unlink|replace|rename|mkdir|makedirs|scandir|listdir)\(|\bshutil\.(rmtree|copy|move)|pickle\.load"
)


# An operation relative to a folder the file layer opened (dir_fd=), a file of the kernel (/proc,
# /dev/kmsg), a string's or a frame's replace or rename.
NOT_A_FOLDERS_PATH = re.compile(r'dir_fd=|"/proc|"/dev/|\.replace\(|\.rename\((columns|")')


def unowned_openers(src: Path) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        name = path.relative_to(src).as_posix()
        if name.startswith("contracts/fs/") or name == "contracts/files.py" or name in NOT_FOLDER_FILES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if OPENERS.search(code) and not NOT_A_FOLDERS_PATH.search(code):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_module_opens_a_folders_path_but_through_the_file_layer():
    assert unowned_openers(ROOT / "src" / "hpcfsdp") == []


def test_the_file_layer_check_names_a_module_that_opens_a_path_itself(tmp_path):
    copy = tmp_path / "hpcfsdp"
    shutil.copytree(ROOT / "src" / "hpcfsdp", copy, ignore=shutil.ignore_patterns("presets", "__pycache__"))
    with (copy / "results" / "collect.py").open("a") as module:
        module.write("\n\ndef sneaky(path):\n    return open(path).read()\n")
    assert [line.split(":")[0] for line in unowned_openers(copy)] == ["results/collect.py"]
