"""Shared fixtures: run cells under a real torchrun, and a real local Slurm cluster."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _own_cluster_per_worker() -> None:
    """Under pytest-xdist (the README's `-n 2`), each worker's session starts a default cluster of
    its own: the first keeps HPCFSDP_SLURM_DIR / HPCFSDP_SLURM_PORT, the others take their own
    folder, a port block 40 above per worker (start.sh uses PORT .. PORT + nodes + 2) and job ids
    of their own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker in ("", "gw0"):
        return
    index = int(worker.removeprefix("gw"))
    os.environ["HPCFSDP_SLURM_DIR"] = os.environ.get("HPCFSDP_SLURM_DIR", "/tmp/hpcfsdp-slurm") + f"-{worker}"
    os.environ["HPCFSDP_SLURM_PORT"] = str(int(os.environ.get("HPCFSDP_SLURM_PORT", "6817")) + 40 * index)
    # a cell derives its MASTER_PORT from its job id (cell/ranks/distributed.py): two clusters must not share job ids,
    # nor two checkouts' workers on one machine (each has its own HPCFSDP_SLURM_FIRST_JOB_ID)
    first = int(os.environ.get("HPCFSDP_SLURM_FIRST_JOB_ID", "1"))
    os.environ["HPCFSDP_SLURM_FIRST_JOB_ID"] = str(100_000 * index + first)


_own_cluster_per_worker()
TINY_CPU = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 4, "warmup_steps": 1}


class GarbageCollections:
    """`with GarbageCollections() as started:` the generation of each garbage collection that starts
    in the block. A class: leaving the block makes no object, which could start one of its own."""

    def __enter__(self) -> list[int]:
        self.started: list[int] = []
        self.callback = self._count
        gc.callbacks.append(self.callback)
        return self.started

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        gc.callbacks.remove(self.callback)

    def _count(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started.append(info["generation"])


def run_torchrun_cell(tmp_path: Path, nprocs: int, **fields) -> dict:
    """Train one cell with `torchrun -m hpcfsdp run KEY=VALUE ...` (gloo, CPU); return its record.

    Like the README's by-hand example, nodes and gpus_per_node come from torchrun unless given.
    """
    return torchrun_cell(tmp_path, nprocs, **fields)[0]


def torchrun_cell(tmp_path: Path, nprocs: int, **fields) -> tuple[dict, subprocess.CompletedProcess]:
    """run_torchrun_cell, also returning the finished torchrun (its exit status, stdout and stderr)."""
    values = {**TINY_CPU, **fields}
    args = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
    results = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "-m",
        "hpcfsdp",
        "run",
        "--results-dir",
        str(results),
        "--sweep",
        "t",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = sorted((results / "t" / "cells").glob("*/result.json"), key=lambda p: p.stat().st_mtime)
    assert records, f"no record written; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(records[-1].read_text()), proc


def local_cells(tmp_path: Path, cells: dict[str, dict]) -> dict[str, dict]:
    """Train these cells (name -> RunSpec fields over TINY_CPU; gpus_per_node and nodes give the
    ranks) in ONE `hpcfsdp submit --executor local`: a supervisor per cell that forks its ranks,
    not torchrun and a Python per rank as run_torchrun_cell starts (each imports torch). Their
    records by name, a failed cell's included: the caller asserts each one's status."""
    import yaml

    from hpcfsdp.cli import main
    from hpcfsdp.sweep.define.matrix import parse_sweep

    jobs = tmp_path / "cells.yaml"
    jobs.write_text(yaml.safe_dump({"name": "cells", "base": TINY_CPU, "include": list(cells.values())}))
    main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)])
    records = {}
    for name, fields in cells.items():
        (cell,) = parse_sweep({"base": TINY_CPU, "include": [fields]}).cells
        path = tmp_path / "cells" / "cells" / cell.id / "result.json"
        assert path.is_file(), f"{name}: no record in {path.parent}"
        records[name] = json.loads(path.read_text())
    return records


