"""Performance levers beside the strategy: the SDPA backend, the loss, float8 matmuls, and op-level
selective activation checkpointing (docs/levers.md).

Each is a RunSpec field. The packages behind them (torchao, cut-cross-entropy, liger-kernel: the
`gpu` extra) are imported here, lazily, and only when their lever is on.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from ..contracts.spec import RunSpec
from ..extras import CCE_FP32_VERSION, CCE_REQUIREMENT, EXTRA, PACKAGES, installed_version

FLOAT8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper and later
GPU_ONLY_LEVERS = ("attention", "loss", "float8")


def require(module: str, lever: str) -> ModuleType:
    """Import `module` of one of the extra's packages, or fail in one line naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = next(p.distribution for p in PACKAGES if p.module == module.split(".")[0])
        raise RuntimeError(
            f"{lever} needs the {top} package, which is not installed here ({exc}); pip install 'hpcfsdp[{EXTRA}]'"
        ) from None


def check_device(spec: RunSpec, device: torch.device) -> None:
    """The run-time half of spec.py's checks: `device: auto` may have resolved to the CPU, and the
    GPU may be too old for float8."""
    if device.type != "cuda":
        on = [f"{name}: {getattr(spec, name)}" for name in GPU_ONLY_LEVERS if _needs_gpu(spec, name)]
        if on:
            raise RuntimeError(f"{', '.join(on)} need a GPU, and this run is on {device.type}")
        return
    if spec.float8 != "none" and torch.cuda.get_device_capability(device) < FLOAT8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"float8: {spec.float8} needs float8 tensor cores (compute capability 8.9 or newer); "
            f"{name} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        )


def _needs_gpu(spec: RunSpec, name: str) -> bool:
    value = getattr(spec, name)
    return {"attention": value != "sdpa", "loss": value == "liger", "float8": value != "none"}[name]


# --- attention -------------------------------------------------------------------------------


def attention_backend(spec: RunSpec) -> AbstractContextManager:
    """SDPA restricted to one backend (`sdpa_kernel`), or PyTorch's own choice for `sdpa`.

    Entered around forward and backward; with compiled layers it must also be active when they
    are traced, which it is, since every step runs inside it.
    """
    if spec.attention == "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[spec.attention]
    return sdpa_kernel(backend)


# --- loss ------------------------------------------------------------------------------------

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, lm_head weight, labels)


def install_loss(model: nn.Module, spec: RunSpec, device: torch.device) -> None:
    """Replace the model's forward by one that feeds the final hidden state and the LM head's weight
    to the loss of `spec.loss`: a fused linear cross-entropy, so the [tokens x vocab] logits are
    never materialised (cce*, liger), or the LM head and cross-entropy in one compiled function
    (compiled).

    The loss equals the model's own: next-token cross-entropy, mean over batch x (seq - 1). The
    forward is replaced on the instance, so DDP and FSDP still call it through the module (under
    FSDP2 the root's pre-forward hook gathers the LM head's weight before it runs, its
    post-forward hook frees it, and backward gathers it again).
    """
    if spec.loss == "default":
        return
    lm_head: nn.Module | None = getattr(model, "lm_head", None)
    if lm_head is None or getattr(lm_head, "bias", None) is not None:
        raise RuntimeError(f"loss: {spec.loss} needs a model with a bias-free lm_head; use loss: default")
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if spec.loss == "compiled":
        loss_fn = _compiled_loss(softcap)
    elif spec.loss == "liger":
        loss_fn = _liger_loss(softcap)
    else:
        loss_fn = _cce_loss(spec.loss, device, softcap)
    decoder = model.get_submodule("model")
    from transformers.modeling_outputs import CausalLMOutput

    def forward(input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> CausalLMOutput:
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        weight = cast(torch.Tensor, lm_head.weight)  # the gathered one while FSDP runs this forward
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        return CausalLMOutput(loss=loss_fn(hidden.to(dtype), weight.to(dtype), labels))

    model.forward = forward


def _compiled_loss(softcap: float | None) -> LossFn:
    """The model's own loss, computed as torchtitan computes its loss: the LM head, the fp32 upcast
    and cross-entropy inside one torch.compile'd function.

    Hugging Face's loss upcasts the whole [tokens x vocab] logits to fp32 in eager mode, and
    log-softmax saves another fp32 copy: 12 bytes per logit at the start of backward. Compiled,
    the upcast happens inside the fused log-sum-exp and gradient kernels, so only the bf16 logits
    and their bf16 gradient are ever held (4 bytes per logit), and the kernels read them once.
    The same function: the last position predicts nothing, the mean is over batch x (seq - 1).
    """

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden[:, :-1], weight)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())

    return cast(LossFn, torch.compile(loss))


