"""Names that are not UTF-8 text (issue 51): a byte of a folder's or a file's name that is not
(Python carries it as a lone surrogate) in a sweep folder's entries, a cells/<id> name, a sweep
folder's or a history's path given on the command line, a jobs file's path. Every command ends in
one line or does its work; none prints a traceback, nor a raw byte of such a name."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from hpcfsdp.cli import main

CPU_CELL = {"model": "tiny", "device": "cpu", "precision": "fp32", "seq_len": 32, "steps": 2, "warmup_steps": 1}
BAD = os.fsdecode(b"\xff\xfe-not-utf8")  # '\udcff\udcfe-not-utf8'
SHOWN = "\\udcff\\udcfe-not-utf8"


@pytest.fixture
def folders(tmp_path):
    """A good jobs file, one in a folder of a bad name, and a sweep folder (print executor) whose
    cells/, slurm/, report/, tune/ and top level hold entries of a bad name."""
    jobs = {"name": "names", "base": CPU_CELL, "matrix": {"batch_size": [1, 2]}}
    good = tmp_path / "names.yaml"
    good.write_text(yaml.safe_dump(jobs))
    (tmp_path / BAD).mkdir()
    shutil.copy(good, tmp_path / BAD / "names.yaml")
    results = tmp_path / "results"
    assert main(["submit", str(good), "--executor", "print", "--results-dir", str(results)]) == 0
    sweep = results / "names"
    for where in ("", "cells", "slurm", "report", "tune"):
        (sweep / where / BAD).mkdir(parents=True, exist_ok=True)
        (sweep / where / f"{BAD}.json").write_text("{}")
    return good, tmp_path / BAD / "names.yaml", sweep


def one_line_or_work(argv: list[str], capsys, codes=(0, 1, 2, 3)) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in codes, (argv, code, err)
    assert "Traceback" not in out + err and BAD not in out + err, (argv, err)
    if code == 2:  # a refusal: one line
        assert err.count("\n") == 1, (argv, err)
    return code, out, err


def test_a_sweep_folder_with_entries_of_names_that_are_not_utf8_is_read_by_every_command(folders, capsys):
    good, _, sweep = folders
    cell = next(name for name in os.listdir(sweep / "cells") if name.isascii() and "." not in name)
    one_line_or_work(["status", str(sweep)], capsys)
    one_line_or_work(["status", str(sweep), "--json"], capsys)
    _, _, err = one_line_or_work(["collect", str(sweep), "--no-plots"], capsys)
    assert f"cells/{SHOWN}: a cell folder whose name is no cell id" in err
    one_line_or_work(["logs", str(sweep), cell], capsys)
    one_line_or_work(["logs", str(sweep), BAD], capsys, codes=(2,))
    one_line_or_work(["cancel", str(sweep), "--cells", BAD], capsys, codes=(2,))
    one_line_or_work(["cancel", str(sweep)], capsys, codes=(0,))
    history = sweep.parent / "history.duckdb"
    one_line_or_work(["history", "--history", str(history)], capsys, codes=(0,))
    one_line_or_work(["submit", str(good), "--executor", "print", "--results-dir", str(sweep.parent)], capsys)


def test_paths_that_are_not_utf8_on_the_command_line_are_refused_in_one_line_or_used(folders, tmp_path, capsys):
    _, bad_jobs, sweep = folders
    one_line_or_work(["plan", str(bad_jobs)], capsys, codes=(0,))
    bad_results = tmp_path / BAD / "results"
    for command in (
        ["submit", "--executor", "print"],
        ["submit", "--executor", "local"],
        ["tune", "--executor", "local"],
    ):
        _, _, err = one_line_or_work(
            [*command[:1], str(bad_jobs), *command[1:], "--results-dir", str(bad_results)], capsys, codes=(2,)
        )
        assert f"{SHOWN}/results/names: the sweep folder's path is not UTF-8 text" in err
    moved = tmp_path / BAD / "names"
    shutil.copytree(sweep, moved, symlinks=True)
    for command in (["status"], ["status", "--json"], ["cancel"]):
        one_line_or_work([command[0], str(moved), *command[1:]], capsys)
    _, _, err = one_line_or_work(["collect", str(moved), "--no-plots"], capsys, codes=(2,))
    assert "the sweep folder's path is not UTF-8 text" in err
    one_line_or_work(["collect", str(sweep), "--no-plots"], capsys)  # the history beside it
    shutil.copy(sweep.parent / "history.duckdb", tmp_path / BAD / "history.duckdb")
    _, _, err = one_line_or_work(["history", "--history", str(tmp_path / BAD / "history.duckdb")], capsys, codes=(1,))
    assert err.count("\n") == 1 and "not UTF-8 text, which DuckDB cannot open" in err
