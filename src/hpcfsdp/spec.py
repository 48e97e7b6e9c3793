"""What one cell runs (RunSpec) and what it asks the scheduler for (Resources).

Every user-settable option is a field here, with a default, validated once in this module, and
copied whole into the result record so the collector can group by it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .errors import UserError
from .gpus import gpu_memory_gib, known_memory_sizes
from .hubrefs import DatasetRef, ModelRef
from .names import MAX_NAME_BYTES, folder_name_problem, name_problem, slurm_name_problem, unseen_character

StrategyName = Literal[
    "ddp",
    "fsdp1_full_shard",
    "fsdp1_shard_grad_op",
    "fsdp1_hybrid_shard",
    "fsdp1_hybrid_zero2",
    "fsdp1_no_shard",
    "fsdp2_zero3",
    "fsdp2_zero2",
    "fsdp2_hsdp",
]
Family = Literal["ddp", "fsdp1", "fsdp2"]
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
Init = Literal["random", "pretrained"]
GpuRequest = Literal["gres", "gpus_per_node", "none"]

# RunSpec fields that only one family of strategies reads; a cell of another family carries their
# defaults. The collector uses this to match a cell with its baseline and to name variants.
FAMILY_KNOBS: dict[Family, tuple[str, ...]] = {
    "ddp": (),
    "fsdp1": (
        "cpu_offload",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "wrap_policy",
        "min_num_params",
        "reduce_dtype",
    ),
    "fsdp2": ("cpu_offload", "prefetch_depth", "reduce_dtype", "optimizer_order"),
}


@dataclass(frozen=True)
class StrategyInfo:
    """What a strategy name means: its family (which wrapper applies it) and how it shards."""

    family: Family
    hybrid: bool = False  # replicate across shard groups (a 2-D mesh; reads hsdp_shard_size)
    reshard_after_forward: bool = True  # False: ZeRO-2 (parameters stay gathered until backward)
    fsdp1_sharding: str = ""  # torch.distributed.fsdp.ShardingStrategy member

    @property
    def knobs(self) -> tuple[str, ...]:
        return FAMILY_KNOBS[self.family] + (("hsdp_shard_size",) if self.hybrid else ())


# The one registry of strategies: validation, the wrappers (cell/strategies.py) and the collector read it.
STRATEGIES: dict[StrategyName, StrategyInfo] = {
    "ddp": StrategyInfo("ddp"),
    "fsdp1_full_shard": StrategyInfo("fsdp1", fsdp1_sharding="FULL_SHARD"),
    "fsdp1_shard_grad_op": StrategyInfo("fsdp1", reshard_after_forward=False, fsdp1_sharding="SHARD_GRAD_OP"),
    "fsdp1_hybrid_shard": StrategyInfo("fsdp1", hybrid=True, fsdp1_sharding="HYBRID_SHARD"),
    "fsdp1_hybrid_zero2": StrategyInfo(
        "fsdp1", hybrid=True, reshard_after_forward=False, fsdp1_sharding="_HYBRID_SHARD_ZERO2"
    ),
    "fsdp1_no_shard": StrategyInfo("fsdp1", fsdp1_sharding="NO_SHARD"),
    "fsdp2_zero3": StrategyInfo("fsdp2"),
    "fsdp2_zero2": StrategyInfo("fsdp2", reshard_after_forward=False),
    "fsdp2_hsdp": StrategyInfo("fsdp2", hybrid=True),
}
assert set(STRATEGIES) == set(get_args(StrategyName)), "every StrategyName needs a registry entry"
STRATEGY_KNOBS = tuple(dict.fromkeys(knob for knobs in FAMILY_KNOBS.values() for knob in knobs)) + ("hsdp_shard_size",)

PRESETS_DIR = Path(__file__).parent / "presets"
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # datasets.save_to_disk
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
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
# C0 and C1 control characters and DEL: a newline in a value that reaches an #SBATCH line would end
# it and make the rest a shell line of the batch script; none belongs in a name, path or option.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# config.json keys that give how many positions a model's position embedding covers
POSITION_KEYS = ("max_position_embeddings", "n_positions")
# The end of the cell's time limit as its job was scheduled (cell/run.py tells a time limit from a cancel).
JOB_END_ENV = "HPCFSDP_JOB_END_TIME"


class SpecError(UserError, ValueError):
    """A bad value in user input, as one line '<where>: <key>: <what>'.

    `where` is a file (and line) or a section, `key` the offending key ("" for a whole-file
    problem), `what` what was expected and what came. Kept apart so that the YAML loader can point
    at the line that set `key` without parsing the message.
    """

    exit_status = 2

    def __init__(self, where: str, key: str = "", what: str = ""):
        self.where, self.key, self.what = where, key, what
        super().__init__(": ".join(part for part in (where, key, what) if part))


@dataclass(frozen=True)
class RunSpec:
    """One training run: model, parallelism, batch shape, and measurement settings."""

    # model and data
    model: str = "tiny"
    seq_len: int = 128
    data: str = "synthetic"  # synthetic, a local folder (text files or save_to_disk), or a hub dataset / preset
    tokenizer: str = ""  # for text data: a folder or hub id; "": the model's own (presets have none)
    text_column: str = ""  # the field / column documents are in; "": the hub preset's (chess: Moves), else text
    init: Init = "random"  # pretrained: the model's weights (a local folder or a cached hub id)
    meta_init: bool = False  # build on the meta device, materialise each rank's shard after sharding
    # parallelism
    strategy: StrategyName = "fsdp2_zero3"
    nodes: int = 1
    gpus_per_node: int = 1
    hsdp_shard_size: int = 0  # 0: shard within a node, replicate across nodes
    cpu_offload: bool = False
    # FSDP1 knobs
    backward_prefetch: BackwardPrefetch = "pre"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    wrap_policy: WrapPolicy = "layer"
    min_num_params: int = 100_000_000
    # FSDP2 knobs
    prefetch_depth: int = 0  # 0: FSDP2's implicit prefetch; k > 0: explicit, k layers ahead
    reduce_dtype: ReduceDtype = "fp32"
    optimizer_order: OptimizerOrder = "after_shard"
    # batch shape
    batch_size: int = 1  # per device; with auto_batch, the first batch the search tries
    grad_accum: int = 1
    global_batch_size: int = 0  # 0: derived; > 0: grad_accum derived from it
    # batch_size: auto (cell/batch_search.py): the largest per-device batch that fits, found in the cell
    auto_batch: bool = False  # set by `batch_size: auto`; the record's batch_size is then the one found
    max_batch_size: int = 256  # the search never tries a larger batch
    batch_margin: float = 0.0  # a batch fits only if its peak reserved memory stays this fraction below the GPU's
    batch_probe_steps: int = 2  # steps per probe; the second one holds the optimizer states
    sync_every_microbatch: bool = False
    # compute
    activation_checkpointing: Checkpointing = "none"  # full | selective (every k-th layer) | op (op-level policy)
    checkpoint_every: int = 2  # for selective: checkpoint every k-th decoder layer
    precision: Precision = "bf16_mixed"
    compile: bool = False
    kernels: Kernels = "none"  # liger: Liger's RMSNorm, SwiGLU and RoPE kernels (GPU); the loss is `loss`
    attention: Attention = "sdpa"  # sdpa: PyTorch picks the SDPA backend; cudnn | flash | efficient: that one (GPU)
    # the model's own; compiled: the same loss, LM head and cross-entropy in one compiled function
    # (no fp32 copy of the logits); cce* (cut-cross-entropy: cce filters small gradients and sums them in bf16,
    # cce_kahan_full_c sums in fp32 and keeps every LM-head gradient, cce_exact filters nothing)
    # | liger (GPU): fused, no logits in memory
    loss: Loss = "default"
    float8: Float8 = "none"  # tensorwise | rowwise: torchao float8 matmuls in the decoder layers (GPU, SM89+)
    expandable_segments: bool = False  # PYTORCH_ALLOC_CONF=expandable_segments:True
    adamw_impl: AdamWImpl = "foreach"
    lr: float = 1e-4
    weight_decay: float = 0.0
    device: Device = "auto"
    # measurement
    steps: int = 10
    warmup_steps: int = 2
    seed: int = 0
    sync_each_step: bool = True  # false: one device sync around the timed window (measures sync overhead)
    nvml: bool = True  # sample GPU utilisation during timed steps
    comm_profile_steps: int = 2  # extra steps under torch.profiler for communication time; 0: off
    profile: bool = False  # TensorBoard trace of a window of steps in the cell folder
    # CUDA allocator history pickle (pytorch.org/memory_viz) in the cell folder, after the run or at an OOM
    memory_snapshot: bool = False
    peak_tflops: float = 0.0  # dense bf16 peak per GPU for MFU; 0: looked up from the GPU name
    record_param_norm: bool = False  # gathers the full model once at the end: for tests and small models

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
    def text_tokenizer(self) -> str:
        """What text data is tokenised with: `tokenizer`, else the model's own ("" for a preset: it has none)."""
        if self.tokenizer or model_kind(self.model) == "preset":
            return self.tokenizer
        return self.model

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "spec") -> RunSpec:
        coerced = coerce_fields(cls, values, where)
        return cls(**coerced)._validated(where, grad_accum_given="grad_accum" in coerced)

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    def _validated(self, where: str, grad_accum_given: bool = False) -> RunSpec:
        _require_choices(where, self)
        for name, value in _text_fields(self):
            require_no_control_characters(where, name, value)
        for name in (
            "seq_len",
            "nodes",
            "gpus_per_node",
            "batch_size",
            "grad_accum",
            "steps",
            "checkpoint_every",
            "max_batch_size",
        ):
            if getattr(self, name) < 1:
                raise SpecError(where, name, f"expected a positive integer, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "global_batch_size",
            "hsdp_shard_size",
            "prefetch_depth",
            "min_num_params",
            "comm_profile_steps",
        ):
            if getattr(self, name) < 0:
                raise SpecError(where, name, f"expected an integer >= 0, got {getattr(self, name)}")
        if self.warmup_steps >= self.steps:
            raise SpecError(where, "warmup_steps", f"expected fewer than steps ({self.steps}), got {self.warmup_steps}")
        if self.lr <= 0:
            raise SpecError(where, "lr", f"expected a positive number, got {self.lr}")
        self._check_overflow(where)
        for name in ("weight_decay", "peak_tflops"):
            if getattr(self, name) < 0:
                raise SpecError(where, name, f"expected a number >= 0, got {getattr(self, name)}")
        self._check_batch_search(where)
        # batch_size: auto derives grad_accum once the search has chosen a batch (with_batch_size).
        spec = self if self.auto_batch else self._with_derived_grad_accum(where, grad_accum_given)
        spec._check_combinations(where)
        spec._check_model(where)
        spec._check_data(where)
        return spec

    def _check_overflow(self, where: str) -> None:
        """lr and weight_decay must not overflow the training dtype in the optimizer's first step:
        AdamW moves each weight by lr / (1 - beta1) (its bias correction) and scales it by
        1 - lr x weight_decay. Beyond the dtype's largest value the weights become inf, and the
        cell fails at run time instead of here."""
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
        if self.cpu_offload and self.strategy == "ddp":
            raise SpecError(where, "cpu_offload", "DDP has no CPU offload; use an fsdp1_* or fsdp2_* strategy")
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

    def _check_model(self, where: str) -> None:
        kind = model_kind(self.model)
        if not kind:
            raise SpecError(
                where,
                "model",
                f"expected a preset ({', '.join(preset_names())}), a folder with "
                f"config.json or a hub id ORG/NAME[@REV]; got {self.model!r}",
            )
        if kind == "local":
            _require_folder_with(where, "model", self.model, ("config.json",))
        if kind in ("preset", "local"):  # a hub model's config is read on the compute node (cell/run.py)
            config = _model_config(
                str(PRESETS_DIR / f"{self.model.lower()}.json")
                if kind == "preset"
                else str(Path(self.model).expanduser() / "config.json")
            )
            check_seq_len(where, self.seq_len, config)
        if self.init == "pretrained" and kind == "preset":
            raise SpecError(
                where,
                "init",
                f"pretrained needs weights, and model {self.model!r} is a preset "
                "(a config only); name a local folder or a hub id ORG/NAME",
            )
        if self.init == "pretrained" and kind == "local":
            _require_folder_with(where, "model", self.model, WEIGHT_GLOBS, "weights for init: pretrained")
        if self.tokenizer:
            tokenizer_kind = model_kind(self.tokenizer)
            if tokenizer_kind not in ("local", "hub"):
                raise SpecError(
                    where, "tokenizer", f"expected a folder or a hub id ORG/NAME[@REV]; got {self.tokenizer!r}"
                )
            if tokenizer_kind == "local":
                _require_folder_with(where, "tokenizer", self.tokenizer, TOKENIZER_FILES)

    def _check_data(self, where: str) -> None:
        kind = data_kind(self.data)
        if not kind:
            raise SpecError(
                where,
                "data",
                f"expected synthetic, a local folder, or a hub dataset "
                f"ORG/NAME[:config][@split] or preset; got {self.data!r}",
            )
        if kind == "synthetic":
            if self.text_column:
                raise SpecError(
                    where, "text_column", "synthetic data has no documents; set data to a folder or hub dataset"
                )
            return
        if kind == "local":
            _require_text_data(where, self.data)
        tokenizer = self.text_tokenizer
        if not tokenizer:
            raise SpecError(
                where,
                "tokenizer",
                f"data {self.data!r} needs one, and model {self.model!r} is a "
                "preset without a tokenizer; set tokenizer to a folder or a hub id ORG/NAME",
            )
        if kind == "hub" and model_kind(tokenizer) != "hub":
            raise SpecError(
                where,
                "tokenizer",
                f"hub data {self.data!r} is read pre-tokenised from the cache, "
                f"which is keyed by a hub tokenizer ORG/NAME; got the local {tokenizer!r}",
            )
        if not self.tokenizer and model_kind(self.model) == "local":
            _require_folder_with(where, "model", self.model, TOKENIZER_FILES, f"a tokenizer for data {self.data!r}")


