"""The cell's model, strategy and optimizer, built in the order the spec asks for (the optimizer
after sharding, before it, or before it with its parameters remapped), with a memory reading after
each stage; the batch search builds its probes the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from ..contracts.sources import Sources, check_seq_len
from ..contracts.spec import RunSpec
from .levers import install_loss
from .measure.metrics import FlopCount, flops_per_token, memory_reading
from .models import ModelSource, build_model, materialize, resolve_model
from .ranks.distributed import DistEnv
from .strategies import parallelize, param_dtype
from .train import build_optimizer


@dataclass(frozen=True)
class Built:
    model: Any
    optimizer: torch.optim.Optimizer
    optimizer_tracks_model: bool
    flops: FlopCount
    source: ModelSource
    vocab_size: int


def build(spec: RunSpec, sources: Sources, env: DistEnv, memory: dict, enter: Callable[[str], None]) -> Built:
    """Model, strategy and optimizer for `spec`, its model from `sources`; memory is read after each stage."""
    enter("model")
    pretrained = spec.init == "pretrained"
    source = resolve_model(sources.model, weights=pretrained)
    model = build_model(source, param_dtype(spec), env.device, spec.seed, spec.kernels, pretrained, meta=spec.meta_init)
    if spec.meta_init and spec.family != "fsdp2":
        materialize(
            cast(PreTrainedModel, model), env.device, spec.seed
        )  # DDP holds a full replica: nothing to shard first
    check_seq_len(f"model {spec.model}", spec.seq_len, model.config.to_dict())  # hub models: unknown at plan time
    install_loss(model, spec, env.device)
    flops = flops_per_token(model, spec.seq_len)
    vocab_size = cast(int, model.config.vocab_size)
    memory["after_model"] = memory_reading(env.device)
    enter("shard")
    model, optimizer, tracks = parallelize_with_optimizer(model, spec, env, memory)
    memory["after_optimizer"] = memory_reading(env.device)
    return Built(model, optimizer, tracks, flops, source, vocab_size)


def build_probe(spec: RunSpec, sources: Sources, env: DistEnv):
    """What a batch-search probe trains: the cell's own set-up at the probe's batch."""
    built = build(spec, sources, env, {}, enter=lambda stage: None)
    return built.model, built.optimizer, built.vocab_size


def parallelize_with_optimizer(model, spec: RunSpec, env: DistEnv, memory: dict):
    """Build the optimizer after sharding (right), before it (the known broken way), or before it
    with its parameter references remapped to the sharded parameters (the fix)."""
    if spec.optimizer_order == "after_shard":
        model = parallelize(model, spec, env)
        if spec.meta_init and spec.family == "fsdp2":
            materialize(model, env.device, spec.seed, offload_params=spec.cpu_offload)  # this rank's shards only
        memory["after_shard"] = memory_reading(env.device)
        optimizer = build_optimizer(model, spec)
    else:
        optimizer = build_optimizer(model, spec)
        unsharded = list(model.parameters())
        model = parallelize(model, spec, env)
        memory["after_shard"] = memory_reading(env.device)
        if spec.optimizer_order == "before_shard_fixed":
            remap = dict(zip(map(id, unsharded), model.parameters(), strict=False))
            for group in optimizer.param_groups:
                group["params"] = [remap[id(p)] for p in group["params"]]
    model_params = {id(p) for p in model.parameters()}
    tracked = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return model, optimizer, model_params == tracked
