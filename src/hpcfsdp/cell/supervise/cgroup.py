"""How many processes the kernel's OOM killer has killed in this process's memory cgroup: cgroup v2's
`memory.events` (`oom_kill N`, its descendants included) or cgroup v1's `memory.oom_control` (the
same line, Linux 4.13 on). A rank's SIGKILL while the count rose is the host's OOM killer (a job's
memory limit under Slurm's cgroup plugin, or the machine's), not a kill -9."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def oom_kills(pid: int | str = "self", root: Path = CGROUP_ROOT) -> int | None:
    """The OOM killer's count in the memory cgroup of `pid`; None where no such count can be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2's unified hierarchy
            found = _count(root / relative / "memory.events")
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            found = _count(root / "memory" / relative / "memory.oom_control")
        else:
            continue
        if found is not None:
            return found
    return None


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
