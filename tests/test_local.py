"""The embedded default: `hpcfsdp submit --executor local` runs cells with torchrun on this machine."""

from __future__ import annotations

import json

from hpcfsdp.cli import main

SWEEP = """
name: local_e2e
base: {model: tiny, device: cpu, precision: fp32, seq_len: 32, steps: 3, warmup_steps: 1, gpus_per_node: 2}
matrix:
  strategy: [fsdp2_zero3]
include:
  - {strategy: ddp, model: acme/not-downloaded}
"""


def test_local_executor_runs_cells_and_records_failures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HPCFSDP_CACHE", str(tmp_path / "empty-cache"))  # the hub model fails when the cell runs
    jobs = tmp_path / "local.yaml"
    jobs.write_text(SWEEP)
    assert main(["submit", str(jobs), "--executor", "local", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    records = {r["spec"]["strategy"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("local_e2e/cells/*/result.json"))}
    assert records["fsdp2_zero3"]["status"] == "ok" and records["fsdp2_zero3"]["world_size"] == 2
    failed = records["ddp"]
    assert failed["status"] == "error" and failed["stage"] == "model" and "acme/not-downloaded" in failed["error"]
    # The run ends in the comparison table, failed cell included.
    table = out[out.index("| strategy"):]
    assert "| ok " in table and "| error " in table
    assert (tmp_path / "local_e2e/report/results.csv").is_file()
