"""The login-node / compute-node split holds: the login-side commands never load torch.

Each command runs in a fresh interpreter (a test process has torch loaded already), as a user on a
login node would run it; the check is `sys.modules` after the command returned.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs one hpcfsdp command in-process, then says which heavy modules it loaded.
PROBE = """
import json, sys
from hpcfsdp.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def loaded_by(args: list[str], cwd: Path = ROOT) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> tuple[Path, dict]:
    """`submit --executor print` of the smoke sweep: its folder (plus one record written by hand) and
    what the command loaded."""
    from hpcfsdp.record import write_record

    results = tmp_path_factory.mktemp("layout") / "results"
    submitted = loaded_by(["submit", "jobs/smoke.yaml", "--executor", "print", "--results-dir", str(results)])
    sweep = results / "smoke"
    cell = sorted((sweep / "cells").iterdir())[0]
    meta = json.loads((cell / "spec.json").read_text())
    write_record(
        cell / "result.json",
        {"status": "error", "stage": "train", "error": "RuntimeError: x", **meta, "world_size": 2, "nodes": 1},
    )
    return sweep, submitted


def test_plan_loads_neither_torch_nor_transformers():
    assert loaded_by(["plan", "jobs/zero2_vs_zero3.yaml"]) == {"code": 0, "loaded": []}


def test_submit_with_the_print_executor_loads_no_torch(printed):
    sweep, submitted = printed
    assert submitted == {"code": 0, "loaded": []}
    assert len(list((sweep / "cells").glob("*/spec.json"))) == 8


def test_status_collect_and_history_load_no_torch(printed):
    sweep, _ = printed
    assert loaded_by(["status", str(sweep)])["loaded"] == []
    assert loaded_by(["collect", str(sweep), "--no-plots"])["loaded"] == []
    assert loaded_by(["history", "--history", str(sweep.parent / "history.duckdb")]) == {"code": 0, "loaded": []}
    assert "RuntimeError: x" in (sweep / "report" / "summary.md").read_text()


