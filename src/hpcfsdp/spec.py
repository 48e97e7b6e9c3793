"""What one cell runs (RunSpec) and what it asks the scheduler for (Resources).

Every user-settable option is a field here, with a default, validated once in this module, and
copied whole into the result record so the collector can group by it.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

DDP = "ddp"
FSDP1_STRATEGIES = (
    "fsdp1_full_shard",
    "fsdp1_shard_grad_op",
    "fsdp1_hybrid_shard",
    "fsdp1_hybrid_zero2",
    "fsdp1_no_shard",
)
FSDP2_STRATEGIES = ("fsdp2_zero3", "fsdp2_zero2", "fsdp2_hsdp")
STRATEGIES = (DDP, *FSDP1_STRATEGIES, *FSDP2_STRATEGIES)
HYBRID_STRATEGIES = ("fsdp1_hybrid_shard", "fsdp1_hybrid_zero2", "fsdp2_hsdp")

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16_mixed", "bf16")
DEVICES = ("auto", "cpu", "cuda")
ADAMW_IMPLS = ("plain", "foreach", "fused")
OPTIMIZER_ORDERS = ("after_shard", "before_shard", "before_shard_fixed")
BACKWARD_PREFETCH = ("pre", "post", "none")
WRAP_POLICIES = ("layer", "size", "none")
GPU_REQUESTS = ("gres", "gpus_per_node", "none")
KERNELS = ("none", "liger")


class SpecError(ValueError):
    """A bad value in user input; the message is one line naming where and what was expected."""


@dataclass(frozen=True)
class RunSpec:
    """One training run: model, parallelism, batch shape, and measurement settings."""

    # model and data
    model: str = "tiny"
    seq_len: int = 128
    data: str = "synthetic"
    # parallelism
    strategy: str = "fsdp2_zero3"
    nodes: int = 1
    gpus_per_node: int = 1
    hsdp_shard_size: int = 0  # 0: shard within a node, replicate across nodes
    cpu_offload: bool = False
    # FSDP1 knobs
    backward_prefetch: str = "pre"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    wrap_policy: str = "layer"
    min_num_params: int = 100_000_000
    # FSDP2 knobs
    prefetch_depth: int = 0  # 0: FSDP2's implicit prefetch; k > 0: explicit, k layers ahead
    reduce_dtype: str = "fp32"
    optimizer_order: str = "after_shard"
    # batch shape
    batch_size: int = 1  # per device
    grad_accum: int = 1
    global_batch_size: int = 0  # 0: derived; > 0: grad_accum derived from it
    sync_every_microbatch: bool = False
    # compute
    activation_checkpointing: str = "none"
    checkpoint_every: int = 2  # for selective: checkpoint every k-th decoder layer
    precision: str = "bf16_mixed"
    compile: bool = False
    kernels: str = "none"  # liger: Liger's fused RMSNorm, SwiGLU, RoPE and linear cross-entropy (GPU)
    expandable_segments: bool = False  # PYTORCH_ALLOC_CONF=expandable_segments:True
    adamw_impl: str = "foreach"
    lr: float = 1e-4
    weight_decay: float = 0.0
    device: str = "auto"
    # measurement
    steps: int = 10
    warmup_steps: int = 2
    seed: int = 0
    sync_each_step: bool = True  # false: one device sync around the timed window (measures sync overhead)
    nvml: bool = True  # sample GPU utilisation during timed steps
    comm_profile_steps: int = 2  # extra steps under torch.profiler for communication time; 0: off
    profile: bool = False  # TensorBoard trace of a window of steps in the cell folder
    memory_snapshot: bool = False  # CUDA memory snapshot pickle (pytorch.org/memory_viz) in the cell folder
    peak_tflops: float = 0.0  # dense bf16 peak per GPU for MFU; 0: looked up from the GPU name
    record_param_norm: bool = False  # gathers the full model once at the end: for tests and small models

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def family(self) -> str:
        if self.strategy == DDP:
            return "ddp"
        return self.strategy.split("_", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "spec") -> "RunSpec":
        return cls(**_coerce_fields(cls, values, where))._validated(where)

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    def _validated(self, where: str) -> "RunSpec":
        _require_choice(where, "strategy", self.strategy, STRATEGIES)
        _require_choice(where, "activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING)
        _require_choice(where, "precision", self.precision, PRECISIONS)
        _require_choice(where, "device", self.device, DEVICES)
        _require_choice(where, "adamw_impl", self.adamw_impl, ADAMW_IMPLS)
        _require_choice(where, "optimizer_order", self.optimizer_order, OPTIMIZER_ORDERS)
        _require_choice(where, "backward_prefetch", self.backward_prefetch, BACKWARD_PREFETCH)
        _require_choice(where, "wrap_policy", self.wrap_policy, WRAP_POLICIES)
        _require_choice(where, "reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        _require_choice(where, "data", self.data, ("synthetic",))
        _require_choice(where, "kernels", self.kernels, KERNELS)
        for name in ("seq_len", "nodes", "gpus_per_node", "batch_size", "grad_accum", "steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise SpecError(f"{where}: {name}: expected a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "global_batch_size", "hsdp_shard_size", "prefetch_depth", "min_num_params",
                     "comm_profile_steps"):
            if getattr(self, name) < 0:
                raise SpecError(f"{where}: {name}: expected an integer >= 0, got {getattr(self, name)}")
        if self.warmup_steps >= self.steps:
            raise SpecError(f"{where}: warmup_steps: expected fewer than steps ({self.steps}), got {self.warmup_steps}")
        if self.lr <= 0:
            raise SpecError(f"{where}: lr: expected a positive number, got {self.lr}")
        spec = self._with_derived_grad_accum(where)
        spec._check_combinations(where)
        return spec

    def _with_derived_grad_accum(self, where: str) -> "RunSpec":
        if not self.global_batch_size:
            return self
        per_step = self.batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise SpecError(
                f"{where}: global_batch_size: {self.global_batch_size} is not a multiple of "
                f"batch_size x world size = {self.batch_size} x {self.world_size} = {per_step}"
            )
        return dataclasses.replace(self, grad_accum=self.global_batch_size // per_step)

    def _check_combinations(self, where: str) -> None:
        if self.family == "fsdp1" and self.device == "cpu":
            raise SpecError(f"{where}: strategy: {self.strategy} needs a GPU (FSDP1 refuses CPU-only runs); use device: cuda or an fsdp2_* strategy")
        if self.kernels == "liger" and self.device == "cpu":
            raise SpecError(f"{where}: kernels: liger needs a GPU (Triton kernels); use kernels: none on CPU")
        if self.cpu_offload and self.strategy == DDP:
            raise SpecError(f"{where}: cpu_offload: DDP has no CPU offload; use an fsdp1_* or fsdp2_* strategy")
        if self.compile and self.device == "cpu" and self.family == "fsdp1":
            raise SpecError(f"{where}: compile: not supported with {self.strategy} on CPU")
        if self.strategy in HYBRID_STRATEGIES:
            shard = self.hsdp_shard_size or self.gpus_per_node
            if self.world_size % shard:
                raise SpecError(
                    f"{where}: hsdp_shard_size: {shard} does not divide the world size "
                    f"{self.nodes} nodes x {self.gpus_per_node} = {self.world_size}"
                )
        if self.optimizer_order != "after_shard" and self.family != "fsdp2":
            raise SpecError(f"{where}: optimizer_order: {self.optimizer_order} applies to fsdp2_* strategies only")


@dataclass(frozen=True)
class Resources:
    """What every array task of a sweep asks Slurm for, beside nodes and GPUs per node (in RunSpec)."""

    partition: str = "gpu"
    time_min: int = 30
    cpus_per_task: int = 1
    mem_gb: int = 0  # 0: the partition's default
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = False
    array_parallelism: int = 64
    gpu_request: str = "gres"  # how GPUs are asked for: --gres=gpu:N, --gpus-per-node=N, or not at all
    max_requeue: int = 0
    extra_sbatch: dict[str, Any] = field(default_factory=dict)  # passed through: {"reservation": "x"}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "slurm") -> "Resources":
        res = cls(**_coerce_fields(cls, values, where))
        _require_choice(where, "gpu_request", res.gpu_request, GPU_REQUESTS)
        for name in ("time_min", "cpus_per_task", "array_parallelism"):
            if getattr(res, name) < 1:
                raise SpecError(f"{where}: {name}: expected a positive integer, got {getattr(res, name)}")
        return res

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def unknown_key_message(where: str, key: str, known: tuple[str, ...], section: str = "") -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(known)}"
    label = f"{section}.{key}" if section else key
    return f"{where}: {label}: unknown key{hint}"


def _coerce_fields(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check names and types of user values against the dataclass fields (YAML gives plain types)."""
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise SpecError(unknown_key_message(where, key, tuple(known)))
        default = known[key].default if known[key].default is not dataclasses.MISSING else known[key].default_factory()
        out[key] = _coerce(where, key, value, type(default))
    return out


def _coerce(where: str, key: str, value: Any, expected: type) -> Any:
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(f"{where}: {key}: expected true or false, got {value!r}")
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(f"{where}: {key}: expected an integer, got {value!r}")
    if expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise SpecError(f"{where}: {key}: expected a number, got {value!r}")
    if expected is str:
        if key == "activation_checkpointing" and isinstance(value, bool):
            return "full" if value else "none"
        if isinstance(value, str):
            return value
        raise SpecError(f"{where}: {key}: expected a string, got {value!r}")
    if expected is dict:
        if isinstance(value, dict):
            return dict(value)
        raise SpecError(f"{where}: {key}: expected a mapping, got {value!r}")
    return value


def _require_choice(where: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SpecError(f"{where}: {key}: expected one of {', '.join(choices)}; got {value!r}{hint}")
