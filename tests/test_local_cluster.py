"""slurm/local/start.sh itself: a changed knob restarts the cluster, and it comes up the first time."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, free_port_block, start_slurm, stop_slurm

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
