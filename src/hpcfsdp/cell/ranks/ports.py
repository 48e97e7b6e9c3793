"""The rendezvous' port: a Slurm job's from its id, or one free on this machine. Without torch: the
node's supervisor picks it before it starts the ranks."""

from __future__ import annotations

import socket

# A Slurm job's rendezvous port, from its id: below Linux's default range of ports for outgoing
# connections (32768-60999), which submitit's own choice (20000-60000 from the job id) overlaps; a
# cell once could not listen on its port (EADDRINUSE) because an outgoing connection held it.
# Consecutive job ids (an array's tasks) get consecutive ports.
SLURM_MASTER_PORTS = (20_000, 32_000)
CELL_PORT_STRIDE = 97  # between the ports of a job's successive cells: far from the next job's


def slurm_port(job_id: str, cell_index: int = 0) -> int:
    """The rendezvous port of the job's `cell_index`-th cell (each node's task runs the same cells in
    the same order, so every node computes the same port): a fresh port for each cell of a job."""
    low, high = SLURM_MASTER_PORTS
    return low + (int(job_id) + CELL_PORT_STRIDE * cell_index) % (high - low)


def free_port(address: str) -> int:
    """A port free on `address` now, for a rendezvous to listen on: "127.0.0.1" for one on this
    host only, "" (every interface) for one that other nodes reach."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
