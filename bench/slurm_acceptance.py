"""GPU cells under real Slurm (issue 42), on a local cluster of the host's GPUs (slurm/local/start.sh
with HPCFSDP_SLURM_GPUS=host: two nodes on one host, each with its share of the GPUs);
bench/gpu_slurm_acceptance.sh starts the cluster and runs the parts it is given.

  seed:      the seed's question through `hpcfsdp submit` with the Slurm executor: one array of cells of
             1 node x 2 GPUs, two running at once (array_parallelism 2), Qwen2.5-1.5B at seq 4096,
             ZeRO-2 / ZeRO-3 / FSDP1 at a batch that fits and one that does not, one `batch_size: auto`
             cell, `--then-collect`; `status --watch` until the arrays end and `logs CELL --stderr` of a
             cell out of memory. From the records: each cell's ranks on distinct GPUs, and no two cells
             that ran at once on a common GPU.
  multinode: cells of 2 nodes x 2 GPUs through srun (fsdp2_hsdp: shard in the node, replicate across;
             fsdp2_zero3 across both), and the same cells on 1 node x 4 GPUs under torchrun: the losses
             agree (the mean of the last 5 steps within LOSS_AGREEMENT, under the 1.23% two bf16 seeds
             differ by, docs/levers.md), and the records place the ranks on 2 nodes and 4 GPUs.
  faults:    one fault on rank 3 (the second node) of a 2-node cell each: out of memory, an error, SIGKILL,
             SIGSTOP, a hang, Slurm's time limit (time_min 1), a preemption with requeue. Each ends with
             its status and failing rank, soon after its fault; the cell after it runs; nothing is left
             on a GPU. Then `submit --retry-failed` reruns the failed cells without the fault: ok.
  daytoday:  `cancel --pending-only` on an array of which one cell runs, and `tune` with the Slurm
             executor and --probes-per-job.
  scaling:   the FSDP2 blog's 1 -> 2 -> 4 GPU table (bench/jobs/scaling_slurm.yaml; the models of
             SLURM_ACCEPTANCE_SCALING_MODELS only, where set: one model fits a call) through Slurm and
             collect: the report's Scaling section and plot.
  table:     acceptance.md from the parts' rows.

Smoke mode (SLURM_ACCEPTANCE_SMOKE=1): the tiny model on CPU processes, on the local cluster's stand-in
GPUs (no FSDP1; out of memory from the fault hook), to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from acceptance import gpu_pids  # bench/acceptance.py: the GPU processes nvidia-smi lists

LOSS_AGREEMENT = 0.01  # relative, the mean of the last 5 steps: under two bf16 seeds' 1.23%
# GPUs per node of the cluster: 2 on a 4-GPU host (2 x 2), 1 in the reduced form on 2 GPUs (2 x 1)
PER_NODE = int(os.environ.get("SLURM_ACCEPTANCE_GPUS_PER_NODE", "2"))
FAULT_RANK = 2 * PER_NODE - 1  # the last rank: on the second node of a 2-node cell
FAULT_END_S = 45  # from the fault to the record (a hang: past its train_timeout_s too)
TRAIN_TIMEOUT_S = 15


def smoke() -> bool:
    return os.environ.get("SLURM_ACCEPTANCE_SMOKE") == "1"


def base(model: str = "qwen2.5-1.5b", seq_len: int = 4096) -> dict:
    if smoke():
        return {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "comm_profile_steps": 0}
    return {"model": model, "device": "cuda", "precision": "bf16_mixed", "seq_len": seq_len, "comm_profile_steps": 0}


def slurm_section(**more) -> dict:
    gib = 0.0
    if not smoke():
        total = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout.split()[0]
        gib = round(float(total) / 1024, 1)
    return {"time_min": 10, "cpus_per_task": 4, **({"gpu_memory_gib": gib} if gib else {}), **more}


def hpcfsdp(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "hpcfsdp", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(exc.cmd, 124, out, f"timed out after {timeout} s")


def keep(out: Path, name: str, proc: subprocess.CompletedProcess) -> None:
    (out / f"{name}.log").write_text(
        f"$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def records(sweep_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((sweep_dir / "cells").glob("*/result.json"))]


def gpus_of(record: dict) -> list[str]:
    """Each rank's GPU as its record names it (UUID, else PCI bus id); [] where the record has none."""
    return [r.get("gpu_uuid") or r.get("gpu_bus_id") or "" for r in record.get("ranks", [])]


