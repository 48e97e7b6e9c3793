"""The optional packages behind the levers (pyproject.toml's `gpu` extra): which RunSpec values need
which package, and whether this environment has it, found without importing anything.

A cell runs with the Python that submitted it (the sbatch script and the local executor call
`sys.executable`), so a package missing from the login node's environment is missing on the compute
node too. `plan` and `submit` ask here (sweep/launch/packages.py) and stop before anything is queued;
cell/levers.py imports the packages when a lever is on and names the same requirements when that
fails. Torch-free: `importlib.util.find_spec` on top-level names and `importlib.metadata` only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

from packaging.version import Version

from .contracts.spec import RunSpec

EXTRA = "gpu"  # pyproject.toml's optional extra that holds the packages below


@dataclass(frozen=True)
class Package:
    module: str  # the top-level import name
    requirement: str  # as pyproject.toml's gpu extra names it (tests/test_dependencies.py compares)

    @property
    def distribution(self) -> str:
        # imported here: every rank imports this module (cell/levers.py), and only plan's check and a
        # lever's import error name a distribution
        from packaging.requirements import Requirement

        return Requirement(self.requirement).name


TORCHAO = Package("torchao", "torchao>=0.18")
LIGER = Package("liger_kernel", "liger-kernel>=0.6")
CCE = Package("cut_cross_entropy", "cut-cross-entropy>=25.1")
PACKAGES = (TORCHAO, LIGER, CCE)

# loss: cce_kahan_full_c and cce_exact (fp32-accumulating) need cut-cross-entropy 25.6 or later,
# which is not on the package index (PyPI stops at 25.1.1): the user installs it from its GitHub
# archive, a pinned commit of 25.6.4. No extra depends on it, so every extra stays installable
# from a package index or a wheelhouse (docs/levers.md).
CCE_FP32_LOSSES = ("cce_kahan_full_c", "cce_exact")
CCE_FP32_VERSION = "25.6"
CCE_REQUIREMENT = (
    "cut-cross-entropy @ https://github.com/apple/ml-cross-entropy/archive/d42911f9b1a1f98289bb601c35c8151562603d74.zip"
)


def needed(spec: RunSpec) -> list[tuple[str, Package]]:
    """(the RunSpec field, the package it needs) for every lever of `spec` that needs one."""
    wants = [
        ("float8", TORCHAO, spec.float8 != "none"),
        ("loss", CCE, spec.loss.startswith("cce")),
        ("loss", LIGER, spec.loss == "liger"),
        ("kernels", LIGER, spec.kernels == "liger"),
    ]
    return [(name, package) for name, package, on in wants if on]


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cce_too_old(version: str | None) -> bool:
    """Whether this cut-cross-entropy lacks the fp32-accumulating variants."""
    return version is not None and Version(version) < Version(CCE_FP32_VERSION)


def missing(spec: RunSpec) -> list[tuple[str, str]]:
    """(field, why: value, package and the pip line) for every lever of `spec` whose package this
    environment lacks, or has in a release without the lever."""
    problems = []
    for name, package in needed(spec):
        value = getattr(spec, name)
        if importlib.util.find_spec(package.module) is None:
            problems.append(
                (name, f"{value} needs {package.distribution}, which {_here()} lacks: {pip_line(value, package)}")
            )
        elif name == "loss" and value in CCE_FP32_LOSSES:
            version = installed_version(package.distribution)
            if cce_too_old(version):
                problems.append(
                    (
                        name,
                        f"{value} needs {package.distribution} {CCE_FP32_VERSION} or later, and {_here()} "
                        f"has {version}: {pip_line(value, package)}",
                    )
                )
    return problems


def pip_line(value: str, package: Package) -> str:
    """How to install what the lever value needs into this environment."""
    return f"pip install '{CCE_REQUIREMENT if value in CCE_FP32_LOSSES else package.requirement}'"


def _here() -> str:
    return f"the Python the cells run with ({sys.executable})"
