"""What hpcfsdp needs of its dependencies holds, and pyproject.toml says so; every requirement is a
release on the package index, and env/environment.yml lists the same ones.

submitit: the API the submitter uses holds for the installed version, and pyproject's bound says so.

`sweep/launch/sbatch.py` renders the sbatch script with submitit's private `_make_sbatch_string` (submitit
has no public call for the script text) and reads logs through `JobPaths`; the job object is a
`Checkpointable`. A submitit that changes these must fail here, not on a user's login node.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def requirement(name: str) -> Requirement:
    return next(Requirement(line) for line in pyproject()["dependencies"] if Requirement(line).name == name)


def test_submitit_is_pinned_below_the_next_minor_version_and_the_installed_one_is_inside():
    req = requirement("submitit")
    assert req.specifier.contains(version("submitit"))
    assert any(spec.operator == "<" for spec in req.specifier), "an upper bound guards the private API"


def test_the_submitit_api_the_submitter_calls_has_the_arguments_it_passes():
    import submitit
    from submitit.core.utils import JobPaths
    from submitit.slurm.slurm import _make_sbatch_string

    from hpcfsdp.sweep.define.matrix import parse_sweep
    from hpcfsdp.sweep.define.resources import Resources
    from hpcfsdp.sweep.launch.job import CellJob
    from hpcfsdp.sweep.launch.sbatch import slurm_parameters

    sweep = parse_sweep(
        {
            "name": "deps",
            "base": {"device": "cpu", "gpus_per_node": 2},
            "slurm": Resources(mem_gb=8, account="a", max_requeue=1).to_dict(),
        },
        "deps.yaml",
    )
    accepted = set(inspect.signature(_make_sbatch_string).parameters)
    parameters = slurm_parameters(sweep, nodes=1, gpus_per_node=2, sweep_dir=Path("results"))
    assert set(parameters) | {"command", "folder", "map_count"} <= accepted
    # slurm.container wraps the job's Python through the executor's own `python` (sweep/define/container.py).
    assert "python" in inspect.signature(submitit.SlurmExecutor).parameters
    requeued = CellJob(("/cells/a",)).checkpoint()  # what submitit pickles again at the time-limit signal
    assert isinstance(requeued, submitit.helpers.DelayedSubmission) and requeued.function == CellJob(("/cells/a",))
    assert JobPaths("/x/%j", job_id="7_1", task_id=1).stderr == Path("/x/7_1/7_1_1_log.err")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_dependency_of_every_extra_is_a_release_on_the_package_index():
    """A URL or path requirement cannot be published to an index, served by a mirror or put in a
    wheelhouse (env/setup.sh --download-wheels)."""
    project = pyproject()
    lines = project["dependencies"] + [line for extra in project["optional-dependencies"].values() for line in extra]
    assert [line for line in lines if Requirement(line).url] == []
    assert len(lines) > 20


def test_the_gpu_extra_is_the_packages_the_levers_name():
    from hpcfsdp.extras import PACKAGES

    assert sorted(pyproject()["optional-dependencies"]["gpu"]) == sorted(p.requirement for p in PACKAGES)


def test_the_fp32_cce_losses_name_the_github_release_in_their_one_line_error():
    """loss: cce_kahan_full_c / cce_exact need cut-cross-entropy 25.6, which is on GitHub only: no
    extra installs it; with an older release the plan-time check names the archive to install."""
    from hpcfsdp.extras import CCE_REQUIREMENT, cce_too_old

    requirement = Requirement(CCE_REQUIREMENT)
    assert requirement.name == "cut-cross-entropy" and requirement.url.endswith(".zip")  # no git on the login node
    assert cce_too_old("25.1.1") and not cce_too_old("25.6.4") and not cce_too_old(None)


def test_the_conda_environment_lists_the_projects_dependencies():
    import yaml

    environment = yaml.safe_load((ROOT / "env" / "environment.yml").read_text())
    pip = next(entry["pip"] for entry in environment["dependencies"] if isinstance(entry, dict))
    python = next(entry for entry in environment["dependencies"] if str(entry).startswith("python="))
    assert sorted(pip) == sorted(pyproject()["dependencies"])
    assert SpecifierSet(pyproject()["requires-python"]).contains(python.split("=")[1] + ".0")


# Runs `hpcfsdp plan` in a fresh interpreter, as on a login node: its exit status, stderr and
# whether it loaded torch.
PLAN_PROBE = """
import json, sys
from hpcfsdp.cli import main
code = main(["plan", sys.argv[1]])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def plan_in_fresh_python(tmp_path: Path, yaml_text: str) -> tuple[dict, str]:
    jobs = tmp_path / "levers.yaml"
    jobs.write_text(yaml_text)
    proc = subprocess.run(
        [sys.executable, "-c", PLAN_PROBE, str(jobs)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize(
    ("line", "package", "pip"),
    [
        ("float8: [none, tensorwise]", "torchao", "pip install 'torchao>=0.18'"),
        ("loss: [default, liger]", "liger-kernel", "pip install 'liger-kernel>=0.6'"),
        ("kernels: [none, liger]", "liger-kernel", "pip install 'liger-kernel>=0.6'"),
    ],
)
def test_a_gpu_lever_whose_package_is_missing_stops_plan_in_one_line_naming_key_package_and_pip_line(
    tmp_path, line, package, pip
):
    """The login node (no GPU, no torch loaded) refuses the sweep: its cells would run with this
    environment and fail on the compute node."""
    if importlib.util.find_spec(package.replace("-", "_")) is not None:
        pytest.skip(f"{package} is installed here (the gpu extra): nothing to refuse")
    key = line.split(":")[0]
    outcome, stderr = plan_in_fresh_python(
        tmp_path, f"name: levers\nbase: {{device: cuda, strategy: fsdp2_zero2}}\nmatrix:\n  {line}\n"
    )
    assert outcome == {"code": 2, "torch": False}
    assert stderr.count("\n") == 1 and stderr.startswith(f"error: {tmp_path / 'levers.yaml'}:4: matrix.{key}: ")
    assert f"needs {package}, which the Python the cells run with ({sys.executable}) lacks: {pip}" in stderr


def test_loss_cce_exact_plans_with_cut_cross_entropy_25_6_and_stops_in_one_line_with_25_1(tmp_path):
    """PyPI's cut-cross-entropy 25.1.1 (the extras' release) lacks cce_exact: plan names the
    GitHub archive of 25.6.4 to install; with 25.6 or later installed by hand, the cell plans."""
    from hpcfsdp.extras import CCE_REQUIREMENT, installed_version

    version = installed_version("cut-cross-entropy")
    outcome, stderr = plan_in_fresh_python(
        tmp_path, "name: levers\nbase: {device: cpu, strategy: ddp}\nmatrix:\n  loss: [cce, cce_exact]\n"
    )
    assert outcome["torch"] is False
    if version is not None and Version(version) >= Version("25.6"):
        assert outcome["code"] == 0, stderr
    else:
        assert outcome["code"] == 2 and stderr.count("\n") == 1
        assert "matrix.loss: cce_exact needs cut-cross-entropy" in stderr
        assert stderr.rstrip().endswith(f"pip install '{CCE_REQUIREMENT}'")
