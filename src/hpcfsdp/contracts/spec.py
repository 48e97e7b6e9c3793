"""What one cell runs (RunSpec): the contract between the sweep that plans a cell, the cell that runs it
and the record that reports it.

Every user-settable option is a field here, with a default and a short doc beside it, validated
once in this module, and copied whole into the result record so the collector can group by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from .fields import SpecError, coerce_fields, documented, require_choices, require_no_control_characters, text_fields
from .sources import Sources, resolve_sources
from .strategies import STRATEGIES, Family, StrategyInfo, StrategyName

Checkpointing = Literal["none", "full", "selective", "op"]
Precision = Literal["fp32", "bf16_mixed", "bf16"]
Device = Literal["auto", "cpu", "cuda"]
AdamWImpl = Literal["plain", "foreach", "fused"]
OptimizerOrder = Literal["after_shard", "before_shard", "before_shard_fixed"]
BackwardPrefetch = Literal["pre", "post", "none"]
WrapPolicy = Literal["layer", "size", "none"]
ReduceDtype = Literal["fp32", "bf16"]
Kernels = Literal["none", "liger"]
Attention = Literal["sdpa", "cudnn", "flash", "efficient"]
Loss = Literal["default", "compiled", "cce", "cce_kahan_full_c", "cce_exact", "liger"]
Float8 = Literal["none", "tensorwise", "rowwise"]
LRDecay = Literal["none", "linear", "cosine"]
Init = Literal["random", "pretrained"]

# The groups a RunSpec field may belong to, said once, on the field (option): a strategy family
# that reads it (fsdp1, fsdp2; hybrid: the hybrid strategies), measurement-only, searched by
# batch_size: auto, or how that search runs.
Group = Literal["fsdp1", "fsdp2", "hybrid", "measurement", "searched", "batch_search"]


def option(default: Any, doc: str, *groups: Group, default_means: str = "") -> Any:
    """A RunSpec field: its default, its short doc (fields.documented: docs/submit.md and
    `hpcfsdp run --help` are written from it), and the groups it belongs to (fields_in)."""
    return documented(default, doc, default_means=default_means, groups=groups)


# The dtype the weights and the compute take under each precision, and its largest finite value
# (torch.finfo(...).max; spec.py imports no torch); AdamW's beta1 as cell/train.py leaves it.
TRAINING_DTYPE_MAX = {
    "fp32": ("float32", 3.4028234663852886e38),
    "bf16_mixed": ("bfloat16", 3.3895313892515355e38),
    "bf16": ("bfloat16", 3.3895313892515355e38),
}
ADAMW_BETA1 = 0.9
# Tells each array task how many requeues its sweep allows (Resources.max_requeue); see run.py.
MAX_REQUEUE_ENV = "HPCFSDP_MAX_REQUEUE"
# The end of the cell's time limit as its job was scheduled (cell/run.py tells a time limit from a cancel).
JOB_END_ENV = "HPCFSDP_JOB_END_TIME"
# When the launching side started torchrun / srun (Unix time): the record's launcher_start phase and launch_span_s.
LAUNCH_STARTED_ENV = "HPCFSDP_LAUNCH_STARTED"
# One launch of a cell across its ranks, as the node's supervisor names it (cell/supervise/): the
# records' launch_id, by which the first ending of a launch is kept.
LAUNCH_ID_ENV = "HPCFSDP_LAUNCH_ID"


# Counts a cell takes at least one of, or 0 or more of: RunSpec checks them, recordspec.spec_problem a recorded spec.
POSITIVE_FIELDS = (
    *("seq_len", "nodes", "gpus_per_node", "batch_size"),
    *("grad_accum", "steps", "checkpoint_every", "max_batch_size"),
)
NON_NEGATIVE_FIELDS = (
    *("warmup_steps", "lr_warmup_steps", "global_batch_size", "hsdp_shard_size"),
    *("prefetch_depth", "min_num_params", "comm_profile_steps"),
)
NON_NEGATIVE_NUMBERS = ("weight_decay", "max_grad_norm", "peak_tflops")


@dataclass(frozen=True)
class RunSpec:
    """One training run: model, parallelism, batch shape, and measurement settings."""

    AUTO_FIELD: ClassVar[tuple[str, str]] = ("batch_size", "auto_batch")  # `batch_size: auto` sets auto_batch

    # model and data (docs/models_and_data.md)
    model: str = option("tiny", "a preset (`tiny`, ...), a folder with `config.json`, or a hub ORG/NAME@REVISION")
    seq_len: int = option(128, "tokens per sequence (at most the model's `max_position_embeddings`)")
    data: str = option("synthetic", "synthetic, a local folder (text files or save_to_disk), or a hub dataset / preset")
    tokenizer: str = option(
        "",
        "for text data: `tiny` (shipped, for tries), a folder or hub id",
        default_means="the model's own; presets have none",
    )
    text_column: str = option(
        "", "the field / column documents are in", default_means="the hub preset's (chess: Moves), else text"
    )
    init: Init = option("random", "pretrained: the model's weights (a local folder or a cached hub id)")
    meta_init: bool = option(False, "build on the meta device, materialise each rank's shard after sharding")
    # parallelism
    strategy: StrategyName = option(
        "fsdp2_zero3", "single, ddp, fsdp1_* (GPU only) or fsdp2_*: the README's Strategies"
    )
    nodes: int = option(1, "nodes of the cell (a matrix axis: cells of one shape share a job array)")
    gpus_per_node: int = option(1, "GPUs (ranks) per node")
    hsdp_shard_size: int = option(
        0, "ranks per shard group", "hybrid", default_means="shard within a node, replicate across nodes"
    )
    cpu_offload: bool = option(
        False, "the rank's shard of parameters, gradients and AdamW states in pinned host memory", "fsdp1", "fsdp2"
    )
    # FSDP1 knobs
    backward_prefetch: BackwardPrefetch = option("pre", "FSDP1's BackwardPrefetch: pre | post | none", "fsdp1")
    forward_prefetch: bool = option(False, "FSDP1's forward_prefetch", "fsdp1")
    limit_all_gathers: bool = option(True, "FSDP1's limit_all_gathers", "fsdp1")
    use_orig_params: bool = option(True, "FSDP1's use_orig_params", "fsdp1")
    wrap_policy: WrapPolicy = option(
        "layer", "FSDP1's auto wrap: layer (each decoder layer) | size (min_num_params) | none", "fsdp1"
    )
    min_num_params: int = option(100_000_000, "with wrap_policy: size, the parameters of a wrapped unit", "fsdp1")
    # FSDP2 knobs
    prefetch_depth: int = option(
        0, "k > 0: explicit prefetch, k layers ahead", "fsdp2", default_means="FSDP2's implicit prefetch"
    )
    reduce_dtype: ReduceDtype = option("fp32", "with bf16_mixed: the dtype gradients are reduced in", "fsdp1", "fsdp2")
    optimizer_order: OptimizerOrder = option(
        "after_shard",
        "build the optimizer after sharding; before_shard: before it (the known broken way); "
        "before_shard_fixed: before it, its parameters remapped to the sharded ones",
        "fsdp2",
    )
    # batch shape
    batch_size: int = option(1, "per device; with auto_batch, the first batch the search tries", "searched")
    grad_accum: int = option(1, "micro-batches per optimizer step", "searched")
    global_batch_size: int = option(0, "> 0: grad_accum derived from it", default_means="derived")
    # batch_size: auto (cell/batch_search.py): the largest per-device batch that fits, found in the cell
    auto_batch: bool = option(False, "set by `batch_size: auto`", "batch_search")
    max_batch_size: int = option(
        256, "no batch above this is tried (nor above `global_batch_size` / world size)", "batch_search"
    )
    batch_margin: float = option(
        0.0,
        "a batch fits only if its peak reserved GPU memory stays this fraction below the memory free "
        "when the search started (`0.05`: 5% headroom)",
        "batch_search",
    )
    batch_probe_steps: int = option(
        2, "steps per probe (at least 2: the optimizer states exist from the second step)", "batch_search"
    )
    sync_every_microbatch: bool = option(False, "reduce gradients on every micro-batch, not only the window's last")
    # compute
    activation_checkpointing: Checkpointing = option(
        "none", "full | selective (every k-th layer) | op (op-level policy)"
    )
    checkpoint_every: int = option(2, "for selective: checkpoint every k-th decoder layer")
    precision: Precision = option("bf16_mixed", "fp32 | bf16_mixed (bf16 compute, fp32 weights) | bf16")
    compile: bool = option(False, "torch.compile each decoder layer (one compilation, reused)")
    kernels: Kernels = option("none", "liger: Liger's RMSNorm, SwiGLU and RoPE kernels (GPU); the loss is `loss`")
    attention: Attention = option("sdpa", "sdpa: PyTorch picks the backend; cudnn | flash | efficient: that one (GPU)")
    loss: Loss = option(
        "default",
        "the model's own; compiled: the same loss, LM head and cross-entropy in one compiled function "
        "(no fp32 copy of the logits); cce* (cut-cross-entropy: cce filters small gradients and sums them "
        "in bf16, cce_kahan_full_c sums in fp32 and keeps every LM-head gradient, cce_exact filters nothing) "
        "| liger (GPU): fused, no logits in memory",
    )
    float8: Float8 = option("none", "tensorwise | rowwise: torchao float8 matmuls in the decoder layers (GPU, SM89+)")
    expandable_segments: bool = option(False, "PYTORCH_ALLOC_CONF=expandable_segments:True")
    adamw_impl: AdamWImpl = option("foreach", "AdamW's implementation: plain (a for-loop) | foreach | fused")
    lr: float = option(1e-4, "AdamW's learning rate")
    lr_warmup_steps: int = option(
        0, "the lr rises linearly over the first n steps: lr/n, 2 lr/n, ..., lr (torchtitan's)"
    )
    lr_decay: LRDecay = option(
        "none", "after the warm-up: none (constant) | linear | cosine, towards lr x lr_min_ratio"
    )
    lr_min_ratio: float = option(0.0, "where the decay ends, as a fraction of lr (reached one step after the last)")
    weight_decay: float = option(0.0, "AdamW's weight decay")
    max_grad_norm: float = option(
        0.0, "clip the gradients' total norm (over every rank) to this before each step", default_means="off"
    )
    device: Device = option("auto", "auto: a GPU where torch sees one, else the CPU")
    # measurement
    steps: int = option(10, "training steps, the warm-up included", "measurement")
    warmup_steps: int = option(2, "steps before the timed ones", "measurement")
    seed: int = option(0, "seeds the random init and each rank's data order", "measurement")
    stop_when_stable: bool = option(False, "cell/train.py: tune's probes stop once tokens/s holds", "measurement")
    sync_each_step: bool = option(True, "false: one device sync around the timed window (measures sync overhead)")
    nvml: bool = option(True, "sample GPU utilisation during timed steps", "measurement")
    comm_profile_steps: int = option(
        2,
        "steps under torch.profiler for communication time, after the timed window and one more unprofiled step; "
        "0: off",
        "measurement",
    )
    profile: bool = option(False, "TensorBoard trace of a window of steps in the cell folder", "measurement")
    memory_snapshot: bool = option(
        False, "CUDA allocator history pickle (pytorch.org/memory_viz) in the cell folder, after the run or at an OOM"
    )
    peak_tflops: float = option(
        0.0, "dense bf16 peak per GPU for MFU", "measurement", default_means="looked up from the GPU name"
    )
    record_param_norm: bool = option(False, "gathers the whole model at the end: tests, small models", "measurement")
    init_timeout_s: float = option(300.0, "set-up's collectives and the first step may wait this long", "measurement")
    train_timeout_s: float = option(100.0, "then a step this long past the slowest is hung (watchdog)", "measurement")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def strategy_info(self) -> StrategyInfo:
        return STRATEGIES[self.strategy]

    @property
    def family(self) -> Family:
        return STRATEGIES[self.strategy].family

    @property
    def float8_all_gather(self) -> bool:
        """tensorwise float8 under FSDP2 on several ranks gathers the weights in float8 (half the
        bytes of bf16). On one rank there is nothing to gather, and the float8 all-gather would
        only cast each weight eagerly in every layer's pre-forward, CPU time the GPU waits for
        (docs/levers.md): there the compiled layer casts its weights itself."""
        return self.float8 == "tensorwise" and self.family == "fsdp2" and self.world_size > 1

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value. Every field holds a str, int, float or bool (coerce_fields makes them
        so), which dataclasses.asdict would return as they are after a deep copy per field: the same
        dict without that copy, a tenth of the time (plan reads 10,000 cells' dicts)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "spec") -> RunSpec:
        return cls.resolved(values, where)[0]

    @classmethod
    def resolved(
        cls, values: Mapping[str, Any], where: str = "spec", sources: Sources | None = None
    ) -> tuple[RunSpec, Sources]:
        """The spec, validated, with what its model, data and tokenizer name (sources.py): decided
        now from its strings, or `sources` as the login node decided them, checked again."""
        coerced = coerce_fields(cls, values, where)
        spec = cls(**coerced)._validated(where, grad_accum_given="grad_accum" in coerced)
        return spec, resolve_sources(where, spec, sources)

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    def _validated(self, where: str, grad_accum_given: bool = False) -> RunSpec:
        require_choices(where, self)
        for name, value in text_fields(self):
            require_no_control_characters(where, name, value)
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise SpecError(where, name, f"expected a positive integer, got {getattr(self, name)}")
        for name in NON_NEGATIVE_FIELDS:
            if getattr(self, name) < 0:
                raise SpecError(where, name, f"expected an integer >= 0, got {getattr(self, name)}")
        if self.warmup_steps >= self.steps:
            raise SpecError(where, "warmup_steps", f"expected fewer than steps ({self.steps}), got {self.warmup_steps}")
        self._check_optimizer(where)
        for name in NON_NEGATIVE_NUMBERS:
            if getattr(self, name) < 0:
                raise SpecError(where, name, f"expected a number >= 0, got {getattr(self, name)}")
        for name in ("init_timeout_s", "train_timeout_s"):
            if not getattr(self, name) >= 1:
                raise SpecError(where, name, f"expected at least 1 (seconds), got {getattr(self, name)}")
        self._check_batch_search(where)
        # batch_size: auto derives grad_accum once the search has chosen a batch (with_batch_size).
        spec = self if self.auto_batch else self._with_derived_grad_accum(where, grad_accum_given)
        spec._check_combinations(where)
        return spec

    def _check_optimizer(self, where: str) -> None:
        """lr and its schedule. lr and weight_decay must not overflow the training dtype in the first
        step: AdamW moves each weight by lr / (1 - beta1) (its bias correction) and scales it by
        1 - lr x weight_decay; beyond the dtype's largest value the weights become inf, and the
        cell would fail at run time instead of here."""
        if self.lr <= 0:
            raise SpecError(where, "lr", f"expected a positive number, got {self.lr}")
        if self.lr_warmup_steps > self.steps:
            raise SpecError(
                where, "lr_warmup_steps", f"expected at most steps ({self.steps}), got {self.lr_warmup_steps}"
            )
        if not 0 <= self.lr_min_ratio <= 1:
            raise SpecError(where, "lr_min_ratio", f"expected a fraction in [0, 1], got {self.lr_min_ratio}")
        dtype, largest = TRAINING_DTYPE_MAX[self.precision]
        step = self.lr / (1 - ADAMW_BETA1)
        if step > largest:
            raise SpecError(
                where,
                "lr",
                f"{self.lr:g} overflows {dtype}: AdamW's first step moves each weight by lr / (1 - beta1) = "
                f"{step:.3g}, beyond the largest {dtype} {largest:.4g}",
            )
        if self.lr * self.weight_decay > largest:
            raise SpecError(
                where,
                "weight_decay",
                f"{self.weight_decay:g} overflows {dtype}: lr x weight_decay = {self.lr * self.weight_decay:.3g} "
                f"is beyond the largest {dtype} {largest:.4g}",
            )

    def _check_batch_search(self, where: str) -> None:
        if not 0 <= self.batch_margin < 1:
            raise SpecError(where, "batch_margin", f"expected a fraction in [0, 1), got {self.batch_margin}")
        if self.batch_probe_steps < 2:
            raise SpecError(
                where,
                "batch_probe_steps",
                "expected at least 2 (the optimizer states exist from "
                f"the second step on), got {self.batch_probe_steps}",
            )
        if not self.auto_batch:
            return
        if self.global_batch_size % self.world_size:
            raise SpecError(
                where,
                "global_batch_size",
                f"{self.global_batch_size} is not a multiple of the world "
                f"size {self.world_size} (batch_size: auto needs a per-rank share to divide)",
            )
        if self.batch_size > self.batch_cap:
            raise SpecError(
                where,
                "batch_size",
                f"the search's first batch {self.batch_size} is above its cap "
                f"{self.batch_cap} (max_batch_size, or global_batch_size / world size)",
            )

    @property
    def batch_cap(self) -> int:
        """The largest batch `batch_size: auto` may try: max_batch_size, and the per-rank share of
        global_batch_size where one is given."""
        share = self.global_batch_size // self.world_size if self.global_batch_size else self.max_batch_size
        return min(self.max_batch_size, share)

    def with_batch_size(self, batch_size: int, where: str = "batch_size: auto") -> RunSpec:
        """This spec at another per-device batch, grad_accum derived again from global_batch_size."""
        return dataclasses.replace(self, batch_size=batch_size)._with_derived_grad_accum(where, grad_accum_given=False)

    def _with_derived_grad_accum(self, where: str, grad_accum_given: bool) -> RunSpec:
        """grad_accum from global_batch_size; one given beside it must agree, never be overridden."""
        if not self.global_batch_size:
            return self
        per_step = self.batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise SpecError(
                where,
                "global_batch_size",
                f"{self.global_batch_size} is not a multiple of "
                f"batch_size x world size = {self.batch_size} x {self.world_size} = {per_step}",
            )
        derived = self.global_batch_size // per_step
        if grad_accum_given and self.grad_accum != derived:
            raise SpecError(
                where,
                "grad_accum",
                f"{self.grad_accum} disagrees with global_batch_size {self.global_batch_size}, "
                f"which gives {self.global_batch_size} / (batch_size x world size = {per_step}) = {derived}; "
                "give one of the two",
            )
        return dataclasses.replace(self, grad_accum=derived)

    def _check_combinations(self, where: str) -> None:
        if self.family == "fsdp1" and self.device == "cpu":
            raise SpecError(
                where,
                "strategy",
                f"{self.strategy} needs a GPU (FSDP1 refuses CPU-only runs); use device: cuda or an fsdp2_* strategy",
            )
        if self.kernels == "liger" and self.device == "cpu":
            raise SpecError(where, "kernels", "liger needs a GPU (Triton kernels); use kernels: none on CPU")
        self._check_levers(where)
        if self.family == "single" and self.world_size != 1:
            raise SpecError(
                where,
                "strategy",
                f"single trains one process on one device, but the cell has {self.nodes} node(s) x "
                f"{self.gpus_per_node} GPU(s); use ddp or an fsdp* strategy",
            )
        if self.cpu_offload and self.family in ("single", "ddp"):
            raise SpecError(
                where, "cpu_offload", f"{self.strategy} has no CPU offload; use an fsdp1_* or fsdp2_* strategy"
            )
        if self.cpu_offload and self.device == "cpu":
            offload = "offloads parameters from a GPU to the CPU; with device: cpu they are on the CPU already"
            raise SpecError(where, "cpu_offload", f"{offload} (FSDP2's offload needs a GPU); use false or device: cuda")
        if self.compile and self.device == "cpu" and self.family == "fsdp1":
            raise SpecError(where, "compile", f"not supported with {self.strategy} on CPU")
        if self.strategy_info.hybrid:
            shard = self.hsdp_shard_size or self.gpus_per_node
            if self.world_size % shard:
                raise SpecError(
                    where,
                    "hsdp_shard_size",
                    f"{shard} does not divide the world size "
                    f"{self.nodes} nodes x {self.gpus_per_node} = {self.world_size}",
                )
            if self.family == "fsdp1" and shard == 1 and self.world_size > 1:
                # FSDP1 turns a one-rank shard group into NO_SHARD and then reduces gradients over
                # that one-rank group only: replicas never synchronise (pytorch/pytorch#154888).
                raise SpecError(
                    where,
                    "hsdp_shard_size",
                    f"{self.strategy} with a shard group of 1 rank never "
                    f"synchronises gradients across its {self.world_size} replicas (a PyTorch FSDP1 bug); "
                    "use fsdp2_hsdp, ddp, or a shard size of at least 2",
                )
        if self.optimizer_order != "after_shard" and self.family != "fsdp2":
            raise SpecError(where, "optimizer_order", f"{self.optimizer_order} applies to fsdp2_* strategies only")
        if self.meta_init and self.family == "fsdp1":
            raise SpecError(where, "meta_init", f"supported with ddp and fsdp2_* strategies only, got {self.strategy}")
        if self.meta_init and self.init == "pretrained":
            raise SpecError(
                where, "meta_init", "applies to init: random only (pretrained weights are loaded whole, then sharded)"
            )
        if self.meta_init and self.optimizer_order != "after_shard":
            raise SpecError(where, "meta_init", f"needs optimizer_order: after_shard, got {self.optimizer_order}")

    def _check_levers(self, where: str) -> None:
        """The levers of docs/levers.md that cannot run where the cell runs."""
        if self.device == "cpu":
            if self.attention != "sdpa":
                raise SpecError(
                    where, "attention", f"{self.attention} is a CUDA SDPA backend; use attention: sdpa on CPU"
                )
            if self.loss == "liger":
                raise SpecError(where, "loss", "liger needs a GPU (Triton kernels); use loss: default or cce on CPU")
            if self.float8 != "none":
                raise SpecError(
                    where,
                    "float8",
                    f"{self.float8} needs a GPU with float8 tensor cores (SM89+: "
                    "Ada, Hopper or newer); use float8: none on CPU",
                )
        if self.float8 != "none" and self.family == "fsdp1":
            raise SpecError(where, "float8", f"supported with ddp and fsdp2_* strategies, got {self.strategy}")
        if self.float8 != "none" and self.cpu_offload:
            raise SpecError(where, "float8", "not with cpu_offload (the float8 casts would run on the CPU)")


_FIELD_NAMES = tuple(f.name for f in fields(RunSpec))


def fields_in(group: str) -> tuple[str, ...]:
    """The RunSpec fields of a group, in field order."""
    return tuple(f.name for f in fields(RunSpec) if group in f.metadata.get("groups", ()))