# RunSpec fields that change how a cell is measured or what it writes beside the measurement, not
# what it runs: cells that differ only in these are the same *setup* to the history and its
# regression checks (results/history.py). Not among them: sync_each_step (it changes what the step
# time measures) and memory_snapshot (recording every allocation from set-up on slows the steps).
MEASUREMENT_FIELDS = (
    "steps",
    "warmup_steps",
    "seed",
    "nvml",
    "comm_profile_steps",
    "profile",
    "record_param_norm",
    "peak_tflops",
)
assert set(MEASUREMENT_FIELDS) <= {f.name for f in fields(RunSpec)}, "MEASUREMENT_FIELDS names RunSpec fields"


@dataclass(frozen=True)
class Resources:
    """What every array task of a sweep asks Slurm for, beside nodes and GPUs per node (in RunSpec)."""

    partition: str = "gpu"
    time_min: int = 30
    cpus_per_task: int = 1
    mem_gb: int = 0  # 0: the partition's default
    mem_auto: bool = False  # mem_gb: auto: the predicted host memory per node plus a margin (sweep/hostmemory.py)
    account: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = False
    array_parallelism: int = 64
    max_array_size: int = 0  # cells per array at most; 0: the cluster's MaxArraySize (scontrol show config)
    max_jobs_in_queue: int = 0  # your jobs (array tasks) queued at once at most, e.g. MaxSubmitJobs; 0: no cap
    gpu_request: GpuRequest = "gres"  # how GPUs are asked for: --gres=gpu:N, --gpus-per-node=N, or not at all
    max_requeue: int = 0  # requeues after the time-limit signal; the cell then starts over
    signal_delay_s: int = 90  # SIGUSR2 this long before the time limit (Slurm may send it up to 60 s early)
    cache_dir: str = ""  # exported as HPCFSDP_CACHE to the tasks; default: $HPCFSDP_CACHE where you submit
    gpu_name: str = ""  # the partition's GPU model (e.g. H200): plan --memory looks up its memory size
    gpu_memory_gib: float = 0.0  # GPU memory for plan --memory and submit --skip-predicted-oom; 0: from gpu_name
    extra_sbatch: dict[str, Any] = field(default_factory=dict)  # passed through: {"reservation": "x"}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "slurm") -> Resources:
        res = cls(**coerce_fields(cls, values, where))
        _require_choices(where, res)
        for name in ("time_min", "cpus_per_task", "array_parallelism", "signal_delay_s"):
            if getattr(res, name) < 1:
                raise SpecError(where, name, f"expected a positive integer, got {getattr(res, name)}")
        for name in ("mem_gb", "max_requeue", "max_array_size", "max_jobs_in_queue"):
            if getattr(res, name) < 0:
                raise SpecError(where, name, f"expected an integer >= 0, got {getattr(res, name)}")
        if res.gpu_memory_gib < 0:
            raise SpecError(where, "gpu_memory_gib", f"expected a number >= 0, got {res.gpu_memory_gib}")
        if res.gpu_name and not res.gpu_memory_gib and gpu_memory_gib(res.gpu_name) is None:
            known = ", ".join(known_memory_sizes())
            raise SpecError(
                where, "gpu_name", f"memory size of {res.gpu_name!r} unknown (known: {known}); set gpu_memory_gib"
            )
        if res.signal_delay_s >= res.time_min * 60:
            raise SpecError(
                where,
                "signal_delay_s",
                f"{res.signal_delay_s} s is not below the time limit (time_min {res.time_min} = {res.time_min * 60} s)",
            )
        for name, value in _text_fields(res):
            require_no_control_characters(where, name, value)
        _check_names(where, res)
        _check_extra_sbatch(where, res)
        return res

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_names(where: str, res: Resources) -> None:
    """The sbatch arguments that name something (names.py), and a cache_dir that can be a folder."""
    for name in ("partition", "account", "qos", "constraint"):
        problem = slurm_name_problem(getattr(res, name))
        if problem:
            raise SpecError(where, name, f"{problem}: {shown(getattr(res, name))}")
    if res.cache_dir:
        problem = name_problem(res.cache_dir)
        path = Path(res.cache_dir).expanduser()
        if not problem and _exists(path, where, "cache_dir") and not path.is_dir():
            problem = "a file, not a folder (the pre-download cache is a folder)"
        if problem:
            raise SpecError(where, "cache_dir", f"{problem}: {shown(res.cache_dir)}")


