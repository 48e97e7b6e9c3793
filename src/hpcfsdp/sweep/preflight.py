"""Check a sweep's arrays against the partition before anything is queued.

Slurm accepts some jobs that can never start and holds them pending for ever (more nodes than the
partition has or allows: PartitionNodeLimit / PartitionConfig; a time limit above MaxTime:
PartitionTimeLimit), and refuses others only at the array that asks (GPUs, CPUs or memory no node
has), when arrays before it may already be queued. `plan` and `submit` ask here first: one line
per nodes x GPUs shape that can never run, naming the YAML line and key that set the value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .cluster import Partition, read_partitions
from .matrix import Cell, Sweep, by_shape


def cluster_problems(sweep: Sweep, cells: Iterable[Cell] | None = None) -> list[str]:
    """One line per shape of `cells` (default: every cell) that the sweep's partition can never run;
    [] when every shape can run, or when no Slurm answers here (nothing to check against)."""
    partitions = read_partitions()
    if partitions is None:
        return []
    res = sweep.resources
    # sbatch takes a list of partitions (the job runs in the first that can run it); "": the default.
    names = [n.strip() for n in res.partition.split(",") if n.strip()]
    names = names or [p.name for p in partitions.values() if p.default]
    unknown = [name for name in names if name not in partitions] if names else [""]  # "": no default partition
    if unknown:
        known = ", ".join(sorted(partitions)) or "none"
        return [f"{place(sweep, 'slurm.partition')}: no partition {unknown[0]!r} on this cluster (partitions: {known})"]
    where = f"partition {names[0]}" if len(names) == 1 else f"any of the partitions {', '.join(names)}"
    problems = []
    limits = [limit for name in names if (limit := partitions[name].max_time_min) is not None]
    if len(limits) == len(names) and res.time_min > max(limits):  # no cell can run
        texts = (
            ", ".join(f"{name} {partitions[name].max_time_text}" for name in names)
            if len(names) > 1
            else partitions[names[0]].max_time_text
        )
        problems.append(
            f"{place(sweep, 'slurm.time_min')}: {res.time_min} min is above the MaxTime of {where} "
            f"({texts}, {max(limits)} min): no cell can ever run"
        )
    for (nodes, gpus), group in by_shape(sweep.cells if cells is None else cells).items():
        found = [_why_never(partitions[name], nodes, gpus, sweep) for name in names]
        first = found[0]
        if first is not None and all(found):  # the first partition's reason
            key, value, why = first
            problems.append(
                f"{place(sweep, key, value)}: {len(group)} cell(s) on {nodes} node(s) x {gpus} GPU(s) "
                f"can never run in {where}: {why}"
            )
    return problems


def _why_never(partition: Partition, nodes: int, gpus: int, sweep: Sweep) -> tuple[str, Any, str] | None:
    """(the key to blame, its value, why) for a shape the partition can never run, else None."""
    res = sweep.resources
    if partition.max_nodes is not None and nodes > partition.max_nodes:
        return "nodes", nodes, f"it allows at most {partition.max_nodes} node(s) per job (MaxNodes)"
    if nodes > len(partition.nodes):
        return "nodes", nodes, f"it has {len(partition.nodes)} node(s)"
    if nodes < partition.min_nodes:
        return "nodes", nodes, f"it needs at least {partition.min_nodes} node(s) per job (MinNodes)"
    need_gpus = gpus if res.gpu_request != "none" else 0
    need_cpus = gpus * res.cpus_per_task  # one task per GPU
    need_mb = res.mem_gb * 1024
    most_gpus = max(n.gpus for n in partition.nodes)
    if need_gpus > most_gpus:
        return "gpus_per_node", gpus, f"its nodes have at most {most_gpus} GPU(s) each (gres)"
    most_cpus = max(n.cpus for n in partition.nodes)
    if partition.max_cpus_per_node is not None:
        most_cpus = min(most_cpus, partition.max_cpus_per_node)
    if need_cpus > most_cpus:
        return (
            "slurm.cpus_per_task",
            None,
            f"{gpus} task(s) x {res.cpus_per_task} CPU(s) = {need_cpus} CPUs per "
            f"node, and its nodes have at most {most_cpus}",
        )
    most_mb = max(n.memory_mb for n in partition.nodes)
    if partition.max_mem_per_node_mb is not None:
        most_mb = min(most_mb, partition.max_mem_per_node_mb)
    if need_mb > most_mb:
        return "slurm.mem_gb", None, f"mem_gb {res.mem_gb} is above the {most_mb} MB its nodes have at most"
    fitting = [n for n in partition.nodes if n.gpus >= need_gpus and n.cpus >= need_cpus and n.memory_mb >= need_mb]
    if len(fitting) < nodes:
        return (
            "nodes",
            nodes,
            f"only {len(fitting)} of its nodes have {need_gpus} GPU(s), {need_cpus} CPUs"
            f"{f' and {res.mem_gb} GB' if need_mb else ''} each",
        )
    return None


def place(sweep: Sweep, key: str, value: Any = None) -> str:
    """'<file>:<line>: <section>.<key>' for where the YAML set `key` (to `value`: the first matrix
    axis, include entry or base that did), else '<file>: <key>' (its default)."""
    raw = sweep.raw
    if key.startswith("slurm."):
        places = [key]
    else:
        places = [f"matrix.{key}"] if value in ((raw.get("matrix") or {}).get(key) or []) else []
        places += [f"include[{i}].{key}" for i, entry in enumerate(raw.get("include") or []) if entry.get(key) == value]
        places += [f"base.{key}"] if (raw.get("base") or {}).get(key) == value else []
    for place in places:
        if place in sweep.lines:
            return f"{sweep.source}:{sweep.lines[place]}: {place}"
    return f"{sweep.source}: {places[0] if places else key}"
