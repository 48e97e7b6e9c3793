"""Validation of jobs YAML and RunSpec: clear one-line errors, stable ids, derived fields."""

from __future__ import annotations

import textwrap

import pytest

from conftest import ROOT
from hpcfsdp.cli import main
from hpcfsdp.contracts.fields import SpecError
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.sweep.define.matrix import cell_id, load_sweep


def write(tmp_path, text: str):
    path = tmp_path / "jobs.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_unknown_axis_names_file_line_and_suggestion(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        name: t
        matrix:
          strategy: [ddp]
          batch_sizes: [1, 2]
        """,
    )
    err = cli_error(capsys, "plan", str(path))
    assert f"{path}:5" in err and "matrix.batch_sizes" in err and "did you mean 'batch_size'" in err


def test_non_positive_batch_names_file_and_key(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        matrix:
          batch_size: [2, 0]
        """,
    )
    err = cli_error(capsys, "plan", str(path))
    assert str(path) in err and "batch_size" in err and "positive" in err and "got 0" in err


def test_missing_jobs_file(tmp_path, capsys):
    err = cli_error(capsys, "submit", str(tmp_path / "nope.yaml"), "--executor", "print")
    assert "nope.yaml: no such jobs file" in err


def test_wrong_type_and_unknown_strategy(tmp_path):
    with pytest.raises(SpecError, match=r"grad_accum: expected an integer, got 'two'"):
        load_sweep(write(tmp_path, "base: {grad_accum: two}\n"))
    with pytest.raises(SpecError, match=r"did you mean 'fsdp2_zero3'"):
        load_sweep(write(tmp_path, "matrix: {strategy: [fsdp2_zer03]}\n"))


def test_impossible_combinations_are_refused_at_plan_time(tmp_path):
    with pytest.raises(SpecError, match="needs a GPU"):
        RunSpec.from_dict({"strategy": "fsdp1_full_shard", "device": "cpu"})
    with pytest.raises(SpecError, match="does not divide"):
        RunSpec.from_dict({"strategy": "fsdp2_hsdp", "gpus_per_node": 4, "hsdp_shard_size": 3})
    with pytest.raises(SpecError, match="ddp has no CPU offload"):
        RunSpec.from_dict({"strategy": "ddp", "cpu_offload": True})
    with pytest.raises(SpecError, match="never synchronises gradients across its 2 replicas"):
        RunSpec.from_dict({"strategy": "fsdp1_hybrid_zero2", "nodes": 2, "gpus_per_node": 1, "device": "cuda"})
    assert RunSpec.from_dict({"strategy": "fsdp2_hsdp", "gpus_per_node": 2, "hsdp_shard_size": 1}).world_size == 2


def test_global_batch_size_derives_grad_accum():
    spec = RunSpec.from_dict({"global_batch_size": 32, "batch_size": 2, "nodes": 2, "gpus_per_node": 4})
    assert spec.grad_accum == 2
    with pytest.raises(SpecError, match="not a multiple of batch_size x world size = 2 x 8 = 16"):
        RunSpec.from_dict({"global_batch_size": 24, "batch_size": 2, "nodes": 2, "gpus_per_node": 4})


def test_matrix_expansion_include_exclude_and_stable_ids(tmp_path):
    text = """
        name: t
        base: {device: cpu}
        matrix:
          strategy: [ddp, fsdp2_zero2, fsdp2_zero3]
          batch_size: [1, 2]
        exclude:
          - {strategy: ddp, batch_size: 2}
        include:
          - {strategy: fsdp2_zero3, batch_size: 4, activation_checkpointing: true}
        """
    first, second = load_sweep(write(tmp_path, text)), load_sweep(write(tmp_path, text))
    assert len(first.cells) == 3 * 2 - 1 + 1
    assert [c.id for c in first.cells] == [c.id for c in second.cells]
    assert len({c.id for c in first.cells}) == len(first.cells)
    assert first.cells[-1].spec.activation_checkpointing == "full"


def test_cell_ids_hash_only_the_fields_that_differ_from_their_defaults():
    # Golden ids: a change here orphans every record users have (resubmits rerun, --compare pairs nothing).
    assert cell_id(RunSpec(strategy="ddp", batch_size=2, device="cpu")) == "ddp-b2-a1-f867e1384c"
    assert cell_id(RunSpec()) == "fsdp2_zero3-b1-a1-bf21a9e8fb"
    assert cell_id(RunSpec(lr=RunSpec().lr, device="cpu")) == cell_id(RunSpec(device="cpu"))


def test_exclude_matches_coerced_values_and_may_drop_invalid_combinations(tmp_path):
    sweep = load_sweep(
        write(
            tmp_path,
            """
        base: {device: cuda, lr: 3e-4}
        matrix:
          strategy: [ddp, fsdp2_zero3]
          activation_checkpointing: [none, full]
          cpu_offload: [false, true]
        exclude:
          - {strategy: ddp, activation_checkpointing: true}
          - {strategy: ddp, cpu_offload: true}
        """,
        )
    )
    assert sorted((c.spec.strategy, c.spec.activation_checkpointing, c.spec.cpu_offload) for c in sweep.cells) == [
        ("ddp", "none", False),
        *(("fsdp2_zero3", ckpt, off) for ckpt in ("full", "none") for off in (False, True)),
    ]
    assert {c.spec.lr for c in sweep.cells} == {3e-4}  # YAML reads 3e-4 as a string


