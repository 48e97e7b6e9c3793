"""The performance levers (docs/levers.md): attention backend, loss, float8, op-level checkpointing.

Validation and recording everywhere; on the CPU the levers that can run there train the same model
as the defaults: cut-cross-entropy (its torch.compile implementation) and op-level selective
activation checkpointing. The GPU-only ones are refused with one line, at plan time or, when
`device: auto` finds no GPU, in the cell's record.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import local_cells, run_torchrun_cell
from hpcfsdp.cell.levers import install_loss, require
from hpcfsdp.cell.models import build_model, resolve_model
from hpcfsdp.cell.strategies import apply_activation_checkpointing
from hpcfsdp.cli import main
from hpcfsdp.contracts.fields import SpecError
from hpcfsdp.contracts.sources import model_source
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.sweep.define.matrix import cell_id, load_sweep
from test_equivalence import assert_same_training

CPU = {"device": "cpu"}


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"attention": "flashy"},
            "attention: expected one of sdpa, cudnn, flash, efficient; got 'flashy' (did you mean 'flash'?)",
        ),
        (
            {"loss": "fused"},
            "loss: expected one of default, compiled, cce, cce_kahan_full_c, cce_exact, liger; got 'fused'",
        ),
        (
            {"float8": "rowwize"},
            "float8: expected one of none, tensorwise, rowwise; got 'rowwize' (did you mean 'rowwise'?)",
        ),
        (
            {"activation_checkpointing": "ops"},
            "activation_checkpointing: expected one of none, full, selective, op; got 'ops'",
        ),
        ({**CPU, "attention": "cudnn"}, "attention: cudnn is a CUDA SDPA backend; use attention: sdpa on CPU"),
        ({**CPU, "attention": "flash"}, "attention: flash is a CUDA SDPA backend"),
        ({**CPU, "loss": "liger"}, "loss: liger needs a GPU (Triton kernels); use loss: default or cce on CPU"),
        ({**CPU, "float8": "tensorwise"}, "float8: tensorwise needs a GPU with float8 tensor cores (SM89+"),
        (
            {"float8": "rowwise", "strategy": "fsdp1_full_shard", "device": "cuda"},
            "float8: supported with ddp and fsdp2_* strategies, got fsdp1_full_shard",
        ),
        ({"float8": "tensorwise", "cpu_offload": True}, "float8: not with cpu_offload"),
    ],
)
def test_a_bad_or_impossible_lever_is_refused_in_one_line(fields, message):
    with pytest.raises(SpecError) as error:
        RunSpec.from_dict(fields, where="jobs.yaml")
    assert message in str(error.value) and str(error.value).startswith("jobs.yaml: ")
    assert "\n" not in str(error.value)


def test_plan_refuses_a_gpu_lever_on_cpu_naming_file_and_key(tmp_path, capsys):
    path = tmp_path / "jobs.yaml"
    path.write_text("base: {device: cpu}\nmatrix:\n  float8: [none, tensorwise]\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "float8: tensorwise needs a GPU" in err


def test_the_levers_are_yaml_axes_and_their_defaults_keep_todays_cell_ids(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text("base: {device: cpu}\nmatrix:\n  loss: [default, cce]\n  activation_checkpointing: [none, op]\n")
    cells = load_sweep(path).cells
    assert {(c.spec.loss, c.spec.activation_checkpointing) for c in cells} == {
        ("default", "none"),
        ("default", "op"),
        ("cce", "none"),
        ("cce", "op"),
    }
    plain = next(c for c in cells if c.spec.loss == "default" and c.spec.activation_checkpointing == "none")
    assert plain.id == cell_id(RunSpec(device="cpu"))
    assert (plain.spec.attention, plain.spec.float8) == ("sdpa", "none")


def test_a_missing_package_is_one_line_naming_the_extra():
    with pytest.raises(RuntimeError) as error:
        require("cut_cross_entropy.not_a_module", "loss: cce")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("loss: cce needs the cut-cross-entropy package")
    assert "pip install 'hpcfsdp[gpu]'" in message


def _tiny_backward(**fields) -> tuple[float, float, torch.Tensor]:
    """Loss, backward FLOPs and the embedding's gradient of one step of the tiny model (fp32, CPU)."""
    spec = RunSpec(device="cpu", precision="fp32", **fields)
    model = build_model(resolve_model(model_source("tiny")), torch.float32, torch.device("cpu"), seed=0)
    install_loss(model, spec, torch.device("cpu"))
    apply_activation_checkpointing(model, spec)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=tokens, labels=tokens).loss
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return loss.item(), flops.get_total_flops(), model.get_input_embeddings().weight.grad


def test_op_checkpointing_recomputes_part_of_the_forward_and_changes_no_gradient():
    """Backward FLOPs count what is recomputed: none < op (every other matmul) < full (all of it)."""
    loss_none, flops_none, grad_none = _tiny_backward()
    loss_op, flops_op, grad_op = _tiny_backward(activation_checkpointing="op")
    _, flops_full, _ = _tiny_backward(activation_checkpointing="full")
    assert flops_none < flops_op < flops_full
    assert loss_op == loss_none
    torch.testing.assert_close(grad_op, grad_none, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["cce", "cce_kahan_full_c", "cce_exact"])