# sbatch options that hpcfsdp sets itself -> what to set instead ("": submitit's own); extra_sbatch
# must not repeat them.
SBATCH_SET_BY = {
    "partition": "slurm.partition",
    "time": "slurm.time_min",
    "cpus-per-task": "slurm.cpus_per_task",
    "mem": "slurm.mem_gb",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "exclusive": "slurm.exclusive",
    "array": "slurm.array_parallelism",
    "signal": "slurm.signal_delay_s",
    "requeue": "slurm.max_requeue",
    "gres": "slurm.gpu_request",
    "gpus-per-node": "slurm.gpu_request",
    "nodes": "the cells' nodes",
    "ntasks-per-node": "the cells' gpus_per_node",
    "job-name": "",
    "output": "",
    "error": "",
    "open-mode": "",
}


# An sbatch option name; anything else in a key (a newline, a space, '=', '#') would let the key
# end its `#SBATCH --key=value` line and start a line of shell in the batch script.
SBATCH_OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def _check_extra_sbatch(where: str, res: Resources) -> None:
    for key, value in res.extra_sbatch.items():
        if not isinstance(key, str) or not SBATCH_OPTION_NAME.fullmatch(key):
            raise SpecError(
                where,
                f"extra_sbatch.{key!r}",
                "expected an sbatch option name (letters, digits, '-' and '_', e.g. reservation)",
            )
        flag = key.replace("_", "-")
        if flag in SBATCH_SET_BY:
            hint = f"; set {SBATCH_SET_BY[flag]} instead" if SBATCH_SET_BY[flag] else ""
            raise SpecError(where, f"extra_sbatch.{key}", f"--{flag} is set by hpcfsdp{hint}")
        if not isinstance(value, (str, int, float, bool)) or value is False:
            raise SpecError(where, f"extra_sbatch.{key}", f"expected a string, a number or true, got {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(where, f"extra_sbatch.{key}", f"expected a finite number, got {value}")
        if isinstance(value, str):
            require_no_control_characters(where, f"extra_sbatch.{key}", value)
        # Options sbatch refuses beside one that hpcfsdp sets:
        if flag in ("mem-per-cpu", "mem-per-gpu") and (res.mem_gb or res.mem_auto):
            raise SpecError(
                where,
                f"extra_sbatch.{key}",
                f"sbatch takes only one of --{flag} and --mem "
                f"(slurm.mem_gb: {'auto' if res.mem_auto else res.mem_gb}); set mem_gb: 0",
            )
        if flag in ("gpus", "gpus-per-task", "gpus-per-socket") and res.gpu_request != "none":
            raise SpecError(
                where,
                f"extra_sbatch.{key}",
                f"GPUs are already asked for (slurm.gpu_request: "
                f"{res.gpu_request}); set gpu_request: none to ask with --{flag}",
            )


# `batch_size: auto` in a jobs YAML or on the command line: RunSpec.auto_batch (batch_size stays an int).
AUTO = "auto"
# The fields that take `auto`, and the flag that `auto` sets instead (the field keeps its default).
AUTO_FIELDS: dict[type, tuple[str, str]] = {RunSpec: ("batch_size", "auto_batch"), Resources: ("mem_gb", "mem_auto")}
# The fields whose values a `batch_size: auto` cell's record holds as the search chose them.
SEARCHED_FIELDS = ("batch_size", "grad_accum")
# The fields that say how the search ran (not what its cell then measured).
BATCH_SEARCH_FIELDS = ("auto_batch", "max_batch_size", "batch_margin", "batch_probe_steps")

# A model / data / tokenizer value written like this names a local path, which must exist.
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")


@functools.cache
def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))


