"""One small function per strategy: it takes a model and a spec and returns the wrapped model.

Strategies never own a loop. Activation checkpointing and compilation are applied per decoder
layer before wrapping, so every strategy shards, checkpoints and compiles the same units.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..contracts.spec import RunSpec
from ..contracts.strategies import Family
from .levers import convert_float8, op_checkpoint_context
from .models import decoder_layers
from .ranks.distributed import DistEnv, build_mesh

Strategy = Callable[[nn.Module, RunSpec, DistEnv], nn.Module]


def apply_activation_checkpointing(model: nn.Module, spec: RunSpec) -> None:
    """Wrap decoder layers in non-reentrant checkpointing: all of them (full), every k-th
    (selective), or all of them with an op-level policy that keeps some outputs (op)."""
    if spec.activation_checkpointing == "none":
        return
    every = spec.checkpoint_every if spec.activation_checkpointing == "selective" else 1
    wrap = checkpoint_wrapper
    if spec.activation_checkpointing == "op":
        wrap = functools.partial(checkpoint_wrapper, context_fn=op_checkpoint_context)
    layers = decoder_layers(model)
    for index in range(len(layers)):
        if index % every == 0:
            layers[index] = wrap(layers[index])


def apply_compile(model: nn.Module, spec: RunSpec) -> None:
    """torch.compile each decoder layer: same graph for every layer, so one compilation is reused."""
    if not spec.compile:
        return
    layers = decoder_layers(model)
    for index in range(len(layers)):
        layers[index] = cast(nn.Module, torch.compile(layers[index], fullgraph=False))


def single(model: nn.Module, spec: RunSpec, env: DistEnv) -> nn.Module:
    """The plain model on its one device: what FSDP or DDP on one rank would only add copies and
    hooks to (torchtitan on one GPU runs so)."""
    return model


def ddp(model: nn.Module, spec: RunSpec, env: DistEnv) -> nn.Module:
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def fsdp2(model: nn.Module, spec: RunSpec, env: DistEnv) -> nn.Module:
    """fully_shard per decoder layer, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = build_mesh(env, replicate=_replicas(spec, env))
    mp_policy = MixedPrecisionPolicy()
    if spec.precision == "bf16_mixed":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_dtype(spec.reduce_dtype))
    offload = CPUOffloadPolicy() if spec.cpu_offload else OffloadPolicy()
    reshard = spec.strategy_info.reshard_after_forward
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    layers = list(decoder_layers(model))
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them gathered.
        shard(layer, reshard_after_forward=reshard and index < len(layers) - 1)
    shard(model, reshard_after_forward=reshard)
    if spec.prefetch_depth:
        _set_explicit_prefetch(layers, spec.prefetch_depth)
    return model


def _set_explicit_prefetch(layers: list[nn.Module], depth: int) -> None:
    for index, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[index + 1 : index + 1 + depth])
        layer.set_modules_to_backward_prefetch(layers[max(0, index - depth) : index][::-1])


def fsdp1(model: nn.Module, spec: RunSpec, env: DistEnv) -> nn.Module:
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if env.device.type != "cuda":
        raise RuntimeError(
            f"strategy: {spec.strategy} needs a GPU (FSDP1 refuses CPU-only runs); use an fsdp2_* strategy on CPU"
        )
    sharding = ShardingStrategy[spec.strategy_info.fsdp1_sharding]
    layer_class = type(_unwrapped(decoder_layers(model)[0]))
    policy = {
        "layer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_class}),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=spec.min_num_params),
        "none": None,
    }[spec.wrap_policy]
    mixed = None
    if spec.precision == "bf16_mixed":
        mixed = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=_dtype(spec.reduce_dtype), buffer_dtype=torch.bfloat16
        )
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}
    mesh = build_mesh(env, replicate=_replicas(spec, env)) if spec.strategy_info.hybrid else None
    return FullyShardedDataParallel(
        model,
        sharding_strategy=sharding,
        auto_wrap_policy=policy,
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=spec.cpu_offload),
        backward_prefetch=prefetch[spec.backward_prefetch],
        forward_prefetch=spec.forward_prefetch,
        limit_all_gathers=spec.limit_all_gathers,
        use_orig_params=spec.use_orig_params,
        device_id=env.device,
        device_mesh=mesh,
    )


# One wrapper per family; how each strategy of a family shards is in strategies.STRATEGIES.
WRAPPERS: dict[Family, Strategy] = {"single": single, "ddp": ddp, "fsdp1": fsdp1, "fsdp2": fsdp2}


def parallelize(model: nn.Module, spec: RunSpec, env: DistEnv) -> nn.Module:
    convert_float8(model, spec)
    apply_activation_checkpointing(model, spec)
    apply_compile(model, spec)
    return WRAPPERS[spec.family](model, spec, env)


def gradient_sync(model: nn.Module, spec: RunSpec, enabled: bool) -> AbstractContextManager:
    """Skip the gradient reduction on all but the last micro-batch of an accumulation window."""
    if enabled or spec.sync_every_microbatch:
        return _set_fsdp2_sync(model, True) if spec.family == "fsdp2" else contextlib.nullcontext()
    if spec.family == "fsdp2":
        return _set_fsdp2_sync(model, False)
    if spec.family == "single":
        return contextlib.nullcontext()  # nothing to synchronise: gradients accumulate in .grad
    return model.no_sync()


def clip_gradients(model: nn.Module, spec: RunSpec) -> None:
    """Scale the gradients so that their total norm, over the whole model, is at most
    spec.max_grad_norm, as torchtitan and most LM trainers do before each step (0: no clipping).

    FSDP1 sums its flat shards' norms itself. Under FSDP2 the gradients are sharded DTensors, and
    DTensor reduces their norm over the mesh: the total is the whole model's on every rank (taken
    out of the DTensor before it scales them, as torchtitan does). DDP's and single's gradients are
    whole on every rank."""
    if not spec.max_grad_norm:
        return
    if spec.family == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        cast(FullyShardedDataParallel, model).clip_grad_norm_(spec.max_grad_norm)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), spec.max_grad_norm, total, foreach=True)


@contextlib.contextmanager
def _set_fsdp2_sync(model: nn.Module, enabled: bool):
    model.set_requires_gradient_sync(enabled)
    yield


def autocast(spec: RunSpec, device: torch.device) -> AbstractContextManager:
    """DDP and the plain model have no mixed-precision policy: bf16_mixed means autocast around
    forward there."""
    if spec.family in ("single", "ddp") and spec.precision == "bf16_mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def param_dtype(spec: RunSpec) -> torch.dtype:
    """The dtype the model is built in: bf16 only for pure-bf16 training; fp32 master weights otherwise."""
    return torch.bfloat16 if spec.precision == "bf16" else torch.float32


def _replicas(spec: RunSpec, env: DistEnv) -> int:
    """Replica groups of a hybrid strategy (a 2-D mesh even when 1); 0 for a flat 1-D mesh."""
    if not spec.strategy_info.hybrid:
        return 0
    shard = spec.hsdp_shard_size or spec.gpus_per_node
    return env.world_size // shard


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _unwrapped(module: nn.Module) -> nn.Module:
    inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
    return _unwrapped(inner) if inner is not None else module
