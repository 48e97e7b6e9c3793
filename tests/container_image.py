"""podman for the container tests: installed from Debian's packages (as the Slurm fixture installs
Slurm), configured for this machine by files of its own, and a small image made from this
machine's files, since no registry is reachable.

The image holds the Python interpreter the tests run on (its executable, standard library and
libpython) and the shared libraries that it and the virtualenv's extension modules load (found
with ldd). The virtualenv and the checkout are not copied in: the jobs bind them at their own
paths, as sites bind shared software into their images; the image stays ~70 MB and builds in
seconds, where a copy of the virtualenv (torch) would be ~1 GB per build.

podman's settings for this machine (each one found necessary here, see docs/containers.md):
runc, since crun refuses the hybrid cgroup layout (v1 controllers plus a cgroup2 mount that has
one); cgroupfs, there being no systemd; events to a file, there being no journald; and ulimits
no higher than podman's own (root without CAP_SYS_RESOURCE cannot raise them).
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

PACKAGES = ("podman", "runc")
# podman lowers its own RLIMIT_NPROC to this (seen in /proc/<podman>/limits); a container may not ask more.
PODMAN_NPROC = 32768
SKIPPED_STDLIB = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "__pycache__"}
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
LDD_PATH = re.compile(r"(?:=> )?(/\S+) \(0x")


def install_podman() -> None:
    """podman and runc from the distribution's packages, unless podman and runc are there."""
    if shutil.which("podman") and shutil.which("runc"):
        return
    with open("/tmp/hpcfsdp-machine.lock", "w") as lock:  # slurm/local/start.sh installs under it too
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shutil.which("podman") and shutil.which("runc")):
            _apt_install_podman()


def _apt_install_podman() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "-q"]
    subprocess.run([*apt, "update"], check=True, capture_output=True, env=env, timeout=600)
    subprocess.run(
        [*apt, "install", "-y", "--no-install-recommends", *PACKAGES],
        check=True,
        capture_output=True,
        env=env,
        timeout=900,
    )


def podman_config(folder: Path) -> dict[str, str]:
    """containers.conf and storage.conf of its own in `folder` (storage there too): the environment
    that points podman at them, for the tests and the jobs they submit (sbatch passes it on)."""
    folder.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc_soft, nproc_hard = (min(limit, PODMAN_NPROC) for limit in resource.getrlimit(resource.RLIMIT_NPROC))
    (folder / "containers.conf").write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={soft}:{hard}", "nproc={nproc_soft}:{nproc_hard}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'events_logfile_path = "{folder}/events.log"\n'
    )
    (folder / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{folder}/storage"\nrunroot = "{folder}/run"\n'
    )
    return {"CONTAINERS_CONF": str(folder / "containers.conf"), "CONTAINERS_STORAGE_CONF": str(folder / "storage.conf")}


def image_paths(venv: Path) -> list[Path]:
    """The files of the image: the interpreter (and the links to it), its standard library, and
    the shared libraries of the interpreter, its extension modules and the virtualenv's."""
    executable = Path(sys.executable)
    chain = [executable]
    while chain[-1].is_symlink():
        chain.append(chain[-1].parent / os.readlink(chain[-1]))
    paths = [path for path in chain if not path.is_relative_to(venv)]
    stdlib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [name for name in dirs if name not in SKIPPED_STDLIB and not name.startswith("config-")]
        paths += [Path(root) / name for name in files]
    loaded = [chain[-1], *stdlib.glob("lib-dynload/*.so"), *venv.rglob("*.so*")]
    loaded = [path for path in loaded if not path.name.startswith("_tkinter")]  # Tcl/Tk and X11
    for start in range(0, len(loaded), 200):
        out = subprocess.run(["ldd", *map(str, loaded[start : start + 200])], capture_output=True, text=True).stdout
        paths += [Path(found) for found in LDD_PATH.findall(out) if not Path(found).is_relative_to(venv)]
    return list(dict.fromkeys(paths + [Path("/etc/passwd"), Path("/etc/group"), Path("/etc/ld.so.cache")]))


def image_tarball(venv: Path) -> bytes:
    """The image's root file system as a tar: each file at its own path, links kept as links, and
    the folders a process expects (/tmp, /root, ...)."""
    buffer = io.BytesIO()
    added: set[str] = set()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in (("tmp", 0o1777), ("root", 0o700), ("dev", 0o755), ("proc", 0o755), ("sys", 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for name in ROOT_LINKS:  # a merged-/usr system's /lib, /lib64, /bin: the loader's path is /lib64/...
            if Path("/", name).is_symlink():
                tar.add(f"/{name}", arcname=name, recursive=False)
        for path in image_paths(venv):
            _add(tar, path, added)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, path: Path, added: set[str]) -> None:
    """Add `path` at its real folder (a merged-/usr system's /lib is /usr/lib), links followed and kept."""
    while True:
        path = Path(os.path.realpath(path.parent)) / path.name
        if str(path) in added:
            return
        added.add(str(path))
        tar.add(str(path), arcname=str(path).lstrip("/"), recursive=False)
        if not path.is_symlink():
            return
        path = path.parent / os.readlink(path)


def build_image(tag: str, venv: Path, env: dict[str, str]) -> None:
    """`podman import` of the tarball as `tag`."""
    subprocess.run(
        ["podman", "import", "-", tag],
        input=image_tarball(venv),
        check=True,
        capture_output=True,
        env={**os.environ, **env},
        timeout=600,
    )