def model_kind(value: str) -> str:
    """A model (or tokenizer) value: 'preset', 'local' (written as a path, or an existing folder),
    'hub' (ORG/NAME[@REV]), or '' when it is none of these."""
    return "preset" if value.lower() in preset_names() else _local_or_hub(value, ModelRef)


def data_kind(value: str) -> str:
    """A data value: 'synthetic', 'local', 'hub' (ORG/NAME[:config][@split] or a preset), or ''."""
    return "synthetic" if value == "synthetic" else _local_or_hub(value, DatasetRef)


def _local_or_hub(value: str, ref: type[ModelRef] | type[DatasetRef]) -> str:
    """'local' for a path, 'hub' for what `ref` parses, else ''."""
    if _is_local(value):
        return "local"
    try:
        ref.parse(value)
    except ValueError:
        return ""
    return "hub"


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_MARKERS)


def text_files(path: Path) -> Iterator[Path]:
    """The .txt/.json/.jsonl files of a data folder (recursively, hidden ones left out), or the file itself."""
    if path.is_file():
        yield from [path] if path.suffix in TEXT_SUFFIXES else []
        return
    for found in path.rglob("*"):
        if (
            found.suffix in TEXT_SUFFIXES
            and found.is_file()
            and not any(part.startswith(".") for part in found.relative_to(path).parts)
        ):
            yield found