def slurm(*args: str) -> str:
    """A Slurm client command (sbatch, squeue, sacct, scontrol, ...): its output; it must succeed
    (a failure names the command and its stderr)."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}"
    return proc.stdout


def start_slurm(knobs: dict[str, str]) -> tuple[dict[str, str], bool]:
    """Run slurm/local/start.sh with these HPCFSDP_SLURM_* knobs: the environment that reaches the
    cluster, and whether start.sh started any Slurm daemon (else it found them all running)."""
    if knobs and "HPCFSDP_SLURM_FIRST_JOB_ID" not in knobs:
        # A test's own cluster runs beside the session's (and, under xdist, another worker's):
        # job ids of its own, so that the cells' MASTER_PORT (20000 + job id % 12000) differs.
        # The session's clusters' jobs take ports 20001-20500 and 24001-24500 (two workers); a
        # test's own, x501-x999 of one thousand in 21000-31999, chosen from its folder so that
        # starting it again (a slurmd brought back) keeps its configuration.
        block = zlib.crc32(knobs.get("HPCFSDP_SLURM_DIR", "").encode()) % 11 + 1
        knobs = {**knobs, "HPCFSDP_SLURM_FIRST_JOB_ID": str(1_200_000 + block * 1_000 + 501)}
    start = subprocess.run(
        ["bash", str(ROOT / "slurm/local/start.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **knobs},
    )
    if start.returncode != 0:
        pytest.fail(f"slurm/local/start.sh failed ({start.returncode}):\n{start.stderr[-3000:]}")
    last = start.stdout.strip().splitlines()[-1]
    assert last.startswith("export SLURM_CONF="), last
    env = {"SLURM_CONF": last.split("=", 1)[1].strip().strip("'\""), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    assert shutil.which("sbatch"), "sbatch not on PATH after start.sh"
    # start.sh logs "starting slurmctld ..." / "starting slurmd <node>" / "starting slurmdbd ..." /
    # "starting mariadbd ..." for each daemon it starts.
    return env, re.search(r"^\[hpcfsdp-slurm\] starting (slurm|mariadbd)", start.stderr, flags=re.M) is not None


def client_conf(tmp_path: Path, name: str, **settings: str) -> str:
    """A copy of the local cluster's slurm.conf with these settings changed, for the clients only
    (squeue, sacct): e.g. a SlurmctldPort where no slurmctld listens."""
    text = Path(os.environ["SLURM_CONF"]).read_text()
    for key, value in settings.items():
        text, found = re.subn(rf"(?m)^{key}=.*$", f"{key}={value}", text)
        assert found == 1, key
    path = tmp_path / f"{name}.conf"
    path.write_text(text)
    return str(path)


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def silent_controller() -> socket.socket:
    """A port that accepts connections and never answers them, until closed."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def hold() -> None:
        try:
            while True:
                held.append(server.accept()[0])
        except OSError:  # closed
            for connection in held:
                connection.close()

    threading.Thread(target=hold, daemon=True).start()
    return server


def free_port_block(size: int) -> int:
    """A port p with p .. p+size-1 all free (slurmctld on p, the slurmd of node i on p+i, ...), for
    a cluster of a test module's own beside the session's. The search starts at a random block, so
    that test runs beside each other (other checkouts) seldom race for the same one."""
    blocks = list(range(10017, 19817, 97))  # below the cells' rendezvous ports (cell/ranks/distributed.py)
    start = random.randrange(len(blocks))
    for base in blocks[start:] + blocks[:start]:
        try:
            for port in range(base, base + size):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def skip_where_root_is_no_mount_point(what: str) -> None:
    """Skips the test where `/` is no mount point: in a chroot into a plain folder (not in
    bench/debian13_suite.sh's root, which it binds onto itself). A mount namespace cannot make `/`
    private there, the kernel refuses (EINVAL): podman cannot unpack an image (containers/storage
    does that first: "remount /, flags: 0x44000: invalid argument"), nor `unshare --mount` start
    ("cannot change root filesystem propagation")."""
    with open("/proc/self/mountinfo") as mounts:  # only the mounts this process's root reaches
        if not any(line.split()[4] == "/" for line in mounts):
            pytest.skip(f"{what} cannot run here: / is no mount point (a chroot into a folder) to make private")


def stop_slurm(knobs: dict[str, str], *args: str) -> None:
    stop = subprocess.run(
        ["bash", str(ROOT / "slurm/local/stop.sh"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **knobs},
    )
    assert stop.returncode == 0, stop.stderr[-3000:]


@pytest.fixture(autouse=True)
def _no_slurm_unless_asked(monkeypatch) -> None:
    """A SLURM_CONF exported in the shell that runs pytest reaches no test but those that ask for a
    cluster (they set their own), so plan's check against the cluster never depends on it."""
    monkeypatch.delenv("SLURM_CONF", raising=False)


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[dict[str, str]]:
    """The default local cluster (slurm/local/start.sh, as configured by HPCFSDP_SLURM_* in the
    environment), started once per session or found running. A cluster this session started is
    stopped at its end (slurm/local/stop.sh) unless HPCFSDP_KEEP_SLURM=1; one found running is left."""
    env, started = start_slurm({})
    yield env
    if started and os.environ.get("HPCFSDP_KEEP_SLURM") != "1":
        stop_slurm({})


@pytest.fixture
def slurm_cluster(local_slurm, monkeypatch) -> dict[str, str]:
    """The local cluster's environment (SLURM_CONF, ...) for this test only: tests without this
    fixture never reach a Slurm controller, whatever ran before them."""
    for key, value in local_slurm.items():
        monkeypatch.setenv(key, value)
    return local_slurm
