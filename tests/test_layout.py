"""The login-node / compute-node split holds: the login-side commands never load torch, and a rank
loads nothing of the sweep side.

Each command runs in a fresh interpreter (a test process has torch loaded already), as a user on a
login node would run it; the check is `sys.modules` after the command returned.
"""

from __future__ import annotations

import ast
import json
import os
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
    from hpcfsdp.contracts.record import write_record

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


def test_run_refuses_a_bad_field_in_one_error_line_before_torch_is_imported():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(["run", "steps=2", "warmup_steps=2"])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 2, "loaded": []}
    assert proc.stderr == "error: run arguments: warmup_steps: expected fewer than steps (2), got 2\n"


def test_the_cache_side_loads_no_torch_outside_tokenising():
    probe = (
        "import sys, hpcfsdp.cache.download, hpcfsdp.cache.fetch, hpcfsdp.cache.hub, hpcfsdp.cache.manifest, "
        "hpcfsdp.cache.plan, hpcfsdp.cache.tokenize, hpcfsdp.cache.verify, hpcfsdp.sweep.launch.job;"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_a_rank_run_on_its_cell_folder_imports_nothing_of_the_sweep_side(tmp_path):
    """What a rank imports before its cell starts counts in every launch (the record's
    `phases.imports`): `run --cell-dir` reads the cell that submit wrote, so neither the parser's
    listing of the RunSpec fields nor run's KEY=VALUE path (both import sweep/define) is loaded.
    The rank's own log of its imports (`python -X importtime`) says what it loaded."""
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "name: ranks\nbase: {model: tiny, device: cpu, precision: fp32, seq_len: 16, steps: 2, warmup_steps: 1,"
        " comm_profile_steps: 0, strategy: single}\n"
    )
    assert loaded_by(["submit", str(jobs), "--executor", "print", "--results-dir", str(tmp_path / "results")]) == {
        "code": 0,
        "loaded": [],
    }
    (cell,) = (tmp_path / "results" / "ranks" / "cells").iterdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpcfsdp", "run", "--cell-dir", str(cell)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    record = json.loads((cell / "result.json").read_text())
    assert proc.returncode == 0 and record["status"] == "ok", record.get("error") or proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hpcfsdp.cell.run" in imported and "torch" in imported
    assert sorted(m for m in imported if m.startswith("hpcfsdp.sweep")) == []


# ---------------------------------------------------------------------------------------------
# The module tree and the import table of docs/design.md, read from the page itself: they are the
# one statement of which module lives in which room and which room may import which, and these
# tests keep the code to them (module level and lazy imports alike).

SRC = ROOT / "src" / "hpcfsdp"
DESIGN = ROOT / "docs" / "design.md"
HEAVY = ("torch", "transformers")
TABLE_HEADER = "| part | may import (of hpcfsdp) | torch, transformers |"
TREE_ROOT = "src/hpcfsdp/"
MAX_MODULES_PER_FOLDER = 15
# A line of the tree: a folder (`launch/`) or its modules (`matrix, yamlfile`), then what they do.
ENTRY = re.compile(r"([\w.]+(?:, [\w.]+)*/?)(?:\s|$)")


def import_table(page: Path = DESIGN) -> dict[str, tuple[set[str], set[str]]]:
    """part -> (the rooms and modules it may import, the heavy libraries it may import), from the
    table under TABLE_HEADER. A part is a room (a folder: `sweep/launch`), a module at the top
    (`cli`) or one file of a room (`sweep/launch/job.py`, which adds to its room's row); an entry
    names a room or a module (`sweep/track/status`); `everything` allows every part."""
    lines = page.read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2
    table = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        parts, allowed, heavy = (re.findall(r"`([^`]+)`", cell) for cell in line.strip("|").split("|"))
        for part in parts:
            table[part] = (set(allowed), set(heavy))
    return table


def module_tree(page: Path = DESIGN) -> set[str]:
    """The modules the tree of design.md lists, as paths under src/hpcfsdp without .py
    (`sweep/launch/job`, `cli`). A folder line ends in `/`; a line of a folder's entries starts
    two columns in from the folder and names its modules (`matrix, yamlfile   what they do`); a line
    indented further goes on with the description above it."""
    lines = page.read_text().split("```")[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == TREE_ROOT)
    folders = [(lines[start].index(TREE_ROOT), "")]  # (indent, folder path)
    listed = set()
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while indent <= folders[-1][0]:
            folders.pop()
        if indent > folders[-1][0] + 2:  # a description going on
            continue
        words = ENTRY.match(line.strip())
        assert words, f"design.md's tree: {line.strip()!r} names no module or folder"
        folder = folders[-1][1]
        if words[1].endswith("/"):
            folders.append((indent, f"{folder}{words[1]}"))
            continue
        listed |= {folder + name.strip().removesuffix(".py") for name in words[1].split(",")}
    return listed


