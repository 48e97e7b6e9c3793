"""The cache's files and their hashes: recording every file of an item (size, sha256; an unchanged
file keeps its recorded hash), checking them against the hub's, and `verify_cache`, which hashes
every recorded file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hub import (
    DOWNLOAD_COMMAND,
    MANIFEST_NAME,
    CacheMissError,
    entry_files,
    find_model_entry,
    model_download_command,
    read_cache_manifest,
)
from .plan import DownloadError, Plan

PROGRESS_MIN_BYTES = 64 * 2**20  # hashing progress bar only for items at least this big


@dataclass(frozen=True)
class _Wanted:
    """One item to verify: its manifest key and entry (None: not in the manifest), and for a model
    that a pretrained cell reads, the command that fetches its weights."""

    key: str
    entry: dict | None
    weights_command: str | None = None


def verify_cache(cache: Path, plan: Plan | None = None, out: Callable[[str], None] = print) -> bool:
    """Hash every recorded file again (of every item, or of the plan's); print one line per item and
    per problem. A model the plan needs with weights but cached without them is a problem too.
    True when all is well."""
    wanted = _wanted_items(cache, plan)
    if not wanted:
        out(f"{cache}: no items in {MANIFEST_NAME}")
        return False
    ok = True
    for item in wanted:
        entry = item.entry
        if entry is None:
            ok = False
            out(f"MISSING  {item.key}: not in {cache / MANIFEST_NAME}; run {DOWNLOAD_COMMAND} --cache-dir {cache} ...")
            continue
        problems = list(_file_problems(cache, entry))
        if item.weights_command and not entry.get("weights"):
            problems.append(f"cached without weights, which init: pretrained needs; run {item.weights_command}")
        if problems:
            ok = False
            for problem in problems:
                out(f"BAD      {entry['kind']} {entry['item']}: {problem}")
        else:
            out(
                f"ok       {entry['kind']} {entry['item']} "
                f"({len(entry['files'])} files, {human_size(entry['total_bytes'])})"
            )
    if not ok:
        out(f"to repair: rerun the download command for the items above with --force (cache {cache})")
    return ok


def _wanted_items(cache: Path, plan: Plan | None) -> list[_Wanted]:
    """Every manifest item (no plan), or the plan's items; a model asked for by commit sha is found
    under whichever download resolved to that sha."""
    items = read_cache_manifest(cache)["items"]
    if plan is None:
        return [_Wanted(key, entry) for key, entry in items.items()]
    wanted = []
    for ref, weights in plan.models.values():
        command = model_download_command(cache, ref, weights=True) if weights else None
        wanted.append(_Wanted(*find_model_entry(items, ref), weights_command=command))
    wanted += [_Wanted(key, items.get(key)) for key in [*plan.datasets, *plan.tokenized]]
    return wanted


def _file_problems(cache: Path, entry: dict) -> Iterator[str]:
    try:
        _, files = entry_files(cache, entry)
    except CacheMissError as exc:
        yield str(exc)
        return
    total = sum(f["size"] for _, f in files)
    with _progress(total, f"verify {entry['item']}") as bar:
        for path, f in files:
            if not path.is_file():
                yield f"{path}: missing"
                continue
            size = path.stat().st_size
            if size != f["size"]:
                yield f"{path}: corrupted (size {size}, expected {f['size']})"
                continue
            digest = _sha256(path, bar)
            if digest != f["sha256"]:
                yield f"{path}: corrupted (sha256 {digest[:16]}..., expected {f['sha256'][:16]}...)"


def files_complete(cache: Path, entry: dict) -> bool:
    """Every file of the entry is there with its size; False for an entry whose paths lead out of
    the cache (the item is then fetched again, and its entry rewritten)."""
    try:
        _, files = entry_files(cache, entry)
    except CacheMissError:
        return False
    return all(path.is_file() and path.stat().st_size == f["size"] for path, f in files)


def file_records(folder: Path, previous: dict | None, expected: dict | None = None, label: str = "") -> list[dict]:
    """[{path, size, sha256}] of every file under folder (symlinks followed), sorted by path.

    A file whose size and mtime match the previous entry keeps its recorded hash (no re-read of
    unchanged weights). With `expected` (from _hub_hashes), each file is checked against the hub's
    hash of it (sha256 for LFS files, git blob sha1 otherwise): a mismatch is a corrupted download.
    """
    known = {f["path"]: f for f in (previous or {}).get("files", [])}
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in paths)
    records = []
    with _progress(total, f"hash {label}") as bar:
        for path in paths:
            rel = path.relative_to(folder).as_posix()
            stat = path.stat()
            old = known.get(rel)
            if old and old["size"] == stat.st_size and old.get("mtime_ns") == stat.st_mtime_ns:
                digest = old["sha256"]
                bar.update(stat.st_size)
            else:
                digest = _sha256(path, bar)
            if expected and rel in expected:
                _check_hub_hash(path, digest, expected[rel], label)
            records.append({"path": rel, "size": stat.st_size, "sha256": digest, "mtime_ns": stat.st_mtime_ns})
    return records


def _check_hub_hash(path: Path, sha256: str, expected: tuple[str | None, str], label: str) -> None:
    lfs_sha256, blob_id = expected
    actual, wanted = (sha256, lfs_sha256) if lfs_sha256 else (_git_blob_sha1(path), blob_id)
    if actual != wanted:
        raise DownloadError(
            f"model {label}: {path.name} does not match the hub's hash ({actual[:12]} != "
            f"{wanted[:12]}); rerun with --force to download it again"
        )


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256(path: Path, bar: Any = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator[Any]:
    if total < PROGRESS_MIN_BYTES or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        yield _NoBar()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True) as bar:
        yield bar


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"
