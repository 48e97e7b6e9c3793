"""slurm/local/start.sh itself: a changed knob restarts the cluster, it comes up the first time, and a
daemon that cannot start is explained (its log, the process on its port) and what started is stopped."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port_block, skip_where_root_is_no_mount_point, start_slurm, stop_slurm

# In a PID and mount namespace of its own, with a /run/munge of its own, the cluster is the only
# one on the "machine" (as on a bare CI machine): start.sh starts munged, and stop.sh stops it
# with the last Slurm daemon. The namespace's processes all end with it.
RESTART = """
set -euo pipefail
mount -t tmpfs -o mode=0755 tmpfs /run/munge
bash {start} >/dev/null
HPCFSDP_SLURM_GPUS=2 bash {start} >/dev/null 2>{log}
echo "FIRST RESTART OK"
bash {stop} 2>/dev/null
"""


@pytest.mark.slurm
def test_start_comes_up_the_first_time_after_a_knob_change_on_a_machine_of_one_cluster(tmp_path):
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is needed for a machine of one cluster")
    skip_where_root_is_no_mount_point("unshare --mount")
    state = tempfile.mkdtemp(prefix="hpcfsdp-slurm-restart-")
    knobs = {
        "HPCFSDP_SLURM_DIR": state,
        "HPCFSDP_SLURM_PORT": str(free_port_block(4)),
        "HPCFSDP_SLURM_NODES": "1",
        "HPCFSDP_SLURM_CPUS": "1",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    script = RESTART.format(
        start=ROOT / "slurm/local/start.sh", stop=ROOT / "slurm/local/stop.sh", log=tmp_path / "restart.log"
    )
    try:
        proc = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=600,
            env=knobs,
        )
    finally:
        shutil.rmtree(state, ignore_errors=True)
    log = (tmp_path / "restart.log").read_text() if (tmp_path / "restart.log").exists() else ""
    assert "FIRST RESTART OK" in proc.stdout, f"{proc.stderr[-2000:]}\n{log[-3000:]}"
    assert "configuration changed: restarting the daemons" in log


@pytest.mark.slurm
def test_a_cluster_on_the_hosts_gpus_gives_each_nodes_tasks_that_nodes_own_devices(tmp_path):
    """HPCFSDP_SLURM_GPUS=host splits the host's GPUs across nodes that share the host. Slurm numbers
    each node's GPUs from 0 (both nodes' tasks would get CUDA_VISIBLE_DEVICES=0,1 and share two
    cards); the TaskProlog gives them the host's numbers. Six links to /dev/null stand in for the
    device files of a six-GPU host, of which the cluster takes four (HPCFSDP_SLURM_HOST_GPUS), as
    when other runs hold the rest."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for k in range(6):
        (devices / f"nvidia{k}").symlink_to("/dev/null")
    state = tempfile.mkdtemp(prefix="hpcfsdp-slurm-hostgpus-")
    knobs = {
        "HPCFSDP_SLURM_DIR": state,
        "HPCFSDP_SLURM_PORT": str(free_port_block(4)),
        "HPCFSDP_SLURM_GPUS": "host",
        "HPCFSDP_SLURM_GPU_DEVICES": str(devices),
        "HPCFSDP_SLURM_HOST_GPUS": "1,2,4,5",
        "HPCFSDP_SLURM_ACCOUNTING": "0",
    }
    try:
        env, _ = start_slurm(knobs)
        out = tmp_path / "job.out"
        task = 'echo "$SLURMD_NODENAME $SLURM_PROCID $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"'
        two_nodes = slurm_with(
            env,
            "sbatch",
            "--parsable",
            "--wait",
            "-N",
            "2",
            "--ntasks-per-node=2",
            "--gres=gpu:2",
            "-o",
            str(out),
            "--wrap",
            f"srun bash -c '{task}'",
        )
        assert two_nodes.strip()
        lines = sorted(out.read_text().split("\n"))
        tasks = {tuple(line.split()[:2]): line.split()[2:] for line in lines if line.startswith("hpcfsdp-n")}
        assert tasks == {
            ("hpcfsdp-n1", "0"): ["1,2", "PCI_BUS_ID"],
            ("hpcfsdp-n1", "1"): ["1,2", "PCI_BUS_ID"],
            ("hpcfsdp-n2", "2"): ["4,5", "PCI_BUS_ID"],
            ("hpcfsdp-n2", "3"): ["4,5", "PCI_BUS_ID"],
        }, out.read_text()
        gres = (Path(state) / "conf/gres.conf").read_text()
        assert f"NodeName=hpcfsdp-n2 Name=gpu File={state}/gpu/hpcfsdp-n2/nvidia5" in gres
    finally:
        stop_slurm(knobs, "--purge")
        shutil.rmtree(state, ignore_errors=True)