def _is_local(value: str) -> bool:
    return value.startswith(LOCAL_PATH_PREFIXES) or _exists(Path(value))


def _exists(path: Path, where: str = "", key: str = "") -> bool:
    """Path.exists, for any text a user may write: a name the OS refuses (longer than a path or
    file name may be) is a SpecError when `key` names the value, else simply no such path."""
    try:
        return path.exists()
    except (OSError, ValueError) as exc:
        if key:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SpecError(where, key, f"not a usable path ({reason}): {shown(str(path))}") from None
        return False


def _require_folder_with(where: str, key: str, value: str, patterns: tuple[str, ...], what: str = "") -> None:
    """A local folder holding at least one file matching one of `patterns`."""
    path = Path(value).expanduser()
    if not (_exists(path, where, key) and path.is_dir()):
        raise SpecError(where, key, f"no such folder: {value}")
    if not any(next(path.glob(pattern), None) for pattern in patterns):
        raise SpecError(where, key, f"folder {value} has no {' or '.join(patterns)}" + (f" ({what})" if what else ""))


def _require_text_data(where: str, value: str) -> None:
    path = Path(value).expanduser()
    if not _exists(path, where, "data"):
        raise SpecError(where, "data", f"no such file or folder: {value}")
    if not (is_saved_dataset(path) or next(text_files(path), None)):
        raise SpecError(
            where,
            "data",
            f"{value}: expected {'/'.join(TEXT_SUFFIXES)} files with a 'text' field, "
            "or a folder written by datasets' save_to_disk",
        )


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def unknown_key(where: str, key: str, known: tuple[str, ...], section: str = "") -> SpecError:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(known)}"
    return SpecError(where, f"{section}.{key}" if section else str(key), f"unknown key{hint}")