def test_the_cache_side_loads_no_torch_outside_tokenising():
    probe = (
        "import sys, hpcfsdp.cache.download, hpcfsdp.cache.fetch, hpcfsdp.cache.hub, hpcfsdp.cache.manifest, "
        "hpcfsdp.cache.plan, hpcfsdp.cache.tokenize, hpcfsdp.cache.verify, hpcfsdp.sweep.job;"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# The import table of docs/design.md, read from the page itself: it is the one statement of which
# part may import which, and this test keeps the code to it (module level and lazy imports alike).

SRC = ROOT / "src" / "hpcfsdp"
HEAVY = ("torch", "transformers")
TABLE_HEADER = "| part | may import (of hpcfsdp) | torch, transformers |"


def import_table() -> dict[str, tuple[set[str], set[str]]]:
    """part -> (the parts and modules it may import, the heavy libraries it may import), from the
    table under TABLE_HEADER. A part is a module (`spec`), a folder (`sweep`) or one file of a folder
    (`sweep/job.py`, which adds to its folder's row); `everything` allows every part."""
    lines = (ROOT / "docs" / "design.md").read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        parts, allowed, heavy = (re.findall(r"`([^`]+)`", cell) for cell in line.strip("|").split("|"))
        for part in parts:
            table[part] = (set(allowed), set(heavy))
    return table


def part_of(module: str) -> str:
    """hpcfsdp.sweep.job -> sweep; hpcfsdp.spec -> spec; hpcfsdp -> hpcfsdp (the package: its version)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def imports_of(path: Path, src: Path = SRC) -> set[str]:
    """Every module the file imports, at module level or inside a function, as absolute names."""
    module = ".".join(("hpcfsdp", *path.relative_to(src).with_suffix("").parts))
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            found.add(target)
            # `from . import plots`: a name may be a module itself
            found |= {f"{target}.{alias.name}" for alias in node.names if _is_module(src, f"{target}.{alias.name}")}
    return found


def _is_module(src: Path, name: str) -> bool:
    return src.joinpath(*name.split(".")[1:]).with_suffix(".py").exists()


def allowed(rule: set[str], target: str) -> bool:
    name = target.removeprefix("hpcfsdp.")
    return "everything" in rule or any(name == entry or name.startswith(entry + ".") for entry in rule)


def violations(src: Path, table: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """'<file> imports <module>' for each import the table does not allow."""
    broken = []
    for path in sorted(src.rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        part = relative.split("/")[0].removesuffix(".py")
        if part not in table and relative not in table:
            broken.append(f"{relative}: no row in the import table")
            continue
        own, heavy = table.get(part, (set(), set()))
        extra, extra_heavy = table.get(relative, (set(), set()))
        for target in sorted(imports_of(path, src)):
            top = target.split(".")[0]
            if top in HEAVY:
                ok = top in heavy | extra_heavy
            else:
                ok = top != "hpcfsdp" or part_of(target) == part or allowed(own | extra, target)
            if not ok:
                broken.append(f"{relative} imports {target}")
    return broken


def test_every_part_imports_only_what_the_import_table_of_design_md_allows():
    assert violations(SRC, import_table()) == []


def test_the_import_check_names_a_forbidden_import_lazy_or_not(tmp_path):
    """The check above can fail: in a copy of the package whose spec.py reaches into the sweep side
    inside a function, and whose results/ loads torch, both are named."""
    copy = tmp_path / "hpcfsdp"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("presets", "__pycache__"))
    with (copy / "spec.py").open("a") as spec:
        spec.write("\n\ndef _late():\n    from .sweep.matrix import Cell\n\n    return Cell\n")
    with (copy / "results" / "read.py").open("a") as read:
        read.write("\nimport torch  # noqa\n")
    assert violations(copy, import_table()) == ["results/read.py imports torch", "spec.py imports hpcfsdp.sweep.matrix"]


# Only the runner (slurm.py) and the cell's reading of its own job (cell/requeue.py) run Slurm's
# commands as the program of a subprocess (docs/design.md).
SLURM_RUNNERS = {"slurm.py", "cell/requeue.py"}
SLURM_PROGRAMS = {"sbatch", "squeue", "sacct", "sinfo", "scontrol", "sacctmgr", "scancel", "srun", "salloc", "sstat"}
SPAWNERS = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output", "getoutput")} | {
    ("os", name) for name in ("system", "popen", "execv", "execvp", "execvpe", "execl", "execlp", "spawnv", "spawnvp")
}


def slurm_runs(src: Path) -> list[str]:
    """'<file>: <what>' for each module outside SLURM_RUNNERS that starts a Slurm command: a process
    call whose program is one (a literal list, tuple or command string), or, where the program is
    not a literal, a process call in a module that names one as a string of its own."""
    found = []
    for path in sorted(src.rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        if relative in SLURM_RUNNERS:
            continue
        tree = ast.parse(path.read_text())
        named = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SLURM_PROGRAMS
        }
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
                continue
            if (func.value.id, func.attr) not in SPAWNERS or not node.args:  # type: ignore[union-attr]
                continue
            program = node.args[0]  # type: ignore[union-attr]
            if isinstance(program, (ast.List, ast.Tuple)) and program.elts:
                program = program.elts[0]
            if isinstance(program, ast.Constant) and isinstance(program.value, str):
                words = program.value.split()
                if words and words[0] in SLURM_PROGRAMS:
                    found.append(f"{relative}:{node.lineno}: runs {words[0]}")
            elif named:
                found.append(f"{relative}:{node.lineno}: runs a command, and names {', '.join(sorted(named))}")
    return found


def test_only_the_runner_and_the_cells_own_reading_of_its_job_run_slurm_commands():
    assert slurm_runs(SRC) == []


def test_the_slurm_command_check_names_a_module_that_runs_one(tmp_path):
    """The check above can fail: a copy of the package whose status.py runs squeue itself, and whose
    local.py runs a command held in a variable while naming sacct, has both named."""
    copy = tmp_path / "hpcfsdp"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("presets", "__pycache__"))
    with (copy / "sweep" / "status.py").open("a") as status:
        status.write('\n\ndef _ask():\n    import subprocess\n\n    return subprocess.run(["squeue", "--me"])\n')
    with (copy / "sweep" / "local.py").open("a") as local:
        local.write('\n\ndef _accounted():\n    command = ["sacct"]\n    return subprocess.check_output(command)\n')
    lines = {line.split(":", 2)[0] + ":" + line.split(":", 2)[2] for line in slurm_runs(copy)}
    assert lines == {"sweep/local.py: runs a command, and names sacct", "sweep/status.py: runs squeue"}
