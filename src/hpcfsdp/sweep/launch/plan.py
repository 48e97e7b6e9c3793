"""`hpcfsdp plan`: a sweep's cells, arrays, predicted memory and sbatch scripts, before anything is
submitted; and `submit --skip-predicted-oom`, which leaves out the cells `plan --memory` flags."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...contracts.fields import SpecError
from ...contracts.gpus import GPU_WORDS
from ...contracts.strategies import STRATEGIES
from ..define.matrix import (
    Cell,
    Sweep,
    arrays,
    cells_on_shape,
    cells_rank_words,
    column_texts,
    packed,
    varying_columns,
)
from ..track.cluster import array_size_limit
from .environment import fault_hook_warning, sbatch_from_shell, sbatch_note, slurm_clients_dropped

if TYPE_CHECKING:
    from ..predict.memory import CellPrediction
# Always shown by plan; any other RunSpec field gets a column when its value varies across the sweep.
# What plan could not check where no Slurm answered (preflight.py).
SKIPPED_CHECKS = (
    "the partition, QOS, host-memory and sbatch --test-only checks were skipped; "
    "plan on a machine whose Slurm answers runs them"
)
SBATCH_EXAMPLE = "slurm/fsdp_job.sbatch"  # the plain sbatch script, for a run without submitit (docs/submit.md)
PLAN_FIELDS = ("strategy", "batch_size", "grad_accum", "activation_checkpointing", "nodes", "gpus_per_node")


def print_plan(sweep: Sweep, memory: bool = False) -> int:
    """The cell table (or, with memory, the memory table), the arrays, the GPU-hours bound; then
    one `error:` line per cache miss or shape the partition cannot run (exit status 2)."""
    res = sweep.resources
    size = array_size_limit(res.max_array_size, res.clusters)
    planned = arrays(sweep.cells, size, res.cells_per_task)
    where = f" on cluster {res.clusters}" if res.clusters else ""
    print(f"{sweep.name}: {len(sweep.cells)} cell(s) in {len(planned)} array(s){where}")
    sys.stdout.write("\n".join(memory_table(sweep) if memory else plan_table(sweep, planned)) + "\n")
    for index, ((nodes, gpus), cells) in enumerate(planned):
        per_task = min(packed(nodes, res.cells_per_task), len(cells))
        tasks = f", {per_task} per task: {-(-len(cells) // per_task)} task(s) of {per_task * res.time_min} min"
        print(f"array {index}: {cells_on_shape(cells, nodes, gpus)}{tasks if per_task > 1 else ''}")
    if len(planned) > len(sweep.groups()):
        limit = "slurm.max_array_size" if size == res.max_array_size else "the cluster's MaxArraySize"
        print(f"(an array holds at most {size} {'tasks' if res.cells_per_task > 1 else 'cells'}: {limit})")
    requeues = f", {res.max_requeue} requeue(s)" if res.max_requeue else ""
    print(
        f"upper bound: {rank_hours(sweep):.1f} {cells_rank_words(sweep.cells).hours} at a {res.time_min} min limit "
        f"per cell{requeues}"
    )
    for note in single_replica_notes(sweep.cells):
        print(note)
    if res.pass_env:
        print(
            f"note: slurm.pass_env: {', '.join(res.pass_env)} go to the Slurm jobs as set where you submit, "
            "and slurmctld saves their values with each job (its state folder, read by the cluster's administrators)"
        )
    if note := sbatch_note(sweep):
        print(note)
    if warning := fault_hook_warning():
        print(warning)
    return print_problems(problems_noted(sweep))


def single_replica_notes(cells: tuple[Cell, ...]) -> list[str]:
    """A note per hybrid strategy whose cells shard across all their ranks (one node, no smaller
    hsdp_shard_size): one replica, so no hybrid at all, the non-hybrid strategy under another name."""
    specs = [cell.spec for cell in cells]
    alike = Counter(
        spec.strategy
        for spec in specs
        if spec.strategy_info.hybrid and (spec.hsdp_shard_size or spec.gpus_per_node) == spec.world_size
    )
    return [
        f"note: {count} {strategy} cell(s) shard over all their ranks (one shard group, one replica): that is "
        f"{STRATEGIES[strategy].single_replica} under another name; a hybrid needs nodes >= 2 or an "
        "hsdp_shard_size below the ranks"
        for strategy, count in alike.items()
    ]


def print_problems(problems: list[str]) -> int:
    """One `error:` line per problem on stderr; the exit status: 2 when there is one (docs/submit.md)."""
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


def problems_noted(sweep: Sweep) -> list[str]:
    """plan_problems, with a `note:` line on stderr for the cluster's checks that could not run."""
    skipped: list[str] = []
    problems = plan_problems(sweep, skipped)
    for reason in skipped:
        print(f"note: {reason}: {SKIPPED_CHECKS}", file=sys.stderr)
    return problems


