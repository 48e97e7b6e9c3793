"""The memory prediction (hpcfsdp/sweep/predict/memory.py): its parts by hand and against torch on the CPU, its
accuracy on the project's GPU records, and `plan --memory` / `submit --skip-predicted-oom`."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from hpcfsdp.cell.models import build_model, resolve_model
from hpcfsdp.cell.strategies import param_dtype
from hpcfsdp.cell.train import build_optimizer
from hpcfsdp.cli import main
from hpcfsdp.contracts.sources import model_source, preset_names
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.sweep.predict.memory import GIB, WORKSPACE_GIB, fsdp1_units, layer_activation_bytes, loss_bytes, predict
from hpcfsdp.sweep.predict.modelshape import load_shape
from test_layout import loaded_by

sys.path.insert(0, str(ROOT / "bench"))
import memory_prediction


@pytest.mark.parametrize("preset", preset_names())
def test_parameter_count_matches_the_model_transformers_builds(preset):
    with torch.device("meta"):
        model = build_model(resolve_model(model_source(preset)), torch.float32, torch.device("meta"), 0, meta=True)
    assert load_shape(model_source(preset)).params == sum(p.numel() for p in model.parameters())


def saved_bytes_per_token(model, vocab: int, autocast: bool) -> float:
    """Bytes autograd saves for backward per token (forward only, parameters left out), from the
    difference between two batch sizes: what does not grow with the tokens cancels."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(batch: int) -> int:
        storages: dict[int, int] = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in params:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        tokens = torch.randint(0, vocab, (batch, 64))
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        ):
            model(input_ids=tokens, labels=tokens)
        return sum(storages.values())

    return (saved(4) - saved(2)) / (2 * 64)


@pytest.mark.parametrize(
    "strategy, precision", [("fsdp2_zero3", "fp32"), ("fsdp2_zero3", "bf16"), ("ddp", "bf16_mixed")]
)
def test_saved_activations_per_token_match_autograd_on_cpu(strategy, precision):
    """fp32; pure bf16 (what FSDP's mixed precision computes in); and DDP's autocast, whose
    residual stream stays fp32. In forward the loss saves log-softmax's fp32 output (4 bytes per
    vocabulary entry); backward adds two more fp32 logits-sized gradients (12 in the prediction)."""
    spec = RunSpec(device="cpu", strategy=strategy, precision=precision, seq_len=64)
    shape = load_shape(model_source("tiny"))
    model = build_model(resolve_model(model_source("tiny")), param_dtype(spec), torch.device("cpu"), 0)
    measured = saved_bytes_per_token(model, shape.vocab, autocast=precision == "bf16_mixed")
    forward = shape.layers * layer_activation_bytes(shape, spec) + loss_bytes(shape, spec) - 8 * shape.vocab
    assert measured == pytest.approx(forward, rel=0.01)


def test_states_are_the_parameters_gradients_and_adamw_moments_torch_allocates():
    spec = RunSpec(device="cpu", strategy="fsdp2_zero3", precision="fp32", gpus_per_node=1, seq_len=64)
    model = build_model(resolve_model(model_source("tiny")), torch.float32, torch.device("cpu"), 0)
    optimizer = build_optimizer(model, spec)
    tokens = torch.randint(0, 512, (2, 64))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    tensors = [*model.parameters(), *(s for state in optimizer.state.values() for s in state.values() if s.dim())]
    states = sum(t.numel() * t.element_size() for t in tensors)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    prediction = predict(spec, load_shape(model_source("tiny")))
    assert prediction.states_gib * GIB == states == 3 * grads  # parameters + exp_avg + exp_avg_sq, one shard


def test_the_peak_of_a_zero3_cell_by_hand():
    """Qwen2.5-1.5B, FSDP2 ZeRO-3 over 2 ranks, bf16, one sequence of 8192 tokens (the record of
    2026-11-22 measured 41.02 GiB)."""
    spec = RunSpec(model="qwen2.5-1.5b", strategy="fsdp2_zero3", gpus_per_node=2, precision="bf16", seq_len=8192)
    h, f, v, layers, kv = 1536, 8960, 151936, 28, 2 * 128
    params = 1_543_714_304
    layer = 3 * h * f + 2 * h * h + 2 * h * kv + h + 2 * kv + 2 * h  # MLP, q/o, k/v, q/k/v biases, norms
    states = 3 * params * 2 / 2  # bf16 parameters and two AdamW moments, half of them per rank
    gathered = (v * h + h + layer) * 2  # the root (tied embedding, final norm) and the last layer
    norm = (4 + 2 + 2) * h + 4  # fp32 upcast, normalised bf16, output bf16, fp32 rsqrt
    per_layer = 2 * norm + 2 * (2 * h + 2 * kv) + 4 * 12 + 4 * 2 * f  # norms, q/out/k/v + lse, MLP
    loss = norm + 8 + 12 * v
    expected = (states + gathered + 8192 * (layers * per_layer + loss)) / GIB + WORKSPACE_GIB
    prediction = predict(spec, load_shape(model_source("qwen2.5-1.5b")))
    assert prediction.peak_moment == "backward"
    assert prediction.peak_gib == pytest.approx(expected, rel=1e-9)
    assert prediction.peak_gib == pytest.approx(41.02, rel=0.02)


