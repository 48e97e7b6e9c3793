"""The cache's manifest.json and its locks: one entry per item (kind, resolved sha, files), added
under a file lock and written with the one atomic JSON writer; one lock per item, so that
concurrent downloaders of one item wait for each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..contracts.files import exclusive_lock, write_json
from ..contracts.fs.beneath import make_folders
from .hub import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    read_cache_manifest,
)

LOCKS_DIR = ".locks"


def manifest_entry(key: str, kind: str, item: str, folder: Path, cache: Path, files: list[dict], **extra: Any) -> dict:
    return {
        "key": key,
        "item": item,
        "kind": kind,
        **extra,
        "path": folder.relative_to(cache).as_posix(),
        "files": files,
        "total_bytes": sum(f["size"] for f in files),
        "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": _versions(),
    }


def previous_entry(cache: Path, key: str, sha: str | None) -> dict | None:
    entry = read_cache_manifest(cache)["items"].get(key)
    return entry if entry and entry.get("sha") == sha else None


def add_to_manifest(cache: Path, entry: dict) -> None:
    """Add or replace one item in manifest.json: read-merge-write under a lock (downloaders of other
    items may be adding theirs), written atomically."""
    lock_dir = cache / LOCKS_DIR
    make_folders(lock_dir)
    with exclusive_lock(lock_dir / "manifest.lock"):
        manifest = read_cache_manifest(cache)
        manifest["version"] = MANIFEST_VERSION
        manifest["items"][entry["key"]] = entry
        manifest["items"] = dict(sorted(manifest["items"].items()))
        write_json(cache / MANIFEST_NAME, manifest)


@contextlib.contextmanager
def item_lock(cache: Path, key: str, name: str, out: Callable[[str], None]) -> Iterator[None]:
    """One downloader per item at a time; others wait (and then find the item up to date). The
    cache is often shared: its locks are never links, nor files hpcfsdp did not make (open_lock)."""
    lock_dir = cache / LOCKS_DIR
    make_folders(lock_dir)
    lock = lock_dir / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".lock")
    with exclusive_lock(lock, lambda: out(f"  waiting for another downloader of {name} ...")):
        yield


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("hpcfsdp", "huggingface_hub", "datasets", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out
