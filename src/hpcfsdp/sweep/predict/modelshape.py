"""What the memory predictions read of a model: its Shape, off its config.json (a preset, a local
folder, or a cached hub model), without torch. memory.py (the GPU) and hostmemory.py (the host)
size every term from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...contracts.sources import PRESETS_DIR, Source, preset_of_hub_id


class ModelConfigError(ValueError):
    """The model's config.json cannot be found or lacks a field the prediction needs."""


@dataclass(frozen=True)
class Shape:
    """What the prediction reads from a decoder-only model's config.json (Llama-style blocks:
    attention with grouped KV heads, a gated MLP, two RMSNorms)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys (head_dim weights each)
    origin: str = field(default="", compare=False)  # where a hub model's config was read when not cached

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> Shape:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            attention_bias = bool(config.get("attention_bias", False))
            return cls(
                vocab=int(config["vocab_size"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tied=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias or config.get("model_type") == "qwen2",  # Qwen2 always has q/k/v biases
                o_bias=attention_bias,
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=config.get("model_type") == "qwen3",
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"{where}: not a decoder config this prediction knows ({exc})") from None

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """The weights of a layer's seven matmuls (no biases, no norms)."""
        h = self.hidden
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.intermediate
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        attention += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * f + (2 * f + h) * self.mlp_bias
        return attention + mlp + 2 * h + 2 * self.head_dim * self.qk_norm  # RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Outside the decoder layers: embedding, final norm, and an untied LM head."""
        return self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


def load_shape(model: Source, cache_dir: str | None = None) -> Shape:
    """The Shape of a resolved model: a preset, a local folder, or a hub id. A hub id is read from
    the cache (downloaded, or its config.json alone: `download --config-only`), else from the shipped
    preset of the same model (PRESET_HUB_IDS): nothing is downloaded to review a sweep."""
    origin = ""
    if model.kind == "preset":
        path = model.preset_file
    elif model.kind == "local":
        path = Path(model.path) / "config.json"
    else:
        path, origin = _hub_config(model, cache_dir)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: unreadable ({exc})") from None
    shape = Shape.from_config(config, str(path))
    return dataclasses.replace(shape, origin=origin) if origin else shape


def _hub_config(model: Source, cache_dir: str | None) -> tuple[Path, str]:
    """A hub model's config.json, and a note of where it came from where it is not the downloaded model's."""
    from ...cache.hub import CacheMissError, cached_config, default_cache_dir, lookup_model, model_download_command

    ref = model.model_ref
    try:
        return lookup_model(ref.name, cache_dir).path / "config.json", ""
    except (CacheMissError, ValueError) as exc:
        missing = str(exc)
    if (config := cached_config(ref, cache_dir)) is not None:
        return config, f"{ref.name}: its config.json alone (download --config-only)"
    if preset := preset_of_hub_id(ref.repo_id):
        return PRESETS_DIR / f"{preset}.json", f"{ref.name} not cached: from the preset {preset}, its configuration"
    command = model_download_command(default_cache_dir(cache_dir), ref, weights=False)
    raise ModelConfigError(
        f"{missing.split(';')[0]}; its config.json alone lets plan predict it: {command} --config-only"
    )