def coerce_fields(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check names and types of user values against the dataclass fields (YAML gives plain types)."""
    types = _field_types(cls)
    out: dict[str, Any] = {}
    auto_key, auto_flag = AUTO_FIELDS.get(cls, ("", ""))
    auto = bool(auto_key) and values.get(auto_key) == AUTO
    if auto and values.get(auto_flag, True) is not True:
        raise SpecError(
            where, auto_flag, f"{shown(values[auto_flag])} contradicts {auto_key}: auto; leave {auto_flag} out"
        )
    for key, value in values.items():
        if key not in types:
            raise unknown_key(where, key, tuple(types))
        if auto and key == auto_key:
            out[auto_flag] = True  # the field keeps its default (batch_size: the search's first batch)
            continue
        out[key] = _coerce(where, key, value, types[key])
    return out


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """Each field's type, read off its default (annotations are strings here)."""
    return {
        f.name: type(f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
        for f in fields(cls)
    }


def _coerce(where: str, key: str, value: Any, expected: type) -> Any:
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(where, key, f"expected true or false, got {shown(value)}")
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpecError(
            where,
            key,
            f"expected an integer{' or auto' if key in ('batch_size', 'mem_gb') else ''}, got {shown(value)}",
        )
    if expected is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            raise SpecError(where, key, f"expected a finite number, got {shown(value)}")
        return number
    if expected is str:
        if key == "activation_checkpointing" and isinstance(value, bool):
            return "full" if value else "none"
        if isinstance(value, str):
            return value
        raise SpecError(where, key, f"expected a string, got {shown(value)}")
    if expected is dict:
        if isinstance(value, dict):
            return dict(value)
        raise SpecError(where, key, f"expected a mapping, got {shown(value)}")
    return value


@functools.cache
def choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields of a dataclass typed as a Literal, and their allowed values."""
    hints = get_type_hints(cls)
    return {name: get_args(hint) for name, hint in hints.items() if get_origin(hint) is Literal}


def _require_choices(where: str, instance: Any) -> None:
    for key, allowed in choices(type(instance)).items():  # type: ignore[arg-type]  # a class is hashable
        value = getattr(instance, key)
        if value not in allowed:
            close = difflib.get_close_matches(value, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(where, key, f"expected one of {', '.join(allowed)}; got {value!r}{hint}")


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def one_line(text: str) -> str:
    """`text` with control characters written as escapes: a message that quotes user input raw
    (a key, a path) still prints as one line."""
    return CONTROL_CHARACTERS.sub(lambda match: repr(match.group())[1:-1], text)


def require_no_control_characters(where: str, key: str, value: str) -> None:
    """No control character, nor one that is invisible or turns the text around (names.py): every
    text of a RunSpec, Resources and extra_sbatch reaches a path, an sbatch line or a report."""
    if CONTROL_CHARACTERS.search(value):
        raise SpecError(where, key, f"expected no control characters (newline, tab, NUL, ...), got {shown(value)}")
    unseen = unseen_character(value)
    if unseen:
        raise SpecError(
            where, key, f"holds {unseen}, a character that is invisible or changes the direction of the text around it"
        )


def check_folder_name(where: str, key: str, value: Any) -> None:
    """A name that becomes one folder (results/<name>): not . or .., no separator, fits a file name."""
    if (
        not isinstance(value, str)
        or value in ("", ".", "..")
        or "/" in value
        or "\\" in value
        or CONTROL_CHARACTERS.search(value)
        or len(value.encode()) > MAX_NAME_BYTES
    ):
        raise SpecError(
            where,
            key,
            "expected a folder-safe string (not . or .., no / or \\, no control characters, "
            f"at most {MAX_NAME_BYTES} bytes), got {shown(value)}",
        )
    problem = folder_name_problem(value)
    if problem:
        raise SpecError(where, key, f"{problem}: {shown(value)}")


def _text_fields(instance: Any) -> Iterator[tuple[str, str]]:
    """The free-text fields of a RunSpec or Resources and their values."""
    for name in _text_field_names(type(instance)):  # type: ignore[arg-type]  # a class is hashable
        yield name, getattr(instance, name)


@functools.cache
def _text_field_names(cls: type) -> tuple[str, ...]:
    """Fields typed str that are no choice (a Literal is checked against its values)."""
    return tuple(name for name, kind in _field_types(cls).items() if kind is str and name not in choices(cls))


def max_positions(config: Mapping[str, Any]) -> int | None:
    """How many positions a model config's position embedding covers; None when it does not say."""
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_seq_len(where: str, seq_len: int, config: Mapping[str, Any]) -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        key = next(k for k in POSITION_KEYS if config.get(k) == limit)
        raise SpecError(where, "seq_len", f"{seq_len} is beyond the model's {key} ({limit})")


@functools.cache
def _model_config(path: str) -> dict[str, Any]:
    """A config.json as a dict, read once per path; {} when it cannot be read (the cell then fails
    building the model, with a record that says why)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
