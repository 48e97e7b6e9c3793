"""What a cell's processes get from the environment, whatever the executor: the hub switched
offline, the cache folder; and what they never get: secrets.

sbatch copies the environment it starts with into the job, and slurmctld keeps that copy with the
job in its state folder; the local executor's torchrun and the printed command inherit it too.
A variable is taken out when its name has the shape of a secret's, in any case and whatever its
prefix: a word (between underscores) TOKEN(S), KEY(S), APIKEY, SECRET(S), PASSWORD(S), PASSWD,
PASS, PWD, PAT, CREDENTIAL(S), CREDS, PASSPHRASE, AUTH, COOKIE, DSN or WEBHOOK (HF_TOKEN,
MYAPP_KEY, PGPASSWORD, MYSQL_PWD, GITHUB_PAT, API_TOKENS, SENTRY_DSN, SSH_AUTH_SOCK, ...); or
when its value has the shape of one: a URL with a password in it (DATABASE_URL, HTTPS_PROXY
with user:password@), a private key, or a token of a well-known issuer (ghp_..., hf_...,
AKIA..., xoxb-..., glpat-..., sk-...). PWD and OLDPWD, the working folders, are no secrets.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ..cache.hub import CACHE_ENV
from .matrix import Sweep

# Compute nodes never reach the network: the hub clients must read the pre-downloaded cache only.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def job_environment(sweep: Sweep) -> dict[str, str]:
    """What every cell's processes get, whatever the executor: hub offline, and the cache folder."""
    env = dict(OFFLINE_ENV)
    cache = sweep.resources.cache_dir or os.environ.get(CACHE_ENV, "")
    if cache:
        env[CACHE_ENV] = os.path.expanduser(cache)
    return env


# Always unset in a printed command and an sbatch script from `plan --sbatch`, set here or not.
HF_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "TOKENS",
        "KEY",
        "KEYS",
        "APIKEY",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASS",
        "PWD",
        "PAT",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "PASSPHRASE",
        "AUTH",
        "COOKIE",
        "DSN",
        "WEBHOOK",
    }
)
# Words glued to the end of a name without an underscore: PGPASSWORD, APIKEY, MYTOKEN.
SECRET_ENDINGS = ("TOKEN", "TOKENS", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIALS")
NOT_SECRETS = frozenset({"PWD", "OLDPWD"})
SECRET_VALUE = re.compile(
    r"[a-z][a-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@"  # scheme://user:password@host
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abpors]-[\w-]{10,}|sk-[\w-]{20,})",
)


def is_secret(name: str, value: str = "") -> bool:
    """An environment variable whose name or value has the shape of a secret's (module docstring)."""
    upper = name.upper()
    if upper in NOT_SECRETS:
        return False
    words = set(re.split(r"[^A-Z0-9]+", upper))
    return bool(words & SECRET_WORDS) or upper.endswith(SECRET_ENDINGS) or bool(SECRET_VALUE.search(value))


def secret_names(environ: Mapping[str, str]) -> list[str]:
    return sorted(name for name, value in environ.items() if is_secret(name, value))


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if not is_secret(name, value)}


@contextmanager
def secrets_removed() -> Iterator[None]:
    """Take secrets out of os.environ while sbatch runs: submitit starts it with this process's
    environment, and sbatch hands that to the job and to slurmctld's saved copy of it."""
    removed = {name: os.environ.pop(name) for name in secret_names(os.environ)}
    try:
        yield
    finally:
        os.environ.update(removed)
