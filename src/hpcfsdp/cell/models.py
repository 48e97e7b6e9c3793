"""Model sources (shipped preset, local folder, cached hub id), construction, and initialisation.

Random init is defined once, for every path: the model's own `_init_weights`, applied module by
module in the order transformers' `initialize_weights` uses (children first), drawing from the
default generator of the compute device seeded with the spec's seed. The full-replica path builds
the model on the device and re-runs that init; the meta path (`meta_init`) builds on the meta
device, and after sharding `materialize` allocates only the local shards and runs the same init,
generating each module's full tensors one module at a time and keeping this rank's slice. So the
initial full parameters are bit-identical with and without meta init, for every world size and
every strategy that supports it (DDP, FSDP2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ..cache.hub import resolve_cached_model
from ..contracts.sources import PRESETS_DIR, Source, preset_names

__all__ = [
    "PRESETS_DIR",
    "ModelSource",
    "build_model",
    "decoder_layers",
    "init_weights",
    "load_config",
    "materialize",
    "model_class",
    "preset_names",
    "resolve_model",
]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset's JSON file, or a folder with config.json (local or cached)."""

    kind: str  # preset | local | hub
    path: Path
    provenance: dict[str, Any]


def resolve_model(model: Source, weights: bool = False) -> ModelSource:
    """A resolved model (or tokenizer) -> the files to read; hub ids offline from the cache
    (CacheMissError if absent)."""
    if model.kind == "preset":
        path = model.preset_file
        return ModelSource("preset", path, {"kind": "preset", "name": model.name, "path": str(path)})
    if model.kind == "local":
        path = Path(model.path).resolve()
        return ModelSource("local", path, {"kind": "local", "path": str(path)})
    if model.kind == "hub":
        item = resolve_cached_model(model.model_ref.name, weights=weights)
        provenance = {"kind": "hub", "item": item.item, "sha": item.sha, "path": str(item.path)}
        return ModelSource("hub", item.path, provenance)
    raise ValueError(f"model: {model.given!r} is {model.kind} data, not a model")


def load_config(source: ModelSource) -> PretrainedConfig:
    if source.kind == "preset":
        return AutoConfig.for_model(**json.loads(source.path.read_text()))
    return AutoConfig.from_pretrained(source.path, local_files_only=True)


def model_class(source: ModelSource) -> object:
    """The class from_config builds for this model, its module imported (the node's supervisor
    imports it once, before it forks the ranks: cell/supervise/start.py)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(load_config(source))]


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    kernels: str = "none",
    pretrained: bool = False,
    meta: bool = False,
) -> nn.Module:
    """The model on `device` (pretrained weights, or seeded random init), or on the meta device
    (`meta`: no storage; `materialize` it after sharding)."""
    if pretrained:
        # Loaded in host memory, then moved: transformers' device_map would need accelerate.
        loaded: nn.Module = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=dtype, attn_implementation="sdpa", use_cache=False
        )
        built = loaded.to(device)
    else:
        config = load_config(source)
        config.use_cache = False
        torch.manual_seed(seed)  # parameters the model's own init leaves alone keep a seeded constructor init
        with torch.device("meta" if meta else device):
            built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        if not meta:
            init_weights(built, seed, device)
    if kernels == "liger":
        apply_liger_kernels(built)
    return built


def materialize(model: PreTrainedModel, device: torch.device, seed: int, offload_params: bool = False) -> None:
    """Give a meta-built model real storage (only this rank's shards, once sharded) and initialise it.

    Storage is NaN-filled first, so a parameter or buffer that the model's init does not cover
    fails loudly here instead of training from garbage. With `offload_params` (FSDP2 CPU offload)
    parameters live on the CPU and buffers on `device`.
    """
    model.to_empty(device="cpu" if offload_params else device)
    if offload_params:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device=device)
    _retie(model)
    with torch.no_grad():
        for _, tensor in _local_tensors(model):
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    init_weights(model, seed, device)
    with torch.no_grad():
        for name, tensor in _local_tensors(model):
            if tensor.is_floating_point() and bool(tensor.isnan().any()):
                raise RuntimeError(
                    f"meta_init: {name} is not set by the model's own _init_weights; use meta_init: false"
                )


@torch.no_grad()
def init_weights(model: PreTrainedModel, seed: int, device: torch.device) -> None:
    """The model's own `_init_weights` on every module, children first, from the device's generator
    seeded with `seed`. A sharded (DTensor) parameter is initialised as a full tensor on `device`,
    of which this rank keeps its slice: the values do not depend on how the model is sharded."""
    torch.manual_seed(seed)
    for module, owner in _init_order(model, model):
        sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
        for name, param in sharded.items():
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
        owner._init_weights(module)
        for name, param in sharded.items():
            full = module._parameters[name].data
            module._parameters[name] = param
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)


def _init_order(module: nn.Module, owner: PreTrainedModel) -> Iterator[tuple[nn.Module, PreTrainedModel]]:
    """(module, the PreTrainedModel whose _init_weights applies), in transformers' smart_apply order."""
    for child in module.children():
        yield from _init_order(child, child if isinstance(child, PreTrainedModel) else owner)
    yield module, owner


def _local_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and buffers by name; this rank's shard of a sharded one."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        yield name, tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _retie(model: PreTrainedModel) -> None:
    """to_empty replaces plain parameters module by module, so a tied pair comes apart (FSDP2's
    sharded parameters are swapped in place and stay tied)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.tie_weights()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(
            "meta_init: the LM head could not be tied to the input embedding again after materialisation"
        )


def apply_liger_kernels(model: nn.Module) -> None:
    """Swap in Liger's Triton kernels for RMSNorm, SwiGLU and RoPE. Its fused linear cross-entropy
    is `loss: liger` (levers.py), so the loss is chosen in one place only."""
    from .levers import require

    liger = require("liger_kernel.transformers", "kernels: liger")
    liger._apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the unit of sharding, checkpointing and compilation."""
    return cast(nn.ModuleList, model.model.layers)
