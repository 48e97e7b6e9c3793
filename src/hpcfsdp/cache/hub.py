"""The pre-downloaded cache, as seen from a compute node: names, manifest, offline resolvers.

This module is light on purpose (standard library only): `hpcfsdp run` calls it before building
a model, and it must answer, without the network, within a fraction of a second, either with a
local path or with a one-line error that names the missing item and the command that fetches it.

Cache layout (everything under one folder, default $HPCFSDP_CACHE, else ~/.cache/hpcfsdp):

    manifest.json                      what was downloaded: item, kind, revision sha, files
    hub/models--ORG--NAME/...          huggingface_hub cache (snapshots/<sha>/ holds the files)
    datasets/ORG--NAME/CONFIG/SPLIT/   datasets.save_to_disk of one split
    tokenized/ORG--NAME/CONFIG/SPLIT/MODELORG--MODELNAME[@REV]/seqN[-COLUMN]/   packed `input_ids` blocks
    hf-datasets/, hub/datasets--*      intermediates of `datasets.load_dataset` (may be deleted)
    .locks/                            file locks of concurrent downloaders

The downloader (hpcfsdp.download) writes the cache; this module only reads it.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..contracts.errors import UserError
from ..contracts.fields import unknown_home
from ..contracts.files import RecordError, read_json_object
from ..contracts.names import DatasetRef, ModelRef, TokenizedRef

CACHE_ENV = "HPCFSDP_CACHE"
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
DOWNLOAD_COMMAND = "python download_models.py"
RUN_WHERE_ONLINE = "; on a machine with internet run: "  # before a cache miss's one download command
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


class CacheMissError(UserError, FileNotFoundError):
    """An item is not (completely) in the cache. str() is one line: the item and the command to run."""


# -- cache folder and manifest -----------------------------------------------------------------


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """--cache-dir if given, else $HPCFSDP_CACHE, else ~/.cache/hpcfsdp."""
    for given, named in ((cache_dir, "--cache-dir"), (os.environ.get(CACHE_ENV), CACHE_ENV)):
        if given:
            user = unknown_home(str(given))
            if user:
                raise UserError(f"{named}: {user}: no such user here, so no home folder for it to name")
            return Path(given).expanduser().resolve()
    return (Path.home() / ".cache" / "hpcfsdp").resolve()


def read_cache_manifest(cache_dir: Path) -> dict[str, Any]:
    """The manifest as a dict {"version": 1, "items": {key: entry}}; empty when there is none yet."""
    path = Path(cache_dir) / MANIFEST_NAME
    try:
        data = read_json_object(path, kind="cache manifest")
    except FileNotFoundError:
        return {"version": MANIFEST_VERSION, "items": {}}
    except RecordError as exc:
        raise CacheMissError(f"{exc}; rerun {DOWNLOAD_COMMAND}") from None
    if not isinstance(data.get("items"), dict):
        raise CacheMissError(f"{path}: not an hpcfsdp manifest; rerun {DOWNLOAD_COMMAND}")
    problem = _manifest_problem(data["items"])
    if problem:
        raise CacheMissError(f"{path}: {problem}; rerun {DOWNLOAD_COMMAND}")
    return data


# The types of the manifest's fields that the cache's readers use (manifest.manifest_entry): a
# hand-edited manifest of other types is one line, never a traceback in plan or download --verify.
ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "key": (str,),
    "item": (str,),
    "kind": (str,),
    "path": (str,),
    "sha": (str, type(None)),
    "repo_id": (str, type(None)),
    "weights": (bool, type(None)),
    "total_bytes": (int,),
    "files": (list,),
}
REQUIRED_ENTRY_FIELDS = ("item", "kind", "path", "files")
FILE_TYPES: dict[str, tuple[type, ...]] = {"path": (str,), "size": (int,), "sha256": (str,), "mtime_ns": (int,)}
REQUIRED_FILE_FIELDS = ("path", "size", "sha256")


def _manifest_problem(items: dict[str, Any]) -> str | None:
    """What makes the manifest's items unusable ("item 'model:x@main': files[0].size: expected
    int, got 'big'"), or None."""
    for key, entry in items.items():
        if not isinstance(entry, dict):
            return f"item {key!r}: expected an object, got {type(entry).__name__}"
        problem = _fields_problem(entry, ENTRY_TYPES, REQUIRED_ENTRY_FIELDS, "")
        for index, record in enumerate(entry.get("files", [])):
            if problem:
                break
            if not isinstance(record, dict):
                problem = f"files[{index}]: expected an object, got {type(record).__name__}"
            else:
                problem = _fields_problem(record, FILE_TYPES, REQUIRED_FILE_FIELDS, f"files[{index}].")
        if problem:
            return f"item {key!r}: {problem}"
    return None


