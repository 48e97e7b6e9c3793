"""Predicted peak GPU memory per rank of a cell, before anything is queued (`hpcfsdp plan --memory`).

An analytic model of what the one training loop allocates, read off the model's config.json (a
preset, a local folder, or a cached hub model: its Shape, modelshape.py) and the cell's RunSpec; no
torch, so it runs on a login node. docs/metrics.md derives each term; bench/memory_prediction.py compares it with the
measured peaks of the GPU records. Units are bytes unless a name says GiB. For a rank:

  states      parameters, AdamW's two states (and DDP's gradient buckets), 1/N of them under
              sharding over N ranks, none on the GPU with cpu_offload; with optimizer_order:
              before_shard, the whole unsharded model the optimizer holds instead of AdamW's states
  gathered    compute-dtype copies of parameters held unsharded at the start of backward: all of
              them for ZeRO-2 / SHARD_GRAD_OP / NO_SHARD (mixed precision), the root (embeddings,
              LM head) and the last layer for ZeRO-3 (FSDP1: the root unit and the largest other
              unit of its wrap_policy; `none`, the whole model), autocast's bf16 weight cache for DDP
  activations tensors autograd saves per token, per decoder layer and for the loss (the logits
              in fp32 three times over at the start of backward); a checkpointed layer saves its
              input only and recomputes one layer at a time
  peak        the largest of: the start of backward (states + gathered + all activations), the
              recomputation of a checkpointed layer, and the optimizer step (states + gradients +
              one optimizer-state-sized temporary of foreach AdamW); plus cuBLAS's workspaces

The measured peak (`peak_memory_gib`) is CUDA's peak allocated during training; model building
happens before its counter is reset, so `build_gib` (the full model in its storage dtype, before
sharding) is reported apart and counts only towards whether the cell fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...contracts.gpus import GPUS, gpu_memory_gib
from ...contracts.sources import Source
from ...contracts.spec import RunSpec
from ...contracts.strategies import STRATEGIES
from .modelshape import ModelConfigError, Shape, load_shape

GIB = 1024**3
# What the allocator never gets of a GPU: the CUDA context, NCCL's and cuBLAS's buffers, and the
# part the driver keeps (torch's total_memory is below nvidia-smi's). A cell fits when its
# predicted peak stays below capacity minus this.
RUNTIME_RESERVE_GIB = 2.0
TIGHT_FRACTION = 0.9  # above this share of the usable memory a prediction is flagged "tight"
# Inductor's partitioner recomputes cheap pointwise results instead of saving them: the saved
# activations of a compiled decoder layer relative to eager, measured on Qwen2.5-1.5B (2 x H200,
# FSDP2 ZeRO-2, bf16, seq 8192, batch 1 and 2: 36.92 and 66.58 GiB against 43.37 GiB eager).
COMPILE_ACTIVATION_FACTOR = 0.71
# The same with Liger's kernels, whose Triton autograd functions the compiler cannot look into
# (batch 2 x 8192 and 8 x 4096 tokens with Liger's fused loss: 40.61 and 73.44 GiB).
LIGER_COMPILE_ACTIVATION_FACTOR = 0.735
# cuBLAS's and cuBLASLt's workspaces (32 MiB each on Hopper), which torch allocates through its
# caching allocator: the whole 0.07 GiB peak of a tiny model's cell on 2 x H200.
WORKSPACE_GIB = 1 / 16


@dataclass(frozen=True)
class Prediction:
    """Predicted memory of one rank, GiB. `peak_gib` is comparable with a record's peak_memory_gib."""

    states_gib: float  # parameters, optimizer states, DDP buckets (per rank, between steps)
    gathered_gib: float  # unsharded compute copies at the start of backward (and DDP's autocast cache)
    activations_gib: float  # decoder layers (saved for backward)
    loss_gib: float  # final norm, logits and their gradients at the start of backward
    peak_gib: float  # training peak: the largest of the three moments
    peak_moment: str  # backward, recompute or optimizer
    build_gib: float  # the model as built, before sharding (not in the measured training peak)

    @property
    def required_gib(self) -> float:
        return max(self.peak_gib, self.build_gib)


