"""Where and on what a cell ran: the fields every record carries beside its outcome (the cell, its
spec, the process group, the device, every rank's resources and how they differ from the spec), with
what it was made with (provenance) and where its time went (phases)."""

from __future__ import annotations

import torch

from ...contracts.record import Record
from ...contracts.spec import RunSpec
from ..ranks.distributed import DistEnv
from ..ranks.resources import Seen, ranks_fields
from .metrics import device_name
from .phases import PhaseClock, timing_fields
from .provenance import provenance


def start_context(spec: RunSpec, cell_id: str, sweep: str, node: str, clock: PhaseClock) -> Record:
    """What a record of a rank that never formed its process group can say of where it ran."""
    return {
        "cell_id": cell_id,
        "sweep": sweep,
        "spec": spec.to_dict(),
        "nodes": spec.nodes,
        "hostnames": [node],
        **provenance(),
        **timing_fields(spec, clock),
    }


def cell_context(
    spec: RunSpec, env: DistEnv, cell_id: str, sweep: str, seen: list[Seen], ok: bool, node: str, clock: PhaseClock
) -> Record:
    """Where and on what the cell ran: every rank's resources where they were gathered (`seen`; this
    rank's node alone where they were not), and how they differ from the spec."""
    resources = ranks_fields(seen, spec.nodes, spec.gpus_per_node, env.device.type) if seen else {}
    return {
        **resources,  # type: ignore[typeddict-item]
        "cell_id": cell_id,
        "sweep": sweep,
        "spec": spec.to_dict(),
        "world_size": env.world_size,
        "nodes": spec.nodes,
        "device_type": env.device.type,
        "device_name": device_name(env.device),
        "gpu_count": torch.cuda.device_count() if env.device.type == "cuda" else 0,
        "backend": env.backend,
        # every rank's host in an ok record; in a failed one, the host of the rank that wrote it
        "hostnames": sorted({s.ranks["host"] for s in seen} if seen and ok else {node}),
        **provenance(),
        **timing_fields(spec, clock),
    }
