"""slurm/local/start.sh itself: a changed knob restarts the cluster, and it comes up the first time."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest

from conftest import ROOT, free_port_block

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