def precision_bytes(spec: RunSpec) -> tuple[int, int, int]:
    """(storage, compute, residual stream) bytes per element for a spec's precision and strategy.

    Storage holds parameters, gradients and AdamW's states: fp32 unless pure bf16. Compute is what
    matmuls read and write: bf16 unless fp32. The residual stream is the compute dtype under FSDP's
    mixed-precision policy (it casts the inputs), but fp32 under DDP's autocast, where the
    embedding's output and every residual addition stay in the parameters' fp32.
    """
    storage = 2 if spec.precision == "bf16" else 4
    compute = 4 if spec.precision == "fp32" else 2
    autocast = spec.family in ("single", "ddp") and spec.precision == "bf16_mixed"
    residual = 4 if spec.precision == "fp32" or autocast else compute
    return storage, compute, residual


def shard_degree(spec: RunSpec) -> int:
    """How many ranks share one copy of the parameters and optimizer states."""
    if spec.strategy in ("single", "ddp", "fsdp1_no_shard"):
        return 1
    if STRATEGIES[spec.strategy].hybrid:
        return spec.hsdp_shard_size or spec.gpus_per_node
    return spec.world_size


def layer_activation_bytes(shape: Shape, spec: RunSpec) -> float:
    """Bytes autograd saves per token in one eager decoder layer (HF Llama/Qwen2 code, SDPA with
    grouped KV heads, no dropout). Each RMSNorm: its input upcast to fp32, its fp32 reciprocal
    root mean square, the normalised value in the residual dtype, and its output as the next
    matmuls' input (under autocast, each matmul saves its own bf16 cast of it); attention: q, k, v
    after RoPE, the SDPA output (which o_proj reads in place: flash attention's output is laid out
    token-major already) and its fp32 log-sum-exp per head; the MLP: gate and up outputs,
    SiLU(gate), and down_proj's input. Liger's kernels (without compile) save the norms' input
    only and recompute SiLU. float8 matmuls save their input as float8 (1 byte) instead."""
    _, c, r = precision_bytes(spec)
    h, f = shape.hidden, shape.intermediate
    attention = c * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    matmul_in = 1 if spec.float8 != "none" else c  # what a matmul saves of its input, per element
    if spec.float8 != "none":
        attention += shape.q_dim  # o_proj's float8 copy of the SDPA output
    if spec.kernels == "liger" and not spec.compile:
        return 2 * (r * h + matmul_in * h + 4) + attention + 2 * c * f + matmul_in * f
    norms = _norm_bytes(shape, spec, readers=3) + _norm_bytes(shape, spec, readers=2)
    eager = norms + attention + 3 * c * f + matmul_in * f
    if not spec.compile:
        return eager
    return eager * (LIGER_COMPILE_ACTIVATION_FACTOR if spec.kernels == "liger" else COMPILE_ACTIVATION_FACTOR)


CCE_FP32_ACCUMULATION = ("cce_kahan_full_c", "cce_exact")  # sum both gradients in fp32


def loss_bytes(shape: Shape, spec: RunSpec) -> float:
    """Per token at the start of backward: the final norm, and the loss's logits: HF upcasts them to
    fp32, log-softmax saves its fp32 output, and backward adds the fp32 gradient of the loss and of
    log-softmax's input (12 bytes per vocabulary entry). Liger's fused linear cross-entropy never
    forms the logits; it keeps the hidden state's gradient and a chunk (and, apart from the
    tokens, the LM head's gradient: loss_fixed_bytes). Cut-cross-entropy keeps the hidden state
    and a log-sum-exp per token; its fp32-accumulating variants sum the hidden state's gradient in
    fp32 (4 more bytes per hidden unit)."""
    c = precision_bytes(spec)[1]
    labels = 8  # int64 targets
    final_norm = _norm_bytes(shape, spec, float8=False)  # the LM head stays in bf16
    if spec.loss == "default":
        return final_norm + labels + 12 * shape.vocab
    if spec.loss == "compiled":  # the logits and their gradient, in the compute dtype (levers._compiled_loss)
        return final_norm + labels + 2 * c * shape.vocab
    fp32_sum = 4 * shape.hidden if spec.loss in CCE_FP32_ACCUMULATION else 0
    return final_norm + labels + (c + 4) * shape.hidden + fp32_sum