def _cce_loss(variant: str, device: torch.device, softcap: float | None) -> LossFn:
    """cut-cross-entropy: its Triton kernels on a GPU, as `variant` (the library's name for it);
    on the CPU its torch.compile implementation (the same loss, with the logits formed inside one
    compiled function, and exact gradients whatever the variant).

    `cce` skips gradient entries below bf16's resolution and sums the gradients in bf16: fast, and
    meant for fine-tuning. `cce_kahan_full_c` sums in fp32 and keeps every LM-head gradient (the
    library's advice for pretraining); `cce_exact` also keeps every hidden-state gradient. Those
    two need cut-cross-entropy 25.6 or later, which is released on GitHub only (docs/levers.md).
    """
    cce = require("cut_cross_entropy", f"loss: {variant}")
    impl = variant if device.type == "cuda" else "torch_compile"
    known = getattr(cce, "LinearCrossEntropyImpl", None)
    if known is None or impl.upper() not in known.__members__:
        this = installed_version("cut-cross-entropy") or "an unknown version"
        raise RuntimeError(
            f"loss: {variant} needs cut-cross-entropy {CCE_FP32_VERSION} or later (this is {this}); "
            f"pip install '{CCE_REQUIREMENT}'"
        )

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cce.linear_cross_entropy(hidden, weight, labels, shift=True, softcap=softcap, impl=impl)

    return loss


def _liger_loss(softcap: float | None) -> LossFn:
    liger = require("liger_kernel.transformers", "loss: liger")
    fused = liger.LigerFusedLinearCrossEntropyLoss(softcap=softcap)

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return fused(weight, shifted, labels[:, 1:].reshape(-1))

    return loss


# --- float8 ----------------------------------------------------------------------------------


def convert_float8(model: nn.Module, spec: RunSpec) -> None:
    """Swap the decoder's nn.Linear layers for torchao's Float8Linear (before compile and sharding).

    The LM head stays in bf16, as do layers whose sizes are not multiples of 16 (float8 matmuls
    need them). tensorwise under FSDP2 all-gathers the weights in float8 and takes their scales
    from `precompute_float8_scales` after each optimizer step; rowwise all-gathers in bf16.
    """
    if spec.float8 == "none":
        return
    float8 = require("torchao.float8", f"float8: {spec.float8}")
    if spec.float8 == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=spec.float8_all_gather)
    else:
        config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    float8.convert_to_float8_training(model, module_filter_fn=_float8_eligible, config=config)


def _float8_eligible(module: nn.Linear, fqn: str) -> bool:
    return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_linear_count(model: nn.Module) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def add_float8_scale_hook(optimizer: torch.optim.Optimizer, model: nn.Module, spec: RunSpec) -> None:
    """float8 all-gather (tensorwise, FSDP2, several ranks): after every optimizer step, compute
    the float8 scales of all sharded weights in one all-reduce (torchao's
    precompute_float8_dynamic_scale_for_fsdp), rather than one per weight at its all-gather. A
    hook on the optimizer, so the training loop is unchanged."""
    if not spec.float8_all_gather:
        return
    precompute = require("torchao.float8", "float8: tensorwise").precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))


# --- op-level selective activation checkpointing ---------------------------------------------


def op_checkpoint_context() -> tuple[AbstractContextManager, AbstractContextManager]:
    """torchtitan's `op` policy for one checkpointed layer call (torch.utils.checkpoint's
    selective checkpointing): keep the outputs of attention, of reduce-scatters and max, and of
    every other matmul; recompute everything else (norms, activations, RoPE, the other matmuls).

    Matmuls are mm and addmm (a Linear with a bias, as Qwen2's q/k/v projections, is addmm),
    counted separately in the forward and in the recompute so both keep the same ones.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, saved = _matmul_ops(), _saved_ops()
    count: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in matmuls:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        else:
            keep = func in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _matmul_ops() -> set:
    return {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _saved_ops() -> set:
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        aten.max.default,
    }