def hosts_of(record: dict) -> set[str]:
    return {r.get("host", "") for r in record.get("ranks", [])}


def span(record: dict) -> tuple[float, float]:
    """From the launch's start to the record's write. `started_at` is the cell's own start, after
    the launcher's start and the imports; `duration_s` runs from it to the write, `launch_span_s`
    from the launcher's start to the write. (started_at + launch_span_s, as this read before,
    lies the launcher's start and the imports past the write: on 4 x H200 it made two cells that
    ran one after the other on the same GPUs look as if they overlapped by 0.15 s and 0.9 s.)"""
    written = float(record.get("started_at") or 0) + float(record.get("duration_s") or 0)
    return written - float(record.get("launch_span_s") or record.get("duration_s") or 0), written


def row(part: str, check: str, result: object, passed: bool) -> dict:
    line = {"part": part, "check": check, "result": result, "pass": bool(passed)}
    print(f"[slurm-acceptance] {json.dumps(line, default=str)}", flush=True)
    return line


def wait_until(done: Callable[[], bool], limit_s: float, every_s: float = 2) -> float:
    """Seconds until done() is true, polled every every_s, or limit_s has passed."""
    started = time.time()
    while not done() and time.time() - started < limit_s:
        time.sleep(every_s)
    return time.time() - started


def wait_for(sweep_dir: Path, count: int, limit_s: float) -> float:
    """Seconds until `count` cells have a record (or limit_s)."""
    return wait_until(lambda: len(list((sweep_dir / "cells").glob("*/result.json"))) >= count, limit_s)


def placement_rows(part: str, recs: list[dict]) -> list[dict]:
    """Each cell's ranks on GPUs of their own, and no two cells that ran at once on a common GPU."""
    if smoke():
        return [row(part, "ranks in the records", sum(len(r.get("ranks", [])) for r in recs), True)]
    own = all(
        len(set(gpus_of(r))) == len(gpus_of(r)) == r["spec"]["nodes"] * r["spec"]["gpus_per_node"]
        for r in recs
        if r.get("ranks")
    )
    overlapping, shared = 0, []
    for i, a in enumerate(recs):
        for b in recs[i + 1 :]:
            (a0, a1), (b0, b1) = span(a), span(b)
            if a0 < b1 and b0 < a1:
                overlapping += 1
                common = set(gpus_of(a)) & set(gpus_of(b)) - {""}
                if common:
                    shared.append((a["cell_id"], b["cell_id"], sorted(common)))
    with_ranks = sum(1 for r in recs if r.get("ranks"))
    return [
        row(part, "cells whose record names each rank's GPU", f"{with_ranks} of {len(recs)}", with_ranks == len(recs)),
        row(part, "each cell's ranks on GPUs of their own", own, own and with_ranks == len(recs)),
        row(
            part,
            "pairs of cells that ran at once / on a common GPU",
            f"{overlapping} / {len(shared)} {shared}",
            overlapping > 0 and not shared,
        ),
    ]


