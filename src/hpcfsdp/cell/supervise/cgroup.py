"""How many processes the kernel's OOM killer has killed in this process's memory cgroup: cgroup v2's
`memory.events` (`oom_kill N`, its descendants included) or cgroup v1's `memory.oom_control` (the
same line, Linux 4.13 on). A rank's SIGKILL while the count rose is the host's OOM killer (a job's
memory limit under Slurm's cgroup plugin, or the machine's), not a kill -9.

The cgroup's folder is found as libcontainer finds it: the process's cgroup path (/proc/PID/cgroup)
under the mount of its hierarchy that shows it (/proc/PID/mountinfo: the cgroup path the mount
shows at its mount point). In a container without a cgroup namespace (cgroup v1: podman, pyxis)
the path is the host's and the mount shows only the container's own cgroup, so the path is not
below /sys/fs/cgroup as it stands (a fresh Debian 12 container, 2026-11-29).
"""

from __future__ import annotations

import re
from pathlib import Path

PROC = Path("/proc")
EVENTS = {"": "memory.events", "memory": "memory.oom_control"}  # cgroup v2's hierarchy, v1's memory controller


def oom_kills(pid: int | str = "self", proc: Path = PROC) -> int | None:
    """The OOM killer's count in the memory cgroup of `pid`; None where no such count can be read."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
        mounts = _memory_mounts((proc / str(pid) / "mountinfo").read_text())
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        hierarchy = "" if controllers == "" else "memory" if "memory" in controllers.split(",") else None
        if hierarchy is None:
            continue
        for shown, point in mounts.get(hierarchy, ()):
            if path == shown or path.startswith(shown.rstrip("/") + "/"):
                found = _count(point / path[len(shown) :].lstrip("/") / EVENTS[hierarchy])
                if found is not None:
                    return found
    return None


def _memory_mounts(mountinfo: str) -> dict[str, list[tuple[str, Path]]]:
    """The mounts of cgroup v2 ("") and of cgroup v1's memory controller ("memory"): for each, the
    cgroup path it shows and its mount point."""
    mounts: dict[str, list[tuple[str, Path]]] = {}
    for line in mountinfo.splitlines():
        fields, _, filesystem = line.partition(" - ")
        mount, described = fields.split(), filesystem.split()
        if len(mount) < 5 or len(described) < 3:
            continue
        kind, options = described[0], described[2].split(",")
        hierarchy = "" if kind == "cgroup2" else "memory" if kind == "cgroup" and "memory" in options else None
        if hierarchy is not None:
            mounts.setdefault(hierarchy, []).append((_unescaped(mount[3]), Path(_unescaped(mount[4]))))
    return mounts


def _unescaped(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _count(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