def _fields_problem(values: dict, types: dict[str, tuple[type, ...]], required: tuple[str, ...], prefix: str) -> str:
    for name in required:
        if name not in values:
            return f"{prefix}{name}: missing"
    for name, kinds in types.items():
        if name in values and type(values[name]) not in kinds:
            return f"{prefix}{name}: expected {' or '.join(k.__name__ for k in kinds)}, got {values[name]!r:.40}"
        if kinds == (int,) and name in values and values[name] < 0:
            return f"{prefix}{name}: expected 0 or more, got {values[name]}"
    return ""


@dataclass(frozen=True)
class CachedItem:
    """One manifest entry, resolved to a local folder."""

    key: str
    kind: str
    item: str
    sha: str
    path: Path
    entry: dict

    def provenance(self) -> dict[str, Any]:
        """What a result record should carry about this input: name, kind and revision sha."""
        out = {"item": self.item, "kind": self.kind, "sha": self.sha}
        for extra in ("seq_len", "num_rows", "num_blocks", "tokenizer_sha", "text_column"):
            if extra in self.entry:
                out[extra] = self.entry[extra]
        return out


# -- offline resolution (compute nodes) --------------------------------------------------------


def offline_mode() -> None:
    """Forbid network access by huggingface_hub, datasets and transformers in this process.

    Sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE for this process and its
    children. The libraries read these when first imported, so where one is already imported its
    documented offline flag is set to match as well.
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    # Libraries imported before this read their switches already: set them on the modules too.
    switches = {
        "huggingface_hub.constants": ("HF_HUB_OFFLINE",),
        "datasets.config": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
    }
    for module_name, names in switches.items():
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            setattr(module, name, True)


def resolve_cached_model(name: str, cache_dir: str | os.PathLike | None = None, weights: bool = False) -> CachedItem:
    """A hub model `ORG/NAME[@rev]` -> its snapshot folder (config.json, tokenizer files[, weights]).

    Offline only: reads the manifest and checks that the recorded files exist with their sizes.
    weights=True also requires *.safetensors (for `init: pretrained`).
    """
    offline_mode()
    return lookup_model(name, cache_dir, weights)


def lookup_model(name: str, cache_dir: str | os.PathLike | None = None, weights: bool = False) -> CachedItem:
    """resolve_cached_model without switching the process offline (for the downloader itself)."""
    ref = ModelRef.parse(name)
    cache = default_cache_dir(cache_dir)
    command = model_download_command(cache, ref, weights)
    entry_key, entry = find_model_entry(read_cache_manifest(cache)["items"], ref)
    if entry is None:
        raise CacheMissError(f"model {ref.name!r} is not in the cache {cache}{RUN_WHERE_ONLINE}{command}")
    item = _checked(cache, entry_key, entry, ref.name, command)
    if weights and not entry.get("weights"):
        raise CacheMissError(
            f"model {ref.name!r} is in the cache {cache} without weights (needed for pretrained init); "
            f"on a machine with internet run: {command}"
        )
    return item


def cached_config(ref: ModelRef, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """A hub model's config.json fetched alone (`download --config-only`, fetch.download_config)
    into the cache's hub folder, read offline; None where it was not."""
    cache = default_cache_dir(cache_dir) / "hub"
    if not cache.is_dir():  # nothing downloaded here: no need to import huggingface_hub to know it
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.repo_id, "config.json", cache_dir=cache, revision=ref.revision)
    return Path(found) if isinstance(found, str) else None


def model_download_command(cache: Path, ref: ModelRef, weights: bool) -> str:
    """The command that fetches a model into the cache (run where there is internet)."""
    return f"{DOWNLOAD_COMMAND} --cache-dir {cache} --model {ref.name}{' --weights' if weights else ''}"


def resolve_dataset(name: str, cache_dir: str | os.PathLike | None = None) -> CachedItem:
    """A dataset `ORG/NAME[:config][@split]` or preset -> the folder for datasets.load_from_disk."""
    offline_mode()
    return lookup_dataset(name, cache_dir)


