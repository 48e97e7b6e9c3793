"""The login-node / compute-node split holds: the login-side commands never load torch.

Each command runs in a fresh interpreter (a test process has torch loaded already), as a user on a
login node would run it; the check is `sys.modules` after the command returned.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs one hpcfsdp command in-process, then says which heavy modules it loaded.
PROBE = """
import json, sys
from hpcfsdp.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def loaded_by(args: list[str], cwd: Path = ROOT) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> tuple[Path, dict]:
    """`submit --executor print` of the smoke sweep: its folder (plus one record written by hand) and
    what the command loaded."""
    from hpcfsdp.record import write_record

    results = tmp_path_factory.mktemp("layout") / "results"
    submitted = loaded_by(["submit", "jobs/smoke.yaml", "--executor", "print", "--results-dir", str(results)])
    sweep = results / "smoke"
    cell = sorted((sweep / "cells").iterdir())[0]
    meta = json.loads((cell / "spec.json").read_text())
    write_record(
        cell / "result.json",
        {"status": "error", "stage": "train", "error": "RuntimeError: x", **meta, "world_size": 2, "nodes": 1},
    )
    return sweep, submitted


def test_plan_loads_neither_torch_nor_transformers():
    assert loaded_by(["plan", "jobs/zero2_vs_zero3.yaml"]) == {"code": 0, "loaded": []}


def test_submit_with_the_print_executor_loads_no_torch(printed):
    sweep, submitted = printed
    assert submitted == {"code": 0, "loaded": []}
    assert len(list((sweep / "cells").glob("*/spec.json"))) == 8


def test_status_collect_and_history_load_no_torch(printed):
    sweep, _ = printed
    assert loaded_by(["status", str(sweep)])["loaded"] == []
    assert loaded_by(["collect", str(sweep), "--no-plots"])["loaded"] == []
    assert loaded_by(["history", "--history", str(sweep.parent / "history.duckdb")]) == {"code": 0, "loaded": []}
    assert "RuntimeError: x" in (sweep / "report" / "summary.md").read_text()


def test_the_cache_side_loads_no_torch_outside_tokenising():
    probe = (
        "import sys, hpcfsdp.cache.download, hpcfsdp.cache.fetch, hpcfsdp.cache.hub, hpcfsdp.cache.manifest, "
        "hpcfsdp.cache.plan, hpcfsdp.cache.tokenize, hpcfsdp.cache.verify, hpcfsdp.sweep.job;"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