def run_seed(work: Path, out: Path) -> list[dict]:
    oom_batch = 4 if smoke() else 16
    strategies = ["fsdp2_zero2", "fsdp2_zero3"] + ([] if smoke() else ["fsdp1_full_shard"])
    jobs = {
        "name": "seed",
        "base": {**base(), "nodes": 1, "gpus_per_node": PER_NODE, "steps": 12, "warmup_steps": 2},
        "slurm": slurm_section(array_parallelism=2),
        "matrix": {"strategy": strategies, "batch_size": [2, oom_batch]},
        "include": [{"strategy": "fsdp2_zero2", "batch_size": "auto", "max_batch_size": 8}],
    }
    env = {"HPCFSDP_FAULT": "train_step:oom>3"} if smoke() else {}
    (work / "seed.yaml").write_text(yaml.safe_dump(jobs))
    sweep = work / "seed_results" / "seed"
    started = time.time()
    submit = hpcfsdp(
        "submit",
        str(work / "seed.yaml"),
        "--results-dir",
        str(work / "seed_results"),
        "--then-collect",
        env=env,
        timeout=120,
    )
    keep(out, "seed_submit", submit)
    watch = hpcfsdp("status", str(sweep), "--watch", "5", timeout=480)
    wall = time.time() - started
    keep(out, "seed_status_watch", watch)
    collect_job = sweep / "collect_job.json"
    wait_until(
        lambda: (json.loads(collect_job.read_text()) if collect_job.exists() else {}).get("exit_status") is not None,
        120,
    )
    recs = records(sweep)
    cells = len(list((sweep / "cells").iterdir())) if (sweep / "cells").exists() else 0
    statuses = {r["cell_id"]: r["status"] for r in recs}
    oom_cells = [c for c, s in statuses.items() if f"-b{oom_batch}-" in c]
    auto = [r for r in recs if r.get("spec", {}).get("auto_batch")]
    logs = hpcfsdp("logs", str(sweep), oom_cells[0], "--stderr", timeout=60) if oom_cells else None
    if logs:
        keep(out, "seed_logs_stderr", logs)
    report = sweep / "report" / "summary.md"
    rows = [
        row(
            "seed",
            "cells recorded (of cells)",
            f"{len(recs)} of {cells}",
            cells == len(strategies) * 2 + 1 == len(recs),
        ),
        row(
            "seed",
            "status per cell",
            statuses,
            all(s == ("oom" if c in oom_cells else "ok") for c, s in statuses.items()),
        ),
        row(
            "seed",
            "batch_size: auto measured (probes)",
            [(p["batch_size"], p["status"]) for a in auto for p in a.get("batch_search", {}).get("probes", [])],
            bool(auto) and auto[0]["status"] == "ok",
        ),
        row(
            "seed",
            "status --watch exit (4 while running ends in 3: some cells oom)",
            watch.returncode,
            watch.returncode == 3,
        ),
        row(
            "seed",
            "logs CELL --stderr of an oom cell names the OOM",
            logs.returncode if logs else "no oom cell",
            bool(logs)
            and logs.returncode == 0
            and "out of memory" in (logs.stdout + logs.stderr).replace("-", " ").lower(),
        ),
        row(
            "seed",
            "--then-collect: collect job's exit, report written",
            (json.loads(collect_job.read_text()) if collect_job.exists() else {}).get("exit_status"),
            collect_job.exists() and report.exists(),
        ),
        row("seed", "wall time, s (submit to the last record)", round(wall), wall < 540),
        *placement_rows("seed", recs),
    ]
    if report.exists():
        (out / "seed_summary.md").write_text(report.read_text())
    return rows


