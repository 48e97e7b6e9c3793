"""slurm.container: the image each cell runs in, validated once (docs/containers.md). The command
lines that start a cell inside it are sweep/launch/container_command.py's."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...contracts.fields import (
    SpecError,
    coerce_fields,
    documented,
    require_choices,
    require_no_control_characters,
    shown,
)
from .secret_shapes import require_no_secret

ContainerRuntime = Literal["apptainer", "singularity", "podman", "pyxis"]


@dataclass(frozen=True)
class Container:
    """slurm.container: each cell runs inside this image. The sweep folder (records, submitit's
    folder), the cache folder and the cells' local model / data / tokenizer paths are bound at
    their own paths; `mounts` adds more."""

    runtime: ContainerRuntime = documented("apptainer", "`apptainer`, `singularity`, `pyxis` or `podman`")
    image: str = documented(
        "",
        "a `.sif` file or `docker://` reference (Apptainer/Singularity), an image name (podman), a `.sqsh` file "
        "or `registry#image` (pyxis)",
        default_means="required",
    )
    mounts: tuple[str, ...] = documented(
        (),
        "more folders to bind: `SRC`, `SRC:DST` or `SRC:DST:OPTIONS` (`ro`, `rw`, ...); absolute paths (`~` is "
        "your home folder where you submit; `$VARS` are not expanded), no `,`",
    )
    env: dict[str, str] = documented({}, "variables set inside the container, over what the job passes in")
    python: str = documented(
        "", "the Python that runs the cell inside the image", default_means="the Python you submit with"
    )
    gpus: bool = documented(
        True,
        "pass the node's GPUs in: `--nv` (Apptainer/Singularity), `--device=nvidia.com/gpu=all` (podman, "
        "through CDI); pyxis passes the job's GPUs itself",
    )
    options: tuple[str, ...] = documented((), "more flags of `apptainer exec` / `podman run`, or of `srun` (pyxis)")

    @classmethod
    def from_dict(cls, values: Any, where: str) -> Container:
        """Errors name `container.<key>` (the YAML loader finds the line of slurm.container.<key>)."""
        if not isinstance(values, Mapping):
            raise SpecError(
                where, "container", f"expected a mapping (runtime, image, mounts, ...), got {shown(values)}"
            )
        try:
            typed = coerce_fields(cls, values, where)
        except SpecError as exc:
            raise SpecError(exc.where, f"container.{exc.key}", exc.what) from None
        for key in ("mounts", "options"):
            items = typed.get(key, ())
            if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
                raise SpecError(where, f"container.{key}", f"expected a list of strings, got {shown(items)}")
            typed[key] = tuple(items)
        typed["env"] = _env(where, typed.get("env", {}))
        container = cls(**typed)
        try:
            require_choices(where, container)
        except SpecError as exc:
            raise SpecError(exc.where, f"container.{exc.key}", exc.what) from None
        if not container.image:
            raise SpecError(where, "container.image", f"expected the image to run the cells in ({container.runtime})")
        texts = [("image", container.image), ("python", container.python)]
        texts += [("mounts", mount) for mount in container.mounts] + [("options", o) for o in container.options]
        texts += [(f"env.{name}", value) for name, value in container.env.items()]
        for key, text in texts:
            require_no_control_characters(where, f"container.{key}", text)
            variable = key.removeprefix("env.") if key.startswith("env.") else ""
            require_no_secret(where, f"container.{key}", text, variable)
        for mount in container.mounts:
            try:
                parse_mount(mount)
            except ValueError as exc:
                raise SpecError(where, "container.mounts", f"{exc}, got {shown(mount)}") from None
        return container


# A variable name of the shell; an option of a mount (ro, rw, z, ...).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MOUNT_OPTIONS = re.compile(r"[A-Za-z0-9=+_-]+")


def _env(where: str, env: Mapping[Any, Any]) -> dict[str, str]:
    """container.env as NAME -> text (a number is written as YAML read it)."""
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise SpecError(where, "container.env", f"expected variable names (A-Z, 0-9, _), got {shown(name)}")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise SpecError(where, f"container.env.{name}", f"expected a string or a number, got {shown(value)}")
        out[name] = str(value)
    return out


def parse_mount(text: str) -> tuple[str, str, str]:
    """A mount "SRC[:DST[:OPTIONS]]" as (absolute source, absolute destination, options);
    ValueError says what is wrong. `~` is your home folder where you submit. The runtimes separate
    mounts with ',' (pyxis) and their parts with ':', so neither may be in a path."""
    parts = text.split(":")
    if len(parts) > 3 or "," in text:
        raise ValueError("expected SRC, SRC:DST or SRC:DST:OPTIONS without ','")
    source = str(Path(parts[0]).expanduser())
    target = parts[1] if len(parts) > 1 else source
    options = parts[2] if len(parts) > 2 else ""
    if not (source.startswith("/") and target.startswith("/")):
        raise ValueError("expected absolute paths (the job's working folder is not the container's)")
    if len(parts) > 2 and not MOUNT_OPTIONS.fullmatch(options):
        raise ValueError("expected options such as ro or rw")
    return source, target, options
