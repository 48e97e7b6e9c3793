"""Model presets (shipped config JSON) and model construction from a config or a local directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

PRESETS_DIR = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_config(model: str) -> PretrainedConfig:
    """A preset name (see presets/) or a local directory holding config.json."""
    preset = PRESETS_DIR / f"{model.lower()}.json"
    if preset.is_file():
        values = json.loads(preset.read_text())
        return AutoConfig.for_model(**values)
    if (Path(model) / "config.json").is_file():
        return AutoConfig.from_pretrained(model, local_files_only=True)
    raise ValueError(f"model: {model!r} is neither a preset ({', '.join(preset_names())}) nor a directory with config.json")


def build_model(model: str, dtype: torch.dtype, device: torch.device, seed: int, kernels: str = "none") -> nn.Module:
    """Random init from the config, identical on every rank (same seed), directly on the device."""
    config = load_config(model)
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if kernels == "liger":
        apply_liger_kernels(built)
    return built


def apply_liger_kernels(model: nn.Module) -> None:
    """Swap in Liger's Triton kernels; the fused linear cross-entropy never materialises the logits."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise RuntimeError("kernels: liger needs the liger-kernel package (pip install 'hpcfsdp[liger]')") from exc
    _apply_liger_kernel_to_instance(model=model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the unit of sharding, checkpointing and compilation."""
    return model.model.layers