def run_multinode(work: Path, out: Path) -> list[dict]:
    steps = 20
    common = {**base(seq_len=2048), "batch_size": 2, "steps": steps, "warmup_steps": 2, "seed": 1234}
    strategies = ["fsdp2_hsdp", "fsdp2_zero3"]
    two_nodes = {
        "name": "twonodes",
        "base": {**common, "nodes": 2, "gpus_per_node": PER_NODE},
        "slurm": slurm_section(),
        "matrix": {"strategy": strategies},
    }
    one_node = {
        "name": "onenode",
        "base": {**common, "nodes": 1, "gpus_per_node": 2 * PER_NODE},
        "slurm": slurm_section(),
        "matrix": {"strategy": strategies},
    }
    (work / "twonodes.yaml").write_text(yaml.safe_dump(two_nodes))
    (work / "onenode.yaml").write_text(yaml.safe_dump(one_node))
    started = time.time()
    slurm = hpcfsdp("submit", str(work / "twonodes.yaml"), "--results-dir", str(work / "multi"), "--wait", timeout=420)
    keep(out, "multinode_submit", slurm)
    slurm_s = time.time() - started
    local = hpcfsdp(
        "submit",
        str(work / "onenode.yaml"),
        "--results-dir",
        str(work / "multi"),
        "--executor",
        "local",
        env={"CUDA_VISIBLE_DEVICES": os.environ["SLURM_ACCEPTANCE_HOST_GPUS"]}
        if os.environ.get("SLURM_ACCEPTANCE_HOST_GPUS")
        else None,
        timeout=420,
    )
    keep(out, "onenode_local_submit", local)
    by_strategy = {r["spec"]["strategy"]: r for r in records(work / "multi" / "twonodes")}
    reference = {r["spec"]["strategy"]: r for r in records(work / "multi" / "onenode")}
    rows = [
        row(
            "multinode",
            "2-node cells ok (wall, s)",
            ({s: r["status"] for s, r in by_strategy.items()}, round(slurm_s)),
            len(by_strategy) == 2 and all(r["status"] == "ok" for r in by_strategy.values()),
        )
    ]
    for strategy in strategies:
        a, b = by_strategy.get(strategy, {}), reference.get(strategy, {})
        la, lb = a.get("losses") or [], b.get("losses") or []
        if len(la) >= 5 and len(la) == len(lb) and None not in la + lb:
            tail_a, tail_b = sum(la[-5:]) / 5, sum(lb[-5:]) / 5
            rel = abs(tail_a - tail_b) / abs(tail_b)
            worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
            rows.append(
                row(
                    "multinode",
                    f"{strategy}: loss 2x2 (srun) vs 1x4 (torchrun), last 5 steps; worst step",
                    f"{tail_a:.4f} vs {tail_b:.4f} ({rel:+.3%}); {worst:.3%}",
                    rel <= LOSS_AGREEMENT,
                )
            )
        else:
            rows.append(row("multinode", f"{strategy}: losses of both", (len(la), len(lb)), False))
        hosts, gpus = hosts_of(a), gpus_of(a)
        rows.append(
            row(
                "multinode",
                f"{strategy}: ranks' hosts / distinct GPUs",
                (sorted(hosts), len(set(gpus) - {""})),
                len(hosts) == 2 and (smoke() or len(set(gpus) - {""}) == 2 * PER_NODE),
            )
        )
        mesh = a.get("mesh") or a.get("mesh_shape")
        if strategy == "fsdp2_hsdp" and mesh is not None:
            rows.append(row("multinode", "fsdp2_hsdp mesh (replicate, shard)", mesh, list(mesh) == [2, PER_NODE]))
    return rows


FAULTS = {  # name: (HPCFSDP_FAULT kind, the status the record must say)
    "oom": ("oom", "oom"),
    "error": ("error", "error"),
    "sigkill": ("sigkill", "error"),
    "sigstop": ("sigstop", "hang"),
    "hang": ("hang", "hang"),
}


PREEMPT_STEPS = 1000  # about 25 s of the tiny model's steps on 2 x 2 H100 (the CPU smoke's cells: 100)


def fault_jobs(name: str, **more) -> dict:
    return {
        "name": name,
        "base": {
            **base(seq_len=256),
            "model": "tiny",
            "nodes": 2,
            "gpus_per_node": PER_NODE,
            "batch_size": 2,
            "steps": more.pop("steps", 30),
            "warmup_steps": 2,
            "train_timeout_s": TRAIN_TIMEOUT_S,
        },
        "slurm": slurm_section(**more),
    }


def fault_time(sweep_dir: Path) -> float | None:
    """When the fault fired, from the rank's log line (cell/stopping/faults.py)."""
    for log in sweep_dir.glob("slurm/**/*"):
        if log.is_file():
            found = re.findall(
                r"\[hpcfsdp\] fault \w+ at \w+ on rank \d+ at ([0-9.]+)", log.read_text(errors="replace")
            )
            if found:
                return float(found[-1])
    return None