def test_fsdp1_without_a_wrap_policy_is_predicted_to_gather_the_whole_model():
    """FSDP1's `wrap_policy: none` makes the model one unit: every layer is gathered from the first
    forward to the end of backward (for a 7B, about 12 GiB of bf16 weights more than `layer`)."""
    base = dict(model="codellama-7b", strategy="fsdp1_full_shard", gpus_per_node=8, seq_len=2048, device="cuda")
    shape = load_shape(model_source("codellama-7b"))
    layer, none, size = (predict(RunSpec(**base, wrap_policy=policy), shape) for policy in ("layer", "none", "size"))
    whole = (shape.root_params + shape.layers * shape.layer_params) * 2 / GIB  # bf16 copies
    assert none.gathered_gib == pytest.approx(whole)
    assert none.peak_gib - layer.peak_gib == pytest.approx((shape.layers - 1) * shape.layer_params * 2 / GIB)
    assert 11 < none.peak_gib - layer.peak_gib < 13
    # size: each 7B MLP (135M of a 202M layer), the embedding and the LM head (131M each) are units, and
    # the decoder, with the attention of every layer (67M each), is the largest: nothing is left to the root
    root, largest = fsdp1_units(shape, RunSpec(**base, wrap_policy="size"))
    assert root == 0 and largest == 32 * (4 * 4096 * 4096 + 2 * 4096) + 4096
    assert size.gathered_gib == pytest.approx((root + largest) * 2 / GIB)
    # Qwen2.5-1.5B: 47M a layer, under min_num_params: the decoder but its (tied) embedding is one unit
    qwen = load_shape(model_source("qwen2.5-1.5b"))
    small = RunSpec(**dict(base, model="qwen2.5-1.5b"), wrap_policy="size")
    assert fsdp1_units(qwen, small) == (0, qwen.params - qwen.embedding_params)


def test_checkpointing_keeps_each_layers_input_only():
    base = dict(model="qwen2.5-1.5b", strategy="fsdp2_zero3", gpus_per_node=2, seq_len=4096, batch_size=4)
    shape = load_shape(model_source("qwen2.5-1.5b"))
    none, full = (predict(RunSpec(**base, activation_checkpointing=mode), shape) for mode in ("none", "full"))
    assert full.activations_gib * GIB == 4 * 4096 * 28 * 2 * 1536  # bf16 inputs of 28 layers
    assert full.loss_gib == none.loss_gib and full.peak_gib < none.peak_gib / 1.5


def test_prediction_is_within_15_percent_of_every_gpu_record():
    lines, worst = memory_prediction.table([memory_prediction.DEFAULT])
    assert len(lines) >= 30 and {line[0] for line in lines} >= {"qwen2.5-1.5b", "smollm3-3b", "codellama-7b"}
    assert worst <= 0.15


