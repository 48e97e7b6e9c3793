"""Real torch.distributed (gloo, CPU, several processes): every strategy trains the same model.

fp32, same seed and data: losses per step must agree within 1e-5 across strategies, batch splits
and activation checkpointing; the optimizer-before-sharding bug must show in the record.
"""

from __future__ import annotations

import pytest

from conftest import run_torchrun_cell

TOL = 1e-5


def assert_same_training(a: dict, b: dict) -> None:
    assert a["status"] == b["status"] == "ok", (a.get("error"), b.get("error"))
    assert len(a["losses"]) == len(b["losses"])
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        assert abs(x - y) < TOL, f"step {step}: {x} vs {y}"
    if "final_param_norm" in a and "final_param_norm" in b:
        assert abs(a["final_param_norm"] - b["final_param_norm"]) < TOL * max(1.0, a["final_param_norm"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train a cell (nprocs, fields) once for this module: the tests that compare against the same
    cell share its record, whichever of them runs first."""
    records: dict[tuple, dict] = {}

    def train(nprocs: int, **fields) -> dict:
        key = (nprocs, tuple(sorted(fields.items())))
        if key not in records:
            records[key] = run_torchrun_cell(tmp_path_factory.mktemp("cell"), nprocs, **fields)
        return records[key]

    return train


@pytest.fixture(scope="module")
def ddp_2(trained):
    return trained(2, strategy="ddp", record_param_norm=True)


@pytest.mark.parametrize("strategy", ["fsdp2_zero2", "fsdp2_zero3"])
def test_fsdp2_matches_ddp_on_2_processes(trained, ddp_2, strategy):
    record = trained(2, strategy=strategy, record_param_norm=True)
    assert record["world_size"] == 2 and record["backend"] == "gloo"
    assert_same_training(ddp_2, record)
    # Training really happened: the loss moved and every timed step was measured.
    assert ddp_2["losses"][0] != ddp_2["losses"][-1]
    assert record["timed_steps"] == 3 and record["tokens_per_s"] > 0


def test_hsdp_2x2_matches_ddp_on_4_processes(tmp_path):
    ddp = run_torchrun_cell(tmp_path / "ddp", 4, strategy="ddp", nodes=2, gpus_per_node=2)
    hsdp = run_torchrun_cell(tmp_path / "hsdp", 4, strategy="fsdp2_hsdp", nodes=2, gpus_per_node=2)
    assert hsdp["world_size"] == 4
    assert_same_training(ddp, hsdp)


def test_grad_accumulation_equals_larger_batch(tmp_path):
    splits = [(4, 1), (2, 2), (1, 4)]
    records = [
        run_torchrun_cell(
            tmp_path / f"b{b}a{a}", 2, strategy="fsdp2_zero3", batch_size=b, grad_accum=a, record_param_norm=True
        )
        for b, a in splits
    ]
    for other in records[1:]:
        assert_same_training(records[0], other)


def test_activation_checkpointing_changes_no_loss(tmp_path, ddp_2):
    full = run_torchrun_cell(
        tmp_path / "full", 2, strategy="ddp", activation_checkpointing="full", record_param_norm=True
    )
    assert_same_training(ddp_2, full)


def test_optimizer_before_sharding_shows_its_symptom(tmp_path, trained):
    right = trained(2, strategy="fsdp2_zero3", record_param_norm=True)  # optimizer_order: after_shard, the default
    broken = run_torchrun_cell(tmp_path / "before", 2, strategy="fsdp2_zero3", optimizer_order="before_shard")
    fixed = run_torchrun_cell(tmp_path / "fixed", 2, strategy="fsdp2_zero3", optimizer_order="before_shard_fixed")
    assert right["spec"]["optimizer_order"] == "after_shard"
    assert right["optimizer_tracks_model"] and fixed["optimizer_tracks_model"]
    assert broken["status"] == "ok" and broken["optimizer_tracks_model"] is False
    # The broken optimizer updates tensors the model no longer uses: the model does not learn.
    assert broken["losses"][-1] != pytest.approx(right["losses"][-1], abs=TOL)
    assert_same_training(right, fixed)


@pytest.mark.parametrize(
    "fields",
    [
        {"activation_checkpointing": "selective", "checkpoint_every": 2},
        {"prefetch_depth": 1},
        {"grad_accum": 2, "sync_every_microbatch": True},
    ],
    ids=["selective-checkpointing", "explicit-prefetch", "sync-every-microbatch"],
)
def test_training_knobs_change_no_loss(tmp_path, ddp_2, fields):
    """Against DDP with the same samples per optimizer step (batch 1 x accum 1, or batch 2 x accum 1
    for the accumulation case: micro-batches draw the same token stream as one larger batch)."""
    reference = ddp_2
    if fields.get("grad_accum") == 2:
        reference = run_torchrun_cell(tmp_path / "ref", 2, strategy="ddp", batch_size=2, record_param_norm=True)
    record = run_torchrun_cell(tmp_path / "knob", 2, strategy="fsdp2_zero3", record_param_norm=True, **fields)
    assert_same_training(reference, record)


def test_single_trains_as_ddp_on_one_process_with_gradient_accumulation(tmp_path):
    """`single` is the plain model: no wrapper, gradients accumulate in .grad across micro-batches."""
    fields = {"grad_accum": 2, "record_param_norm": True}
    single = run_torchrun_cell(tmp_path / "single", 1, strategy="single", **fields)
    ddp = run_torchrun_cell(tmp_path / "ddp", 1, strategy="ddp", **fields)
    assert single["spec"]["strategy"] == "single" and single["world_size"] == 1
    assert_same_training(ddp, single)
    assert single["losses"][0] != single["losses"][-1]


def test_gradient_clipping_scales_by_the_whole_models_norm_under_fsdp2_as_under_ddp(tmp_path):
    """max_grad_norm scales every gradient by one factor, from the norm over every rank's shards:
    FSDP2 (partial norms reduced over the mesh) trains as DDP (whole gradients) does. A norm this
    small makes the gradients smaller than AdamW's eps, so that the factor shows in the update
    (AdamW barely notices a gradient rescaled by a moderate factor): a rank that clipped by its own
    shard's norm would train differently, and so would no clipping at all."""
    fields = {"lr": 1e-2, "record_param_norm": True}
    ddp = run_torchrun_cell(tmp_path / "ddp", 2, strategy="ddp", max_grad_norm=1e-6, **fields)
    fsdp = run_torchrun_cell(tmp_path / "fsdp", 2, strategy="fsdp2_zero3", max_grad_norm=1e-6, **fields)
    assert_same_training(ddp, fsdp)
    unclipped = run_torchrun_cell(tmp_path / "unclipped", 2, strategy="ddp", **fields)
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


def test_a_warm_up_from_twice_the_lr_takes_its_first_step_at_the_lr_under_fsdp2(tmp_path):
    """The schedule reaches the cell's optimizer over sharded parameters: warming up over 2 steps
    to twice A's lr, B's first step is A's (same second loss), its second is not (third loss)."""
    constant = run_torchrun_cell(tmp_path / "constant", 2, strategy="fsdp2_zero3", lr=1e-2)
    warm = run_torchrun_cell(tmp_path / "warm", 2, strategy="fsdp2_zero3", lr=2e-2, lr_warmup_steps=2)
    assert constant["status"] == warm["status"] == "ok", (constant.get("error"), warm.get("error"))
    assert warm["losses"][:2] == pytest.approx(constant["losses"][:2], abs=TOL)
    assert abs(warm["losses"][2] - constant["losses"][2]) > 100 * TOL, (warm["losses"], constant["losses"])
    assert warm["spec"]["lr_warmup_steps"] == 2 and warm["spec"]["lr_decay"] == "none"