def loss_fixed_bytes(shape: Shape, spec: RunSpec) -> float:
    """Bytes the loss holds whatever the number of tokens: Liger's fused linear cross-entropy
    computes the LM head weight's gradient during forward, in the weight's compute dtype; the
    fp32-accumulating cut-cross-entropy variants sum it into an fp32 buffer during backward."""
    if spec.loss == "liger":
        return shape.embedding_params * precision_bytes(spec)[1]
    return shape.embedding_params * 4.0 if spec.loss in CCE_FP32_ACCUMULATION else 0.0


def _norm_bytes(shape: Shape, spec: RunSpec, readers: int = 1, float8: bool = True) -> int:
    """An RMSNorm and the input of the `readers` matmuls that read its output (q, k, v; gate, up;
    the LM head): one tensor, unless autocast (or float8) casts the output for each of them."""
    _, c, r = precision_bytes(spec)
    if float8 and spec.float8 != "none":
        return (4 + r + readers) * shape.hidden + 4
    return (4 + r + c * (readers if r != c else 1)) * shape.hidden + 4


def predict(spec: RunSpec, shape: Shape) -> Prediction:
    p = precision_bytes(spec)[0]
    n = shard_degree(spec)
    params, tokens = shape.params, spec.batch_size * spec.seq_len
    # Seed 003's bug: an optimizer built before sharding holds the unsharded parameters, which stay
    # on the GPU beside the shards and get no gradient, so AdamW makes no state and steps nothing.
    stale = spec.optimizer_order == "before_shard"
    states = 0.0 if spec.cpu_offload else (1 if stale else 3) * params * p / n  # parameters, exp_avg, exp_avg_sq
    states += params * p if stale else 0.0
    grads = 0.0 if spec.cpu_offload else params * p / n
    if spec.strategy == "ddp":
        states += params * p  # gradient buckets (gradient_as_bucket_view=False keeps them beside .grad)
    gathered = _gathered_bytes(spec, shape)
    per_layer = layer_activation_bytes(shape, spec)
    checkpointed = _checkpointed_layers(spec, shape.layers)
    saved = tokens * ((shape.layers - checkpointed) * per_layer + checkpointed * checkpoint_bytes(shape, spec))
    loss = tokens * loss_bytes(shape, spec) + loss_fixed_bytes(shape, spec)
    moments = {
        "backward": states + gathered + saved + loss,
        # a checkpointed layer recomputed in backward, with its activations' gradients beside it
        "recompute": states + gathered + grads + saved + 2 * tokens * per_layer if checkpointed else 0.0,
        "optimizer": states + grads + (0.0 if stale else optimizer_temporary(spec, shape, params * p / n)),
    }
    moment = max(moments, key=lambda name: moments[name])
    workspace = WORKSPACE_GIB if spec.device != "cpu" else 0.0
    return Prediction(
        states_gib=states / GIB,
        gathered_gib=gathered / GIB,
        activations_gib=saved / GIB,
        loss_gib=loss / GIB,
        peak_gib=moments[moment] / GIB + workspace,
        peak_moment=moment,
        build_gib=0.0 if spec.meta_init else params * p / GIB,
    )


def _gathered_bytes(spec: RunSpec, shape: Shape) -> float:
    c = precision_bytes(spec)[1]
    if spec.family in ("single", "ddp"):
        # autocast caches a bf16 copy of every weight a matmul reads (the layers' and the LM head)
        matmul_weights = shape.layers * shape.layer_params + shape.embedding_params
        return 2 * matmul_weights if spec.precision == "bf16_mixed" else 0.0
    if spec.strategy == "fsdp1_no_shard":
        # the parameters are whole already; mixed precision adds their bf16 copy
        return shape.params * c if spec.precision == "bf16_mixed" else 0.0
    layer = shape.layer_params * c
    if spec.float8_all_gather:  # FSDP2 gathers the matmul weights in float8
        layer -= shape.layer_matmul_params * (c - 1)
    if not STRATEGIES[spec.strategy].reshard_after_forward:
        return shape.root_params * c + shape.layers * layer  # ZeRO-2: every layer stays gathered until backward
    if spec.family == "fsdp1" and spec.wrap_policy != "layer":
        root, largest = fsdp1_units(shape, spec)
        return (root + largest) * c  # what the root unit keeps, and the largest other unit gathered
    return shape.root_params * c + layer  # ZeRO-3: the root and the last layer


