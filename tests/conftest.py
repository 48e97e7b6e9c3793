"""Shared fixtures: run cells under a real torchrun, and a real local Slurm cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 4, "warmup_steps": 1}


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           "-m", "hpcfsdp", "run", "--results-dir", str(results), "--sweep", "t", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = sorted((results / "t" / "cells").glob("*/result.json"), key=lambda p: p.stat().st_mtime)
    assert records, f"no record written; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(records[-1].read_text()), proc


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """Start (or reuse) the local Slurm cluster of slurm/local/start.sh; return the environment to use."""
    start = subprocess.run(["bash", str(ROOT / "slurm/local/start.sh")], capture_output=True, text=True, timeout=900)
    if start.returncode != 0:
        pytest.fail(f"slurm/local/start.sh failed ({start.returncode}):\n{start.stderr[-3000:]}")
    last = start.stdout.strip().splitlines()[-1]
    assert last.startswith("export SLURM_CONF="), last
    env = {"SLURM_CONF": last.split("=", 1)[1].strip().strip("'\""), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    assert shutil.which("sbatch"), "sbatch not on PATH after start.sh"
    return env
