"""What a cell's processes get from the environment, whatever the executor: the hub switched
offline, the cache folder; and what they never get: tokens, keys and passwords."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ..cache.hub import CACHE_ENV
from .matrix import Sweep

# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# sbatch copies the submitting environment into the job, and slurmctld keeps that copy: tokens and
# keys are taken out of the environment sbatch (and the local executor's torchrun) starts with.
HF_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
SECRET_NAME = re.compile(r"(^|_)(TOKEN|API_KEY|SECRET|SECRET_KEY|ACCESS_KEY|PASSWORD)$", re.IGNORECASE)


def job_environment(sweep: Sweep) -> dict[str, str]:
    """What every cell's processes get, whatever the executor: hub offline, and the cache folder."""
    env = dict(OFFLINE_ENV)
    cache = sweep.resources.cache_dir or os.environ.get(CACHE_ENV, "")
    if cache:
        env[CACHE_ENV] = os.path.expanduser(cache)
    return env


def is_secret(name: str) -> bool:
    """An environment variable that holds a token, key or password (HF_TOKEN, WANDB_API_KEY,
    AWS_SECRET_ACCESS_KEY, ...): it never goes with a cell."""
    return name in HF_TOKEN_ENV or bool(SECRET_NAME.search(name))


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment less every secret (is_secret)."""
    return {name: value for name, value in environ.items() if not is_secret(name)}


@contextmanager
def secrets_removed() -> Iterator[None]:
    """Take tokens out of os.environ while sbatch runs: submitit starts it with this process's
    environment, and sbatch hands that to the job and to slurmctld's saved copy of it."""
    removed = {name: os.environ.pop(name) for name in list(os.environ) if is_secret(name)}
    try:
        yield
    finally:
        os.environ.update(removed)