def fsdp1_units(shape: Shape, spec: RunSpec) -> tuple[int, int]:
    """(parameters of FSDP1's root unit, of its largest other unit) under wrap_policy none or size.
    `none`: the whole model is the root unit, gathered from the first forward to the end of
    backward. `size` (torch's size_based_auto_wrap_policy): bottom-up, a module of at least
    min_num_params not wrapped below it becomes a unit (never a ModuleList); what no unit takes
    stays in the root unit, which FSDP1 does not reshard after forward."""
    if spec.wrap_policy == "none":
        return shape.params, 0
    h, f, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    attention = [h * q + q * shape.qkv_bias, h * kv + kv * shape.qkv_bias, h * kv + kv * shape.qkv_bias]
    attention += [q * h + h * shape.o_bias]
    mlp = [h * f + f * shape.mlp_bias] * 2 + [f * h + h * shape.mlp_bias]
    norms = 2 * h + 2 * shape.head_dim * shape.qk_norm
    units: list[int] = []

    def left(children: list[int], own: int = 0, wrappable: bool = True) -> int:
        """What a module leaves to its parent (children: what each of its own left): nothing once
        it is a unit. A module under min_num_params is not looked into: nothing below it is either."""
        remaining = own + sum(children)
        if wrappable and remaining >= spec.min_num_params:
            units.append(remaining)
            return 0
        return remaining

    def leaves(sizes: list[int]) -> list[int]:
        return [left([], size) for size in sizes]

    layer = left([left(leaves(attention)), left(leaves(mlp))], norms)
    layers = left([layer] * shape.layers, wrappable=False)  # a ModuleList is never a unit
    inner = left([*leaves([shape.embedding_params]), layers], h)  # the decoder: embedding, layers, final norm
    head = 0 if shape.tied else leaves([shape.embedding_params])[0]
    return inner + head, max(units, default=0)


def checkpoint_bytes(shape: Shape, spec: RunSpec) -> float:
    """Per token, what a checkpointed layer keeps until its backward: its input (non-reentrant
    checkpointing holds the arguments), and under the op-level policy (`op`) also the outputs it
    saves: SDPA's output and log-sum-exp, and every other matmul's (q, v, gate and down in a
    Llama-style layer's order q, k, v, o, gate, up, down)."""
    _, c, r = precision_bytes(spec)
    kept = r * shape.hidden
    if spec.activation_checkpointing == "op":
        kept += c * (2 * shape.q_dim + shape.kv_dim + shape.intermediate + shape.hidden) + 4 * shape.heads
    return kept


def _checkpointed_layers(spec: RunSpec, layers: int) -> int:
    if spec.activation_checkpointing in ("full", "op"):
        return layers
    if spec.activation_checkpointing == "selective":
        return math.ceil(layers / spec.checkpoint_every)  # layers 0, k, 2k, ...
    return 0


def optimizer_temporary(spec: RunSpec, shape: Shape, state_bytes: float) -> float:
    """foreach AdamW builds sqrt(exp_avg_sq) for all parameters at once; plain AdamW one parameter
    at a time (the embedding is the largest); fused AdamW none. Offloaded states step on the CPU."""
    if spec.cpu_offload or spec.adamw_impl == "fused":
        return 0.0
    if spec.adamw_impl == "plain":
        return state_bytes * shape.embedding_params / shape.params
    return state_bytes


def usable_gib(capacity_gib: float) -> float:
    return capacity_gib - RUNTIME_RESERVE_GIB


def fit(prediction: Prediction, capacity_gib: float | None) -> str:
    """'fits', 'tight' (above TIGHT_FRACTION of the usable memory), 'oom', or '' when capacity is unknown."""
    if capacity_gib is None:
        return ""
    usable = usable_gib(capacity_gib)
    if prediction.required_gib > usable:
        return "oom"
    return "tight" if prediction.required_gib > TIGHT_FRACTION * usable else "fits"


