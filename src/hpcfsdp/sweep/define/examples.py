"""The example jobs YAMLs and the plain sbatch script that the package carries, for a user who
installed the wheel and has no checkout: `hpcfsdp examples` lists them, prints one, or writes a
copy to start from; `plan`, `submit` and `download` take an example's name where no such file is.

They are the checkout's jobs/*.yaml and slurm/fsdp_job.sbatch themselves: src/hpcfsdp/examples/
links to them, and the wheel and sdist carry copies (pyproject.toml's package data), so there is
one copy to keep up to date.
"""

from __future__ import annotations

import re
import sys
from importlib.resources import files
from pathlib import Path

from ...contracts.fields import SpecError

SBATCH_NAME = "fsdp_job.sbatch"
# The example that answers each public document's question the suite grew from (docs/seeds.md).
SEED_EXAMPLES = {
    "000": "zero2_vs_zero3",
    "001": "ddp_vs_fsdp",
    "002": "codellama_chess",
    "003": "optimizer_order",
    "004": "smollm3_mfu",
}


def examples_folder() -> Path:
    return Path(str(files("hpcfsdp") / "examples"))


def examples() -> dict[str, Path]:
    """Name -> file: each jobs YAML by its stem (smoke, ...), then the sbatch script."""
    folder = examples_folder()
    found = {path.stem: path for path in sorted((folder / "jobs").glob("*.yaml"))}
    return {**found, SBATCH_NAME: folder / SBATCH_NAME}


def summary(path: Path) -> str:
    """What the example is: the first sentence of the file's opening comment, whole (its lines
    joined; a command line, indented in the comment, ends the prose)."""
    prose: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("#!"):
            continue
        text = line[1:].removeprefix(" ") if line.startswith("#") and not line.startswith("#SBATCH") else None
        if text is None or text.startswith(" ") or not text:
            break
        prose.append(text)
    return re.split(r"(?<=[.!?])\s", " ".join(prose), maxsplit=1)[0]


def listing() -> list[str]:
    rows = examples()
    width = max(len(name) for name in rows)
    seeds = {name: f"[seed {seed}] " for seed, name in SEED_EXAMPLES.items()}
    return [
        *(f"{name:{width}}  {seeds.get(name, '')}{summary(path)}" for name, path in rows.items()),
        "`hpcfsdp examples NAME` prints one, `--copy-to DIR` writes it there to edit; "
        "`hpcfsdp plan NAME` plans it as it is; [seed N]: the question it answers (docs/seeds.md)",
    ]


def example(name: str) -> Path:
    """The example `name` names (smoke, smoke.yaml or jobs/smoke.yaml), or a SpecError."""
    found = examples().get(_stem(name)) or examples().get(name)
    if found is None:
        raise SpecError("examples", "", f"{name}: no such example; expected one of: {', '.join(examples())}")
    return found


def copy_example(name: str, folder: Path) -> Path:
    """Write the example into folder, never over a file that is there."""
    source = example(name)
    target = folder / source.name
    if target.exists():
        raise SpecError("examples", "--copy-to", f"{target} exists; it is left as it is")
    folder.mkdir(parents=True, exist_ok=True)
    target.write_text(source.read_text())
    return target


def jobs_file(given: str) -> str:
    """The jobs YAML to load for `given`: the file where it exists, else the packaged example it
    names (a note on stderr says so), else `given` (the loader then says there is no such file)."""
    path = examples().get(_stem(given))
    if Path(given).exists() or path is None or path.suffix != ".yaml":
        return given
    print(f"note: {given}: no such file here; using the packaged example {path}", file=sys.stderr)
    return str(path)


def _stem(name: str) -> str:
    """smoke, smoke.yaml and jobs/smoke.yaml all name the example smoke."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.parent in (Path("."), Path("jobs")):
        return path.stem
    return name if "/" not in name else ""
