"""The one-GPU acceptance (issue 52): a lone rank's every fault, under the local executor and under
Slurm (a one-node local cluster whose gres is the GPU); bench/gpu_acceptance.sh runs it with
ACCEPTANCE_ONE_GPU=1.

Each row is one cell of one rank through `hpcfsdp submit --executor local|slurm --wait`: the rank
SIGKILLed, SIGSTOPped, hung (a step that never ends), a real out-of-memory (a batch the card cannot
hold; on CPU the fault hook's), or an error, at its first step. The row says the status and the
rank and signal the record names, the seconds from the fault (the line the fault hook prints) to the
record's write, against the issue's goal (10 s; a stop or hang: train_timeout_s + 10 s), and what
was left: processes of the cell alive, processes on the GPU (nvidia-smi --query-compute-apps), a job
still in the queue. Leftovers are then ended by pid.

  MODEL (qwen2.5-1.5b) and DEVICE (cuda): MODEL=tiny DEVICE=cpu is the CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from acceptance import alive, gpu_pids

ROWS = ("sigkill", "sigstop", "hang", "oom", "error")
EXPECTED = {"sigkill": "error", "sigstop": "hang", "hang": "hang", "oom": "oom", "error": "error"}
EXPECTED_SIGNAL = {"sigkill": "SIGKILL", "sigstop": "SIGSTOP"}
TRAIN_TIMEOUT_S = 10
GOAL_S = {"sigstop": TRAIN_TIMEOUT_S + 10, "hang": TRAIN_TIMEOUT_S + 10}  # the others: 10 s
FAULT_LINE = re.compile(r"\[hpcfsdp\] fault \w+ at \w+ on rank 0 at (\d+\.\d+)")
ROW_LIMIT_S = 150  # a row's submit is ended (and the row fails) past this


def cell_base(fault: str) -> dict:
    model, device = os.environ.get("MODEL", "qwen2.5-1.5b"), os.environ.get("DEVICE", "cuda")
    gpu = device == "cuda"
    base = {
        "model": model,
        "device": device,
        "precision": "bf16_mixed" if gpu else "fp32",
        "seq_len": 1024 if gpu else 32,
        "batch_size": 1,
        "steps": 40,
        "warmup_steps": 2,
        "comm_profile_steps": 0,
        "strategy": "ddp",
        "train_timeout_s": TRAIN_TIMEOUT_S,
    }
    if fault == "oom" and gpu:  # a real one: the logits alone of 32 x 8192 tokens outgrow the card
        base.update(batch_size=32, seq_len=8192)
    return base


def injected(fault: str) -> str:
    """The fault hook's setting: every row but a real out-of-memory on a GPU."""
    if fault == "oom" and os.environ.get("DEVICE", "cuda") == "cuda":
        return ""
    return f"train_step:{fault}:0"


def cell_processes(sweep: Path) -> list[int]:
    """Processes whose command line names the row's sweep folder: its supervisor (under Slurm the
    submitit task, whose command names the sweep's slurm/ folder) and its rank, which the
    supervisor forked and which so carries the supervisor's command line."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        pid = int(cmdline.parent.name)
        if f"{sweep}/" in text and pid != os.getpid() and alive(pid):
            found.append(pid)
    return found


def written_at(record: dict, path: Path) -> float:
    """When the record was first written: a rank's record says it (started_at + duration_s; the
    local executor rewrites the file later, adding the launch's tear-down), else the file's time."""
    started, took = record.get("started_at"), record.get("duration_s")
    if isinstance(started, float) and isinstance(took, float):
        return started + took
    return path.stat().st_mtime


def run_row(work: Path, executor: str, fault: str) -> dict:
    name = f"{executor}-{fault}"
    jobs = work / f"{name}.yaml"
    slurm = {"partition": "gpu", "time_min": 5, "cpus_per_task": 4}
    jobs.write_text(yaml.safe_dump({"name": name, "base": cell_base(fault), "slurm": slurm}))
    env = {k: v for k, v in os.environ.items() if k != "HPCFSDP_FAULT"}
    if setting := injected(fault):
        env["HPCFSDP_FAULT"] = setting
    results = work / "results"
    command = [sys.executable, "-m", "hpcfsdp", "submit", str(jobs), "--executor", executor, "--wait"]
    command += ["--results-dir", str(results)]
    started = time.time()
    with open(work / f"{name}.submit.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=ROW_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ended = time.time()
    cells = list((results / name / "cells").glob("*"))
    cell = cells[0] if cells else results / name
    path = cell / "result.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    logs = [cell / "log.txt", *(results / name / "slurm").glob("*/*_log.*")]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file())
    found = FAULT_LINE.search(text)
    fault_at = float(found.group(1)) if found else None
    to_record = written_at(record, path) - fault_at if fault_at is not None and path.is_file() else None
    time.sleep(2)  # the driver frees a process's memory as it ends
    left = cell_processes(results / name)
    on_gpu = sorted(gpu_pids())
    job = (record.get("slurm") or {}).get("job_id")
    queued = ""
    if executor == "slurm" and job:
        queued = subprocess.run(["squeue", "-h", f"--jobs={job}"], capture_output=True, text=True).stdout.strip()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    goal = GOAL_S.get(fault, 10)
    status = record.get("status", "no record")
    ok = status == EXPECTED[fault] and record.get("failed_rank") == 0 and not left and not on_gpu and not queued
    ok = ok and record.get("failed_signal") == EXPECTED_SIGNAL.get(fault, record.get("failed_signal"))
    ok = ok and (to_record is not None and to_record <= goal if setting else True)
    return {
        "executor": executor,
        "fault": fault,
        "status": status,
        "failed_rank": record.get("failed_rank"),
        "failed_signal": record.get("failed_signal"),
        "recorded_by": record.get("recorded_by", "the rank"),
        "fault_to_record_s": to_record,
        "goal_s": goal,
        "row_s": ended - started,
        "left_alive": left,
        "left_on_gpu": on_gpu,
        "queued": queued,
        "error": (record.get("error") or "")[:160],
        "pass": ok,
    }


def run(work: Path, out: Path, executors: list[str]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    with open(out / "lone.jsonl", "a") as rows:
        for executor in executors:
            for fault in os.environ.get("LONE_FAULTS", " ".join(ROWS)).split():
                row = run_row(work, executor, fault)
                print(f"[lone] {json.dumps(row)}", flush=True)
                rows.write(json.dumps(row) + "\n")
                rows.flush()


def table(out: Path) -> str:
    lines = [
        "| executor | fault | status (expected) | rank (signal) | recorded by | fault to record, s (goal) "
        "| row, s | left alive / on GPU / queued | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    path = out / "lone.jsonl"
    for r in [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []:
        took = "-" if r["fault_to_record_s"] is None else f"{r['fault_to_record_s']:.1f}"
        sig = f" ({r['failed_signal']})" if r["failed_signal"] else ""
        lines.append(
            f"| {r['executor']} | {r['fault']} | {r['status']} ({EXPECTED[r['fault']]}) | {r['failed_rank']}{sig} "
            f"| {r['recorded_by'].split(' (')[0]} | {took} ({r['goal_s']}) | {r['row_s']:.0f} "
            f"| {len(r['left_alive'])} / {len(r['left_on_gpu'])} / {'yes' if r['queued'] else 'no'} "
            f"| {'pass' if r['pass'] else 'FAIL'} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "lone_acceptance.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["local", "slurm", "table"])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "table":
        print(table(args.out))
    else:
        run(args.work / args.part, args.out, [args.part])


if __name__ == "__main__":
    main()
