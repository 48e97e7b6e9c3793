"""Which Slurm cluster a sweep runs on (`slurm.clusters`, sbatch -M), so that every Slurm command
that tracks its jobs asks that cluster and no other.

submit records the cluster in each manifest entry; status, cancel and collect read it there, so
they need no YAML. `use_cluster` sets SLURM_CLUSTERS for this process, which sbatch (submitit's,
the preflight's --test-only, the --then-collect job's), squeue, scancel, sinfo and scontrol read as
their -M; sacct does not read it, so its callers add `sacct_cluster_args()`. The array tasks inherit
it through sbatch's --export=ALL, so the squeue a job asks about itself asks its own cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

from .layout import read_manifest

CLUSTERS_ENV = "SLURM_CLUSTERS"


# What the shell that started this process exported: "" goes back to it, so that one command
# (a test calling several in one process) never leaves the next at another sweep's cluster.
_INHERITED = os.environ.get(CLUSTERS_ENV)


def use_cluster(name: str) -> None:
    """Point this process's Slurm commands at cluster `name` ("": the one the shell chose)."""
    if name:
        os.environ[CLUSTERS_ENV] = name
    elif _INHERITED is None:
        os.environ.pop(CLUSTERS_ENV, None)
    else:
        os.environ[CLUSTERS_ENV] = _INHERITED


def sacct_cluster_args() -> list[str]:
    """sacct's -M for the cluster use_cluster chose (sacct ignores SLURM_CLUSTERS)."""
    name = os.environ.get(CLUSTERS_ENV, "")
    return [f"--clusters={name}"] if name else []


def manifest_cluster(sweep_dir: Path) -> str | None:
    """The cluster the sweep's latest queued cells went to ("": the default one; None: none queued)."""
    entries = sorted(read_manifest(sweep_dir).values(), key=_submitted_at)
    clusters = [entry.get("cluster", "") for entry in entries if entry.get("executor") == "slurm"]
    return str(clusters[-1]) if clusters else None


def _submitted_at(entry: dict) -> float:
    when = entry.get("submitted_at")
    return float(when) if isinstance(when, (int, float)) else 0.0


def use_sweep_cluster(sweep_dir: Path) -> None:
    """use_cluster with the cluster the sweep folder's manifest names."""
    use_cluster(manifest_cluster(sweep_dir) or "")
