"""The field tables of the docs and `hpcfsdp run --help` are written from the doc each field carries
beside its declaration (fields.documented, spec.option): they cannot drift from the code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from hpcfsdp.cli import main
from hpcfsdp.contracts.spec import RunSpec
from hpcfsdp.sweep.define.container import Container
from hpcfsdp.sweep.define.fielddocs import PAGES, TABLES, field_doc, rewrite
from hpcfsdp.sweep.define.resources import Resources

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("cls", [RunSpec, Resources, Container], ids=lambda cls: cls.__name__)
def test_every_field_a_user_fills_in_carries_a_one_line_doc(cls):
    docs = {item.name: field_doc(item) for item in fields(cls)}
    assert all(doc and "\n" not in doc for doc in docs.values()), docs


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_field_tables_of_the_docs_are_the_declarations(page):
    text = (DOCS / page).read_text()
    for table in PAGES[page]:
        assert text.count(f"<!-- fields: {table} -->") == 1, f"{page} lacks the table {table}"
    assert rewrite(text) == text, f"docs/{page} drifted: run `python -m hpcfsdp.sweep.define.fielddocs docs`"


@pytest.mark.parametrize("cls", [RunSpec, Resources, Container], ids=lambda cls: cls.__name__)
def test_no_field_whose_default_does_something_says_its_default_is_off(cls):
    """A default documented as `off` is one that does nothing (0, false, empty): comm_profile_steps
    said `2 (off)` and profiled 1 + 2 steps of every cell."""
    said_off = {item.name: item.default for item in fields(cls) if item.metadata.get("default_means") == "off"}
    assert {name: default for name, default in said_off.items() if default} == {}


def test_every_table_sits_in_one_page():
    assert sorted(table for tables in PAGES.values() for table in tables) == sorted(TABLES)


def test_a_row_edited_by_hand_is_drift_that_the_generator_writes_back(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in PAGES:
        shutil.copy(DOCS / page, docs / page)
    submit = docs / "submit.md"
    edited = submit.read_text().replace("| `time_min` | `30` |", "| `time_min` | `60` |")
    assert edited != submit.read_text()
    submit.write_text(edited)

    def generator(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hpcfsdp.sweep.define.fielddocs", str(docs), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    check = generator("--check")
    assert check.returncode == 1 and f"{submit}: differ from the declarations" in check.stderr
    assert generator().returncode == 0
    assert submit.read_text() == (DOCS / "submit.md").read_text()
    assert generator("--check").returncode == 0


def test_run_help_lists_every_runspec_field_with_its_default_and_doc(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    listing = " ".join(capsys.readouterr().out.split("RunSpec fields, their defaults")[1].split())
    for item in fields(RunSpec):
        assert f" {item.name}=" in listing
        assert " ".join(field_doc(item).replace("`", "").split()) in listing, item.name
    assert 'tokenizer="" for text data: tiny (shipped, for tries), a folder or hub id; "": the model\'s own' in listing
    assert "seq_len=128 tokens per sequence" in listing
