"""Check a sweep's arrays against the partition before anything is queued.

Slurm accepts some jobs that can never start and holds them pending for ever (more nodes than the
partition has or allows: PartitionNodeLimit / PartitionConfig; a time limit above MaxTime:
PartitionTimeLimit), and refuses others only at the array that asks (GPUs, CPUs or memory no node
has), when arrays before it may already be queued. `plan` and `submit` ask here first: one line
per nodes x GPUs shape that can never run, naming the YAML line and key that set the value.

Then what the partition's limits do not show: each shape's predicted host memory per node
(sweep/predict/hostmemory.py) against the memory the job gets (`slurm.mem_gb`, else the partition's
DefMemPerNode or DefMemPerCPU x CPUs, else the whole node); the per-job limits of `slurm.qos`
(MaxWall, MaxTRESPerJob, MaxTRESPerNode: Slurm queues a job beyond them and holds it pending for
ever, unless the QOS denies it on submission); and last `sbatch --test-only` with each shape's
first array script, which Slurm refuses for an account, QOS, constraint, reservation or partition
the job may not use. Nothing is queued before every shape passed, so a wrong account never leaves
half a sweep queued.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...slurm import ANSWER_TIMEOUT_S, SlurmError, ask, installed
from ..define.matrix import Cell, Sweep, by_shape, cells_on_shape, packed
from ..predict.hostmemory import predict_host_cells, requested_mem_gb
from ..track.cluster import Partition, array_size_limit, known_clusters, read_partitions, read_qos, tres_counts
from .environment import shell_part_in, slurm_environment
from .sbatch import sbatch_script  # submitit's script text


def cluster_problems(sweep: Sweep, cells: Iterable[Cell] | None = None, skipped: list[str] | None = None) -> list[str]:
    """One line per shape of `cells` (default: every cell) that the sweep's partition can never run;
    when every shape can, one per shape beyond its host memory, the QOS's limits, or refused by
    sbatch --test-only (module docstring); [] when all pass, or when no Slurm answers here (then
    why is added to `skipped`, for plan to say so)."""
    res = sweep.resources
    clusters = known_clusters() if res.clusters else None
    if clusters is not None and res.clusters not in clusters:  # sbatch -M, scancel -M: never a cluster it guesses
        return [
            f"{place(sweep, 'slurm.clusters')}: no cluster {res.clusters!r} answers here "
            f"(`sacctmgr show clusters` knows {', '.join(clusters) or 'none'})"
        ]
    partitions = read_partitions(res.clusters)
    if partitions is None:
        if res.clusters and read_partitions() is not None:  # this login node's cluster answers
            return [
                f"{place(sweep, 'slurm.clusters')}: no cluster {res.clusters!r} answers here "
                "(`sacctmgr show clusters` lists those its slurmdbd knows)"
            ]
        if skipped is not None:
            skipped.append(
                "no Slurm here (sinfo is not on PATH)" if not installed("sinfo") else "no Slurm controller answered"
            )
        return []
    # sbatch takes a list of partitions (the job runs in the first that can run it); "": the default.
    names = [n.strip() for n in res.partition.split(",") if n.strip()]
    names = names or [p.name for p in partitions.values() if p.default]
    unknown = [name for name in names if name not in partitions] if names else [""]  # "": no default partition
    if unknown:
        known = ", ".join(sorted(partitions)) or "none"
        cluster = f"cluster {res.clusters}" if res.clusters else "this cluster"
        return [f"{place(sweep, 'slurm.partition')}: no partition {unknown[0]!r} on {cluster} (partitions: {known})"]
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
    shapes = by_shape(sweep.cells if cells is None else cells)
    per_task = max(
        (min(packed(nodes, res.cells_per_task), len(group)) for (nodes, _), group in shapes.items()), default=1
    )
    if per_task > 1 and len(limits) == len(names) and res.time_min <= max(limits) < res.time_min * per_task:
        problems.append(
            f"{place(sweep, 'slurm.cells_per_task')}: {per_task} cells x time_min {res.time_min} = "
            f"{res.time_min * per_task} min per array task is above the MaxTime of {where} ({max(limits)} min); "
            f"set cells_per_task to at most {max(1, max(limits) // res.time_min)}"
        )
    for (nodes, gpus), group in shapes.items():
        found = [_why_never(partitions[name], nodes, gpus, sweep) for name in names]
        first = found[0]
        if first is not None and all(found):  # the first partition's reason
            key, value, why = first
            problems.append(
                f"{place(sweep, key, value)}: {cells_on_shape(group, nodes, gpus)} can never run in {where}: {why}"
            )
    if problems:
        return problems
    chosen = list(sweep.cells if cells is None else cells)
    problems = host_memory_problems(sweep, chosen, partitions[names[0]]) + qos_problems(sweep, chosen)
    return problems or sbatch_refusals(sweep, chosen)


def memory_given_mb(sweep: Sweep, partition: Partition, nodes: int, gpus: int) -> tuple[int, str] | None:
    """The host memory per node a job of this shape gets, MB, and where that comes from; None when
    the partition has no nodes to tell."""
    res = sweep.resources
    requested = requested_mem_gb(sweep, nodes, gpus)
    if requested:
        return requested * 1024, f"mem_gb {'auto: ' if res.mem_auto else ''}{requested}"
    for key, per in (("mem_per_cpu", gpus * res.cpus_per_task), ("mem_per_gpu", gpus)):
        value = res.extra_sbatch.get(key, res.extra_sbatch.get(key.replace("_", "-")))
        mb = tres_counts(f"mem={value}").get("mem") if value is not None else None
        if mb:
            return per * mb, f"extra_sbatch.{key} {value} x {per}"
    if partition.def_mem_per_node_mb:
        return (
            partition.def_mem_per_node_mb,
            f"partition {partition.name}'s DefMemPerNode {partition.def_mem_per_node_mb} MB",
        )
    if partition.def_mem_per_cpu_mb:
        cpus = gpus * res.cpus_per_task
        return (
            cpus * partition.def_mem_per_cpu_mb,
            f"partition {partition.name}'s DefMemPerCPU {partition.def_mem_per_cpu_mb} MB x {cpus} CPU(s)",
        )
    if not partition.nodes:
        return None
    smallest = min(node.memory_mb for node in partition.nodes)
    return smallest, f"a whole node of partition {partition.name}, the smallest: {smallest} MB"


def host_memory_problems(sweep: Sweep, cells: list[Cell], partition: Partition) -> list[str]:
    """One line per shape whose predicted host memory per node is above what its jobs get."""
    predicted = predict_host_cells(cells, sweep.resources.cache_dir or None)
    problems = []
    for (nodes, gpus), group in by_shape(cells).items():
        needs = {cell.id: p.node_gib for cell in group if (p := predicted[cell.id])}
        given = memory_given_mb(sweep, partition, nodes, gpus)
        if not needs or given is None:
            continue
        given_mb, how = given
        over = [need for need in needs.values() if need * 1024 > given_mb]
        if over:
            problems.append(
                f"{place(sweep, 'slurm.mem_gb')}: {cells_on_shape(group, nodes, gpus, len(over))} are "
                f"predicted to need {max(over):.1f} GiB of host memory per node, above the {given_mb / 1024:.1f} GiB "
                f"they get ({how}); raise slurm.mem_gb to at least {math.ceil(max(over))} (or mem_gb: auto)"
            )
    return problems


def _tres_asked(sweep: Sweep, nodes: int, gpus: int) -> tuple[dict[str, int], dict[str, int]]:
    """(per job, per node) TRES a job of this shape asks for, as sacctmgr names them (mem in MB)."""
    res = sweep.resources
    mem = requested_mem_gb(sweep, nodes, gpus) * 1024
    per_node = {"cpu": gpus * res.cpus_per_task}
    if res.gpu_request != "none":
        per_node["gres/gpu"] = gpus
    if mem:
        per_node["mem"] = mem
    return {"node": nodes, **{k: v * nodes for k, v in per_node.items()}}, per_node


def _tres_key(tres: str, nodes: int, gpus: int) -> tuple[str, Any]:
    """The key (and its value, to find its YAML line) that set how much of `tres` a shape asks for."""
    if tres == "node":
        return "nodes", nodes
    if tres == "mem":
        return "slurm.mem_gb", None
    if tres == "cpu" and gpus == 1:
        return "slurm.cpus_per_task", None
    return "gpus_per_node", gpus


def qos_problems(sweep: Sweep, cells: list[Cell]) -> list[str]:
    """Lines for what exceeds the per-job limits of slurm.qos (none when no QOS is named or
    sacctmgr does not know it: sbatch --test-only then names a QOS that does not exist)."""
    res = sweep.resources
    qos = read_qos(res.qos) if res.qos else None
    if qos is None:
        return []
    problems = []
    if qos.max_wall_min is not None and res.time_min > qos.max_wall_min:
        problems.append(
            f"{place(sweep, 'slurm.time_min')}: {res.time_min} min is above the MaxWall of QOS {qos.name} "
            f"({qos.max_wall_text}, {qos.max_wall_min} min): no cell can ever start (Slurm would hold it pending "
            f"with QOSMaxWallDurationPerJobLimit); lower slurm.time_min or choose another slurm.qos"
        )
    for (nodes, gpus), group in by_shape(cells).items():
        per_job, per_node = _tres_asked(sweep, nodes, gpus)
        for scope, asked, limits in (("job", per_job, qos.max_tres_per_job), ("node", per_node, qos.max_tres_per_node)):
            beyond = [tres for tres, limit in limits.items() if asked.get(tres, 0) > limit]
            if beyond:
                tres = beyond[0]
                key, value = _tres_key(tres, nodes, gpus)
                problems.append(
                    f"{place(sweep, key, value)}: {cells_on_shape(group, nodes, gpus)} can never "
                    f"start under QOS {qos.name}: they ask for {tres}={asked[tres]} per {scope}, above its "
                    f"MaxTRESPer{scope.capitalize()} {tres}={limits[tres]}"
                )
                break
    return problems


# A word of sbatch's refusal (lower case) -> the key that chose what it refuses.
REFUSAL_KEYS = (
    ("account", "slurm.account"),
    ("qos", "slurm.qos"),
    ("feature", "slurm.constraint"),
    ("reservation", "slurm.extra_sbatch"),
    ("partition", "slurm.partition"),
    ("cluster", "slurm.clusters"),
)


def sbatch_refusals(sweep: Sweep, cells: list[Cell]) -> list[str]:
    """`sbatch --test-only` of the first array of each shape, as submit would queue it: one line
    per shape that Slurm refuses; none when sbatch is not here or does not answer."""
    size = array_size_limit(sweep.resources.max_array_size, sweep.resources.clusters)
    folder = Path(tempfile.gettempdir()) / "hpcfsdp-test-only" / sweep.name  # named in the script only
    env = slurm_environment(sweep)  # as submit's sbatch runs
    problems = []
    for (nodes, gpus), group in by_shape(cells).items():
        count = min(len(group), size * packed(nodes, sweep.resources.cells_per_task) if size else len(group))
        script = sbatch_script(sweep, folder, nodes, gpus, count)
        try:
            ask(
                "sbatch",
                "--test-only",
                cluster=sweep.resources.clusters,
                timeout_s=ANSWER_TIMEOUT_S,
                stdin=script,
                env=env,
            )
            continue
        except SlurmError as exc:
            if not exc.answered:  # not here, or no answer: the preflight skips what it cannot ask
                return []
            why = refusal_text(exc.stderr)
        key = next((key for word, key in REFUSAL_KEYS if re.search(rf"\b{word}\b", why.lower())), "slurm")
        problems.append(
            f"{place(sweep, key)}: Slurm refuses the array of {cells_on_shape(group, nodes, gpus, count)} "
            f"(sbatch --test-only): {why}{shell_part_in(why, sweep)}"
        )
    return problems


def refusal_text(stderr: str) -> str:
    """sbatch's reason on one line: 'allocation failure: <why>' (or 'sbatch: error: <why>'), with
    the limit's name where sbatch gives one ('sbatch: error: QOSMaxWallDurationPerJobLimit')."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.split(":", 2)[-1].strip() for line in lines if line.startswith("sbatch: error:")]
    failures = [line.split(":", 1)[1].strip() for line in lines if line.startswith("allocation failure:")]
    codes = [error for error in errors if error.isidentifier()]  # a bare reason: QOSMaxCpuPerJobLimit
    why = (failures or [e for e in errors if not e.isidentifier()] or lines or ["refused"])[-1]
    why = why.removeprefix("Batch job submission failed:").strip()
    return f"{why} ({codes[-1]})" if codes else why


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
    need_cpus = gpus * res.cpus_per_task  # the node's one task: cpus_per_task per GPU
    mem_gb = requested_mem_gb(sweep, nodes, gpus)
    need_mb = mem_gb * 1024
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
        shown = f"auto: {mem_gb}" if res.mem_auto else mem_gb
        return "slurm.mem_gb", None, f"mem_gb {shown} is above the {most_mb} MB its nodes have at most"
    fitting = [n for n in partition.nodes if n.gpus >= need_gpus and n.cpus >= need_cpus and n.memory_mb >= need_mb]
    if len(fitting) < nodes:
        return (
            "nodes",
            nodes,
            f"only {len(fitting)} of its nodes have {need_gpus} GPU(s), {need_cpus} CPUs"
            f"{f' and {mem_gb} GB' if need_mb else ''} each",
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