def test_cut_cross_entropy_gives_the_models_own_loss_and_gradient_on_cpu(variant):
    loss_default, _, grad_default = _tiny_backward()
    loss_cce, _, grad_cce = _tiny_backward(loss=variant)
    assert loss_cce == pytest.approx(loss_default, rel=1e-6)
    torch.testing.assert_close(grad_cce, grad_default, rtol=1e-5, atol=1e-7)


def test_the_compiled_loss_gives_the_models_own_loss_and_gradient_on_cpu():
    loss_default, _, grad_default = _tiny_backward()
    loss_compiled, _, grad_compiled = _tiny_backward(loss="compiled")
    assert loss_compiled == pytest.approx(loss_default, rel=1e-6)
    torch.testing.assert_close(grad_compiled, grad_default, rtol=1e-5, atol=1e-7)


def test_a_cce_variant_the_installed_release_lacks_is_one_line_naming_the_release(monkeypatch):
    """PyPI's cut-cross-entropy 25.1.1 knows only `cce` and `torch_compile`; the fp32-accumulating
    variants are in 25.6, released on GitHub. The check reads the library's own list of variants."""
    import enum

    import cut_cross_entropy

    monkeypatch.setattr(cut_cross_entropy, "LinearCrossEntropyImpl", enum.IntEnum("Impl", "CCE TORCH_COMPILE"))
    with pytest.raises(RuntimeError) as error:
        install_loss(
            build_model(resolve_model(model_source("tiny")), torch.float32, torch.device("cpu"), seed=0),
            RunSpec(device="cuda", loss="cce_kahan_full_c"),
            torch.device("cuda"),
        )
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("loss: cce_kahan_full_c needs cut-cross-entropy 25.6 or later (this is ")
    assert "pip install 'cut-cross-entropy @ https://github.com/apple/ml-cross-entropy/" in message


ZERO2 = {"strategy": "fsdp2_zero2", "gpus_per_node": 2, "record_param_norm": True}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    """The defaults and each lever that runs on the CPU, trained once in one local submit: whichever
    test runs first pays for all of them."""
    return local_cells(
        tmp_path_factory.mktemp("levers"),
        {
            "default": ZERO2,
            "op": {**ZERO2, "activation_checkpointing": "op"},
            "cce": {**ZERO2, "loss": "cce"},
            "compiled": {**ZERO2, "loss": "compiled"},
        },
    )


def test_op_checkpointing_trains_the_same_model_under_fsdp2_and_is_recorded(trained):
    record = trained["op"]
    assert record["spec"]["activation_checkpointing"] == "op"
    assert_same_training(trained["default"], record)


def test_cut_cross_entropy_trains_the_same_model_under_fsdp2_and_is_recorded(trained):
    """The replaced forward still runs FSDP2's root hooks: the tied LM head is gathered for the
    loss and its gradient reduced, so the parameters end where the model's own loss takes them."""
    zero2_default, record = trained["default"], trained["cce"]
    assert record["spec"]["loss"] == "cce"
    assert (record["spec"]["attention"], record["spec"]["float8"]) == ("sdpa", "none")
    assert "float8_linears" not in record
    assert_same_training(zero2_default, record)
    assert zero2_default["losses"][0] != zero2_default["losses"][-1]


def test_the_compiled_loss_trains_the_same_model_under_fsdp2_and_is_recorded(trained):
    record = trained["compiled"]
    assert record["status"] == "ok" and record["spec"]["loss"] == "compiled"
    assert_same_training(trained["default"], record)


def test_a_gpu_lever_on_a_node_without_a_gpu_records_why(tmp_path):
    """device: auto passes plan; the cell finds no GPU and says so in its record."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    record = run_torchrun_cell(tmp_path, 2, device="auto", loss="liger", attention="cudnn")
    assert record["status"] == "error" and record["stage"] == "setup"
    assert record["error"] == "RuntimeError: attention: cudnn, loss: liger need a GPU, and this run is on cpu"
    assert record["spec"]["loss"] == "liger"


@pytest.mark.parametrize(
    "fields, gathers_float8",
    [
        ({"strategy": "fsdp2_zero2", "gpus_per_node": 2}, True),
        ({"strategy": "fsdp2_zero3", "nodes": 2}, True),
        ({"strategy": "fsdp2_zero2"}, False),  # one rank: the compiled layer casts its own weights
        ({"strategy": "fsdp2_zero2", "gpus_per_node": 2, "float8": "rowwise"}, False),
        ({"strategy": "ddp", "gpus_per_node": 2}, False),
    ],
)
def test_weights_are_gathered_in_float8_only_where_there_is_something_to_gather(fields, gathers_float8):
    from hpcfsdp.sweep.predict.memory import _gathered_bytes
    from hpcfsdp.sweep.predict.modelshape import load_shape

    spec = RunSpec.from_dict({"device": "cuda", "float8": "tensorwise", "model": "qwen3-1.7b", **fields}, "t.yaml")
    assert spec.float8_all_gather is gathers_float8
    bf16 = RunSpec.from_dict({**spec.to_dict(), "float8": "none"}, "t.yaml")
    shape = load_shape(model_source("qwen3-1.7b"))
    # the memory prediction follows: float8 all-gather holds the gathered matmul weights in 1 byte, not 2
    assert (_gathered_bytes(spec, shape) < _gathered_bytes(bf16, shape)) is (gathers_float8 and spec.family == "fsdp2")