def jobs(tmp_path, gpu_memory_gib: float = 80):
    path = tmp_path / "mem.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: mem
        base: {{model: qwen2.5-1.5b, seq_len: 4096, gpus_per_node: 2, strategy: fsdp2_zero3}}
        slurm: {{gpu_memory_gib: {gpu_memory_gib}}}
        matrix:
          batch_size: [1, 8, auto]
        """)
    )
    return path


def test_plan_memory_flags_cells_predicted_not_to_fit_and_loads_no_torch(tmp_path, capsys):
    path = jobs(tmp_path)
    assert loaded_by(["plan", str(path), "--memory"]) == {"code": 0, "loaded": []}
    assert main(["plan", str(path), "--memory"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("fsdp2_zero3-")}
    by_batch = {line.split()[2]: line for line in rows.values()}
    assert by_batch["1"].split()[-1] == "fits" and by_batch["8"].split()[-1] == "OOM"
    assert by_batch["auto:3"].split()[-1] in ("fits", "tight")  # 80 GiB: batch 3 is the largest predicted to fit
    assert "GPU memory 80 GiB, 78 usable" in out and "1 cell(s) predicted not to fit" in out


def test_submit_skips_the_cells_predicted_not_to_fit(tmp_path, capsys):
    assert (
        main(
            [
                "submit",
                str(jobs(tmp_path)),
                "--executor",
                "print",
                "--skip-predicted-oom",
                "--results-dir",
                str(tmp_path / "results"),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    commands = captured.out.strip().splitlines()
    assert len(commands) == 2 and not any("-b8-" in c for c in commands)
    assert "skipping fsdp2_zero3-b8-" in captured.err and "--skip-predicted-oom" in captured.err


def test_skip_predicted_oom_without_a_gpu_size_is_one_line_error(tmp_path, capsys):
    path = tmp_path / "nosize.yaml"
    path.write_text("base: {model: qwen2.5-1.5b, gpus_per_node: 2}\n")
    assert main(["submit", str(path), "--executor", "print", "--skip-predicted-oom"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_memory_gib" in err and "gpu_name" in err


def test_submit_warns_of_the_cells_predicted_not_to_fit_with_their_gpu_hours_and_how_to_skip_them(tmp_path, capsys):
    argv = ["submit", str(jobs(tmp_path)), "--executor", "print", "--results-dir", str(tmp_path / "results")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 3  # warned, not skipped
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    # batch 8 at 80 GiB: 2 GPUs x the default 30 min limit
    assert warning == (
        "warning: 1 cell(s) predicted not to fit in 80 GiB per GPU (`hpcfsdp plan --memory` shows why), "
        "up to 1.0 GPU-hours at their time limit; --skip-predicted-oom leaves them out"
    )


def test_plan_memory_predicts_that_an_optimizer_built_before_sharding_keeps_the_whole_model(tmp_path, capsys):
    """Seed 003: the optimizer built before sharding holds the unsharded parameters (they stay beside
    the shards, and get no AdamW state); remapped to the shards (the fix), it is the right order's memory."""
    path = tmp_path / "orders.yaml"
    path.write_text(
        textwrap.dedent("""
        name: orders
        base: {model: qwen2.5-1.5b, seq_len: 2048, gpus_per_node: 8, strategy: fsdp2_zero3, precision: bf16}
        slurm: {gpu_memory_gib: 80}
        matrix:
          optimizer_order: [after_shard, before_shard, before_shard_fixed]
        """)
    )
    shape = load_shape(model_source("qwen2.5-1.5b"))
    right, broken, fixed = (
        predict(
            RunSpec(
                model="qwen2.5-1.5b",
                strategy="fsdp2_zero3",
                gpus_per_node=8,
                precision="bf16",
                seq_len=2048,
                optimizer_order=order,
            ),
            shape,
        )
        for order in ("after_shard", "before_shard", "before_shard_fixed")
    )
    params = shape.params * 2
    assert fixed == right
    assert broken.states_gib == pytest.approx((params / 8 + params) / GIB) and right.states_gib == pytest.approx(
        3 * params / 8 / GIB
    )
    assert main(["plan", str(path), "--memory"]) == 0
    out = capsys.readouterr().out
    peaks = {line.split()[0]: float(line.split()[10]) for line in out.splitlines() if line.startswith("fsdp2_zero3-")}
    assert len(peaks) == 3 and len(set(peaks.values())) == 2
    assert max(peaks.values()) == pytest.approx(broken.peak_gib, abs=0.01)


def review_jobs(tmp_path, model: str):
    path = tmp_path / "review.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: review
        base: {{model: {model}, seq_len: 8192, gpus_per_node: 4, precision: bf16_mixed}}
        slurm: {{gpu_memory_gib: 80, cache_dir: {tmp_path / "empty-cache"}}}
        matrix:
          strategy: [fsdp2_zero2, fsdp2_zero3]
        """)
    )
    return path


def test_plan_memory_predicts_a_hub_model_that_is_not_cached_from_its_preset(tmp_path, capsys):
    """Issue 54, item 3: SmolLM3-3B's hub id, never downloaded, is predicted from the preset that
    ships its configuration: the same figures as the preset's own cells."""
    assert main(["plan", str(review_jobs(tmp_path, "HuggingFaceTB/SmolLM3-3B")), "--memory"]) == 2  # not cached
    hub = capsys.readouterr().out
    assert main(["plan", str(review_jobs(tmp_path, "smollm3-3b")), "--memory"]) == 0
    preset = capsys.readouterr().out

    def figures(out: str) -> list[list[str]]:  # states, gathered, activations, loss, peak of each row
        return [line.split()[5:10] for line in out.splitlines() if line.startswith("fsdp2_zero")]

    assert len(figures(hub)) == 2 and figures(hub) == figures(preset), hub
    assert "HuggingFaceTB/SmolLM3-3B not cached: from the preset smollm3-3b" in hub
    assert "0 cell(s) predicted not to fit" in hub and "not predicted" not in hub


def test_plan_memory_gives_no_verdict_over_cells_it_could_not_predict(tmp_path, capsys):
    assert main(["plan", str(review_jobs(tmp_path, "acme/unknown-7b")), "--memory"]) == 2
    out = capsys.readouterr().out
    assert "predicted not to fit" not in out
    assert "2 cell(s) not predicted, so not known to fit: model 'acme/unknown-7b' is not in the cache" in out
    assert "--model acme/unknown-7b --config-only" in out


def test_plan_sbatch_writes_the_scripts_of_a_hub_model_that_is_not_downloaded(tmp_path, capsys):
    assert main(["plan", str(review_jobs(tmp_path, "HuggingFaceTB/SmolLM3-3B")), "--sbatch"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("#!/bin/bash") == 1 and "#SBATCH" in captured.out
    assert any(  # the cache-miss line as plan gives it (file:line), a note here
        line.startswith("note: ") and "model 'HuggingFaceTB/SmolLM3-3B' is not in the cache" in line
        for line in captured.err.splitlines()
    ), captured.err
    assert "error:" not in captured.err