def slurm_with(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        list(args), check=True, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    ).stdout


@pytest.mark.slurm
def test_a_taken_port_is_named_with_its_process_and_the_log_and_start_stops_what_it_started():
    """slurmctld's port held by another process (this test's): start.sh does not wait out its
    timeout, prints slurmctld's last log lines and the pid holding the port, and stops the slurmd
    it started (issue 53: it said only that a daemon "does not answer")."""
    state = tempfile.mkdtemp(prefix="hpcfsdp-slurm-taken-")
    port = free_port_block(4)
    knobs = {
        "HPCFSDP_SLURM_DIR": state,
        "HPCFSDP_SLURM_PORT": str(port),
        "HPCFSDP_SLURM_NODES": "1",
        "HPCFSDP_SLURM_ACCOUNTING": "0",
        "HPCFSDP_SLURM_TIMEOUT": "60",
    }
    try:
        with socket.socket() as holder:
            holder.bind(("0.0.0.0", port))
            holder.listen()
            started = time.monotonic()
            proc = subprocess.run(
                ["bash", str(ROOT / "slurm/local/start.sh")],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, **knobs},
            )
            took = time.monotonic() - started
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-3000:]
        assert f"port {port} (slurmctld's) is held by pid {os.getpid()} (" in proc.stderr, proc.stderr[-3000:]
        assert f"the last lines of {state}/log/slurmctld.log:" in proc.stderr
        assert "stopping slurmd-hpcfsdp-n1 (pid " in proc.stderr and "which this run started" in proc.stderr
        assert took < 45, took  # not the 60 s of HPCFSDP_SLURM_TIMEOUT
        left = [f.name for f in Path(state, "run").glob("*.pid") if Path(f"/proc/{f.read_text().strip()}").exists()]
        assert left == []
    finally:
        stop_slurm(knobs, "--purge")
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slurm
def test_a_release_the_machines_packages_do_not_give_is_refused_in_one_line(slurm_cluster, tmp_path):
    """HPCFSDP_SLURM_RELEASE: 22.05 is Debian 12's, 24.11 Debian 13's; the other one than this
    machine's is refused naming where to get it, before anything is installed or started."""
    installed = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=30).stdout
    other = "24.11" if " 22.05." in installed else "22.05"
    knobs = {"HPCFSDP_SLURM_DIR": str(tmp_path / "state"), "HPCFSDP_SLURM_RELEASE": other}
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm/local/start.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **knobs},
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"ERROR: Slurm {other} asked (HPCFSDP_SLURM_RELEASE)" in proc.stderr
    assert "bench/debian13_suite.sh" in proc.stderr and not (tmp_path / "state" / "conf").exists()
    bad = subprocess.run(
        ["bash", str(ROOT / "slurm/local/start.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **knobs, "HPCFSDP_SLURM_RELEASE": "23.02"},
    )
    assert bad.returncode == 1 and "HPCFSDP_SLURM_RELEASE must be 22.05, 24.11 or system, not '23.02'" in bad.stderr
