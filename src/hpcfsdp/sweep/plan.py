"""`hpcfsdp plan`: a sweep's cells, arrays, predicted memory and sbatch scripts, before anything is
submitted; and `submit --skip-predicted-oom`, which leaves out the cells `plan --memory` flags."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from ..fields import SpecError, field_names
from ..spec import RunSpec
from .cluster import array_size_limit
from .matrix import Cell, Sweep, arrays, plain_value

# Always shown by plan; any other RunSpec field gets a column when its value varies across the sweep.
PLAN_FIELDS = ("strategy", "batch_size", "grad_accum", "activation_checkpointing", "nodes", "gpus_per_node")


def print_plan(sweep: Sweep, memory: bool = False) -> int:
    """The cell table (or, with memory, the memory table), the arrays, the GPU-hours bound; then
    one `error:` line per cache miss or shape the partition cannot run (exit status 2)."""
    from ..cache.plan import cache_misses
    from .preflight import cluster_problems

    res = sweep.resources
    size = array_size_limit(res.max_array_size, res.clusters)
    planned = arrays(sweep.cells, size)
    where = f" on cluster {res.clusters}" if res.clusters else ""
    print(f"{sweep.name}: {len(sweep.cells)} cell(s) in {len(planned)} array(s){where}")
    sys.stdout.write("\n".join(memory_table(sweep) if memory else plan_table(sweep, planned)) + "\n")
    for index, ((nodes, gpus), cells) in enumerate(planned):
        print(f"array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s)")
    if len(planned) > len(sweep.groups()):
        limit = "slurm.max_array_size" if size == res.max_array_size else "the cluster's MaxArraySize"
        print(f"(an array holds at most {size} cells: {limit})")
    runs = 1 + res.max_requeue  # every requeue may use a whole time limit again
    gpu_hours = sum(c.spec.world_size for c in sweep.cells) * res.time_min * runs / 60
    requeues = f", {res.max_requeue} requeue(s)" if res.max_requeue else ""
    print(f"upper bound: {gpu_hours:.1f} GPU-hours at a {res.time_min} min limit per cell{requeues}")
    if res.pass_env:
        print(
            f"note: slurm.pass_env: {', '.join(res.pass_env)} go to the Slurm jobs as set where you submit, "
            "and slurmctld saves their values with each job (its state folder, read by the cluster's administrators)"
        )
    problems = cache_misses(sweep, res.cache_dir or None) + cluster_problems(sweep)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def print_sbatch_scripts(sweep: Sweep, results_dir: Path) -> int:
    """`plan --sbatch`: the script of each array, as submit would write it (the sweep id, its jobs'
    comment, once the folder has one: layout.folder_uid)."""
    from .layout import folder_uid
    from .sbatch import sbatch_script

    sweep_dir = results_dir / sweep.name
    uid = folder_uid(sweep_dir) if (sweep_dir / "manifest.json").is_file() else ""

    for index, ((nodes, gpus), cells) in enumerate(
        arrays(sweep.cells, array_size_limit(sweep.resources.max_array_size, sweep.resources.clusters))
    ):
        print(f"# ===== array {index}: {len(cells)} cell(s) on {nodes} node(s) x {gpus} GPU(s) =====")
        print(sbatch_script(sweep, sweep_dir, nodes, gpus, len(cells), uid))
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
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>5} {'accum':>5} {'ckpt':>9} {'nodes x gpus':>12} {'array':>5}"
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
    """`plan --memory`: the predicted memory of every cell, GiB per GPU (sweep/memory.py), and its
    host memory per node (sweep/hostmemory.py)."""
    from .hostmemory import predict_host_cells
    from .memory import RUNTIME_RESERVE_GIB, predict_cells, usable_gib

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


def capacity_of(sweep: Sweep) -> float | None:
    """The GPU memory, GiB, the sweep's cells get: slurm.gpu_memory_gib, else slurm.gpu_name's."""
    from .memory import capacity_gib

    return capacity_gib(sweep.resources.gpu_memory_gib, sweep.resources.gpu_name)


def without_predicted_oom(sweep: Sweep, log: Callable[[str], None]) -> Sweep:
    """`submit --skip-predicted-oom`: the sweep less the cells predicted not to fit, each named."""
    from .memory import predict_cells

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