def modules_of(src: Path = SRC) -> set[str]:
    """Every module under src/hpcfsdp, as the tree names it: a folder's __init__.py is the folder
    itself (not listed), the package's own __init__ and __main__ are."""
    found = {path.relative_to(src).with_suffix("").as_posix() for path in src.rglob("*.py")}
    return {name for name in found if not name.endswith("/__init__")}


def part_of(module: str) -> str:
    """sweep/launch/job -> sweep/launch (its room); cli -> cli (a module at the top is a part of its own)."""
    return module.rsplit("/", 1)[0] if "/" in module else module


def module_named(dotted: str, src: Path = SRC) -> str:
    """hpcfsdp.sweep.launch.job -> sweep/launch/job; hpcfsdp.sweep -> sweep/__init__; hpcfsdp -> __init__."""
    path = src.joinpath(*dotted.split(".")[1:])
    return (path / "__init__" if path.is_dir() else path).relative_to(src).as_posix()


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


def import_edges(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the modules of hpcfsdp it imports (lazily or not), and 'heavy:<library>' for torch
    and transformers; module names as module_named gives them."""
    edges = {}
    for path in sorted(src.rglob("*.py")):
        module = path.relative_to(src).with_suffix("").as_posix()
        targets = set()
        for target in imports_of(path, src):
            top = target.split(".")[0]
            if top in HEAVY:
                targets.add(f"heavy:{top}")
            elif top == "hpcfsdp":
                targets.add(module_named(target, src))
        edges[module] = targets - {module}
    return edges


def matches(entry: str, module: str) -> bool:
    return module == entry or module.startswith(entry + "/")


def rules_of(module: str, table: dict[str, tuple[set[str], set[str]]]) -> tuple[set[str], set[str]] | None:
    """The entries a module may import (its room's row and its own file's row), None when neither has one."""
    part, own = part_of(module), f"{module}.py"
    if part not in table and own not in table:
        return None
    allowed, heavy = table.get(part, (set(), set()))
    extra, extra_heavy = table.get(own, (set(), set()))
    return allowed | extra, heavy | extra_heavy


def violations(src: Path, table: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """'<file> imports <module>' for each import the table does not allow."""
    broken = []
    for module, targets in import_edges(src).items():
        rules = rules_of(module, table)
        if rules is None:
            broken.append(f"{module}.py: no row in the import table")
            continue
        allowed, heavy = rules
        for target in sorted(targets):
            if target.startswith("heavy:"):
                ok = target.removeprefix("heavy:") in heavy
            else:
                ok = part_of(target) == part_of(module) or "everything" in allowed
                ok = ok or any(matches(entry, target) for entry in allowed)
            if not ok:
                shown = target.removeprefix("heavy:")
                broken.append(f"{module}.py imports {shown}")
    return broken


def unused_permissions(src: Path, table: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """'<row>: <entry>' for each permission of the table that no module of the row uses."""
    edges = import_edges(src)
    unused = []
    for row, (allowed, heavy) in table.items():
        members = [m for m in edges if (f"{m}.py" == row if row.endswith(".py") else part_of(m) == row)]
        used = set().union(*(edges[m] for m in members)) if members else set()
        for entry in sorted(allowed - {"everything"}):
            if not any(matches(entry, target) for target in used if part_of(target) != row):
                unused.append(f"{row}: {entry}")
        unused += [f"{row}: {library}" for library in sorted(heavy) if f"heavy:{library}" not in used]
    return unused


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: each strongly connected set of more than one node, sorted
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def module_circles(src: Path = SRC) -> list[list[str]]:
    edges = import_edges(src)
    return circles({m: {t for t in targets if not t.startswith("heavy:")} for m, targets in edges.items()})


def room_circles(src: Path = SRC) -> list[list[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in import_edges(src).items():
        room = rooms.setdefault(part_of(module), set())
        room |= {part_of(t) for t in targets if not t.startswith("heavy:")} - {part_of(module)}
    return circles(rooms)


def crowded_folders(src: Path = SRC) -> list[str]:
    counts = {}
    for path in src.rglob("*.py"):
        folder = path.parent.relative_to(src).as_posix()
        counts[folder] = counts.get(folder, 0) + 1
    return [f"{folder}: {n} modules" for folder, n in sorted(counts.items()) if n > MAX_MODULES_PER_FOLDER]


def test_every_part_imports_only_what_the_import_table_of_design_md_allows():
    assert violations(SRC, import_table()) == []


def test_the_import_table_permits_nothing_that_no_module_uses():
    assert unused_permissions(SRC, import_table()) == []


def test_no_module_and_no_room_imports_another_that_imports_it_back():
    assert module_circles() == []
    assert room_circles() == []


def test_no_folder_of_the_package_holds_more_than_15_modules():
    assert crowded_folders() == []


def test_the_module_tree_of_design_md_lists_every_module_and_only_modules_that_exist():
    listed, present = module_tree(), modules_of()
    assert sorted(present - listed) == [], "modules missing from design.md's tree"
    assert sorted(listed - present) == [], "design.md's tree lists modules that do not exist"


def test_the_import_check_names_a_forbidden_import_lazy_or_not(tmp_path):
    """The check above can fail: in a copy of the package whose spec.py reaches into the sweep side
    inside a function, and whose results/ loads torch, both are named."""
    copy = tmp_path / "hpcfsdp"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("presets", "__pycache__"))
    with (copy / "contracts" / "spec.py").open("a") as spec:
        spec.write("\n\ndef _late():\n    from ..sweep.define.matrix import Cell\n\n    return Cell\n")
    with (copy / "results" / "read.py").open("a") as read:
        read.write("\nimport torch  # noqa\n")
    assert violations(copy, import_table()) == [
        "contracts/spec.py imports sweep/define/matrix",
        "results/read.py imports torch",
    ]


def test_the_layout_checks_name_a_circle_an_unused_permission_a_crowded_folder_and_a_missing_module(tmp_path):
    """The checks above can fail: a copy of the package where define/matrix.py imports launch/submit
    inside a function (a circle of modules and of rooms), whose design.md permits cache to import
    sweep, whose contracts/ holds 16 modules, and with a module the tree does not list."""
    copy = tmp_path / "hpcfsdp"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("presets", "__pycache__"))
    with (copy / "sweep" / "define" / "matrix.py").open("a") as matrix:
        matrix.write("\n\ndef _late():\n    from ..launch.submit import select_cells\n\n    return select_cells\n")
    for n in range(16 - len(list((copy / "contracts").glob("*.py")))):
        (copy / "contracts" / f"extra{n}.py").write_text('"""A module too many."""\n')
    page = tmp_path / "design.md"
    page.write_text(DESIGN.read_text().replace("| `cache` | ", "| `cache` | `sweep`, ", 1))
    assert any({"sweep/define/matrix", "sweep/launch/submit"} <= set(c) for c in module_circles(copy))
    assert any({"sweep/define", "sweep/launch"} <= set(c) for c in room_circles(copy))
    assert "cache: sweep" in unused_permissions(copy, import_table(page))
    assert crowded_folders(copy) == ["contracts: 16 modules"]
    assert "contracts/extra0" in modules_of(copy) - module_tree(page)


# Only the runner (slurm.py), the cell's reading of its own job (cell/stopping/requeue.py) and of its
# Slurm release (cell/measure/provenance.py) run Slurm's commands as the program of a subprocess
# (docs/design.md).
SLURM_RUNNERS = {"slurm.py", "cell/stopping/requeue.py", "cell/measure/provenance.py"}
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
    with (copy / "sweep" / "track" / "status.py").open("a") as status:
        status.write('\n\ndef _ask():\n    import subprocess\n\n    return subprocess.run(["squeue", "--me"])\n')
    with (copy / "sweep" / "launch" / "local.py").open("a") as local:
        local.write('\n\ndef _accounted():\n    command = ["sacct"]\n    return subprocess.check_output(command)\n')
    lines = {line.split(":", 2)[0] + ":" + line.split(":", 2)[2] for line in slurm_runs(copy)}
    assert lines == {"sweep/launch/local.py: runs a command, and names sacct", "sweep/track/status.py: runs squeue"}