def test_plan_prints_every_cell(capsys):
    assert main(["plan", str(ROOT / "jobs/smoke.yaml")]) == 0
    out = capsys.readouterr().out
    sweep = load_sweep(ROOT / "jobs/smoke.yaml")
    assert f"{len(sweep.cells)} cell(s) in 1 array(s)" in out
    assert all(cell.id in out for cell in sweep.cells)


@pytest.mark.parametrize(
    "jobs", sorted([*(ROOT / "jobs").glob("*.yaml"), *(ROOT / "bench" / "jobs").glob("*.yaml")]), ids=lambda p: p.name
)
def test_every_shipped_jobs_file_plans(jobs):
    sweep = load_sweep(jobs)
    assert sweep.cells and sweep.name == jobs.stem


def test_batch_size_auto_in_base_matrix_or_include_sets_auto_batch(tmp_path):
    sweep = load_sweep(
        write(
            tmp_path,
            """
        base: {device: cpu, gpus_per_node: 2, batch_size: auto}
        matrix:
          strategy: [ddp, fsdp2_zero3]
          batch_size: [auto, 4]
        exclude:
          - {strategy: ddp, batch_size: auto}
        include:
          - {strategy: fsdp2_zero2, max_batch_size: 32, batch_margin: 0.05}
        """,
        )
    )
    cells = {(c.spec.strategy, c.spec.auto_batch, c.spec.batch_size): c for c in sweep.cells}
    assert set(cells) == {
        ("ddp", False, 4),
        ("fsdp2_zero3", True, 1),
        ("fsdp2_zero3", False, 4),
        ("fsdp2_zero2", True, 1),
    }
    assert cells["fsdp2_zero3", True, 1].id.startswith("fsdp2_zero3-bauto-a1-")
    zero2 = cells["fsdp2_zero2", True, 1].spec
    assert (zero2.max_batch_size, zero2.batch_margin, zero2.batch_cap) == (32, 0.05, 32)
    assert RunSpec.from_dict({"batch_size": "auto", "auto_batch": True}).auto_batch


@pytest.mark.parametrize(
    "values, key, message",
    [
        ({"batch_size": "big"}, "batch_size", "expected an integer or auto, got 'big'"),
        ({"batch_size": "auto", "auto_batch": False}, "auto_batch", "contradicts batch_size: auto"),
        ({"batch_size": "auto", "batch_margin": 1.0}, "batch_margin", "expected a fraction in [0, 1)"),
        ({"batch_size": "auto", "batch_probe_steps": 1}, "batch_probe_steps", "expected at least 2"),
        ({"batch_size": "auto", "max_batch_size": 0}, "max_batch_size", "expected a positive integer"),
        (
            {"batch_size": "auto", "gpus_per_node": 4, "global_batch_size": 6},
            "global_batch_size",
            "not a multiple of the world size 4",
        ),
        ({"batch_size": 64, "auto_batch": True, "max_batch_size": 32}, "batch_size", "above its cap 32"),
    ],
)
def test_batch_search_settings_are_validated(values, key, message):
    with pytest.raises(SpecError) as caught:
        RunSpec.from_dict(values)
    assert caught.value.key == key and message in caught.value.what


def test_a_searched_cells_record_is_not_stale_for_the_batch_it_chose(tmp_path):
    from hpcfsdp.contracts.record import write_record
    from hpcfsdp.sweep.define.matrix import Cell
    from hpcfsdp.sweep.track.status import cell_status

    cell = Cell.of(
        RunSpec.from_dict({"batch_size": "auto", "global_batch_size": 16, "gpus_per_node": 2, "device": "cpu"})
    )
    measured = cell.spec.with_batch_size(4)
    path = tmp_path / "cells" / cell.id / "result.json"
    write_record(path, {"status": "ok", "spec": measured.to_dict()})
    assert (measured.batch_size, measured.grad_accum) == (4, 2) and cell_status(tmp_path, cell) == "ok"
    write_record(path, {"status": "ok", "spec": measured.replace(seq_len=64).to_dict()})
    assert cell_status(tmp_path, cell) == "stale"


def test_an_unknown_gpu_name_asks_for_its_memory_size(tmp_path):
    with pytest.raises(
        SpecError, match=r"jobs.yaml:1: slurm.gpu_name: memory size of 'X9000' unknown .*set gpu_memory_gib"
    ):
        load_sweep(write(tmp_path, "slurm: {gpu_name: X9000}\n"))
    assert load_sweep(write(tmp_path, "slurm: {gpu_name: X9000, gpu_memory_gib: 96}\n")).resources.gpu_memory_gib == 96
