"""sbatch's long options, and an `extra_sbatch` key resolved to the one option sbatch reads it as.

sbatch parses its options with getopt_long, which takes any unique prefix of a long option:
`--arr=0-3` is `--array=0-3`, `--requeu` is `--requeue` (issue 33). So an extra_sbatch key is
first resolved the way sbatch resolves it, then checked against the options hpcfsdp sets itself
(resources.SBATCH_SET_BY). A prefix of several options is refused (getopt_long's "ambiguous"),
and so is a key that is no option at all, with the nearest option named.

The options come from the installed sbatch where there is one (`sbatch --help` and `--usage`,
plus the options of its release that its help leaves out: --open-mode, --test-only, --hint, ...),
else from the table below: every long option of sbatch in Slurm 22.05 to 25.11, read off
src/common/slurm_opt.c of each release (`common_options[]`, those with a set function for sbatch;
--export-file, missing from 23.11 alone, is kept throughout). An option the table holds and the
installed sbatch lacks only makes more prefixes ambiguous (refused); a release after 25.11 adds
what its --help lists. tests/test_sbatch_options.py checks the table against the local sbatch.
"""

from __future__ import annotations

import difflib
import functools
import re

from ...slurm import ANSWER_TIMEOUT_S, SlurmError, ask

# Slurm 22.05's sbatch options (slurm-22-05-8-1).
SBATCH_22_05 = frozenset(
    {
        "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster", "cluster-constraint",
        "clusters", "comment", "constraint", "container", "context", "contiguous", "core-spec", "cores-per-socket",
        "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error",
        "exclude", "exclusive", "export", "export-file", "extra-node-info", "get-user-env", "gid", "gpu-bind",
        "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "help", "hint",
        "hold", "ignore-pbs", "input", "job-name", "kill-on-invalid-dep", "licenses", "mail-type", "mail-user",
        "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "network", "nice", "no-kill",
        "no-requeue", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu",
        "ntasks-per-node", "ntasks-per-socket", "ntasks-per-tres", "open-mode", "output", "overcommit",
        "oversubscribe", "parsable", "partition", "power", "prefer", "priority", "profile", "propagate", "qos",
        "quiet", "reboot", "requeue", "reservation", "signal", "sockets-per-node", "spread-job", "switches",
        "tasks-per-node", "test-only", "thread-spec", "threads-per-core", "time", "time-min", "tmp", "uid", "usage",
        "use-min-nodes", "verbose", "version", "wait", "wait-all-nodes", "wckey", "wrap"
    }
)  # fmt: skip
# What later releases added (--power went in 24.05).
ADDED = {
    (23, 2): ("autocomplete", "container-id", "extra", "tres-per-task"),
    (23, 11): ("tres-bind",),
    (24, 5): ("resv-ports", "segment", "stepmgr"),
    (24, 11): ("oom-kill-step",),
    (25, 5): ("external",),
    (25, 11): ("consolidate-segments", "resources", "spread-segments"),
}
# What later releases reject: the known-rejected table, which wins over their --help (24.11.5's
# still lists --power). A table, not a probe: one `sbatch --test-only` per option would cost a
# controller round trip each (docs/clusters.md).
REMOVED = {(24, 5): ("power",)}
# Options that set what another one sets (the same set function in slurm_opt.c).
ALIASES = {"cluster": "clusters", "tasks-per-node": "ntasks-per-node"}


def release_options(release: tuple[int, int] | None = None) -> frozenset[str]:
    """sbatch's long options in a Slurm release (year, month); None: those of every release the
    table knows, so that a prefix is unique only where it is unique in each."""
    names = set(SBATCH_22_05)
    for since, added in ADDED.items():
        if release is None or release >= since:
            names.update(added)
    if release is not None:
        names.difference_update(removed_by(release))
    return frozenset(names)


@functools.cache
def sbatch_options() -> frozenset[str]:
    """The long options of the sbatch installed here, else of every release the table knows."""
    return options_of(_ask_sbatch("--version"), (_ask_sbatch("--help") or "") + (_ask_sbatch("--usage") or ""))


def release_of(version: str | None) -> tuple[int, int] | None:
    """(year, month) of `sbatch --version`'s answer ("slurm 24.11.5", "slurm-wlm 22.05.8"), else None."""
    match = re.search(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


@functools.cache
def running_release() -> tuple[int, int] | None:
    """The release of the sbatch installed here; None where there is none."""
    return release_of(_ask_sbatch("--version"))


def options_of(version: str | None, listed: str) -> frozenset[str]:
    """sbatch's options from its --version and its --help and --usage: what the help lists and
    what the table holds for its release, less what the release rejects though its help lists it
    (24.11.5 lists --power, and sbatch then says "unrecognized option"). Without both answers, the
    options of every release the table knows."""
    release = release_of(version)
    if release is None or not listed:
        return release_options()
    shown = set(re.findall(r"--([a-z][a-z0-9-]*)", listed))
    return frozenset((shown - removed_by(release)) | release_options(release))


def removed_by(release: tuple[int, int]) -> frozenset[str]:
    """The options that sbatch of a release rejects, whatever its --help lists."""
    return frozenset(name for since, removed in REMOVED.items() if release >= since for name in removed)


def _ask_sbatch(flag: str) -> str | None:
    try:
        return ask("sbatch", flag, timeout_s=ANSWER_TIMEOUT_S)
    except SlurmError:
        return None


def resolve_option(key: str, options: frozenset[str] | None = None) -> tuple[str, str]:
    """(the option sbatch reads `--key` as, its aliases resolved; "") or ("", why it reads none):
    getopt_long's rules, an exact name first, else the one option that starts with it."""
    options = sbatch_options() if options is None else options
    if key in options:
        return ALIASES.get(key, key), ""
    found = sorted({ALIASES.get(name, name) for name in options if name.startswith(key)})
    if len(found) == 1:
        return found[0], ""
    if found:
        shown = ", ".join(f"--{name}" for name in found[:6]) + (", ..." if len(found) > 6 else "")
        return "", f"--{key} is a prefix of several sbatch options ({shown}), which sbatch refuses; write one in full"
    nearest = difflib.get_close_matches(key, sorted(options), n=1, cutoff=0.0)
    return "", f"--{key} is no sbatch option" + (f" (the nearest: --{nearest[0]})" if nearest else "")
