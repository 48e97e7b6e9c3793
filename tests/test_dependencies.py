"""What hpcfsdp needs of its dependencies holds, and pyproject.toml says so.

submitit: the API the submitter uses holds for the installed version, and pyproject's bound says so.

`sweep/sbatch.py` renders the sbatch script with submitit's private `_make_sbatch_string` (submitit
has no public call for the script text) and reads logs through `JobPaths`; the job object is a
`Checkpointable`. A submitit that changes these must fail here, not on a user's login node.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(Requirement(line) for line in project["dependencies"] if Requirement(line).name == name)


def test_submitit_is_pinned_below_the_next_minor_version_and_the_installed_one_is_inside():
    req = requirement("submitit")
    assert req.specifier.contains(version("submitit"))
    assert any(spec.operator == "<" for spec in req.specifier), "an upper bound guards the private API"


def test_the_submitit_api_the_submitter_calls_has_the_arguments_it_passes():
    import submitit
    from submitit.core.utils import JobPaths
    from submitit.slurm.slurm import _make_sbatch_string

    from hpcfsdp.spec import Resources
    from hpcfsdp.sweep.job import CellJob
    from hpcfsdp.sweep.matrix import parse_sweep
    from hpcfsdp.sweep.sbatch import slurm_parameters

    sweep = parse_sweep(
        {
            "name": "deps",
            "base": {"device": "cpu", "gpus_per_node": 2},
            "slurm": Resources(mem_gb=8, account="a", max_requeue=1).to_dict(),
        },
        "deps.yaml",
    )
    accepted = set(inspect.signature(_make_sbatch_string).parameters)
    assert set(slurm_parameters(sweep, nodes=1, gpus_per_node=2)) | {"command", "folder", "map_count"} <= accepted
    requeued = CellJob("/cells/a").checkpoint()  # what submitit pickles again at the time-limit signal
    assert isinstance(requeued, submitit.helpers.DelayedSubmission) and requeued.function == CellJob("/cells/a")
    assert JobPaths("/x/%j", job_id="7_1", task_id=1).stderr == Path("/x/7_1/7_1_1_log.err")


def test_the_gpu_extra_installs_the_cut_cross_entropy_release_that_the_lever_error_names():
    """loss: cce_kahan_full_c / cce_exact need cut-cross-entropy 25.6, which is on GitHub only;
    the one-line error of cell/levers.py names the same URL as the extra."""
    from hpcfsdp.cell.levers import CCE_REQUIREMENT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert CCE_REQUIREMENT in extras["gpu"]
    assert Requirement(CCE_REQUIREMENT).url.endswith(".zip")  # no git needed on the login node