def plan_document(sweep: Sweep, memory: bool = False) -> dict:
    """`plan --json`: every cell (its array and spec; with memory, its predicted memory), the
    arrays, the bound and the problems, with the exit status print_plan would give."""
    res = sweep.resources
    planned = arrays(sweep.cells, array_size_limit(res.max_array_size, res.clusters), res.cells_per_task)
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
            {
                "array": index,
                "nodes": nodes,
                "ranks_per_node": ranks,
                "rank": cells_rank_words(members).one,
                "cells": len(members),
            }
            for index, ((nodes, ranks), members) in enumerate(planned)
        ],
        "upper_bound_hours": rank_hours(sweep),
        "hours_of": cells_rank_words(sweep.cells).one,
        "time_min": res.time_min,
        "max_requeue": res.max_requeue,
        "problems": problems,
        "sbatch_from_shell": sbatch_from_shell(sweep),  # the shell's SBATCH_* variables that reach sbatch
        "not_to_the_jobs": slurm_clients_dropped(sweep),  # the shell's SLURM_*, SRUN_*, SALLOC_* left out
        "cluster_checks_skipped": "; ".join(f"{reason}: {SKIPPED_CHECKS}" for reason in skipped),
    }


def refused_document(problem: str, exit_status: int) -> dict:
    """`plan --json` of a jobs YAML that was refused (unreadable, a bad key or value): the same
    keys as plan_document's, no cells, and the refusal as its one problem."""
    return {
        "sweep": "",
        "cluster": "",
        "exit_status": exit_status,
        "cells": [],
        "arrays": [],
        "upper_bound_hours": 0.0,
        "hours_of": "GPU",
        "time_min": 0,
        "max_requeue": 0,
        "problems": [problem],
        "sbatch_from_shell": {},
        "not_to_the_jobs": [],
        "cluster_checks_skipped": "",
    }


