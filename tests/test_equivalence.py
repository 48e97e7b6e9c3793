"""Real torch.distributed (gloo, CPU, several processes): every strategy trains the same model.

fp32, same seed and data: losses per step must agree within 1e-5 across strategies, batch splits
and activation checkpointing; the optimizer-before-sharding bug must show in the record.
"""

from __future__ import annotations

import pytest

from conftest import local_cells

TOL = 1e-5


def assert_same_training(a: dict, b: dict) -> None:
    assert a["status"] == b["status"] == "ok", (a.get("error"), b.get("error"))
    assert len(a["losses"]) == len(b["losses"])
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert abs(x - y) < TOL, f"step {step}: {x} vs {y}"
    if "final_param_norm" in a and "final_param_norm" in b:
        assert abs(a["final_param_norm"] - b["final_param_norm"]) < TOL * max(1.0, a["final_param_norm"])


NORM = {"record_param_norm": True}
TWO = {"gpus_per_node": 2, **NORM}
CLIPPED = {"gpus_per_node": 2, "lr": 1e-2, **NORM}
CELLS = {
    "ddp_2": {"strategy": "ddp", **TWO},
    "fsdp2_zero2": {"strategy": "fsdp2_zero2", **TWO},
    "fsdp2_zero3": {"strategy": "fsdp2_zero3", **TWO},  # optimizer_order: after_shard, the default
    "ddp_2x2": {"strategy": "ddp", "nodes": 2, "gpus_per_node": 2},
    "hsdp_2x2": {"strategy": "fsdp2_hsdp", "nodes": 2, "gpus_per_node": 2},
    "zero3_b4a1": {"strategy": "fsdp2_zero3", "batch_size": 4, "grad_accum": 1, **TWO},
    "zero3_b2a2": {"strategy": "fsdp2_zero3", "batch_size": 2, "grad_accum": 2, **TWO},
    "zero3_b1a4": {"strategy": "fsdp2_zero3", "batch_size": 1, "grad_accum": 4, **TWO},
    "ddp_full_checkpointing": {"strategy": "ddp", "activation_checkpointing": "full", **TWO},
    "before_shard": {"strategy": "fsdp2_zero3", "optimizer_order": "before_shard", "gpus_per_node": 2},
    "before_shard_fixed": {"strategy": "fsdp2_zero3", "optimizer_order": "before_shard_fixed", "gpus_per_node": 2},
    "selective-checkpointing": {
        "strategy": "fsdp2_zero3",
        "activation_checkpointing": "selective",
        "checkpoint_every": 2,
        **TWO,
    },
    "explicit-prefetch": {"strategy": "fsdp2_zero3", "prefetch_depth": 1, **TWO},
    "sync-every-microbatch": {"strategy": "fsdp2_zero3", "grad_accum": 2, "sync_every_microbatch": True, **TWO},
    "ddp_batch_2": {"strategy": "ddp", "batch_size": 2, **TWO},
    "single_accum": {"strategy": "single", "grad_accum": 2, **NORM},
    "ddp_1_accum": {"strategy": "ddp", "grad_accum": 2, **NORM},
    "ddp_clipped": {"strategy": "ddp", "max_grad_norm": 1e-6, **CLIPPED},
    "fsdp_clipped": {"strategy": "fsdp2_zero3", "max_grad_norm": 1e-6, **CLIPPED},
    "ddp_unclipped": {"strategy": "ddp", **CLIPPED},
    "constant_lr": {"strategy": "fsdp2_zero3", "lr": 1e-2, "gpus_per_node": 2},
    "warm_up_to_twice": {"strategy": "fsdp2_zero3", "lr": 2e-2, "lr_warmup_steps": 2, "gpus_per_node": 2},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    """Every cell this module compares (CELLS), trained once in one local submit: whichever test
    runs first pays for all of them."""
    return local_cells(tmp_path_factory.mktemp("equivalence"), CELLS)


@pytest.mark.parametrize("strategy", ["fsdp2_zero2", "fsdp2_zero3"])
def test_fsdp2_matches_ddp_on_2_processes(trained, strategy):
    ddp_2, record = trained["ddp_2"], trained[strategy]
    assert record["world_size"] == 2 and record["backend"] == "gloo"
    assert_same_training(ddp_2, record)
    # Training really happened: the loss moved and every timed step was measured.
    assert ddp_2["losses"][0] != ddp_2["losses"][-1]
    assert record["timed_steps"] == 3 and record["tokens_per_s"] > 0


def test_hsdp_2x2_matches_ddp_on_4_processes(trained):
    ddp, hsdp = trained["ddp_2x2"], trained["hsdp_2x2"]
    assert hsdp["world_size"] == 4
    assert_same_training(ddp, hsdp)


def test_grad_accumulation_equals_larger_batch(trained):
    records = [trained[name] for name in ("zero3_b4a1", "zero3_b2a2", "zero3_b1a4")]
    for other in records[1:]:
        assert_same_training(records[0], other)


def test_activation_checkpointing_changes_no_loss(trained):
    assert_same_training(trained["ddp_2"], trained["ddp_full_checkpointing"])


def test_optimizer_before_sharding_shows_its_symptom(trained):
    right, broken, fixed = trained["fsdp2_zero3"], trained["before_shard"], trained["before_shard_fixed"]
    assert right["spec"]["optimizer_order"] == "after_shard"
    assert right["optimizer_tracks_model"] and fixed["optimizer_tracks_model"]
    assert broken["status"] == "ok" and broken["optimizer_tracks_model"] is False
    # The broken optimizer updates tensors the model no longer uses: the model does not learn.
    assert broken["losses"][-1] != pytest.approx(right["losses"][-1], abs=TOL)
    assert_same_training(right, fixed)


@pytest.mark.parametrize("knob", ["selective-checkpointing", "explicit-prefetch", "sync-every-microbatch"])
def test_training_knobs_change_no_loss(trained, knob):
    """Against DDP with the same samples per optimizer step (batch 1 x accum 1, or batch 2 x accum 1
    for the accumulation case: micro-batches draw the same token stream as one larger batch)."""
    reference = trained["ddp_batch_2" if knob == "sync-every-microbatch" else "ddp_2"]
    assert_same_training(reference, trained[knob])


def test_single_trains_as_ddp_on_one_process_with_gradient_accumulation(trained):
    """`single` is the plain model: no wrapper, gradients accumulate in .grad across micro-batches."""
    single, ddp = trained["single_accum"], trained["ddp_1_accum"]
    assert single["spec"]["strategy"] == "single" and single["world_size"] == 1
    assert_same_training(ddp, single)
    assert single["losses"][0] != single["losses"][-1]


def test_gradient_clipping_scales_by_the_whole_models_norm_under_fsdp2_as_under_ddp(trained):
    """max_grad_norm scales every gradient by one factor, from the norm over every rank's shards:
    FSDP2 (partial norms reduced over the mesh) trains as DDP (whole gradients) does. A norm this
    small makes the gradients smaller than AdamW's eps, so that the factor shows in the update
    (AdamW barely notices a gradient rescaled by a moderate factor): a rank that clipped by its own
    shard's norm would train differently, and so would no clipping at all."""
    ddp, fsdp, unclipped = trained["ddp_clipped"], trained["fsdp_clipped"], trained["ddp_unclipped"]
    assert_same_training(ddp, fsdp)
    assert abs(ddp["losses"][-1] - unclipped["losses"][-1]) > 100 * TOL, (ddp["losses"], unclipped["losses"])
    assert ddp["spec"]["max_grad_norm"] == 1e-6


@pytest.mark.parametrize(
    "fields, factors",
    [
        # torchtitan's qwen3 comparison: warm-up 2, then linear decay over the other 10 steps
        (
            {"steps": 12, "lr_warmup_steps": 2, "lr_decay": "linear"},
            [0.5, 1, 1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
        ),
        # cos(0), cos(pi/5), ... scaled into [0.1, 1]
        (
            {"steps": 6, "lr_warmup_steps": 1, "lr_decay": "cosine", "lr_min_ratio": 0.1},
            [1, 1, 0.9140576, 0.6890576, 0.4109424, 0.1859424],
        ),
        ({"steps": 4, "lr_warmup_steps": 4}, [0.25, 0.5, 0.75, 1]),
        ({"steps": 3}, [1, 1, 1]),
    ],
    ids=["warm-up-linear", "cosine-to-min", "warm-up-only", "constant"],
)
def test_the_optimizer_steps_at_torchtitans_scheduled_learning_rates(fields, factors):
    """The values are torchtitan's build_lr_schedulers at v0.2.2 (decay_ratio unset: the decay
    ends at a virtual step after the last), worked out by hand."""
    import torch

    from hpcfsdp.cell.train import build_optimizer
    from hpcfsdp.contracts.spec import RunSpec

    spec = RunSpec.from_dict({"model": "tiny", "device": "cpu", "warmup_steps": 0, "lr": 8e-4, **fields})
    layer = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(layer, spec)
    used = []
    for _ in range(spec.steps):
        used.append(optimizer.param_groups[0]["lr"] / spec.lr)
        layer(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert used == pytest.approx(factors, abs=1e-6)


def test_a_warm_up_from_twice_the_lr_takes_its_first_step_at_the_lr_under_fsdp2(trained):
    """The schedule reaches the cell's optimizer over sharded parameters: warming up over 2 steps
    to twice A's lr, B's first step is A's (same second loss), its second is not (third loss)."""
    constant, warm = trained["constant_lr"], trained["warm_up_to_twice"]
    assert constant["status"] == warm["status"] == "ok", (constant.get("error"), warm.get("error"))
    assert warm["losses"][:2] == pytest.approx(constant["losses"][:2], abs=TOL)
    assert abs(warm["losses"][2] - constant["losses"][2]) > 100 * TOL, (warm["losses"], constant["losses"])
    assert warm["spec"]["lr_warmup_steps"] == 2 and warm["spec"]["lr_decay"] == "none"
