"""The published JSON Schema of result.json (docs/record.schema.json): the checked-in file is what
the record's declarations generate now, and real records (an ok cell, an oom one and a diverged
one, trained on CPU under torchrun) validate against it, read by the `jsonschema` package."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import ROOT, local_cells
from hpcfsdp.contracts.files import RecordError
from hpcfsdp.contracts.record import read_record
from hpcfsdp.recordschema import main, schema_text

SCHEMA = ROOT / "docs" / "record.schema.json"


def test_the_checked_in_record_schema_is_the_one_the_record_declarations_generate(capsys):
    assert SCHEMA.read_text() == schema_text(), "run: python -m hpcfsdp.recordschema docs/record.schema.json"
    assert main([str(SCHEMA), "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.fixture(scope="module")
def real_records(tmp_path_factory) -> dict[str, dict]:
    """A real record of each ending: ok and diverged from one local submit, oom from another whose
    cell gets an injected out-of-memory."""
    two = {"gpus_per_node": 2, "steps": 3, "warmup_steps": 1}
    records = local_cells(
        tmp_path_factory.mktemp("records"),
        {
            "ok": {"strategy": "fsdp2_zero3", **two},
            "diverged": {**two, "strategy": "ddp", "lr": 1.0e12, "steps": 6, "comm_profile_steps": 0},
        },
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HPCFSDP_FAULT", "train_step:oom")
        return records | local_cells(tmp_path_factory.mktemp("oom"), {"oom": {"strategy": "ddp", **two}})


def test_real_records_of_every_ending_validate_against_the_published_schema_and_bad_ones_do_not(real_records):
    jsonschema = pytest.importorskip("jsonschema")  # the dev extra's
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert {name: record["status"] for name, record in real_records.items()} == {
        "ok": "ok", "oom": "oom", "diverged": "diverged"
    }  # fmt: skip
    for name, record in real_records.items():
        assert [error.message for error in validator.iter_errors(record)] == [], name
    spoiled = copy.deepcopy(real_records["ok"])
    spoiled.update(status="fine", tokens_per_s_per_gpu=-1.0)
    spoiled["spec"]["strategy"] = "zero9"
    problems = sorted(".".join(map(str, error.absolute_path)) for error in validator.iter_errors(spoiled))
    assert problems == ["spec.strategy", "status", "tokens_per_s_per_gpu"]


def test_the_schema_refuses_the_spec_counts_the_reader_refuses(real_records, tmp_path):
    """seq_len 0 and steps 0 (and a negative warm-up) are refused by read_record; so by the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    spoiled = copy.deepcopy(real_records["ok"])
    spoiled["spec"].update(seq_len=0, steps=0, warmup_steps=-1)
    problems = sorted(".".join(map(str, error.absolute_path)) for error in validator.iter_errors(spoiled))
    assert problems == ["spec.seq_len", "spec.steps", "spec.warmup_steps"]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(spoiled))
    with pytest.raises(RecordError, match="seq_len"):
        read_record(path)
