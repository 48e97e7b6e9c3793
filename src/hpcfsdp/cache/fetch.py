"""Fetching from the hub into the cache: models (huggingface_hub.snapshot_download, each file
checked against the hub's hash) and dataset splits (datasets.load_dataset at a pinned commit,
then save_to_disk), with the hub clients' errors turned into one line naming the item.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..contracts.fs.beneath import make_folders, remove_tree, rename
from ..contracts.names import DatasetRef, ModelRef
from .manifest import add_to_manifest, item_lock, manifest_entry, previous_entry
from .plan import DownloadError
from .verify import file_records, files_complete

CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]


WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]


HUB_DIR = "hub"


DATASETS_WORK_DIR = "hf-datasets"


def download_model(
    ref: ModelRef,
    cache: Path,
    weights: bool = False,
    allow_patterns: Iterable[str] = (),
    force: bool = False,
    out: Callable[[str], None] = print,
) -> dict:
    """snapshot_download of config + tokenizer files (+ weights); returns the manifest entry."""
    from huggingface_hub import snapshot_download

    patterns = [*CONFIG_PATTERNS, *(WEIGHT_PATTERNS if weights else []), *allow_patterns]
    out(f"model {ref.name}{' (with weights)' if weights else ''}")
    with item_lock(cache, ref.key, ref.name, out):
        with _hub_errors("model", ref.name):
            folder = Path(
                snapshot_download(
                    ref.repo_id,
                    revision=ref.revision,
                    cache_dir=cache / HUB_DIR,
                    allow_patterns=patterns,
                    force_download=force,
                    tqdm_class=None if sys.stderr.isatty() else file_lines(out),
                )
            )
        sha = folder.name
        if not (folder / "config.json").is_file():
            raise DownloadError(f"model {ref.name}: the repo has no config.json at {sha}; is it a transformers model?")
        has_weights = any(p.name.endswith(".safetensors") for p in folder.rglob("*"))
        if weights and not has_weights:
            raise DownloadError(
                f"model {ref.name}: no *.safetensors weights in the repo at {sha} "
                "(pretrained init reads safetensors only)"
            )
        previous = previous_entry(cache, ref.key, sha)
        paths = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        with _hub_errors("model", ref.name):
            expected = _hub_hashes(ref.repo_id, sha, paths)
        files = file_records(folder, previous, expected=expected, label=ref.name)
        entry = manifest_entry(
            ref.key,
            "model",
            ref.name,
            folder,
            cache,
            files,
            repo_id=ref.repo_id,
            revision=ref.revision,
            sha=sha,
            weights=has_weights,
        )
        add_to_manifest(cache, entry)
    out(f"  -> {ref.repo_id} at {sha} ({len(files)} files)")
    return entry


def download_config(ref: ModelRef, cache: Path, out: Callable[[str], None] = print) -> Path:
    """A hub model's config.json alone, into the cache's hub folder: what `plan --memory` predicts
    from (cache/hub.py's cached_config) before its weights or tokenizer are fetched; no manifest entry,
    so a cell still needs the model downloaded."""
    from huggingface_hub import hf_hub_download

    with _hub_errors("model", ref.name):
        path = Path(hf_hub_download(ref.repo_id, "config.json", revision=ref.revision, cache_dir=cache / HUB_DIR))
    out(f"  model     {ref.name}  config.json only: {path}")
    return path


def file_lines(out: Callable[[str], None]) -> type:
    """For snapshot_download where stderr is no terminal (a log, CI), where huggingface_hub draws
    no bars: one line per file fetched (`  file 3/12`). On a terminal its own bars show."""
    from tqdm.auto import tqdm

    class FileLines(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Drawn into a buffer nobody reads; the file count is said through `out`.
            super().__init__(*args, **{**kwargs, "file": io.StringIO(), "disable": False})
            self.counts_files = str(kwargs.get("desc", "")).startswith("Fetching")

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.counts_files:
                out(f"  file {self.n}/{self.total}")
            return shown

    return FileLines


def download_dataset(
    ref: DatasetRef, cache: Path, num_proc: int | None = None, force: bool = False, out: Callable[[str], None] = print
) -> dict:
    """load_dataset of one split at a pinned commit, then save_to_disk; returns the manifest entry."""
    out(f"dataset {ref.name}")
    with item_lock(cache, ref.key, ref.name, out):
        from huggingface_hub import HfApi

        with _hub_errors("dataset", ref.name):
            sha = HfApi().dataset_info(ref.repo_id, revision="main").sha
        previous = previous_entry(cache, ref.key, sha)
        if previous and not force and files_complete(cache, previous):
            out(f"  -> up to date at {sha}")
            return previous
        import datasets

        with _hub_errors("dataset", ref.name):
            ds = datasets.load_dataset(
                ref.repo_id,
                ref.load_config,
                split=ref.split,
                revision=sha,
                cache_dir=str(cache / DATASETS_WORK_DIR),
                num_proc=num_proc,
                download_mode="force_redownload" if force else None,
            )
        folder = cache / ref.relpath
        save_dataset_atomically(ds, folder)
        files = file_records(folder, None, label=ref.name)
        entry = manifest_entry(
            ref.key,
            "dataset",
            ref.name,
            folder,
            cache,
            files,
            repo_id=ref.repo_id,
            config=ref.config,
            split=ref.split,
            revision="main",
            sha=sha,
            num_rows=ds.num_rows,
            columns=list(ds.column_names),
            features=str(ds.features),
        )
        add_to_manifest(cache, entry)
    out(f"  -> {ref.repo_id} at {sha}: {ds.num_rows} rows, columns {', '.join(ds.column_names)}")
    return entry


def save_dataset_atomically(ds: Any, folder: Path) -> None:
    """save_to_disk into a temporary sibling, then rename over the old copy (readers never see half)."""
    make_folders(folder.parent)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder.parent / f".{folder.name}.tmp-{tag}"
    old = folder.parent / f".{folder.name}.old-{tag}"
    try:
        ds.save_to_disk(str(tmp))
        if folder.exists():
            rename(folder, old)
        rename(tmp, folder)
    finally:
        remove_tree(tmp)
        remove_tree(old)


def _hub_hashes(repo_id: str, sha: str, paths: list[str]) -> dict[str, tuple[str | None, str]]:
    """The hub's own hashes of a model's files at a commit: path -> (LFS sha256 or None, git blob sha1)."""
    from huggingface_hub import HfApi

    out = {}
    for info in HfApi().get_paths_info(repo_id, paths, revision=sha):
        if hasattr(info, "blob_id"):  # a file, not a folder
            lfs = getattr(info, "lfs", None)
            out[info.path] = (lfs.sha256 if lfs is not None else None, info.blob_id)
    return out


@contextlib.contextmanager
def _hub_errors(kind: str, name: str) -> Iterator[None]:
    """Turn the hub clients' not-found / gated / offline / unreachable errors into one line naming the item."""
    try:
        yield
    except DownloadError:
        raise
    except Exception as exc:
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        if isinstance(exc, GatedRepoError):
            why = "is gated: accept its terms on the hub, then set HF_TOKEN or run `hf auth login`"
        elif isinstance(exc, RevisionNotFoundError):
            why = "has no such revision"
        elif isinstance(exc, RepositoryNotFoundError):
            why = "was not found on the hub (private repos need HF_TOKEN or `hf auth login`)"
        elif isinstance(exc, LocalEntryNotFoundError) or _is_unreachable(exc):
            why = f"could not be fetched: the hub at {hub_endpoint()} is not reachable from here"
        elif isinstance(exc, (FileNotFoundError, ValueError)) and kind == "dataset":
            why = f"could not be loaded ({type(exc).__name__}: {_first_line(exc)})"
        else:
            raise
        raise DownloadError(f"{kind} {name} {why}") from exc


# Connection and timeout errors of the HTTP clients under huggingface_hub and datasets (httpx or its
# fork httpx2: TransportError; requests: ConnectionError, Timeout), matched by class name so that
# none of them has to be imported here.
_UNREACHABLE_CLASS_NAMES = frozenset({"TransportError", "ConnectionError", "Timeout"})


_UNREACHABLE_ERRNOS = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN})


def _is_unreachable(exc: BaseException) -> bool:
    """The hub did not answer: refused, reset, timed out, no route, or a host name that does not resolve.

    Only network errors: other OSErrors (a full disk, a read-only cache) are not the hub's fault.
    """
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS:
        return True
    return any(cls.__name__ in _UNREACHABLE_CLASS_NAMES for cls in type(exc).__mro__)


def hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT
    except ImportError:  # pragma: no cover
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def auth_source() -> str:
    """Where a token would come from; never the token itself."""
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "token from the HF_TOKEN environment variable"
    try:
        from huggingface_hub import get_token

        if get_token():
            return "token from `hf auth login`"
    except Exception:
        pass
    return "anonymous: public repos only"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