def run_faults(work: Path, out: Path) -> list[dict]:
    """SLURM_ACCEPTANCE_FAULTS names a subset (of FAULTS, timelimit, preempt, retry)."""
    wanted = set(
        os.environ.get("SLURM_ACCEPTANCE_FAULTS", " ".join([*FAULTS, "timelimit", "preempt", "retry"])).split()
    )
    faults = {name: fault for name, fault in FAULTS.items() if name in wanted}
    results = work / "faults"
    for name, (kind, _) in faults.items():
        (work / f"{name}.yaml").write_text(yaml.safe_dump(fault_jobs(name, max_requeue=0)))
        sub = hpcfsdp(
            "submit",
            str(work / f"{name}.yaml"),
            "--results-dir",
            str(results),
            env={"HPCFSDP_FAULT": f"train_step:{kind}:{FAULT_RANK}"},
            timeout=120,
        )
        keep(out, f"fault_{name}_submit", sub)
    # Slurm's time limit: time_min 1 and more steps than a minute holds
    (work / "timelimit.yaml").write_text(
        yaml.safe_dump(fault_jobs("timelimit", steps=100000, time_min=1, signal_delay_s=20, max_requeue=0))
    )
    if "timelimit" in wanted:
        keep(
            out,
            "fault_timelimit_submit",
            hpcfsdp("submit", str(work / "timelimit.yaml"), "--results-dir", str(results), timeout=120),
        )
    # A preemption: once the cell runs, a job of partition urgent takes both nodes; the cell is requeued
    # (enough steps that the preemption lands in training: on 2 x 2 H100 the tiny model ran 60 steps in
    # 1.4 s and ended ok before the urgent job was submitted, 2026-11-27)
    (work / "preempt.yaml").write_text(
        yaml.safe_dump(fault_jobs("preempt", steps=100 if smoke() else PREEMPT_STEPS, max_requeue=1))
    )
    if "preempt" in wanted:
        keep(
            out,
            "fault_preempt_submit",
            hpcfsdp("submit", str(work / "preempt.yaml"), "--results-dir", str(results), timeout=120),
        )
    rows = []
    for name, (_, expected) in faults.items():
        sweep = results / name
        wait_for(sweep, 1, 240)
        recs = records(sweep)
        rec = recs[0] if recs else {}
        fired = fault_time(sweep)
        record_at = (sweep / "cells").glob("*/result.json")
        written = max((p.stat().st_mtime for p in record_at), default=None)
        took = written - fired if written and fired else None
        limit = FAULT_END_S + (TRAIN_TIMEOUT_S if expected == "hang" else 0)
        rows.append(
            row(
                "faults",
                f"{name} on rank {FAULT_RANK}: status (expected), failed rank, fault to record s",
                (
                    rec.get("status"),
                    expected,
                    rec.get("failed_rank"),
                    None if took is None else round(took, 1),
                    (rec.get("error") or "")[:120],
                ),
                rec.get("status") == expected
                and rec.get("failed_rank") == FAULT_RANK
                and took is not None
                and took <= limit,
            )
        )
    if "preempt" in wanted:
        rows += preemption_rows(results, out)
    if "timelimit" in wanted:
        wait_for(results / "timelimit", 1, 200)
        tl = (records(results / "timelimit") or [{}])[0]
        rows.append(
            row(
                "faults",
                "Slurm's time limit (time_min 1): status, reason",
                (tl.get("status"), (tl.get("error") or "")[:120]),
                tl.get("status") == "timeout",
            )
        )
    if "retry" in wanted:
        rows += retry_rows(work, results, out, [name for name in ("error", "sigkill") if name in faults])
    left = left_on_gpus()
    rows.append(row("faults", "processes left on a GPU once the jobs left the queue", left, not left))
    return rows


def left_on_gpus() -> list[int]:
    """The processes on the cluster's GPUs once no job of it is queued or running (up to 90 s: a job
    whose record is written still ends its ranks, and Slurm ends what is left after KillWait)."""
    wait_until(lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip(), 90)
    time.sleep(2)  # the driver frees a process's memory as it ends
    return sorted(gpu_pids())


def wait_until_running(job_name: str, limit_s: float) -> None:
    """Wait, polling squeue every 2 s, until a job of this name runs or limit_s has passed."""
    squeue = ["squeue", "-h", "-o", "%T", "-n", job_name]
    wait_until(lambda: "RUNNING" in subprocess.run(squeue, capture_output=True, text=True).stdout, limit_s)


