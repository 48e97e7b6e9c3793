"""hpcfsdp installs anywhere: `python -m build` gives a wheel and an sdist that install into a fresh
virtualenv and run the smoke matrix, and `env/setup.sh --download-wheels` / `--wheelhouse` install
it with no network (docs/install.md).

The build tests reuse this environment's torch and dependencies (a fresh venv that sees them
through a .pth file, without this checkout's editable hpcfsdp), so they take about a minute. The
wheelhouse test downloads every wheel from the package index (marked `network`), then installs
torch and all into a fresh venv with the network cut: about 6 minutes on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from hpcfsdp.cliargs import DOC_NAMED

ROOT = Path(__file__).resolve().parents[1]
# What a user of the package needs beside it: the checkout's parts that the sdist carries.
CHECKOUT_PARTS = (
    "jobs/smoke.yaml",
    "slurm/local/start.sh",
    "slurm/fsdp_job.sbatch",
    "env/setup.sh",
    "README.md",
    "LICENSE",
)


def run(cmd: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build` of this checkout: the sdist, then the wheel built from the sdist."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    return out


def fresh_venv(path: Path, reuse: Path) -> Path:
    """A new venv whose only packages are this environment's, minus hpcfsdp (seen through a .pth
    file that names a folder of links to them): the built package must bring itself."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    own = Path(sysconfig.get_paths()["purelib"])
    for entry in own.iterdir():
        if not entry.name.lower().startswith(("hpcfsdp", "__editable__")) and entry.suffix != ".pth":
            (reuse / entry.name).symlink_to(entry)
    python = path / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(site) / "reuse.pth").write_text(f"{reuse}\n")
    return python


def pip_install(python: Path, *args: str) -> None:
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index", "--no-deps", *args])


