"""A sweep folder touches only its own jobs (issue 33, item 3): a random sweep id made at its first
submit, kept in the manifest beside the folder that queued the jobs, and given to Slurm as the
jobs' --comment, checked with squeue before any scancel, and in status, collect and
--retry-failed. A copy of the folder made while the original's jobs wait, on the local cluster,
neither cancels them nor writes records for them. And a manifest that names `all` (or a list) as
its cluster is never asked about (item 5)."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import slurm
from hpcfsdp.cli import main

CPU_CELL = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 3, "gpus_per_node": 1}


def queued_comments(name: str) -> dict[str, str]:
    """job id -> comment of the queued jobs called hpcfsdp-<name>."""
    out = slurm("squeue", "--noheader", "--array", f"--name=hpcfsdp-{name}", "--format=%i|%k")
    return dict(line.split("|", 1) for line in out.splitlines())


def manifest(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "manifest.json").read_text())


@pytest.mark.slurm
def test_a_copy_of_a_sweep_folder_neither_cancels_nor_records_the_originals_jobs(slurm_cluster, tmp_path, capsys):
    name = f"own{uuid.uuid4().hex[:8]}"
    jobs = tmp_path / f"{name}.yaml"
    jobs.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "base": CPU_CELL,
                "matrix": {"batch_size": [1, 2]},
                "slurm": {"time_min": 5, "extra_sbatch": {"hold": True}},
            }
        )
    )
    original = tmp_path / "results" / name
    copy = tmp_path / "copy" / name
    try:
        assert main(["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path / "results")]) == 0
        capsys.readouterr()
        entries = manifest(original).values()
        (uid,) = {entry["sweep_uid"] for entry in entries}
        assert {entry["folder"] for entry in entries} == {str(original.resolve())}
        queued = queued_comments(name)
        # the sweep's comment, and the token of the array's cells (sweep/track/intent.py)
        assert len(queued) == 2 and {comment.rpartition(":")[0] for comment in queued.values()} == {f"hpcfsdp:{uid}"}
        shutil.copytree(original, copy)

        # The copy: status names the original folder and follows none of its jobs; cancel finds none.
        assert main(["status", str(copy)]) == 3  # its cells are missing here
        out, err = capsys.readouterr()
        assert f"names jobs queued from {original.resolve()} (this folder is a copy of it)" in err
        assert "missing 2" in out and "pending" not in out
        assert main(["cancel", str(copy)]) == 0
        capsys.readouterr()
        assert queued_comments(name) == queued
        # --retry-failed in the copy queues the copy's own jobs, with a sweep id of its own.
        assert (
            main(["submit", str(jobs), "--executor", "slurm", "--retry-failed", "--results-dir", str(copy.parent)]) == 0
        )
        capsys.readouterr()
        copy_uid = {e["sweep_uid"] for e in manifest(copy).values()}
        assert len(copy_uid) == 1 and uid not in copy_uid
        assert len(queued_comments(name)) == 4
        # Cancelling the copy cancels its own two jobs only, and records those two.
        assert main(["cancel", str(copy)]) == 0
        capsys.readouterr()
        assert queued_comments(name) == queued
        assert len(list(copy.glob("cells/*/result.json"))) == 2
        assert not list(original.glob("cells/*/result.json"))

        # A manifest claiming the original's jobs for another folder of the same sweep name, with
        # another sweep id: squeue's comment tells the jobs apart, and nothing is cancelled.
        forged = tmp_path / "forged" / name
        shutil.copytree(original, forged)
        (forged / "manifest.json").write_text(
            json.dumps(
                {
                    cid: {**entry, "sweep_uid": "0123456789abcdef", "folder": str(forged.resolve())}
                    for cid, entry in manifest(original).items()
                }
            )
        )
        assert main(["cancel", str(forged)]) == 0
        capsys.readouterr()
        assert queued_comments(name) == queued

        # The original's own cancel still works.
        assert main(["cancel", str(original)]) == 0
        capsys.readouterr()
        assert queued_comments(name) == {}
        assert {json.loads(p.read_text())["status"] for p in original.glob("cells/*/result.json")} == {"cancelled"}
    finally:
        subprocess.run(["scancel", f"--name=hpcfsdp-{name}"], capture_output=True, timeout=60)


@pytest.mark.parametrize("cluster", ["all", "a,b", "ALL"])
def test_a_manifest_naming_every_cluster_is_never_asked_about(tmp_path, capsys, cluster):
    sweep_dir = tmp_path / "s"
    (sweep_dir / "cells" / "c1").mkdir(parents=True)
    (sweep_dir / "cells" / "c1" / "spec.json").write_text(json.dumps({"spec": {"strategy": "ddp"}}))
    entry = {"executor": "slurm", "job_id": "42", "cluster": cluster, "submitted_at": 1.0}
    (sweep_dir / "manifest.json").write_text(json.dumps({"c1": entry}))
    assert main(["cancel", str(sweep_dir)]) == 1
    err = capsys.readouterr().err
    assert f"cluster {cluster!r}: not one cluster name; not followed" in err and err.count("\n") == 1, err
