"""Where each rank of a node sits in the cell, and the environment the supervisor starts it with:
what torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), and OMP_NUM_THREADS from the CPUs this node's task was given, shared among its ranks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ...contracts.spec import LAUNCH_ID_ENV


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the cell: `node` of `nodes`, `per_node` ranks on each."""

    node: int
    nodes: int
    per_node: int
    master_addr: str
    master_port: int
    cpus: int  # the CPUs this node's task was given, for all its ranks

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node * self.per_node + local_rank

    def rank_environment(self, local_rank: int, launch: str, environ: Mapping[str, str]) -> dict[str, str]:
        """The rank's environment: this process's, with the launcher's variables, and
        OMP_NUM_THREADS (the task's CPUs divided among the node's ranks) unless the user set it."""
        env = {
            **environ,
            "RANK": str(self.global_rank(local_rank)),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.per_node),
            "GROUP_RANK": str(self.node),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            LAUNCH_ID_ENV: launch,
        }
        if "OMP_NUM_THREADS" not in environ:
            env["OMP_NUM_THREADS"] = str(threads_per_rank(self.cpus, self.per_node))
        return env


def threads_per_rank(cpus: int, ranks: int) -> int:
    """Each rank's share of the node's CPUs, at least one."""
    return max(1, cpus // max(1, ranks))


def task_cpus(environ: Mapping[str, str]) -> int:
    """The CPUs this task was given: Slurm's SLURM_CPUS_PER_TASK, else the CPUs it may run on."""
    given = environ.get("SLURM_CPUS_PER_TASK", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_layout(per_node: int, master_port: int, environ: Mapping[str, str]) -> NodeLayout:
    """All ranks on this machine (the local executor, tune's probes), the rendezvous on loopback."""
    return NodeLayout(0, 1, per_node, "127.0.0.1", master_port, task_cpus(environ))


def slurm_layout(per_node: int, environ: Mapping[str, str], port: int) -> NodeLayout:
    """This node's ranks of a Slurm job whose step runs one task per node: the node's index is the
    task's (SLURM_NODEID), the rendezvous on `port` of the allocation's first node."""
    from submitit import JobEnvironment

    job = JobEnvironment()
    return NodeLayout(job.node, job.num_nodes, per_node, job.hostnames[0], port, task_cpus(environ))