def largest_fitting_batch(spec: RunSpec, shape: Shape, capacity_gib: float) -> int:
    """batch_size: auto's predicted outcome: the largest batch up to its cap predicted to stay
    within (1 - batch_margin) of the usable memory; 0 when not even its first batch does."""
    limit = usable_gib(capacity_gib) * (1 - spec.batch_margin)
    largest = 0
    for batch in range(spec.batch_size, spec.batch_cap + 1):  # memory grows with the batch: stop at the first miss
        if predict(spec.replace(batch_size=batch), shape).required_gib > limit:
            break
        largest = batch
    return largest


def batch_prediction(spec: RunSpec, shape: Shape, capacity: float | None) -> dict[str, Any]:
    """What a `batch_size: auto` cell needs to start its search at the predicted batch (the cell
    folder's spec.json; cell/batch_search.py's predicted_batch applies largest_fitting_batch's rule
    to it with the memory it finds): the predicted peak per batch from spec.batch_size up to the cap
    or past the largest GPU, the reserve, and the sweep's GPU memory where it names one."""
    ceiling = capacity or max(gpu.memory_gib or 0.0 for gpu in GPUS)
    required = []
    for batch in range(spec.batch_size, spec.batch_cap + 1):
        required.append(round(predict(spec.replace(batch_size=batch), shape).required_gib, 4))
        if required[-1] > ceiling:
            break
    return {"capacity_gib": capacity, "reserve_gib": RUNTIME_RESERVE_GIB, "required_gib": required}


def batch_predictions(cells, capacity: float | None, cache_dir: str | None = None) -> dict[str, dict[str, Any]]:
    """batch_prediction of each `batch_size: auto` cell whose model's config is at hand, by cell id."""
    shapes: dict[Source, Shape | None] = {}
    found = {}
    for cell in cells:
        if not cell.spec.auto_batch:
            continue
        if cell.sources.model not in shapes:
            try:
                shapes[cell.sources.model] = load_shape(cell.sources.model, cache_dir)
            except ModelConfigError:
                shapes[cell.sources.model] = None
        if (shape := shapes[cell.sources.model]) is not None:
            found[cell.id] = batch_prediction(cell.spec, shape, capacity)
    return found


def capacity_gib(gpu_memory: float, gpu_name: str) -> float | None:
    """The GPU memory a sweep's cells get: slurm.gpu_memory_gib, else slurm.gpu_name looked up."""
    if gpu_memory:
        return gpu_memory
    return gpu_memory_gib(gpu_name) if gpu_name else None


@dataclass(frozen=True)
class CellPrediction:
    """One cell's row of `plan --memory`; `batch` is batch_size: auto's predicted choice."""

    cell_id: str
    spec: RunSpec
    batch: int
    prediction: Prediction | None  # None when the model's config is not at hand (note says why)
    fit: str  # fits / tight / oom, or '' (no capacity, a CPU cell, or no prediction)
    note: str = ""


def predict_cells(cells, capacity: float | None, cache_dir: str | None = None) -> list[CellPrediction]:
    """Predictions for cells (anything with .id, .spec and .sources); a model whose config is not
    at hand gets a row with the reason instead."""
    shapes: dict[Source, Shape | ModelConfigError] = {}
    rows = []
    for cell in cells:
        spec, model = cell.spec, cell.sources.model
        if model not in shapes:
            try:
                shapes[model] = load_shape(model, cache_dir)
            except ModelConfigError as exc:
                shapes[model] = exc
        shape = shapes[model]
        if isinstance(shape, ModelConfigError):
            rows.append(CellPrediction(cell.id, spec, spec.batch_size, None, "", str(shape)))
            continue
        if spec.device == "cpu" or capacity is None:
            rows.append(CellPrediction(cell.id, spec, spec.batch_size, predict(spec, shape), "", shape.origin))
            continue
        batch = largest_fitting_batch(spec, shape, capacity) if spec.auto_batch else spec.batch_size
        prediction = predict(spec.replace(batch_size=max(batch, 1)), shape)
        if not batch:
            note = f"batch {spec.batch_size} is predicted not to fit"
            rows.append(CellPrediction(cell.id, spec, 0, prediction, "oom", note))
            continue
        rows.append(CellPrediction(cell.id, spec, batch, prediction, fit(prediction, capacity), shape.origin))
    return rows