def a_cell_of_the_smoke_matrix(python: Path, checkout: Path, results: Path, offline: bool = False) -> dict:
    """`hpcfsdp plan jobs/smoke.yaml`, then the first cell of the README's main job as its local
    executor runs it (the line `submit --executor print` gives): the record."""
    hpcfsdp = str(python.parent / "hpcfsdp")
    planned = run([hpcfsdp, "plan", "jobs/smoke.yaml"], cwd=checkout).stdout
    assert "smoke: 8 cell(s) in 1 array(s)" in planned
    lines = run(
        [hpcfsdp, "submit", "jobs/smoke.yaml", "--executor", "print", "--results-dir", str(results)], cwd=checkout
    ).stdout.splitlines()
    assert len(lines) == 8 and str(python) in lines[0]
    cell = ["bash", "-c", lines[0]]
    run(without_network(cell) if offline else cell, cwd=checkout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (record,) = (results / "smoke" / "cells").glob("*/result.json")
    return json.loads(record.read_text())


def imported_from(python: Path) -> str:
    return run([str(python), "-c", "import hpcfsdp.cli; print(hpcfsdp.cli.__file__)"], cwd="/").stdout.strip()


def test_the_built_wheel_installs_into_a_fresh_venv_and_runs_the_smoke_matrix_with_its_presets(dist, tmp_path):
    (wheel,) = dist.glob("hpcfsdp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"hpcfsdp/presets/tiny.json", "hpcfsdp/presets/tokenizers/tiny/tokenizer.json"} <= set(names)
    # The examples a user starts from: every jobs YAML of the checkout, and the plain sbatch script.
    examples = {f"hpcfsdp/examples/jobs/{path.name}" for path in (ROOT / "jobs").glob("*.yaml")}
    assert examples | {"hpcfsdp/examples/fsdp_job.sbatch"} <= set(names)
    # The MIT licence the metadata names, as the checkout's LICENSE file.
    (licence,) = (name for name in names if name.endswith(".dist-info/licenses/LICENSE"))
    assert zipfile.ZipFile(wheel).read(licence).decode() == (ROOT / "LICENSE").read_text()
    (tmp_path / "reuse").mkdir()
    python = fresh_venv(tmp_path / "venv", tmp_path / "reuse")
    pip_install(python, str(wheel))
    assert imported_from(python).startswith(str(tmp_path / "venv"))
    hpcfsdp = str(python.parent / "hpcfsdp")
    checkout = tmp_path / "work"  # a user's folder, empty: no checkout, no jobs/
    checkout.mkdir()
    listed = run([hpcfsdp, "examples"], cwd=checkout).stdout
    assert listed.startswith("codellama_chess ") and "\nfsdp_job.sbatch  Plain sbatch template" in listed
    assert "smoke: 8 cell(s) in 1 array(s)" in run([hpcfsdp, "plan", "smoke"], cwd=checkout).stdout
    run([hpcfsdp, "examples", "smoke", "--copy-to", "jobs"], cwd=checkout)  # one to start from, to edit
    assert (checkout / "jobs/smoke.yaml").read_text() == (ROOT / "jobs/smoke.yaml").read_text()
    # Every page of docs/ that a help text names is in the wheel, and the installed help says where.
    named = {page for text in help_texts() for page in DOC_NAMED.findall(text)}
    assert named and {f"hpcfsdp/{page}" for page in named} <= set(names), named - set(names)
    said = run([hpcfsdp, "submit", "--help"], cwd=checkout).stdout
    folder = Path(said.rsplit("installed with the package in ", 1)[1].strip())
    assert folder.is_relative_to(tmp_path / "venv")
    assert all((folder / page.removeprefix("docs/")).is_file() for page in named), sorted(named)
    record = a_cell_of_the_smoke_matrix(python, checkout, tmp_path / "results")
    assert record["status"] == "ok" and record["spec"]["model"] == "tiny"


def help_texts() -> list[str]:
    """`hpcfsdp --help` and every subcommand's help, as the parser writes them."""
    from hpcfsdp.cli import _parser

    parser = _parser()
    (commands,) = (action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return [parser.format_help(), *(sub.format_help() for sub in commands.choices.values())]


def test_the_sdist_carries_the_checkout_and_installs_into_a_fresh_venv(dist, tmp_path):
    (sdist,) = dist.glob("hpcfsdp-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        # our own sdist; extraction filters came with Python 3.11.4 (Debian 12 has 3.11.2)
        tar.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert set(CHECKOUT_PARTS) <= names and not any("__pycache__" in name for name in names)
    assert (tmp_path / sdist.name.removesuffix(".tar.gz") / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    # The raw benchmark logs stay in the repository (docs/benchmarks.md links them there).
    assert "bench/collect_scale.py" in names and not any(name.startswith("bench/results/") for name in names)
    assert sdist.stat().st_size < 2_000_000, sdist.stat().st_size
    (tmp_path / "reuse").mkdir()
    python = fresh_venv(tmp_path / "venv", tmp_path / "reuse")
    pip_install(python, "--no-build-isolation", str(sdist))
    assert imported_from(python).startswith(str(tmp_path / "venv"))
    unpacked = tmp_path / sdist.name.removesuffix(".tar.gz")
    planned = run([str(python.parent / "hpcfsdp"), "plan", "jobs/smoke.yaml"], cwd=unpacked).stdout
    assert "smoke: 8 cell(s) in 1 array(s)" in planned


def without_network(cmd: list[str]) -> list[str]:
    """`cmd` in a network namespace of its own with only loopback up (gloo needs it), where this
    machine lets us make one; else as it is (pip's --no-index alone keeps it off the network)."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh", *cmd]
    return cmd


@pytest.mark.network
def test_a_downloaded_wheelhouse_installs_a_fresh_venv_with_no_network_that_runs_the_smoke_matrix(tmp_path):
    """`--download-wheels` where the package index answers (torch: the CPU build for this
    machine's Python and platform), then `--wheelhouse` with pip's configuration (its index, its
    find-links) out of the way and the network cut, then a cell of the smoke matrix."""
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    run(
        ["bash", str(ROOT / "env/setup.sh"), "--download-wheels", str(wheels), "--cpu"]
        + ["--python-version", version, "--platform", f"manylinux_2_28_{platform.machine()}"]
    )
    names = [path.name for path in wheels.iterdir()]
    assert any(name.startswith("torch-") for name in names) and any(name.startswith("hpcfsdp-") for name in names)
    offline = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    offline |= {"PIP_CONFIG_FILE": os.devnull, "HPCFSDP_VENV": str(tmp_path / "venv")}
    run(without_network(["bash", str(ROOT / "env/setup.sh"), "--wheelhouse", str(wheels)]), env=offline)
    python = tmp_path / "venv" / "bin" / "python"
    assert run([str(python), "-c", "import torch; print(torch.__version__)"]).stdout.startswith("2.13.0")
    record = a_cell_of_the_smoke_matrix(python, ROOT, tmp_path / "results", offline=True)
    assert record["status"] == "ok"


def setup_dry_run(*flags: str, venv: Path) -> tuple[list[str], str]:
    """The pip commands `env/setup.sh --dry-run FLAGS` would run, and its messages."""
    proc = run(["bash", str(ROOT / "env/setup.sh"), "--dry-run", *flags], env={**os.environ, "HPCFSDP_VENV": str(venv)})
    return [line.removeprefix("+ ") for line in proc.stdout.splitlines()], proc.stderr


def test_setup_builds_for_gpu_or_cpu_nodes_as_told_whatever_the_machine_it_runs_on(tmp_path):
    """--gpu on a login node without GPUs installs the CUDA torch and the gpu extra; --cpu the CPU
    build; neither: nvidia-smi on this machine decides, and says so. No venv is made."""
    venv = tmp_path / "venv"
    pip = f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check"
    gpu, _ = setup_dry_run("--gpu", venv=venv)
    assert gpu == [f"{pip} torch>=2.11,<2.14", f"{pip} -e {ROOT}[gpu]"]
    cpu, _ = setup_dry_run("--cpu", "--dev", "--torch-index", "https://download.pytorch.org/whl/cpu", venv=venv)
    assert cpu == [f"{pip} --index-url https://download.pytorch.org/whl/cpu torch==2.13.0", f"{pip} -e {ROOT}[dev]"]
    here = "gpu" if shutil.which("nvidia-smi") else "cpu"
    default, said = setup_dry_run(venv=venv)
    assert default == (gpu if here == "gpu" else [f"{pip} torch==2.13.0", f"{pip} -e {ROOT}"])
    assert f"[setup] {here} build (nvidia-smi " in said and "--gpu or --cpu chooses" in said
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "setup-flags").write_text("gpu nodev\n")  # as --download-wheels DIR --gpu leaves it
    offline, _ = setup_dry_run("--wheelhouse", str(wheels), venv=venv)
    assert offline == [f"{pip} --no-index --find-links {wheels} torch>=2.11,<2.14"] + [
        f"{pip} --no-index --find-links {wheels} -e {ROOT}[gpu]"
    ]
    assert not venv.exists()


def test_the_readmes_example_list_and_the_models_pages_preset_list_name_every_one_that_ships():
    import re

    from hpcfsdp.contracts.sources import preset_names

    readme = " ".join((ROOT / "README.md").read_text().split())
    (listed,) = re.findall(r"Example matrices: `jobs/` \(([^)]*)\)", readme)
    assert listed.split(", ") == sorted(path.stem for path in (ROOT / "jobs").glob("*.yaml"))
    models = (ROOT / "docs/models_and_data.md").read_text()
    (row,) = [line for line in models.splitlines() if "a shipped preset" in line]
    assert re.findall(r"`([^`]+)`", row.split("|")[1]) == sorted(preset_names())


def test_the_readme_quick_start_holds_the_demo_and_cis_test_command_and_the_smoke_file_as_it_is():
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("## On a cluster")]
    blocks = quick.split("```")[1::2]
    commands = [block.removeprefix("bash\n").strip() for block in blocks if block.startswith("bash\n")]
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert commands == ["bash env/setup.sh && .venv/bin/hpcfsdp submit jobs/smoke.yaml --wait", ci]
    (jobs,) = [block.removeprefix("yaml\n") for block in blocks if block.startswith("yaml\n")]
    smoke = (ROOT / "jobs/smoke.yaml").read_text().splitlines()
    assert jobs.splitlines() == [line for line in smoke if not line.startswith("#")]
    assert "`docs/testing.md`" in quick and ci in (ROOT / "docs/testing.md").read_text()
    assert len(quick.splitlines()) <= 60  # one screen
