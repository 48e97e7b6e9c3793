"""The shapes of a secret: a variable name or a value that holds one.

Slurm jobs get an allowlisted environment (environment.py), so these shapes are the second line:
they take secret-shaped variables out of what the local and print executors pass on and out of
the allowlisted prefixes (HPCFSDP_*, CUDA_*, SLURM_*, ...), and they refuse, at plan time, a
jobs YAML that writes a secret into the batch script (issue 33, item 2): slurmctld keeps that
script with the job, readable by the cluster's administrators, and the script sits in the sweep
folder.

A name is a secret's when a word of it (between underscores, any case, a number at its end left
off: PASSWORD2, SECRET1) is TOKEN, KEY(S), APIKEY, SECRET(S), PASSWORD(S), PASSWD, PASS, PW, PWD,
PAT, JWT, CREDENTIAL(S), CREDS, PASSPHRASE, AUTH, COOKIE, DSN or WEBHOOK, or when it ends with one
glued on (PGPASSWORD, SSHPASS, PGPASS, SECRETKEY, AWS_ACCESSKEY, PRIVATEKEY). It is none when it
names where a secret is (its last word PATH, FILE, DIR, SOCK or SOCKET: HF_TOKEN_PATH,
SSH_AUTH_SOCK), when it is a switch set to a switch's value (HF_HUB_DISABLE_IMPLICIT_TOKEN=1), or
when a credential or key is a path (GOOGLE_APPLICATION_CREDENTIALS=/keys/app.json). TOKENS beside
MAX, MIN, NUM, N, COUNT, LIMIT or TOTAL counts text (MAX_TOKENS; API_TOKENS is a secret), and PWD
and OLDPWD are the working folders.
A value is a secret's when it holds a URL with a password (any scheme, any case, '/' allowed in
the password; an image pinned by digest, registry:5000/img@sha256:..., is none), a private key, a
connection string's key or password (Azure's AccountKey=), a JWT, a Slack or Discord webhook, or a
token of a well-known issuer (ghp_, github_pat_, glpat-, hf_, AKIA/ASIA, xox?-, sk-,
sk_live_/rk_live_, pypi-, npm_).

In a line of shell the user wrote (setup), a secret-shaped name may be given only what reads its
value on the node: `$OTHER` or `${OTHER}` (a variable of the job's, slurm.pass_env), `$(cat FILE)`
or `$(< FILE)` (a file only the user can read). Anything else is a value written into the batch
script: a literal, `${X:-hunter2}`, `$(echo hunter2)`, however its name is quoted, and so is
`read NAME <<< ...` (a here-string or here-document) and `printf -v NAME ...` (issue 44, item 7).
"""

from __future__ import annotations

import re

from ...contracts.fields import SpecError

SECRET_WORDS = frozenset(
    {
        "TOKEN", "KEY", "KEYS", "APIKEY", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS",
        "PW", "PWD", "PAT", "JWT", "CREDENTIAL", "CREDENTIALS", "CREDS", "PASSPHRASE", "AUTH", "COOKIE", "DSN",
        "WEBHOOK",
    }
)  # fmt: skip
# Words glued to the end of a name without an underscore: PGPASSWORD, SSHPASS, SECRETKEY, MYTOKEN.
SECRET_ENDINGS = (
    "TOKEN", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIALS", "SSHPASS", "PGPASS",
    "SECRETKEY", "ACCESSKEY", "PRIVATEKEY", "AUTHKEY",
)  # fmt: skip
NOT_SECRETS = frozenset({"PWD", "OLDPWD"})
# TOKENS beside one of these is a count of text (MAX_TOKENS), not a list of secrets (API_TOKENS).
COUNT_WORDS = frozenset({"MAX", "MIN", "NUM", "N", "COUNT", "LIMIT", "TOTAL"})
# A name whose last word is one of these says where a secret is, not what it is: HF_TOKEN_PATH, SSH_AUTH_SOCK.
WHERE_WORDS = frozenset({"PATH", "FILE", "DIR", "SOCK", "SOCKET"})
# A switch (HF_HUB_DISABLE_IMPLICIT_TOKEN) set to a switch's value is none of a secret.
SWITCH_WORDS = frozenset({"DISABLE", "ENABLE", "NO", "USE", "SKIP", "REQUIRE"})
SWITCH_VALUE = re.compile(r"(?i:0|1|true|false|yes|no|on|off|)")
# Secret words of which a path is the usual value: a credentials file, a key file.
FILE_WORDS = frozenset({"CREDENTIAL", "CREDENTIALS", "CREDS", "KEY", "KEYS"})
PATH_VALUE = re.compile(r"(?:/|~/|\$HOME/|\$\{HOME\}/)[^\s;&|<>()`$'\"]*")
SECRET_VALUE = re.compile(
    r"(?i:[a-z][a-z0-9+.-]*)://[^/\s:@]*:[^\s@]+@(?!sha(?:256|384|512):)"  # scheme://user:password@host, not a digest
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|(?:^|;)\s*(?i:AccountKey|SharedAccessKey|SharedAccessSignature|Password|Pwd)=[^;\s$]"  # connection strings
    r"|\beyJ[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]*"  # a JWT
    r"|hooks\.slack\.com/(?:services|workflows)/|discord(?:app)?\.com/api/webhooks/"
    r"|\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|glpat-[\w-]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abpors]-[\w-]{10,}|sk-[\w-]{20,}|[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"
    r"|pypi-[\w-]{20,}|npm_[A-Za-z0-9]{20,})",
)
# NAME=value in a shell line with its quotes taken out (setup: export X=..., a container option
# --env=X=...); overlapping: --env=X=1. The value is what follows the '=', to the line's end.
ASSIGNMENT = re.compile(r"(?<![\w$])(?=([A-Za-z_][A-Za-z0-9_]*)=(.*))")
# What a secret-shaped name may be given in a line: a value read on the node, then the command's end.
READ_ON_THE_NODE = re.compile(
    r"(?:\$[A-Za-z_]\w*|\$\{[A-Za-z_]\w*\}|\$\((?:<|cat)\s+[^\s;&|<>()`$]+\s*\))(?=$|[\s;&|])"
)
# Commands that set a variable other than NAME=value: a here-string or here-document read into it,
# printf into it. Their names are checked; a `read NAME < FILE` reads a file on the node.
READ_HERE = re.compile(r"\bread\b((?:\s+-\w+(?:\s+\S+)?)*(?:\s+[A-Za-z_]\w*)+)\s*<<")
PRINTF_INTO = re.compile(r"\bprintf\s+(?:-\w+\s+)*-v\s*([A-Za-z_]\w*)")