def lookup_dataset(name: str, cache_dir: str | os.PathLike | None = None) -> CachedItem:
    ref = DatasetRef.parse(name)
    cache = default_cache_dir(cache_dir)
    command = f"{DOWNLOAD_COMMAND} --cache-dir {cache} --dataset {ref.name}"
    entry = read_cache_manifest(cache)["items"].get(ref.key)
    if entry is None:
        raise CacheMissError(f"dataset {ref.name!r} is not in the cache {cache}{RUN_WHERE_ONLINE}{command}")
    return _checked(cache, ref.key, entry, ref.name, command)


def resolve_dataset_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_dataset(name, cache_dir).path


def resolve_tokenized(
    dataset: str, model: str, seq_len: int, cache_dir: str | os.PathLike | None = None, text_column: str | None = None
) -> CachedItem:
    """A dataset's text column (None: its own) tokenized with `model`'s tokenizer, packed into
    `seq_len` blocks (column input_ids)."""
    offline_mode()
    return lookup_tokenized(dataset, model, seq_len, cache_dir, text_column)


def lookup_tokenized(
    dataset: str, model: str, seq_len: int, cache_dir: str | os.PathLike | None = None, text_column: str | None = None
) -> CachedItem:
    ref = TokenizedRef(DatasetRef.parse(dataset), ModelRef.parse(model), int(seq_len), text_column)
    cache = default_cache_dir(cache_dir)
    column = f" --text-column {ref.text_column}" if ref.text_column != ref.dataset.text_column else ""
    command = (
        f"{DOWNLOAD_COMMAND} --cache-dir {cache} --dataset {ref.dataset.name} "
        f"--tokenize-for {ref.model.name} --seq-len {ref.seq_len}{column}"
    )
    entry = read_cache_manifest(cache)["items"].get(ref.key)
    if entry is None:
        raise CacheMissError(f"tokenized dataset {ref.name!r} is not in the cache {cache}{RUN_WHERE_ONLINE}{command}")
    return _checked(cache, ref.key, entry, ref.name, command)


def find_model_entry(items: dict[str, dict], ref: ModelRef) -> tuple[str, dict | None]:
    """The manifest entry of a model: by its key, or for a commit sha by any download of the repo
    that resolved to that sha (`org/m@main` downloaded, `org/m@<sha>` asked for). (key, None) if none."""
    if ref.key in items:
        return ref.key, items[ref.key]
    if _SHA_RE.match(ref.revision):
        for key, entry in items.items():
            if (
                entry.get("kind") == "model"
                and entry.get("repo_id") == ref.repo_id
                and entry.get("sha") == ref.revision
            ):
                return key, entry
    return ref.key, None


def entry_files(cache: Path, entry: dict) -> tuple[Path, list[tuple[Path, dict]]]:
    """A manifest entry's folder and its files (each with its manifest record). Every path must lie
    inside the cache: one that is absolute, climbs out with '..' or is not text is a CacheMissError
    naming the manifest and the path, never followed."""
    folder = cache / _inside_path(cache, entry.get("path"), entry)
    files = entry.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise CacheMissError(f"{cache / MANIFEST_NAME}: item {entry.get('item')!r}: files is not a list of objects")
    return folder, [(folder / _inside_path(cache, f.get("path"), entry), f) for f in files]


def _inside_path(cache: Path, path: Any, entry: dict) -> str:
    parts = PurePosixPath(path).parts if isinstance(path, str) and path else ("..",)
    if PurePosixPath(path or "/").is_absolute() or ".." in parts:
        raise CacheMissError(
            f"{cache / MANIFEST_NAME}: item {entry.get('item')!r}: path {path!r} leads out of the cache; not followed"
        )
    return str(path)


def _checked(cache: Path, key: str, entry: dict, name: str, command: str) -> CachedItem:
    """Every recorded file exists with its recorded size (a quick check: --verify hashes them)."""
    folder, files = entry_files(cache, entry)
    for path, f in files:
        try:
            size = path.stat().st_size
        except OSError:
            raise CacheMissError(
                f"{entry.get('kind', 'item')} {name!r}: file {path} is missing from the cache; "
                f"on a machine with internet run: {command}"
            ) from None
        if size != f["size"]:
            raise CacheMissError(
                f"{entry.get('kind', 'item')} {name!r}: file {path} has {size} bytes, expected "
                f"{f['size']}; on a machine with internet run: {command} --force"
            )
    return CachedItem(
        key=key, kind=entry["kind"], item=entry["item"], sha=entry.get("sha", ""), path=folder, entry=entry
    )
