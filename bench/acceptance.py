"""The GPU failure path, shown end to end (issue 32, item 6); bench/gpu_acceptance.sh runs it.

  faults: each fault (oom, error, hang, timeout) on rank 1 under each strategy, and rank 1 killed
          (SIGKILL) or stopped (SIGSTOP) under ddp and fsdp2_zero3, which must be recorded as rank
          1's (its signal named, not a time limit or rank 0's hang), tiny model, one
          torchrun per cell (up to ACCEPTANCE_PARALLEL at once): the status, the time from the
          fault to the cell's end, and the rank processes left afterwards (alive, or holding a GPU
          in nvidia-smi --query-compute-apps). Leftovers are then ended by pid. And `batch_size: auto`
          cells where rank 1 alone runs out of memory above batch 2 (auto_oom; auto_cuda_oom: a
          CUDA error that says so): the search must go on and measure batch 2.
  sweep:  a real sweep of Qwen2.5-1.5B through `hpcfsdp submit --executor local --wait` and
          collect: per strategy a batch that fits and the smallest batch `plan --memory` says will
          not fit this card, and one `batch_size: auto` cell.
  table:  one Markdown table of both (acceptance.md), with the verdict of each row.

Smoke mode (ACCEPTANCE_SMOKE=1) runs the same on 2 CPU processes with the tiny model: no FSDP1,
and out-of-memory comes from the fault hook above batch 3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from hpcfsdp.sweep.launch.local import processes_under

FAULTS = ("oom", "error", "hang", "timeout")
# A signal on rank 1: SIGKILL (what the kernel's OOM killer sends) and SIGSTOP (a rank that stops
# answering), under these strategies; the record must name rank 1, never rank 0 or a time limit.
SIGNAL_FAULTS = ("sigkill", "sigstop")
SIGNAL_STRATEGIES = ("ddp", "fsdp2_zero3")
# batch_size: auto with rank 1 alone out of memory above batch 2 (the allocator's OutOfMemoryError,
# or a CUDA error that says so): the search goes on, and the cell measures batch 2.
SEARCH_FAULTS = {"auto_oom": "oom>2", "auto_cuda_oom": "cuda_oom>2"}
SEARCH_STRATEGIES = {"auto_oom": ("fsdp1_full_shard", "fsdp2_zero3"), "auto_cuda_oom": ("fsdp2_zero2",)}
EXPECTED = {
    "oom": "oom",
    "error": "error",
    "hang": "hang",
    "timeout": "timeout",
    "auto_oom": "ok",
    "auto_cuda_oom": "ok",
    "sigkill": "error",
    "sigstop": "hang",
}
# The signal the record must name (failed_signal) where the rank that wrote it can know it: a stopped
# rank's process says so; a killed one is often reaped before its peer looks (then null, its error
# says it died without a record).
EXPECTED_SIGNAL = {"sigkill": {"SIGKILL", None}, "sigstop": {"SIGSTOP"}}
SEARCH_END_S = 150  # a searching cell: from its last probe's fault to its end (the measured run included)
TRAIN_TIMEOUT_S = 15  # the hang cells' train_timeout_s: a hang is declared this long past the slowest step
FAULT_END_S = 30  # every fault cell must end this soon after its fault (a hang: after its timeout too)
SWEEP_LIMIT_S = 300


def smoke() -> bool:
    return os.environ.get("ACCEPTANCE_SMOKE") == "1"


def strategies() -> list[str]:
    found = ["ddp", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_hsdp"]
    return found if smoke() else ["ddp", "fsdp1_full_shard", *found[1:]]


def cell_fields() -> list[str]:
    device = (
        ["device=cpu", "precision=fp32", "seq_len=32"]
        if smoke()
        else ["device=cuda", "precision=bf16_mixed", "seq_len=256"]
    )
    return [
        "model=tiny",
        *device,
        "batch_size=2",
        "steps=8",
        "warmup_steps=2",
        "comm_profile_steps=0",
        f"train_timeout_s={TRAIN_TIMEOUT_S}",
    ]


def gpu_pids() -> set[int]:
    """The processes on this run's GPUs: ACCEPTANCE_GPUS or CUDA_VISIBLE_DEVICES (nvidia-smi's numbers,
    with CUDA_DEVICE_ORDER=PCI_BUS_ID), else every GPU: runs beside each other on one host (the
    Slurm acceptance on the other GPUs) do not count as left over."""
    if shutil.which("nvidia-smi") is None:
        return set()
    gpus = os.environ.get("ACCEPTANCE_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES", "")
    only = ["-i", gpus] if re.fullmatch(r"\d+(,\d+)*", gpus) else []
    out = subprocess.run(
        ["nvidia-smi", *only, "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class FaultCell:
    def __init__(self, work: Path, strategy: str, fault: str):
        self.strategy, self.fault = strategy, fault
        self.dir = work / f"{strategy}-{fault}"
        self.dir.mkdir(parents=True)
        self.ranks: set[int] = set()
        injected = SEARCH_FAULTS.get(fault, fault)
        env = {**os.environ, "HPCFSDP_FAULT": f"train_step:{injected}:1", "OMP_NUM_THREADS": "1"}
        search = ["batch_size=auto", "max_batch_size=4"] if fault in SEARCH_FAULTS else []
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "hpcfsdp",
            "run",
            "--results-dir",
            str(self.dir / "results"),
            "--sweep",
            "faults",
            *cell_fields(),
            *search,
            f"strategy={strategy}",
        ]
        self.started = time.time()
        with open(self.dir / "log.txt", "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ended: float | None = None

    def poll(self, limit_s: float) -> bool:
        """True once the cell has ended (or was killed at limit_s)."""
        self.ranks |= set(processes_under(self.proc.pid))  # the ranks, and whatever they started
        if self.proc.poll() is None and time.time() - self.started < limit_s:
            return False
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.ended = time.time()
        return True

    def result(self) -> dict:
        time.sleep(2)  # the driver frees a process's memory as it ends
        left_alive = sorted(pid for pid in self.ranks if alive(pid))
        on_gpu = sorted(self.ranks & gpu_pids())
        for pid in left_alive:  # processes we started, ended by pid
            os.kill(pid, signal.SIGKILL)
        log = (self.dir / "log.txt").read_text(errors="replace")
        faults = re.findall(r"\[hpcfsdp\] fault \w+ at \w+ on rank 1 at ([0-9.]+)", log)
        records = list((self.dir / "results").glob("*/cells/*/result.json"))
        record = json.loads(records[0].read_text()) if records else {}
        end_after = (self.ended - float(faults[-1])) if faults and self.ended else None
        limit = SEARCH_END_S if self.fault in SEARCH_FAULTS else FAULT_END_S
        # a stopped rank: the hang's deadline, then torchrun's SIGTERM it cannot take and its SIGKILL 30 s on
        limit += {"hang": TRAIN_TIMEOUT_S, "sigstop": TRAIN_TIMEOUT_S + 30}.get(self.fault, 0)
        status = record.get("status", "no record")
        ok = status == EXPECTED[self.fault] and end_after is not None and end_after <= limit
        if self.fault in SIGNAL_FAULTS:
            ok = ok and record.get("failed_rank") == 1 and record.get("failed_signal") in EXPECTED_SIGNAL[self.fault]
        if self.fault in SEARCH_FAULTS:  # batches 1, 2 fit; 4 and 3 not (rank 1 alone); batch 2 measured
            probes = [(p["batch_size"], p["status"]) for p in record.get("batch_search", {}).get("probes", [])]
            ok = ok and probes == [(1, "ok"), (2, "ok"), (4, "oom"), (3, "oom")] and record["spec"]["batch_size"] == 2
        ok = ok and not left_alive and not on_gpu
        return {
            "part": "fault",
            "strategy": self.strategy,
            "fault": self.fault,
            "status": status,
            "failed_rank": record.get("failed_rank"),
            "failed_signal": record.get("failed_signal"),
            "fault_to_end_s": end_after,
            "limit_s": limit,
            "exit": self.proc.returncode,
            "left_alive": left_alive,
            "left_on_gpu": on_gpu,
            "error": (record.get("error") or "")[:160],
            "pass": ok,
        }


def run_faults(work: Path, out: Path) -> None:
    parallel = int(os.environ.get("ACCEPTANCE_PARALLEL", "6"))
    todo = [(s, f) for s in strategies() for f in FAULTS]
    todo += [(s, f) for f, among in SEARCH_STRATEGIES.items() for s in among if s in strategies()]
    todo += [(s, f) for s in SIGNAL_STRATEGIES for f in SIGNAL_FAULTS]
    if only := os.environ.get("ACCEPTANCE_FAULTS", "").split():  # e.g. "auto_oom auto_cuda_oom"
        todo = [(s, f) for s, f in todo if f in only]
    running: list[FaultCell] = []
    with open(out / "faults.jsonl", "w") as results:
        while todo or running:
            while todo and len(running) < parallel:
                strategy, fault = todo.pop(0)
                running.append(FaultCell(work / "faults", strategy, fault))
                print(f"[acceptance] started {strategy} {fault}", flush=True)
            for cell in list(running):
                if cell.poll(limit_s=180):
                    running.remove(cell)
                    row = cell.result()
                    print(f"[acceptance] {json.dumps(row)}", flush=True)
                    results.write(json.dumps(row) + "\n")
                    results.flush()
            time.sleep(0.3)


def hpcfsdp(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcfsdp", *args], capture_output=True, text=True, **kwargs)


def run_sweep(work: Path, out: Path) -> None:
    if smoke():
        base = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32}
        os.environ["HPCFSDP_FAULT"], os.environ["OMP_NUM_THREADS"] = "train_step:oom>3", "1"
        gib, candidates = 0.0, [8]
    else:
        base = {"model": "qwen2.5-1.5b", "device": "cuda", "precision": "bf16_mixed", "seq_len": 4096}
        total = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout.split()[0]
        gib, candidates = round(float(total) / 1024, 1), [4, 6, 8, 12, 16]
    base |= {"gpus_per_node": 2, "steps": 4, "warmup_steps": 1, "comm_profile_steps": 0}
    # The smallest candidate batch that plan --memory says no strategy fits on this card.
    oom_batch = candidates[-1]
    for batch in candidates:
        probe = {
            "name": "probe",
            "base": base,
            "slurm": {"gpu_memory_gib": gib} if gib else {},
            "matrix": {"strategy": strategies(), "batch_size": [batch]},
        }
        (work / "probe.yaml").write_text(yaml.safe_dump(probe))
        plan = hpcfsdp("plan", str(work / "probe.yaml"), "--memory", timeout=300)
        (out / f"plan_memory_b{batch}.txt").write_text(plan.stdout + plan.stderr)
        rows = [line for line in plan.stdout.splitlines() if re.match(r"\S+-b\d+-a\d+-", line)]
        if smoke() or (rows and all(line.rstrip().endswith("OOM") for line in rows)):
            oom_batch = batch
            break
    jobs = {
        "name": "acceptance",
        "base": base,
        "slurm": {"time_min": 5, **({"gpu_memory_gib": gib} if gib else {})},
        "matrix": {"strategy": strategies(), "batch_size": [2, oom_batch]},
        "include": [{"strategy": "fsdp2_zero2", "batch_size": "auto", "max_batch_size": 8}],
    }
    (work / "acceptance.yaml").write_text(yaml.safe_dump(jobs))
    (out / "acceptance.yaml").write_text(yaml.safe_dump(jobs))
    started = time.time()
    submit = hpcfsdp(
        "submit",
        str(work / "acceptance.yaml"),
        "--executor",
        "local",
        "--wait",
        "--results-dir",
        str(work / "sweep"),
        timeout=SWEEP_LIMIT_S + 240,
    )
    wall = time.time() - started
    (out / "sweep_submit.log").write_text(submit.stdout + "\n--- stderr\n" + submit.stderr)
    collect = hpcfsdp("collect", str(work / "sweep" / "acceptance"), timeout=300)
    (out / "sweep_collect.log").write_text(collect.stdout + "\n--- stderr\n" + collect.stderr)
    records = [json.loads(p.read_text()) for p in (work / "sweep" / "acceptance" / "cells").glob("*/result.json")]
    cells = len(list((work / "sweep" / "acceptance" / "cells").iterdir()))
    statuses = [r["status"] for r in records]
    left = sorted(gpu_pids())
    row = {
        "part": "sweep",
        "cells": cells,
        "recorded": len(records),
        "oom": statuses.count("oom"),
        "ok": statuses.count("ok"),
        "other": len(statuses) - statuses.count("ok") - statuses.count("oom"),
        "oom_batch": oom_batch,
        "wall_s": wall,
        "submit_exit": submit.returncode,
        "collect_exit": collect.returncode,
        "left_on_gpu": left,
        "auto": next(
            (
                r.get("batch_search", {}).get("chosen_batch_size") or r["spec"]["batch_size"]
                for r in records
                if r.get("spec", {}).get("auto_batch")
            ),
            None,
        ),
        "cells_detail": sorted(
            (r["cell_id"], r["status"], r.get("peak_memory_gib") or r.get("memory_at_failure")) for r in records
        ),
    }
    row["pass"] = (
        cells >= 9
        and row["recorded"] == cells
        and row["oom"] >= 3
        and wall < SWEEP_LIMIT_S
        and not left
        and collect.returncode == 0
    )
    print(f"[acceptance] {json.dumps(row, default=str)}", flush=True)
    (out / "sweep.json").write_text(json.dumps(row, indent=1, default=str))


def table(out: Path) -> str:
    lines = [
        "| strategy | fault | status (expected) | failed rank (signal) | fault to end, s (limit) "
        "| left alive / on GPU | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    faults = (
        [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
        if (out / "faults.jsonl").exists()
        else []
    )
    for r in faults:
        took = "-" if r["fault_to_end_s"] is None else f"{r['fault_to_end_s']:.1f}"
        lines.append(
            f"| {r['strategy']} | {r['fault']} | {r['status']} ({EXPECTED[r['fault']]}) | {r['failed_rank']}"
            f"{f' ({signal})' if (signal := r.get('failed_signal')) else ''} "
            f"| {took} ({r['limit_s']}) | {len(r['left_alive'])} / {len(r['left_on_gpu'])} "
            f"| {'pass' if r['pass'] else 'FAIL'} |"
        )
    if (out / "sweep.json").exists():
        s = json.loads((out / "sweep.json").read_text())
        lines += [
            "",
            "| sweep cells | recorded | ok | oom | other | OOM batch | auto batch | wall, s (limit) "
            "| left on GPU | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {s['cells']} | {s['recorded']} | {s['ok']} | {s['oom']} | {s['other']} | {s['oom_batch']} "
            f"| {s['auto']} | {s['wall_s']:.0f} ({SWEEP_LIMIT_S}) | {len(s['left_on_gpu'])} "
            f"| {'pass' if s['pass'] else 'FAIL'} |",
        ]
    text = "\n".join(lines) + "\n"
    (out / "acceptance.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["faults", "sweep", "table"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "faults":
        run_faults(args.work, args.out)
    elif args.part == "sweep":
        run_sweep(args.work, args.out)
    else:
        print(table(args.out))


if __name__ == "__main__":
    main()