# What a `$` the shell takes as itself (quoted '$', $'$', \$) becomes in without_quotes: no `$`, so
# that `export DB_PASSWORD='$ecret99'` is a value written into the script, not `$ecret99` read on the node.
LITERAL_DOLLAR = "\0"


def without_quotes(text: str) -> str:
    """A line of shell with its quotes ('...', "...", $'...', $"...") and backslashes taken out, as
    the shell joins the words; a `$` the shell takes literally (in '...' or $'...', or after a
    backslash) is LITERAL_DOLLAR, so that it is read as no variable (issue 51, item 14)."""
    out: list[str] = []
    quote, i = "", 0
    while i < len(text):
        char, following = text[i], text[i + 1 : i + 2]
        if char == "\\" and quote != "'" and following:  # an escaped character; in $'...' too
            out.append(LITERAL_DOLLAR if following == "$" else following)
            i += 2
            continue
        if (quote in ("'", "$'") and char == "'") or (quote == '"' and char == '"'):
            quote = ""
        elif quote:
            out.append(LITERAL_DOLLAR if char == "$" and quote != '"' else char)
        elif char == "$" and following in ("'", '"'):  # ANSI-C quoting, and locale translation
            quote = "$'" if following == "'" else '"'
            i += 1
        elif char in ("'", '"'):
            quote = char
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _words(name: str) -> list[str]:
    """The words of a name (between non-alphanumerics), upper case, each without a number at its end."""
    return [word.rstrip("0123456789") or word for word in re.split(r"[^A-Z0-9]+", name.upper()) if word]


def is_secret_name(name: str, value: str | None = None) -> bool:
    """A variable name of a secret's shape (module docstring); given its value, a switch set to a
    switch's value or a credentials file's path is none."""
    upper = name.upper()
    words = _words(name)
    if upper in NOT_SECRETS or not words or words[-1] in WHERE_WORDS:
        return False
    found = set(words) & SECRET_WORDS
    if "TOKENS" in words and not set(words) & COUNT_WORDS:  # API_TOKENS: secrets; MAX_TOKENS: a count
        found.add("TOKENS")
    if not found and not upper.rstrip("0123456789").endswith(SECRET_ENDINGS):
        return False
    if value is not None and set(words) & SWITCH_WORDS and SWITCH_VALUE.fullmatch(value):
        return False
    return not (value is not None and found and found <= FILE_WORDS and PATH_VALUE.fullmatch(value))


def is_secret(name: str, value: str = "") -> bool:
    """A variable whose name or value has the shape of a secret's (module docstring)."""
    return is_secret_name(name, value) or bool(SECRET_VALUE.search(value))


def secret_in_text(text: str) -> str:
    """What in a line the user wrote has a secret's shape ("" when nothing): a secret-shaped value,
    a value written for a secret-shaped name (`export DB_PASSWORD=...`, however quoted; its value
    may only be read on the node: READ_ON_THE_NODE), or a secret-shaped name set by `read ... <<<`
    or `printf -v`."""
    if SECRET_VALUE.search(text):
        return "a value of a secret's shape"
    unquoted = without_quotes(text)
    for name, value in ASSIGNMENT.findall(unquoted):
        first = re.split(r"[\s;&|]", value, maxsplit=1)[0]
        if value and not READ_ON_THE_NODE.match(value) and is_secret_name(name, first):
            return f"a value for {name}"
    for names in READ_HERE.findall(unquoted):
        secret = next((name for name in names.split() if is_secret_name(name)), "")
        if secret:
            return f"a value for {secret} (read from the line itself)"
    secret = next((name for name in PRINTF_INTO.findall(unquoted) if is_secret_name(name)), "")
    return f"a value for {secret} (printf -v)" if secret else ""


def require_no_secret(where: str, key: str, text: str, name: str = "") -> None:
    """SpecError when a text of the jobs YAML (or `name`, a variable it sets) holds a secret: it
    would be written into the batch script, which slurmctld keeps with the job."""
    what = f"a value for {name}" if name and is_secret_name(name, text) else secret_in_text(text)
    if what:
        raise SpecError(
            where,
            key,
            f"holds {what}, which would be written into the batch script that slurmctld keeps with the job; "
            "read it on the node from a file only you can read (`export NAME=$(cat ~/.secrets/name)`), or "
            "export it in the shell you submit from and name it in slurm.pass_env",
        )
