"""`hpcfsdp plan`: a sweep's cells, arrays, predicted memory and sbatch scripts, before anything is
submitted; and `submit --skip-predicted-oom`, which leaves out the cells `plan --memory` flags."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ...contracts.fields import SpecError, field_names
from ...contracts.spec import RunSpec
from ..define.matrix import Cell, Sweep, arrays, plain_value
from ..track.cluster import array_size_limit

RANKS = {"GPU": "GPU(s)", "process": "process(es)"}  # rank_word -> how a count of them is written
# Always shown by plan; any other RunSpec field gets a column when its value varies across the sweep.
# What plan could not check where no Slurm answered (preflight.py).
SKIPPED_CHECKS = (
    "the partition, QOS, host-memory and sbatch --test-only checks were skipped; "
    "plan on a machine whose Slurm answers runs them"
)
SBATCH_EXAMPLE = "slurm/fsdp_job.sbatch"  # the plain sbatch script, for a run without submitit (docs/submit.md)
PLAN_FIELDS = ("strategy", "batch_size", "grad_accum", "activation_checkpointing", "nodes", "gpus_per_node")


def rank_word(cells: Iterable[Cell]) -> str:
    """What one rank of these cells runs on, as plan names it: a GPU, or, where every cell says
    `device: cpu`, a process."""
    return "process" if all(cell.spec.device == "cpu" for cell in cells) else "GPU"


def print_plan(sweep: Sweep, memory: bool = False) -> int:
    """The cell table (or, with memory, the memory table), the arrays, the GPU-hours bound; then
    one `error:` line per cache miss or shape the partition cannot run (exit status 2)."""
    res = sweep.resources
    size = array_size_limit(res.max_array_size, res.clusters)
    planned = arrays(sweep.cells, size)
    where = f" on cluster {res.clusters}" if res.clusters else ""
    print(f"{sweep.name}: {len(sweep.cells)} cell(s) in {len(planned)} array(s){where}")
    sys.stdout.write("\n".join(memory_table(sweep) if memory else plan_table(sweep, planned)) + "\n")
    for index, ((nodes, gpus), cells) in enumerate(planned):
        print(f"array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} {RANKS[rank_word(cells)]}")
    if len(planned) > len(sweep.groups()):
        limit = "slurm.max_array_size" if size == res.max_array_size else "the cluster's MaxArraySize"
        print(f"(an array holds at most {size} cells: {limit})")
    requeues = f", {res.max_requeue} requeue(s)" if res.max_requeue else ""
    print(
        f"upper bound: {rank_hours(sweep):.1f} {rank_word(sweep.cells)}-hours at a {res.time_min} min limit "
        f"per cell{requeues}"
    )
    if res.pass_env:
        print(
            f"note: slurm.pass_env: {', '.join(res.pass_env)} go to the Slurm jobs as set where you submit, "
            "and slurmctld saves their values with each job (its state folder, read by the cluster's administrators)"
        )
    skipped: list[str] = []
    problems = plan_problems(sweep, skipped)
    for reason in skipped:
        print(f"note: {reason}: {SKIPPED_CHECKS}", file=sys.stderr)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def rank_hours(sweep: Sweep) -> float:
    """The most GPU-hours (process-hours on CPU) the sweep can use: every rank for its whole time
    limit, again for every requeue."""
    runs = 1 + sweep.resources.max_requeue
    return sum(c.spec.world_size for c in sweep.cells) * sweep.resources.time_min * runs / 60


def plan_problems(sweep: Sweep, skipped: list[str] | None = None) -> list[str]:
    """What stops the sweep here: cache misses, shapes the partition cannot run; why the cluster's
    checks were skipped, if they were, is added to `skipped`."""
    from ...cache.plan import cache_misses
    from .preflight import cluster_problems

    return cache_misses(sweep, sweep.resources.cache_dir or None) + cluster_problems(sweep, skipped=skipped)


def plan_document(sweep: Sweep, memory: bool = False) -> dict:
    """`plan --json`: every cell (its array and spec; with memory, its predicted memory), the
    arrays, the bound and the problems, with the exit status print_plan would give."""
    res = sweep.resources
    planned = arrays(sweep.cells, array_size_limit(res.max_array_size, res.clusters))
    array_of = {cell.id: index for index, (_, members) in enumerate(planned) for cell in members}
    cells = {
        cell.id: {"cell_id": cell.id, "array": array_of[cell.id], "spec": cell.spec.to_dict()} for cell in sweep.cells
    }
    if memory:
        for cell_id, figures in memory_figures(sweep).items():
            cells[cell_id]["memory"] = figures
    skipped: list[str] = []
    problems = plan_problems(sweep, skipped)
    return {
        "sweep": sweep.name,
        "cluster": res.clusters,
        "exit_status": 2 if problems else 0,
        "cells": list(cells.values()),
        "arrays": [
            {"array": index, "nodes": nodes, "ranks_per_node": ranks, "rank": rank_word(members), "cells": len(members)}
            for index, ((nodes, ranks), members) in enumerate(planned)
        ],
        "upper_bound_hours": rank_hours(sweep),
        "hours_of": rank_word(sweep.cells),
        "time_min": res.time_min,
        "max_requeue": res.max_requeue,
        "problems": problems,
        "cluster_checks_skipped": "; ".join(f"{reason}: {SKIPPED_CHECKS}" for reason in skipped),
    }


def print_sbatch_scripts(sweep: Sweep, results_dir: Path) -> int:
    """`plan --sbatch`: the script of each array, as submit would write it (the sweep id, its jobs'
    comment, once the folder has one: layout.folder_uid)."""
    from ..folder.layout import folder_uid
    from .local import srun_command
    from .sbatch import sbatch_script

    sweep_dir = results_dir / sweep.name
    uid = folder_uid(sweep_dir) if (sweep_dir / "manifest.json").is_file() else ""

    for index, ((nodes, gpus), cells) in enumerate(
        arrays(sweep.cells, array_size_limit(sweep.resources.max_array_size, sweep.resources.clusters))
    ):
        print(
            f"# ===== array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} {RANKS[rank_word(cells)]} ====="
        )
        print(sbatch_script(sweep, sweep_dir, nodes, gpus, len(cells), uid))
        print(
            f"# Its cell {cells[0].id} by hand, in an allocation of {nodes} node(s): what the task runs, as srun + "
            "torchrun (`hpcfsdp submit --executor print` writes the cell folder and prints every cell's torchrun)"
        )
        if container := sweep.resources.container:
            print(
                f"# (this line runs outside slurm.container's image; the task runs in it, through {container.runtime})"
            )
        print("\n".join(srun_command(sweep, sweep_dir, cells[0])) + "\n")
    print(
        f"# Without hpcfsdp: {SBATCH_EXAMPLE}, a plain sbatch script of the same srun + torchrun that takes "
        "the cell's fields as KEY=VALUE (`hpcfsdp examples fsdp_job.sbatch --copy-to .`)"
    )
    return 0


def plan_table(sweep: Sweep, planned: list[tuple[tuple[int, int], list[Cell]]]) -> list[str]:
    cells = sweep.cells
    array_of = {cell.id: index for index, (_, members) in enumerate(planned) for cell in members}
    varying = [
        name
        for name in field_names(RunSpec)
        if name not in PLAN_FIELDS and len({getattr(c.spec, name) for c in cells}) > 1
    ]
    columns = {name: [plain_value(getattr(c.spec, name)) for c in cells] for name in varying}
    widths = {name: max(len(name), *map(len, values)) for name, values in columns.items()}
    id_width = max(4, *(len(c.id) for c in cells))
    shape = "nodes x gpus" if rank_word(cells) == "GPU" else "nodes x procs"
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>5} {'accum':>5} {'ckpt':>9} {shape:>12} {'array':>5}"
        + "".join(f" {name:>{widths[name]}}" for name in varying)
    ]
    for row, cell in enumerate(cells):
        s = cell.spec
        lines.append(
            f"{cell.id:{id_width}} {s.strategy:19} {s.batch_size:5} {s.grad_accum:5} {s.activation_checkpointing:>9} "
            f"{f'{s.nodes} x {s.gpus_per_node}':>12} {array_of[cell.id]:5}"
            + "".join(f" {columns[name][row]:>{widths[name]}}" for name in varying)
        )
    return lines


def memory_table(sweep: Sweep) -> list[str]:
    """`plan --memory`: the predicted memory of every cell, GiB per GPU (sweep/predict/memory.py), and its
    host memory per node (sweep/predict/hostmemory.py)."""
    from ..predict.hostmemory import predict_host_cells
    from ..predict.memory import RUNTIME_RESERVE_GIB, predict_cells, usable_gib

    res = sweep.resources
    capacity = capacity_of(sweep)
    rows = predict_cells(sweep.cells, capacity, res.cache_dir or None)
    hosts = predict_host_cells(sweep.cells, res.cache_dir or None)
    id_width = max(4, *(len(r.cell_id) for r in rows))
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>9} {'ckpt':>9} {'seq':>6} {'states':>7} {'gathered':>8} "
        f"{'activ.':>7} {'loss':>7} {'peak GiB':>8} {'peak at':>9} {'host/node':>9} fit"
    ]
    for row in rows:
        s, p = row.spec, row.prediction
        batch = f"auto:{row.batch}" if s.auto_batch and capacity and s.device != "cpu" else str(row.batch)
        figures = (
            (
                f"{p.states_gib:7.2f} {p.gathered_gib:8.2f} {p.activations_gib:7.2f} {p.loss_gib:7.2f} "
                f"{p.peak_gib:8.2f} {p.peak_moment:>9}"
            )
            if p
            else f"{'-':>7} {'-':>8} {'-':>7} {'-':>7} {'-':>8} {'-':>9}"
        )
        fit = {"oom": "OOM", "": "n/a (cpu)" if s.device == "cpu" else "-"}.get(row.fit, row.fit)
        host = hosts[row.cell_id]
        lines.append(
            f"{row.cell_id:{id_width}} {s.strategy:19} {batch:>9} {s.activation_checkpointing:>9} {s.seq_len:6} "
            f"{figures} {f'{host.node_gib:9.2f}' if host else '-':>9} {fit}" + (f"  ({row.note})" if row.note else "")
        )
    lines.append("host/node: predicted host memory (RAM) per node, GiB; preflight compares it with slurm.mem_gb")
    if capacity is None:
        lines.append("GPU memory unknown: set slurm.gpu_memory_gib or slurm.gpu_name to flag cells that do not fit")
    else:
        lines.append(
            f"GPU memory {capacity:g} GiB, {usable_gib(capacity):g} usable after a {RUNTIME_RESERVE_GIB:g} GiB "
            f"runtime reserve: {sum(r.fit == 'oom' for r in rows)} cell(s) predicted not to fit, "
            f"{sum(r.fit == 'tight' for r in rows)} tight (above 90%)"
        )
    return lines


def memory_figures(sweep: Sweep) -> dict[str, dict]:
    """`plan --memory --json`: cell id -> what memory_table shows of it, as numbers (GiB)."""
    from ..predict.hostmemory import predict_host_cells
    from ..predict.memory import predict_cells

    rows = predict_cells(sweep.cells, capacity_of(sweep), sweep.resources.cache_dir or None)
    hosts = predict_host_cells(sweep.cells, sweep.resources.cache_dir or None)
    figures = {}
    for row in rows:
        p, host = row.prediction, hosts[row.cell_id]
        figures[row.cell_id] = {
            "batch_size": row.batch,
            **{
                name: getattr(p, name) if p else None
                for name in ("states_gib", "gathered_gib", "activations_gib", "loss_gib", "peak_gib")
            },
            "peak_at": p.peak_moment if p else None,
            "host_gib_per_node": host.node_gib if host else None,
            "fit": row.fit or None,  # ok, tight, oom; none where the GPU's memory is unknown (or on CPU)
            "note": row.note,
        }
    return figures


def capacity_of(sweep: Sweep) -> float | None:
    """The GPU memory, GiB, the sweep's cells get: slurm.gpu_memory_gib, else slurm.gpu_name's."""
    from ..predict.memory import capacity_gib

    return capacity_gib(sweep.resources.gpu_memory_gib, sweep.resources.gpu_name)


def without_predicted_oom(sweep: Sweep, log: Callable[[str], None]) -> Sweep:
    """`submit --skip-predicted-oom`: the sweep less the cells predicted not to fit, each named."""
    from ..predict.memory import predict_cells

    capacity = capacity_of(sweep)
    if capacity is None:
        raise SpecError(
            sweep.source,
            "slurm.gpu_memory_gib",
            "--skip-predicted-oom needs the GPU's memory: set slurm.gpu_memory_gib or slurm.gpu_name",
        )
    oom = {
        row.cell_id: row
        for row in predict_cells(sweep.cells, capacity, sweep.resources.cache_dir or None)
        if row.fit == "oom"
    }
    for row in oom.values():
        needed = f"{row.prediction.required_gib:.1f}" if row.prediction else "?"
        log(
            f"skipping {row.cell_id}: predicted {needed} GiB per GPU of {capacity:g} GiB "
            f"(--skip-predicted-oom; `hpcfsdp plan --memory` shows why)"
        )
    kept = tuple(cell for cell in sweep.cells if cell.id not in oom)
    if not kept:
        raise SpecError(sweep.source, "", f"every cell is predicted not to fit in {capacity:g} GiB: nothing to submit")
    return dataclasses.replace(sweep, cells=kept)
