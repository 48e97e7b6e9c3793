"""The shapes of a secret: a variable name or a value that holds one.

Slurm jobs get an allowlisted environment (environment.py), so these shapes are the second line:
they take secret-shaped variables out of what the local and print executors pass on and out of
the allowlisted prefixes (HPCFSDP_*, CUDA_*, SLURM_*, ...), and they refuse, at plan time, a
jobs YAML that writes a secret into the batch script (issue 33, item 2): slurmctld keeps that
script with the job, readable by the cluster's administrators, and the script sits in the sweep
folder.

A name is a secret's when a word of it (between underscores, any case) is TOKEN(S), KEY(S),
APIKEY, SECRET(S), PASSWORD(S), PASSWD, PASS, PW, PWD, PAT, JWT, CREDENTIAL(S), CREDS,
PASSPHRASE, AUTH, COOKIE, DSN or WEBHOOK, or when it ends with one glued on (PGPASSWORD, SSHPASS,
PGPASS, SECRETKEY, AWS_ACCESSKEY, PRIVATEKEY). PWD and OLDPWD, the working folders, are none.
A value is a secret's when it holds a URL with a password (any scheme, any case, '/' allowed in
the password), a private key, a connection string's key or password (Azure's AccountKey=), a
JWT, a Slack or Discord webhook, or a token of a well-known issuer (ghp_, github_pat_, glpat-,
hf_, AKIA/ASIA, xox?-, sk-, sk_live_/rk_live_, pypi-, npm_).
"""

from __future__ import annotations

import re

from ...contracts.fields import SpecError

SECRET_WORDS = frozenset(
    {
        "TOKEN", "TOKENS", "KEY", "KEYS", "APIKEY", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS",
        "PW", "PWD", "PAT", "JWT", "CREDENTIAL", "CREDENTIALS", "CREDS", "PASSPHRASE", "AUTH", "COOKIE", "DSN",
        "WEBHOOK",
    }
)  # fmt: skip
# Words glued to the end of a name without an underscore: PGPASSWORD, SSHPASS, SECRETKEY, MYTOKEN.
SECRET_ENDINGS = (
    "TOKEN", "TOKENS", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIALS", "SSHPASS", "PGPASS",
    "SECRETKEY", "ACCESSKEY", "PRIVATEKEY", "AUTHKEY",
)  # fmt: skip
NOT_SECRETS = frozenset({"PWD", "OLDPWD"})
SECRET_VALUE = re.compile(
    r"(?i:[a-z][a-z0-9+.-]*)://[^/\s:@]*:[^\s@]+@"  # scheme://user:password@host, the password may hold '/'
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|(?:^|;)\s*(?i:AccountKey|SharedAccessKey|SharedAccessSignature|Password|Pwd)=[^;\s$]"  # connection strings
    r"|\beyJ[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]*"  # a JWT
    r"|hooks\.slack\.com/(?:services|workflows)/|discord(?:app)?\.com/api/webhooks/"
    r"|\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abpors]-[\w-]{10,}|sk-[\w-]{20,}|[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"
    r"|pypi-[\w-]{20,}|npm_[A-Za-z0-9]{20,})",
)
# NAME=value in a shell line (setup: export X=..., a container option --env=X=...).
ASSIGNMENT = re.compile(r"(?<![\w$])(?=([A-Za-z_][A-Za-z0-9_]*)=(\S*))")  # overlapping: --env=X=1


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    if upper in NOT_SECRETS:
        return False
    return bool(set(re.split(r"[^A-Z0-9]+", upper)) & SECRET_WORDS) or upper.endswith(SECRET_ENDINGS)


def is_secret(name: str, value: str = "") -> bool:
    """A variable whose name or value has the shape of a secret's (module docstring)."""
    return is_secret_name(name) or bool(SECRET_VALUE.search(value))


def secret_in_text(text: str) -> str:
    """What in a line the user wrote has a secret's shape ("" when nothing): a secret-shaped value,
    or a literal value given to a secret-shaped name (`export DB_PASSWORD=...`; `NAME=$OTHER` or
    `NAME=$(cat file)` reads it on the node and is no secret in the text)."""
    if SECRET_VALUE.search(text):
        return "a value of a secret's shape"
    for name, value in ASSIGNMENT.findall(text):
        literal = value.lstrip("'\"")
        if is_secret_name(name) and literal and not literal.startswith(("$", "`")):
            return f"a value for {name}"
    return ""


def require_no_secret(where: str, key: str, text: str, name: str = "") -> None:
    """SpecError when a text of the jobs YAML (or `name`, a variable it sets) holds a secret: it
    would be written into the batch script, which slurmctld keeps with the job."""
    what = f"a value for {name}" if name and is_secret_name(name) else secret_in_text(text)
    if what:
        raise SpecError(
            where,
            key,
            f"holds {what}, which would be written into the batch script that slurmctld keeps with the job; "
            "export it in the shell you submit from and name it in slurm.pass_env instead",
        )
