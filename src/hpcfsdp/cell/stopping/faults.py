"""Fault injection for tests: HPCFSDP_FAULT=stage:kind[>N][:rank] raises a real exception (or
signal) at a stage of the cell, so that every failure path writes its record in a real run.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from ..ranks.distributed import DistEnv

FAULT_ENV = "HPCFSDP_FAULT"
# The fault kinds that are a signal the rank sends itself.
SIGNAL_FAULTS = {
    "sigkill": signal.SIGKILL,
    "sigsegv": signal.SIGSEGV,
    "sigbus": signal.SIGBUS,
    "sigabrt": signal.SIGABRT,
    "sigstop": signal.SIGSTOP,
}


def inject_fault(stage: str, env: DistEnv, batch_size: int = 0) -> None:
    """Test-only hook: HPCFSDP_FAULT=stage:kind[>N][:rank] raises a real exception (or signal) there.

    kind is oom (torch.OutOfMemoryError), cuda_oom (torch.AcceleratorError saying out of memory),
    error (RuntimeError), timeout (SIGTERM to itself), hang
    (sleeps until a signal ends it: a stuck collective, as far as a time limit can tell) or hostmem
    (takes 3 GiB of host memory and holds it: a leak that no prediction sees, for Slurm's memory
    limit to end), or a signal the rank sends itself: sigkill, sigsegv, sigbus, sigabrt (what the
    kernel's OOM killer or a crash does) and sigstop (a rank that stops answering). With >N
    (train_step only) it fires only above a per-device batch of N: a memory budget the CPU path
    enforces, for the batch search (`train_step:oom>4` lets batches up to 4 fit).
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    fault_stage, kind, *rank = spec.split(":")
    kind, _, above = kind.partition(">")
    if fault_stage != stage or (rank and int(rank[0]) != env.rank) or (above and batch_size <= int(above)):
        return
    # bench/gpu_acceptance.sh times the cell's end from this line
    print(f"[hpcfsdp] fault {kind} at {stage} on rank {env.rank} at {time.time():.3f}", flush=True)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory at {stage}")
    if kind == "cuda_oom":  # what a kernel launch or cuBLAS raises when the device has no memory left
        raise torch.AcceleratorError("CUDA error: out of memory")
    if kind in SIGNAL_FAULTS:
        os.kill(os.getpid(), SIGNAL_FAULTS[kind])
        time.sleep(5)  # SIGSTOP: the rank stops here until SIGKILL ends it
    if kind == "timeout":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    if kind == "hostmem":
        held = b"\x01" * (3 << 30)  # written, so every page counts in the rank's resident memory
        while held:
            time.sleep(1)
    if kind == "hang":
        while True:
            time.sleep(1)
    raise RuntimeError(f"injected fault at {stage}")