def wait_until_training(sweep_dir: Path, limit_s: float) -> None:
    """Wait until a cell of the sweep reports a training step in its progress.json (or limit_s)."""

    def training() -> bool:
        for progress in sweep_dir.glob("cells/*/progress.json"):
            try:
                found = json.loads(progress.read_text())
            except (OSError, ValueError):
                continue
            if found.get("stage") == "train" and (found.get("step") or 0) >= 1:
                return True
        return False

    wait_until(training, limit_s, every_s=0.5)


def preemption_rows(results: Path, out: Path) -> list[dict]:
    """Wait until the preempt cell runs, then take both nodes from partition urgent: the cell is
    requeued, runs again and ends ok, its preempted record kept in attempts/."""
    sweep = results / "preempt"
    wait_until_running("hpcfsdp-preempt", 300)
    wait_until_training(sweep, 120)
    urgent = subprocess.run(
        [
            "sbatch",
            "-p",
            "urgent",
            "-N",
            "2",
            f"--gres=gpu:{PER_NODE}",
            "-J",
            "urgent",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 5",
        ],
        capture_output=True,
        text=True,
    )
    (out / "fault_preempt_urgent.log").write_text(urgent.stdout + urgent.stderr)
    wait_until(lambda: any(r["status"] == "ok" for r in records(sweep)), 240, every_s=3)
    pre = (records(sweep) or [{}])[0]
    attempts = [json.loads(p.read_text()).get("status") for p in sweep.glob("cells/*/attempts/*.json")]
    return [
        row(
            "faults",
            "preempted, requeued: final status, earlier attempts",
            (pre.get("status"), attempts),
            pre.get("status") == "ok" and "preempted" in attempts,
        )
    ]


def retry_rows(work: Path, results: Path, out: Path, names: list[str]) -> list[dict]:
    """The failed cells again, without the fault: `submit --retry-failed` ends them ok."""
    retried = []
    for name in names:
        retry = hpcfsdp(
            "submit", str(work / f"{name}.yaml"), "--results-dir", str(results), "--retry-failed", "--wait", timeout=240
        )
        keep(out, f"fault_{name}_retry", retry)
        retried.append((name, retry.returncode, [r["status"] for r in records(results / name)]))
    return [
        row(
            "faults",
            "submit --retry-failed without the fault: exit, status",
            retried,
            all(code == 0 and statuses == ["ok"] for _, code, statuses in retried),
        )
    ]


def run_daytoday(work: Path, out: Path) -> list[dict]:
    jobs = {
        "name": "queued",
        "base": {
            **base(seq_len=256),
            "model": "tiny",
            "nodes": 1,
            "gpus_per_node": PER_NODE,
            "steps": 400,
            "warmup_steps": 2,
        },
        "slurm": slurm_section(array_parallelism=1),
        "matrix": {"batch_size": [1, 2, 3]},
    }
    (work / "queued.yaml").write_text(yaml.safe_dump(jobs))
    sweep = work / "day" / "queued"
    keep(out, "day_submit", hpcfsdp("submit", str(work / "queued.yaml"), "--results-dir", str(work / "day")))
    wait_until_running("hpcfsdp-queued", 120)
    cancel = hpcfsdp("cancel", str(sweep), "--pending-only", timeout=60)
    keep(out, "day_cancel_pending", cancel)
    time.sleep(5)
    status = hpcfsdp("status", str(sweep), "--json", timeout=60)
    keep(out, "day_status", status)
    try:
        states = sorted(str(c.get("status")) for c in json.loads(status.stdout).get("cells", []))
    except (json.JSONDecodeError, AttributeError):
        states = []
    rows = [
        row(
            "daytoday",
            "cancel --pending-only: cell states after",
            states,
            states.count("cancelled") == 2 and sum(s in ("running", "ok") for s in states) == 1,
        )
    ]
    hpcfsdp("cancel", str(sweep), timeout=60)
    tune_jobs = {
        "name": "tuned",
        "base": {**base(seq_len=1024), "nodes": 1, "gpus_per_node": PER_NODE, "steps": 12, "warmup_steps": 2},
        "slurm": slurm_section(),
        "matrix": {"strategy": ["ddp", "fsdp2_zero2", "fsdp2_zero3"], "batch_size": [1, 2]},
    }
    if not smoke():
        tune_jobs["base"]["model"] = "tiny"
    (work / "tuned.yaml").write_text(yaml.safe_dump(tune_jobs))
    started = time.time()
    tune = hpcfsdp(
        "tune",
        str(work / "tuned.yaml"),
        "--results-dir",
        str(work / "day"),
        "--executor",
        "slurm",
        "--probes-per-job",
        "3",
        timeout=420,
    )
    keep(out, "day_tune", tune)
    tuned = work / "day" / "tuned" / "tune.json"
    best = json.loads(tuned.read_text()).get("best", {}) if tuned.exists() else {}
    rows.append(
        row(
            "daytoday",
            "tune --executor slurm --probes-per-job 3: exit, pick, wall s",
            (tune.returncode, best.get("cell_id"), round(time.time() - started)),
            tune.returncode == 0 and bool(best.get("cell_id")),
        )
    )
    return rows


