"""What the Slurm cluster here allows, asked on the login node with scontrol, sinfo and squeue.

- `read_limits`: MaxArraySize and MaxJobCount (`scontrol show config`), which cap one array;
- `read_partitions`: each partition's per-job limits and its nodes' CPUs, memory and GPUs
  (`scontrol show partition`, `sinfo --Node`), for the preflight (preflight.py);
- `jobs_in_queue`: how many of your jobs (array tasks one each) are pending or running, for
  `slurm.max_jobs_in_queue`;
- `never_clears`: whether a pending job's reason (squeue %r) waits on a change that no amount of
  waiting brings.

Each reader asks the cluster it is given (`slurm.clusters`, sbatch -M: slurm.on_cluster; "" the
one this login node's configuration names) through the runner (slurm.py), and returns None when no
Slurm answers here (not installed, no controller, no answer within slurm.ANSWER_TIMEOUT_S): its
callers then skip what they would check, as a plan on a laptop must.
"""

from __future__ import annotations

import getpass
import re
from dataclasses import dataclass

from ...slurm import ANSWER_TIMEOUT_S, SlurmCommand, SlurmError, ask

SLURM_MAX_ARRAY_SIZE = 1001  # Slurm's defaults, for a config that does not print them
SLURM_MAX_JOB_COUNT = 10000
# sinfo's short node states (suffixes such as '*' for not responding stripped) of a node that takes
# no new job until someone acts on it.
DOWN_STATES = ("down", "drain", "drng", "drained", "fail", "failg", "inval")
# Pending reasons that wait on a change of the cluster's configuration (or the job's), never on
# other jobs ending: partition limits the job exceeds, constraints no node has, an account or QOS
# it may not use, a dependency that can no longer be met.
NEVER_CLEARING_REASONS = (
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSNotAllowed",
    "DependencyNeverSatisfied",
)
# Per-job QOS or association limits that the job itself exceeds (QOSMaxWallDurationPerJobLimit,
# AssocMaxNodesPerJobLimit, QOSMinGRES, ...); per-user and group limits clear as other jobs end.
_PER_JOB_LIMIT = re.compile(r"^(QOS|Assoc)Max\w*PerJob|^QOSMin")
# Reasons that mean "the nodes this job needs are not available": they clear when the nodes come
# back, so they count as never clearing only while too few of the partition's nodes are up.
NODE_REASONS = ("ReqNodeNotAvail", "Nodes required for job are DOWN")


@dataclass(frozen=True)
class Limits:
    max_array_size: int  # array task ids run 0 .. max_array_size - 1
    max_job_count: int  # jobs slurmctld holds at once, every user's, each array task one


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int  # the gpu entries of its gres, summed over types
    state: str  # sinfo's short state: idle, mix, alloc, down*, drain, ...

    @property
    def down(self) -> bool:
        return self.state.rstrip("*~#!%$@^-+") in DOWN_STATES


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: tuple[Node, ...]
    max_nodes: int | None  # per job; None: unlimited
    min_nodes: int
    max_time_min: int | None  # None: unlimited
    max_time_text: str  # as Slurm prints it, for messages
    max_cpus_per_node: int | None
    max_mem_per_node_mb: int | None
    def_mem_per_node_mb: int | None = None  # what a job without --mem gets: per node, or
    def_mem_per_cpu_mb: int | None = None  # per allocated CPU; neither: the whole node


@dataclass(frozen=True)
class Qos:
    """A QOS's per-job limits (sacctmgr show qos): a job beyond one never starts, and Slurm queues it
    anyway (pending QOSMax...PerJobLimit) unless the QOS has the DenyOnLimit flag."""

    name: str
    max_wall_min: int | None
    max_wall_text: str
    max_tres_per_job: dict[str, int]  # cpu, node, mem (MB), gres/gpu, ...
    max_tres_per_node: dict[str, int]


def read_limits(cluster: str = "") -> Limits | None:
    out = _ask("scontrol", "show", "config", cluster=cluster)
    if out is None:
        return None
    values = dict(re.findall(r"^(\w+)\s*=\s*(\S*)", out, flags=re.M))
    return Limits(
        max_array_size=_number(values.get("MaxArraySize", "")) or SLURM_MAX_ARRAY_SIZE,
        max_job_count=_number(values.get("MaxJobCount", "")) or SLURM_MAX_JOB_COUNT,
    )


def read_partitions(cluster: str = "") -> dict[str, Partition] | None:
    """Partition name -> its limits and nodes; None when Slurm does not answer."""
    listing = _ask("scontrol", "show", "partition", "--oneliner", cluster=cluster)
    rows = _ask("sinfo", "--Node", "--noheader", "--format=%N|%c|%m|%G|%t|%R", cluster=cluster)
    if listing is None or rows is None:
        return None
    nodes: dict[str, list[Node]] = {}
    for row in rows.splitlines():
        fields = row.split("|")
        if len(fields) != 6:
            continue
        node, cpus, memory, gres, state, partition = (f.strip() for f in fields)
        nodes.setdefault(partition, []).append(
            Node(node, _number(cpus) or 0, _number(memory) or 0, gpus_in_gres(gres), state)
        )
    # A partition without DefMemPerCPU / DefMemPerNode of its own takes slurm.conf's.
    config: dict[str, str] = dict(
        re.findall(
            r"^(DefMemPer(?:CPU|Node))\s*=\s*(\S*)",
            _ask("scontrol", "show", "config", cluster=cluster) or "",
            flags=re.M,
        )
    )
    partitions = {}
    for line in listing.splitlines():
        values = dict(item.split("=", 1) for item in line.split() if "=" in item)
        name = values.get("PartitionName", "")
        if not name:
            continue
        max_time = values.get("MaxTime", "UNLIMITED")
        partitions[name] = Partition(
            name=name,
            default=values.get("Default") == "YES",
            nodes=tuple(nodes.get(name, ())),
            max_nodes=_number(values.get("MaxNodes", "")),
            min_nodes=_number(values.get("MinNodes", "")) or 0,
            max_time_min=slurm_minutes(max_time),
            max_time_text=max_time,
            max_cpus_per_node=_number(values.get("MaxCPUsPerNode", "")),
            max_mem_per_node_mb=_number(values.get("MaxMemPerNode", "")),
            def_mem_per_node_mb=_number(values.get("DefMemPerNode", config.get("DefMemPerNode") or "")),
            def_mem_per_cpu_mb=_number(values.get("DefMemPerCPU", config.get("DefMemPerCPU") or "")),
        )
    return partitions


