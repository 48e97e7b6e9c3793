"""Careless or hostile jobs files: `hpcfsdp plan`, in its own process, refuses each one quickly, in
bounded memory, with one line naming the file and no traceback.

The corpus is tests/bad_yaml/ (each file's first line says what the error must contain; test_plan.py
checks those messages in-process) plus the files below that are better made here than committed:
binary, empty, megabytes long, or one line of thousands of characters.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from hpcfsdp.cli import main

CORPUS = sorted((ROOT / "tests" / "bad_yaml").glob("*.yaml"))
TIME_LIMIT_S = 5.0
ADDRESS_SPACE = 1024**3  # RLIMIT_AS of the plan process: a blow-up ends in MemoryError, which the test sees

# name -> (file content, what the one error line says after "error: <file>")
GENERATED = {
    "zero_bytes": (b"", ": empty jobs file"),
    "latin1": ("name: caf\xe9\nbase: {model: tiny}\n".encode("latin-1"), ":1: not UTF-8 (byte 0xe9 at column 10)"),
    "utf16_with_bom": ("name: x\n".encode("utf-16"), ": not UTF-8 (a UTF-16 byte-order mark)"),
    "utf32_with_bom": ("name: x\n".encode("utf-32"), ": not UTF-8 (a UTF-32 byte-order mark)"),
    "raw_nul_byte": (b"name: x\nbase: {model: a\x00b}\n", ":2: not valid YAML (unacceptable character #x0000"),
    "nested_3000_levels_flow": (
        b"base: " + b"[" * 3000 + b"]" * 3000 + b"\n",
        ":1: not valid YAML (nested more than 64 levels deep)",
    ),
    "nested_1000_levels_block": (
        "".join(f"{' ' * i}k{i}:\n" for i in range(1000)).encode(),
        ":64: not valid YAML (nested more than 64 levels deep)",
    ),
    "data_path_too_long": (
        f"base:\n  data: ./{'d' * 5000}/corpus.jsonl\n".encode(),
        ":2: base.data: not a usable path (File name too long)",
    ),
    "larger_than_a_jobs_file": (
        b"# " + b"x" * 1024**2 + b"\nname: big\n",
        ": jobs file of 1,048,589 bytes, more than the limit",
    ),
}


def plan_bounded(path: Path) -> tuple[subprocess.CompletedProcess, float]:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hpcfsdp", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_memory,
    )
    return proc, time.monotonic() - started


def assert_refused(proc: subprocess.CompletedProcess, elapsed: float, path: Path, says: str = "") -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}{says}"), proc.stderr[:3000]
    assert elapsed < TIME_LIMIT_S, f"{elapsed:.1f} s"


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_every_bad_yaml_file_is_refused_quickly_in_bounded_memory(path):
    assert_refused(*plan_bounded(path), path)


@pytest.mark.parametrize("name", GENERATED)
def test_binary_empty_deep_and_huge_files_are_refused_in_one_line(tmp_path, name):
    content, says = GENERATED[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    assert_refused(*plan_bounded(path), path, says)


def test_the_cell_limit_is_checked_before_expanding_and_can_be_raised(tmp_path, capsys):
    path = tmp_path / "twelve.yaml"
    path.write_text("base: {device: cpu}\nmatrix:\n  seed: [0, 1, 2, 3, 4, 5]\n  batch_size: [1, 2]\n")
    assert main(["plan", str(path), "--max-cells", "11"]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}:2: matrix: 12 cells (6 seed x 2 batch_size) is more than the "
        "limit of 11; split the sweep, or raise the limit with --max-cells\n"
    )
    assert main(["plan", str(path), "--max-cells", "12"]) == 0
    assert capsys.readouterr().out.startswith("twelve: 12 cell(s) in 1 array(s)")