def run_scaling(work: Path, out: Path) -> list[dict]:
    """bench/jobs/scaling_slurm.yaml through the Slurm executor, then collect: the report's Scaling
    section and plot (smoke: the tiny model on CPU processes)."""
    jobs = yaml.safe_load(Path("bench/jobs/scaling_slurm.yaml").read_text())
    if models := os.environ.get("SLURM_ACCEPTANCE_SCALING_MODELS", "").split():  # one model a call
        jobs["matrix"]["model"] = models
        jobs["include"] = [cell for cell in jobs["include"] if cell["model"] in models]
    jobs["base"] |= json.loads(os.environ.get("SLURM_ACCEPTANCE_SCALING_BASE") or "{}")  # e.g. checkpointing
    if smoke():
        jobs["base"] |= base()
        jobs["matrix"]["model"] = ["tiny"]
        jobs["include"] = [{**cell, "model": "tiny"} for cell in jobs["include"][:1]]
    jobs["slurm"] = slurm_section(**jobs.get("slurm", {}))
    (work / "scaling.yaml").write_text(yaml.safe_dump(jobs))
    started = time.time()
    submit = hpcfsdp(
        "submit", str(work / "scaling.yaml"), "--results-dir", str(work / "results"), "--wait", timeout=560
    )
    keep(out, "scaling_submit", submit)
    sweep = work / "results" / jobs["name"]
    recs = records(sweep)
    summary = sweep / "report" / "summary.md"
    text = summary.read_text() if summary.exists() else ""
    scaling = text[text.find("## Scaling") :].split("\n## ")[0] if "## Scaling" in text else ""
    (out / "scaling_section.md").write_text(scaling)
    if (sweep / "report" / "plots" / "scaling.png").exists():
        (out / "scaling.png").write_bytes((sweep / "report" / "plots" / "scaling.png").read_bytes())
    return [
        row(
            "scaling",
            "cells recorded, ok (wall s)",
            (len(recs), sum(r["status"] == "ok" for r in recs), round(time.time() - started)),
            bool(recs) and len(recs) == len(list((sweep / "cells").iterdir())),
        ),
        row("scaling", "the report's Scaling section rows", scaling.count("\n| ") - 1, scaling.count("\n| ") > 2),
    ]


def table(out: Path) -> str:
    lines = ["| part | check | result | verdict |", "|---|---|---|---|"]
    for part in PARTS:
        path = out / f"{part}.json"
        if not path.exists():
            continue
        for r in json.loads(path.read_text()):
            result = json.dumps(r["result"], default=str).replace("|", "/")
            lines.append(f"| {r['part']} | {r['check']} | {result[:300]} | {'pass' if r['pass'] else 'FAIL'} |")
    text = "\n".join(lines) + "\n"
    (out / "slurm_acceptance.md").write_text(text)
    return text


PARTS = {
    "seed": run_seed,
    "multinode": run_multinode,
    "faults": run_faults,
    "daytoday": run_daytoday,
    "scaling": run_scaling,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "table"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part == "table":
        print(table(args.out))
        return
    rows = PARTS[args.part](args.work, args.out)
    (args.out / f"{args.part}.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