def read_qos(name: str) -> Qos | None:
    """The per-job limits of QOS `name`; None when sacctmgr does not answer or knows no such QOS."""
    out = _ask(
        "sacctmgr", "--noheader", "--parsable2", "show", "qos", name, "format=Name,MaxWall,MaxTRESPerJob,MaxTRESPerNode"
    )
    rows = [row.split("|") for row in (out or "").splitlines() if row.split("|")[0] == name]
    if not rows or len(rows[0]) != 4:
        return None
    _, wall, per_job, per_node = rows[0]
    return Qos(name, slurm_minutes(wall), wall, tres_counts(per_job), tres_counts(per_node))


def known_clusters() -> list[str] | None:
    """The clusters `sacctmgr show clusters` knows (those sbatch -M can reach), else the one this
    login node's controller runs (no slurmdbd here); None when neither answers."""
    out = _ask("sacctmgr", "--noheader", "--parsable2", "show", "clusters", "format=Cluster")
    if out is not None:
        return [line.strip() for line in out.splitlines() if line.strip()]
    config = _ask("scontrol", "show", "config")
    found = re.search(r"^ClusterName\s*=\s*(\S+)", config or "", flags=re.M)
    return [found.group(1)] if found else None


def tres_counts(text: str) -> dict[str, int]:
    """'cpu=2,mem=4G,gres/gpu=4' (as sacctmgr prints TRES) -> {'cpu': 2, 'mem': 4096, 'gres/gpu': 4}; mem in MB."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        match = re.fullmatch(r"(\d+)([KMGTP]?)", value.strip())
        if name and match:
            scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2, "P": 1024**3}[match.group(2)]
            out[name.strip()] = int(int(match.group(1)) * scale)
    return out


def jobs_in_queue(cluster: str = "") -> int | None:
    """Your jobs that Slurm holds pending or running, each array task one (as MaxSubmitJobs counts)."""
    out = _ask("squeue", f"--user={getpass.getuser()}", "--noheader", "--array", "--format=%i", cluster=cluster)
    return None if out is None else sum(1 for line in out.splitlines() if line.strip())


def never_clears(reason: str, nodes: int, partition: Partition | None) -> bool:
    """Whether a pending job of `nodes` nodes, held with this squeue %r reason, can never start as
    things are: a partition or per-job limit it exceeds, or (node reasons) fewer nodes of its
    partition up than it needs. `partition` None: node reasons count as clearing."""
    word = reason.split(",", 1)[0].strip()
    if word in NEVER_CLEARING_REASONS or _PER_JOB_LIMIT.match(word):
        return True
    if waits_for_nodes(reason) and partition is not None:
        return sum(not node.down for node in partition.nodes) < nodes
    return False


def waits_for_nodes(reason: str) -> bool:
    """A reason that clears when nodes come back: whether it ever does depends on their state."""
    return reason.startswith(NODE_REASONS)


def gpus_in_gres(gres: str) -> int:
    """GPUs in a gres string as sinfo prints it: gpu:4, gpu:a100:4(S:0-1), gpu:a:2,gpu:b:2, (null)."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def slurm_minutes(text: str) -> int | None:
    """[days-]hours:minutes:seconds (as scontrol prints a time limit) in whole minutes, rounded up;
    None for UNLIMITED / INFINITE or anything else it cannot read."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return (days * 24 + hours) * 60 + minutes + (seconds > 0)


def _number(text: str) -> int | None:
    """An integer Slurm printed ('8000', '8000+'); None for UNLIMITED, N/A and the like."""
    match = re.match(r"\d+", text.strip())
    return int(match.group()) if match else None


def _ask(command: SlurmCommand, *args: str, cluster: str = "") -> str | None:
    """stdout of a Slurm client asked of `cluster`, or None when it is not installed, fails or does
    not answer."""
    try:
        return ask(command, *args, cluster=cluster, timeout_s=ANSWER_TIMEOUT_S)
    except SlurmError:
        return None


def array_size_limit(override: int, cluster: str = "") -> int | None:
    """Cells one array may hold: the smallest of slurm.max_array_size (`override`; 0: none) and the
    cluster's MaxArraySize and MaxJobCount; None when none of them is known (no Slurm here)."""
    limits = read_limits(cluster)
    caps = [override] + ([limits.max_array_size, limits.max_job_count] if limits else [])
    return min((cap for cap in caps if cap > 0), default=None)
