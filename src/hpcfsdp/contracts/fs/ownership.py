"""Whose a folder or file of hpcfsdp is, as ssh's StrictModes asks of ~/.ssh (issue 51).

A sweep folder, its slurm/, cells/, report/ and tune/, the history, the references and the lock
files must be owned by the user running hpcfsdp and writable by no one else: whoever can write
there can swap a record, a figure, the job's pickle or a lock. A group writable folder is taken
where the group is the user's own (a user private group, no other member), as Debian's ssh takes
it. A team that shares a folder on purpose names its group in HPCFSDP_SHARED_GROUP: then a path
of that group may be written by its members and owned by any of them (never by everyone); the
job still runs only the pickle that its own sbatch script names by digest (docs/security.md).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from contextlib import suppress
from functools import cache
from pathlib import Path

SHARED_GROUP_VARIABLE = "HPCFSDP_SHARED_GROUP"


def shared_group() -> int | None:
    """The gid of HPCFSDP_SHARED_GROUP (a group name or number); None when unset or no group."""
    name = os.environ.get(SHARED_GROUP_VARIABLE, "").strip()
    return _gid_of(name) if name else None


@cache
def _gid_of(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return int(name) if name.isdigit() else None


@cache
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@cache
def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


@cache
def _members(gid: int) -> frozenset[str]:
    try:
        return frozenset(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return frozenset()


def _private_group(gid: int, uid: int) -> bool:
    """Whether gid is uid's own group: its name is the user's, and it has no other member."""
    name = user_name(uid)
    return group_name(gid) == name and _members(gid) <= {name}


def _in_group(uid: int, gid: int) -> bool:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return False
    return entry.pw_gid == gid or entry.pw_name in _members(gid)


def ownership_problem(info: os.stat_result) -> str:
    """Why a file or folder of this stat may not be trusted ("" when it may): another owner, or
    writable by others than its owner (a group of others, or everyone)."""
    me = os.geteuid()
    team = shared_group()
    shared = team is not None and info.st_gid == team
    if info.st_uid != me and not (shared and _in_group(info.st_uid, info.st_gid)):
        return f"owned by {user_name(info.st_uid)}, not by {user_name(me)}"
    if info.st_mode & stat.S_IWOTH:
        return "writable by everyone"
    if info.st_mode & stat.S_IWGRP and not shared and not _private_group(info.st_gid, info.st_uid):
        return f"writable by the group {group_name(info.st_gid)}"
    return ""


def refusal_line(path: str | Path, info: os.stat_result, problem: str) -> str:
    """The one line that refuses path: its owner and mode, and the fix."""
    owner = f"{user_name(info.st_uid)}:{group_name(info.st_gid)}"
    return (
        f"{path}: {problem} (owner {owner}, mode {stat.S_IMODE(info.st_mode):04o}); not used: another user could "
        f"change what hpcfsdp runs or reads there. Fix: make it yours and `chmod go-w` it, or name the group "
        f"that shares it on purpose in {SHARED_GROUP_VARIABLE} (docs/security.md)"
    )


def lock_mode() -> int:
    """The mode of a lock file: 0600, for flock needs only read access (anyone who can read a lock
    can hold it); 0660 where a group shares the folder on purpose."""
    return 0o660 if shared_group() is not None else 0o600


LOCK_NOTE_MAX = 4096  # a lock's note ("hpcfsdp submit: pid 4242 on login1, since ...") is one short line
LOCK_NOTE_STARTS = (b"hpcfsdp ", b"pid ")  # this hpcfsdp's notes, and those of earlier ones


def write_lock_note(fd: int, note: str) -> None:
    """Say who holds a lock (for the people who wait): "hpcfsdp <command>: pid N on HOST..."; an empty
    note on release. Best effort: a full disk leaves the note out, never the lock (the flock)."""
    with suppress(OSError):
        os.ftruncate(fd, 0)
        if note:
            os.pwrite(fd, f"hpcfsdp {note}\n".encode(), 0)


def lock_holder(fd: int) -> tuple[str, str]:
    """(the command, the rest of its note) of a lock's holder, as write_lock_note wrote them; an
    earlier hpcfsdp's note gives no command (""). The note is one printable line, cut short: its
    file may have been written by anyone."""
    with suppress(OSError):
        text = os.pread(fd, LOCK_NOTE_MAX, 0).decode(errors="replace").split("\n", 1)[0]
        text = "".join(char for char in text if char.isprintable())[:200]
        command, _, rest = text.removeprefix("hpcfsdp ").partition(": ")
        return (command, rest) if text.startswith("hpcfsdp ") and rest else ("", text)
    return "", ""


def holder_words(fd: int) -> str:
    """Who holds the lock of fd, in words: "pid 4242 of alice (submit: pid 4242 on login1, since
    ...)" from /proc/locks and the holder's note; the note alone where the holder is on another
    node; "an unknown process" where neither says."""
    command, note = lock_holder(fd)
    said = f"{command}: {note}" if command else note
    holders = flock_holders(fd)
    if holders:
        who = ", ".join(f"pid {pid} of {user}" for pid, user in holders)
        return f"{who} ({said})" if said else who
    return said or "an unknown process (on another node, or one that wrote no note)"


def flock_holders(fd: int) -> list[tuple[int, str]]:
    """(pid, user) of each process holding an flock on the file of fd, as /proc/locks lists them
    (this node's kernel only)."""
    try:
        info = os.fstat(fd)
        with open("/proc/locks", "rb") as listing:
            lines = listing.read(1 << 20).decode(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[0].endswith("->"):
            continue
        pid, where = fields[4], fields[5].split(":")
        if len(where) == 3 and where[2].isdigit() and int(where[2]) == info.st_ino and pid.isdigit():
            major, minor = (int(part, 16) for part in where[:2])
            if os.makedev(major, minor) == info.st_dev:
                found.append((int(pid), _user_of(int(pid))))
    return found


def _user_of(pid: int) -> str:
    try:
        return user_name(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "a user not known here"