def print_sbatch_scripts(sweep: Sweep, results_dir: Path) -> int:
    """`plan --sbatch`: the script of each array, as submit would write it (the sweep id, its jobs'
    comment, once the folder has one: layout.folder_uid); none, with plan's error lines and exit
    status, for a sweep that plan refuses."""
    from ...cache.plan import cache_misses
    from ..folder.layout import folder_uid
    from .local import srun_command
    from .preflight import cluster_problems
    from .sbatch import sbatch_script

    # What `plan` refuses, --sbatch does too (no script of a sweep that cannot run), but a cache miss:
    # the script needs no weights, so it can be read before a download.
    skipped: list[str] = []
    if problems := cluster_problems(sweep, skipped=skipped):
        return print_problems(problems)
    for reason in skipped:
        print(f"note: {reason}: {SKIPPED_CHECKS}", file=sys.stderr)
    for miss in cache_misses(sweep, sweep.resources.cache_dir or None):
        print(
            f"note: {miss} (the scripts need it only when they run: submit refuses until it is cached)", file=sys.stderr
        )
    sweep_dir = results_dir / sweep.name
    uid = folder_uid(sweep_dir) if (sweep_dir / "manifest.json").is_file() else ""

    for index, ((nodes, gpus), cells) in enumerate(
        arrays(
            sweep.cells,
            array_size_limit(sweep.resources.max_array_size, sweep.resources.clusters),
            sweep.resources.cells_per_task,
        )
    ):
        print(f"# ===== array {index}: {cells_on_shape(cells, nodes, gpus)} =====")
        print(sbatch_script(sweep, sweep_dir, nodes, gpus, len(cells), uid, [cell.id for cell in cells]))
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
    extra_header, extra = column_texts(varying_columns([c.spec.to_dict() for c in cells], PLAN_FIELDS), len(cells))
    id_width = max(4, *(len(c.id) for c in cells))
    shape = "nodes x gpus" if cells_rank_words(cells) == GPU_WORDS else "nodes x procs"
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>5} {'accum':>5} {'ckpt':>9} {shape:>12} {'array':>5}"
        + extra_header
    ]
    for row, cell in enumerate(cells):
        s = cell.spec
        lines.append(
            f"{cell.id:{id_width}} {s.strategy:19} {s.batch_size:5} {s.grad_accum:5} {s.activation_checkpointing:>9} "
            f"{f'{s.nodes} x {s.gpus_per_node}':>12} {array_of[cell.id]:5}" + extra[row]
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
    # Then the fields that tell cells apart beyond these (optimizer_order, cpu_offload, nodes, ...)
    shown = ("strategy", "batch_size", "activation_checkpointing", "seq_len")
    extra_header, extra = column_texts(varying_columns([r.spec.to_dict() for r in rows], shown), len(rows))
    lines = [
        f"{'cell':{id_width}} {'strategy':19} {'batch':>9} {'ckpt':>9} {'seq':>6}{extra_header} {'states':>7} "
        f"{'gathered':>8} {'activ.':>7} {'loss':>7} {'peak GiB':>8} {'peak at':>9} {'host/node':>9} fit"
    ]
    for index, row in enumerate(rows):
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
            f"{row.cell_id:{id_width}} {s.strategy:19} {batch:>9} {s.activation_checkpointing:>9} {s.seq_len:6}"
            f"{extra[index]} {figures} {f'{host.node_gib:9.2f}' if host else '-':>9} {fit}"
            + (f"  ({'not predicted: see below' if p is None else row.note})" if row.note else "")
        )
    lines.append("host/node: predicted host memory (RAM) per node, GiB; preflight compares it with slurm.mem_gb")
    unpredicted = [row for row in rows if row.prediction is None]
    if capacity is None:
        lines.append("GPU memory unknown: set slurm.gpu_memory_gib or slurm.gpu_name to flag cells that do not fit")
    elif len(unpredicted) < len(rows):
        of = f" of the {len(rows) - len(unpredicted)} predicted" if unpredicted else ""
        lines.append(
            f"GPU memory {capacity:g} GiB, {usable_gib(capacity):g} usable after a {RUNTIME_RESERVE_GIB:g} GiB "
            f"runtime reserve: {sum(r.fit == 'oom' for r in rows)} cell(s){of} predicted not to fit, "
            f"{sum(r.fit == 'tight' for r in rows)} tight (above 90%)"
        )
    if unpredicted:  # never a verdict over rows it could not predict
        why = "; ".join(dict.fromkeys(row.note for row in unpredicted))
        lines.append(f"{len(unpredicted)} cell(s) not predicted, so not known to fit: {why}")
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


def predicted_oom(sweep: Sweep, capacity: float) -> dict[str, CellPrediction]:
    """cell id -> its memory row, of the cells `plan --memory` predicts not to fit in capacity GiB."""
    from ..predict.memory import predict_cells

    rows = predict_cells(sweep.cells, capacity, sweep.resources.cache_dir or None)
    return {row.cell_id: row for row in rows if row.fit == "oom"}


def predicted_oom_warning(sweep: Sweep) -> str:
    """`submit` without --skip-predicted-oom: a warning naming how many cells are predicted not to
    fit and the GPU-hours they may hold, and how to leave them out; "" when none is (or the GPU's
    memory is not known)."""
    capacity = capacity_of(sweep)
    oom = predicted_oom(sweep, capacity) if capacity is not None else {}
    if not oom:
        return ""
    doomed = dataclasses.replace(sweep, cells=tuple(cell for cell in sweep.cells if cell.id in oom))
    return (
        f"warning: {len(oom)} cell(s) predicted not to fit in {capacity:g} GiB per GPU (`hpcfsdp plan --memory` "
        f"shows why), up to {rank_hours(doomed):.1f} {cells_rank_words(doomed.cells).hours} at their time limit; "
        "--skip-predicted-oom leaves them out"
    )


def without_predicted_oom(sweep: Sweep, log: Callable[[str], None]) -> Sweep:
    """`submit --skip-predicted-oom`: the sweep less the cells predicted not to fit, each named."""
    capacity = capacity_of(sweep)
    if capacity is None:
        raise SpecError(
            sweep.source,
            "slurm.gpu_memory_gib",
            "--skip-predicted-oom needs the GPU's memory: set slurm.gpu_memory_gib or slurm.gpu_name",
        )
    oom = predicted_oom(sweep, capacity)
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
