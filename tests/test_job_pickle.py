"""The job pickle of a shared sweep folder (issue 51, item 1): submitit's `<job>_submitted.pkl` is
unpickled by the array task only where its bytes are those the sbatch script names (sha256)."""

from __future__ import annotations

import json
import os
import pickle
import re
import time
from pathlib import Path

import pytest

from conftest import slurm
from hpcfsdp.cli import main
from test_faults import cancel_sweep_jobs, jobs_file, queued_job_ids, unique

pytestmark = pytest.mark.slurm


class Planted:
    """What a co-user's pickle does when it is loaded: run a command (here, touch a marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_job_pickle_replaced_while_the_array_waits_is_refused_and_never_unpickled(slurm_cluster, tmp_path, capsys):
    name = unique("pickle")
    jobs = jobs_file(tmp_path, name, slurm={"extra_sbatch": {"hold": True}}, matrix={"batch_size": [1, 2]})
    results = tmp_path / "results"
    marker = tmp_path / "unpickled"
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(results)]) == 0
        (array,) = re.findall(r"submitted array (\d+): 2 cell", capsys.readouterr().out)
        sweep_dir = results / name
        swapped = sweep_dir / "slurm" / f"{array}_0" / f"{array}_0_submitted.pkl"
        swapped.write_bytes(pickle.dumps(Planted(marker)))  # while the array is held
        slurm("scontrol", "release", array)
        deadline = time.monotonic() + 240
        while queued_job_ids(name) and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        cancel_sweep_jobs(name)
    assert not marker.exists()
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    by_task = {entry["job_id"]: cell for cell, entry in manifest.items()}
    refused = json.loads((sweep_dir / "cells" / by_task[f"{array}_0"] / "result.json").read_text())
    assert refused["status"] == "error", refused
    assert f"{swapped}: digest mismatch" in refused["error"] and "not unpickled" in refused["error"]
    untouched = json.loads((sweep_dir / "cells" / by_task[f"{array}_1"] / "result.json").read_text())
    assert untouched["status"] == "ok", untouched.get("error")
