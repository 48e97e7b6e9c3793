"""Offline pre-downloader: models, tokenizers and datasets, cached on a node with internet.

`hpcfsdp download` (or `python download_models.py`) fetches everything the cells of a jobs YAML
need, or what --model / --dataset name, into one cache folder (see hubcache for the layout), and
records each item in manifest.json: kind, requested revision, resolved commit sha, and every file
with its size and sha256. Compute nodes then resolve items from that folder only (hubcache.resolve_*).

- Models: huggingface_hub.snapshot_download into <cache>/hub: config and tokenizer files always,
  *.safetensors only with --weights (pretrained init). Each file is checked against the hash the
  hub lists for it (LFS sha256, or git blob sha1 for small files).
- Datasets: datasets.load_dataset(repo, config, split=..., revision=<sha>) then save_to_disk.
  --tokenize-for MODEL --seq-len N also tokenizes the text column (the preset's, e.g. chess: Moves,
  else `text`, or --text-column) with MODEL's tokenizer and packs the tokens into blocks of N
  (column input_ids), so compute nodes do no tokenisation.
- Interrupted runs: rerun the same command. Files already complete are kept; huggingface_hub
  resumes a dropped connection with HTTP Range requests and downloads into per-process
  `.incomplete` files, renamed into place when complete.
- Concurrent downloaders on one cache: one file lock per item (a second downloader of the same
  item waits, then finds it done) and one for the manifest, which is replaced atomically.
- Tokens: only the libraries' own lookup (HF_TOKEN or `hf auth login`); this module never reads,
  prints or stores a token.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .hub import (
    DOWNLOAD_COMMAND,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    CacheMissError,
    DatasetRef,
    ModelRef,
    TokenizedRef,
    default_cache_dir,
    find_model_entry,
    is_hub_model,
    lookup_model,
    lookup_tokenized,
    model_download_command,
    read_manifest,
)
from ..spec import data_kind

CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
LOCKS_DIR = ".locks"
HUB_DIR = "hub"
DATASETS_WORK_DIR = "hf-datasets"
PROGRESS_MIN_BYTES = 64 * 2**20  # hashing progress bar only for items at least this big


class DownloadError(RuntimeError):
    """Something the user can fix (a wrong name, a gated repo, a bad file); str() is one line."""


@dataclass
class Plan:
    """What to fetch: models (with or without weights), dataset splits, tokenized variants."""

    models: dict[str, tuple[ModelRef, bool]] = field(default_factory=dict)
    datasets: dict[str, DatasetRef] = field(default_factory=dict)
    tokenized: dict[str, TokenizedRef] = field(default_factory=dict)

    def add_model(self, ref: ModelRef, weights: bool = False) -> None:
        old = self.models.get(ref.key)
        self.models[ref.key] = (ref, weights or (old[1] if old else False))

    def add_dataset(self, ref: DatasetRef) -> None:
        self.datasets.setdefault(ref.key, ref)

    def add_tokenized(self, ref: TokenizedRef) -> None:
        self.add_model(ref.model)
        self.add_dataset(ref.dataset)
        self.tokenized.setdefault(ref.key, ref)

    def __bool__(self) -> bool:
        return bool(self.models or self.datasets or self.tokenized)


# -- what to fetch -----------------------------------------------------------------------------

def plan_from_sweep(sweep: Any, plan: Plan | None = None) -> Plan:
    """The hub items a sweep's cells need.

    model: a hub id (not a preset or local folder) -> config + tokenizer; with `init: pretrained`
    also the weights. data: a hub dataset ORG/NAME[:config][@split] or preset -> that split, plus
    the split tokenized at seq_len for the spec's text tokenizer (a hub id: RunSpec checks that),
    from the spec's text_column, else the dataset's own.
    """
    plan = Plan() if plan is None else plan
    for cell in sweep.cells:
        spec, where = cell.spec, f"{sweep.source}: cell {cell.id}"
        if is_hub_model(spec.model):
            plan.add_model(_parse(ModelRef, spec.model, where), weights=spec.init == "pretrained")
        if data_kind(spec.data) == "hub":
            plan.add_tokenized(TokenizedRef(_parse(DatasetRef, spec.data, where),
                                            _parse(ModelRef, spec.text_tokenizer, where), spec.seq_len,
                                            spec.text_column or None))
    return plan


@dataclass(frozen=True)
class Request:
    """What to fetch, as the command line names it: a jobs YAML and/or explicit items
    (tokenized: every dataset x tokenize_for model x seq_len)."""

    jobs: str | None = None
    max_cells: int | None = None  # for the jobs file; None: the sweep's default limit
    models: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    weights: bool = False
    tokenize_for: tuple[str, ...] = ()
    seq_lens: tuple[int, ...] = ()

    @property
    def names_items(self) -> bool:
        return bool(self.jobs or self.models or self.datasets)


def build_plan(request: Request, text_column: str | None = None) -> Plan:
    """The items of a request, parsed and checked. text_column (--text-column) is the column that
    the --dataset items are tokenized from; None: each dataset's own (DatasetRef.text_column)."""
    plan = Plan()
    if text_column and not request.tokenize_for:
        raise DownloadError(f"--text-column {text_column} applies to the --dataset items that --tokenize-for tokenizes; "
                            "a jobs YAML names its cells' column with text_column")
    if request.jobs:
        from ..sweep.matrix import MAX_CELLS, load_sweep

        plan_from_sweep(load_sweep(request.jobs, request.max_cells or MAX_CELLS), plan)
    for text in request.models:
        plan.add_model(_parse(ModelRef, text, "--model"), weights=request.weights)
    if request.weights:  # --weights also applies to the models a jobs file names
        for key, (ref, _) in list(plan.models.items()):
            plan.models[key] = (ref, True)
    dataset_refs = [_parse(DatasetRef, text, "--dataset") for text in request.datasets]
    for ref in dataset_refs:
        plan.add_dataset(ref)
    if request.tokenize_for or request.seq_lens:
        if not (request.tokenize_for and request.seq_lens and dataset_refs):
            raise DownloadError("--tokenize-for MODEL and --seq-len N go together, with at least one --dataset")
        for n in request.seq_lens:
            if n < 1:
                raise DownloadError(f"--seq-len: expected a positive integer, got {n}")
        for text in request.tokenize_for:
            if not is_hub_model(text):
                raise DownloadError(f"--tokenize-for: {text!r}: expected a hub model id ORG/NAME[@REV] "
                                    "(shipped presets have no tokenizer)")
            model = _parse(ModelRef, text, "--tokenize-for")
            for ds in dataset_refs:
                for n in request.seq_lens:
                    plan.add_tokenized(TokenizedRef(ds, model, n, text_column))
    return plan


def _parse(cls: type, text: str, where: str) -> Any:
    try:
        return cls.parse(text)
    except ValueError as exc:
        raise DownloadError(f"{where}: {exc}") from None


# -- entry point -------------------------------------------------------------------------------

def download_main(
    request: Request,
    cache_dir: str | None = None,
    verify_only: bool = False,
    allow_patterns: Iterable[str] = (),
    text_column: str | None = None,
    num_proc: int | None = None,
    force: bool = False,
    out: Callable[[str], None] = print,
) -> int:
    """`hpcfsdp download`: fetch (or with verify_only, check) the items; returns the exit status."""
    cache = default_cache_dir(cache_dir)
    plan = build_plan(request, text_column)
    if verify_only:
        if request.names_items and not plan:
            out("nothing from the hub is needed (preset models, synthetic data)")
            return 0
        return 0 if verify_cache(cache, plan if request.names_items else None, out=out) else 1
    if not plan:
        raise DownloadError("nothing to download: give a jobs YAML, --model ORG/NAME or --dataset ORG/NAME")
    cache.mkdir(parents=True, exist_ok=True)
    # Raw dataset files fetched by `datasets` go to huggingface_hub's cache; keep them under the cache
    # folder too (huggingface_hub reads HF_HUB_CACHE once, when first imported).
    if "huggingface_hub" not in sys.modules:
        os.environ.setdefault("HF_HUB_CACHE", str(cache / HUB_DIR))
    out(f"cache: {cache}")
    out(f"hub: {_endpoint()} ({_auth_source()})")
    entries = download_plan(plan, cache, allow_patterns=allow_patterns, num_proc=num_proc, force=force, out=out)
    out("")
    for entry in entries:
        out(f"  {entry['kind']:9} {entry['item']}  sha {entry.get('sha', '')[:12]}  "
            f"{len(entry['files'])} files, {_human(entry['total_bytes'])}")
    out(f"manifest: {cache / MANIFEST_NAME}")
    out(f"on compute nodes: export HPCFSDP_CACHE={cache}  (read offline; nothing is downloaded there)")
    return 0


def download_plan(
    plan: Plan,
    cache: Path,
    allow_patterns: Iterable[str] = (),
    num_proc: int | None = None,
    force: bool = False,
    out: Callable[[str], None] = print,
) -> list[dict]:
    entries = []
    for ref, weights in plan.models.values():
        entries.append(download_model(ref, cache, weights=weights, allow_patterns=allow_patterns, force=force, out=out))
    for ref in plan.datasets.values():
        entries.append(download_dataset(ref, cache, num_proc=num_proc, force=force, out=out))
    for ref in plan.tokenized.values():
        entries.append(tokenize_dataset(ref, cache, num_proc=num_proc, force=force, out=out))
    return entries


# -- models ------------------------------------------------------------------------------------

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
    with _item_lock(cache, ref.key, ref.name, out):
        with _hub_errors("model", ref.name):
            folder = Path(snapshot_download(
                ref.repo_id,
                revision=ref.revision,
                cache_dir=cache / HUB_DIR,
                allow_patterns=patterns,
                force_download=force,
            ))
        sha = folder.name
        if not (folder / "config.json").is_file():
            raise DownloadError(f"model {ref.name}: the repo has no config.json at {sha}; is it a transformers model?")
        has_weights = any(p.name.endswith(".safetensors") for p in folder.rglob("*"))
        if weights and not has_weights:
            raise DownloadError(f"model {ref.name}: no *.safetensors weights in the repo at {sha} "
                                "(pretrained init reads safetensors only)")
        previous = _previous(cache, ref.key, sha)
        paths = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        with _hub_errors("model", ref.name):
            expected = _hub_hashes(ref.repo_id, sha, paths)
        files = _file_records(folder, previous, expected=expected, label=ref.name)
        entry = _entry(ref.key, "model", ref.name, folder, cache, files,
                       repo_id=ref.repo_id, revision=ref.revision, sha=sha, weights=has_weights)
        _record(cache, entry)
    out(f"  -> {ref.repo_id} at {sha} ({len(files)} files)")
    return entry


# -- datasets ----------------------------------------------------------------------------------

def download_dataset(
    ref: DatasetRef, cache: Path, num_proc: int | None = None, force: bool = False, out: Callable[[str], None] = print
) -> dict:
    """load_dataset of one split at a pinned commit, then save_to_disk; returns the manifest entry."""
    out(f"dataset {ref.name}")
    with _item_lock(cache, ref.key, ref.name, out):
        from huggingface_hub import HfApi

        with _hub_errors("dataset", ref.name):
            sha = HfApi().dataset_info(ref.repo_id, revision="main").sha
        previous = _previous(cache, ref.key, sha)
        if previous and not force and _complete(cache, previous):
            out(f"  -> up to date at {sha}")
            return previous
        import datasets

        with _hub_errors("dataset", ref.name):
            ds = datasets.load_dataset(ref.repo_id, ref.load_config, split=ref.split, revision=sha,
                                       cache_dir=str(cache / DATASETS_WORK_DIR), num_proc=num_proc,
                                       download_mode="force_redownload" if force else None)
        folder = cache / ref.relpath
        _save_atomically(ds, folder)
        files = _file_records(folder, None, label=ref.name)
        entry = _entry(ref.key, "dataset", ref.name, folder, cache, files, repo_id=ref.repo_id,
                       config=ref.config, split=ref.split, revision="main", sha=sha, num_rows=ds.num_rows,
                       columns=list(ds.column_names), features=str(ds.features))
        _record(cache, entry)
    out(f"  -> {ref.repo_id} at {sha}: {ds.num_rows} rows, columns {', '.join(ds.column_names)}")
    return entry


def tokenize_dataset(
    ref: TokenizedRef, cache: Path, num_proc: int | None = None, force: bool = False, out: Callable[[str], None] = print
) -> dict:
    """Tokenize a saved split's text column with a cached model's tokenizer, pack into seq_len blocks, save."""
    from .hub import lookup_dataset, lookup_model

    out(f"tokenize {ref.name}")
    with _item_lock(cache, ref.key, ref.name, out):
        source = lookup_dataset(ref.dataset.name, cache)
        model = lookup_model(ref.model.name, cache)
        previous = read_manifest(cache)["items"].get(ref.key)
        if (previous and not force and previous.get("dataset_sha") == source.sha
                and previous.get("tokenizer_sha") == model.sha and _complete(cache, previous)):
            out(f"  -> up to date ({previous['num_blocks']} blocks of {ref.seq_len})")
            return previous
        import datasets
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.path)
        ds = datasets.load_from_disk(str(source.path))
        text_column = str(ref.text_column)
        _check_text_column(ds.features, text_column, ref.dataset.name)
        eos = tokenizer.eos_token_id
        seq_len = ref.seq_len

        from .tokenize import document_text

        def encode(batch: dict) -> dict:
            texts = [document_text(value) for value in batch[text_column]]
            return {"input_ids": tokenizer(texts, return_attention_mask=False)["input_ids"]}

        list_type = getattr(datasets, "List", None) or datasets.Sequence
        features = datasets.Features({"input_ids": list_type(datasets.Value("int32"), length=seq_len)})
        work = cache / DATASETS_WORK_DIR / "tokenize" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        work.mkdir(parents=True, exist_ok=True)
        try:
            encoded = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc,
                             load_from_cache_file=False, cache_file_name=str(work / "encoded.arrow"),
                             desc=f"Tokenizing for {ref.model.name}")
            encoded.save_to_disk(str(work / "encoded"))  # what the packing generator reads, by path
            packed = datasets.Dataset.from_generator(
                _packed_rows, features=features, cache_dir=str(work / "packed"),
                gen_kwargs={"encoded": str(work / "encoded"), "seq_len": seq_len, "eos": eos})
            if packed.num_rows == 0:
                raise DownloadError(f"{ref.name}: fewer than {seq_len} tokens in all; "
                                    "nothing to train on (use a smaller --seq-len)")
            folder = cache / ref.relpath
            _save_atomically(packed, folder)
            num_blocks = packed.num_rows
        finally:
            shutil.rmtree(work, ignore_errors=True)
        files = _file_records(folder, None, label=ref.name)
        entry = _entry(ref.key, "tokenized", ref.name, folder, cache, files,
                       dataset=ref.dataset.name, dataset_sha=source.sha, sha=source.sha,
                       tokenizer=ref.model.name, tokenizer_sha=model.sha, seq_len=seq_len,
                       num_blocks=num_blocks, text_column=text_column, eos_appended=eos is not None,
                       column="input_ids")
        _record(cache, entry)
    out(f"  -> {num_blocks} blocks of {seq_len} tokens")
    return entry


def _packed_rows(encoded: str, seq_len: int, eos: int | None) -> Iterator[dict[str, list[int]]]:
    """Dataset.from_generator's source: the saved token ids, packed as a text folder's are."""
    import datasets

    from .tokenize import packed_blocks

    documents = (ids for batch in datasets.load_from_disk(encoded).iter(batch_size=1000) for ids in batch["input_ids"])
    for block in packed_blocks(documents, seq_len, eos):  # datasets draws the progress bar
        yield {"input_ids": block}


def _check_text_column(features: Any, column: str, dataset: str) -> None:
    """The column exists and holds strings, or lists of strings (what data.document_text turns into text)."""
    if column not in features:
        raise DownloadError(f"dataset {dataset}: no column {column!r} (columns: {', '.join(features)}); "
                            "pass --text-column")
    feature = features[column]
    inner = getattr(feature, "feature", feature)  # List / Sequence / LargeList: their items
    if getattr(inner, "dtype", None) not in ("string", "large_string"):
        raise DownloadError(f"dataset {dataset}: column {column!r} holds {feature}, not text or a list of "
                            "strings; pass --text-column")


def _save_atomically(ds: Any, folder: Path) -> None:
    """save_to_disk into a temporary sibling, then rename over the old copy (readers never see half)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder.parent / f".{folder.name}.tmp-{tag}"
    old = folder.parent / f".{folder.name}.old-{tag}"
    try:
        ds.save_to_disk(str(tmp))
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


# -- verification ------------------------------------------------------------------------------

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
            out(f"ok       {entry['kind']} {entry['item']} ({len(entry['files'])} files, {_human(entry['total_bytes'])})")
    if not ok:
        out(f"to repair: rerun the download command for the items above with --force (cache {cache})")
    return ok


def _wanted_items(cache: Path, plan: Plan | None) -> list[_Wanted]:
    """Every manifest item (no plan), or the plan's items; a model asked for by commit sha is found
    under whichever download resolved to that sha."""
    items = read_manifest(cache)["items"]
    if plan is None:
        return [_Wanted(key, entry) for key, entry in items.items()]
    wanted = []
    for ref, weights in plan.models.values():
        command = model_download_command(cache, ref, weights=True) if weights else None
        wanted.append(_Wanted(*find_model_entry(items, ref), weights_command=command))
    wanted += [_Wanted(key, items.get(key)) for key in [*plan.datasets, *plan.tokenized]]
    return wanted


def _file_problems(cache: Path, entry: dict) -> Iterator[str]:
    folder = cache / entry["path"]
    total = sum(f["size"] for f in entry["files"])
    with _progress(total, f"verify {entry['item']}") as bar:
        for f in entry["files"]:
            path = folder / f["path"]
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


def _complete(cache: Path, entry: dict) -> bool:
    folder = cache / entry["path"]
    return all((folder / f["path"]).is_file() and (folder / f["path"]).stat().st_size == f["size"]
               for f in entry["files"])


# -- manifest, files, locks --------------------------------------------------------------------

def _entry(key: str, kind: str, item: str, folder: Path, cache: Path, files: list[dict], **extra: Any) -> dict:
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


def _previous(cache: Path, key: str, sha: str) -> dict | None:
    entry = read_manifest(cache)["items"].get(key)
    return entry if entry and entry.get("sha") == sha else None


def _hub_hashes(repo_id: str, sha: str, paths: list[str]) -> dict[str, tuple[str | None, str]]:
    """The hub's own hashes of a model's files at a commit: path -> (LFS sha256 or None, git blob sha1)."""
    from huggingface_hub import HfApi

    out = {}
    for info in HfApi().get_paths_info(repo_id, paths, revision=sha):
        if hasattr(info, "blob_id"):  # a file, not a folder
            out[info.path] = (info.lfs.sha256 if info.lfs is not None else None, info.blob_id)
    return out


def _file_records(folder: Path, previous: dict | None, expected: dict | None = None, label: str = "") -> list[dict]:
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
        raise DownloadError(f"model {label}: {path.name} does not match the hub's hash ({actual[:12]} != "
                            f"{wanted[:12]}); rerun with --force to download it again")


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


def _record(cache: Path, entry: dict) -> None:
    """Add or replace one item in manifest.json: read-merge-write under a lock, atomic rename."""
    from filelock import FileLock

    lock_dir = cache / LOCKS_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / "manifest.lock")):
        manifest = read_manifest(cache)
        manifest["version"] = MANIFEST_VERSION
        manifest["items"][entry["key"]] = entry
        manifest["items"] = dict(sorted(manifest["items"].items()))
        path = cache / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


@contextlib.contextmanager
def _item_lock(cache: Path, key: str, name: str, out: Callable[[str], None]) -> Iterator[None]:
    """One downloader per item at a time; others wait (and then find the item up to date)."""
    from filelock import FileLock, Timeout

    lock_dir = cache / LOCKS_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_dir / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".lock")))
    try:
        lock.acquire(timeout=1)
    except Timeout:
        out(f"  waiting for another downloader of {name} ...")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
            why = f"could not be fetched: the hub at {_endpoint()} is not reachable from here"
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


def _endpoint() -> str:
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT
    except ImportError:  # pragma: no cover
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _auth_source() -> str:
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


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("hpcfsdp", "huggingface_hub", "datasets", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cache_misses(sweep: Any, cache_dir: str | None = None) -> list[str]:
    """One line per hub item the sweep's cells read that the cache lacks (models, and datasets in
    their tokenized form): `plan` and `submit` check this before anything is queued."""
    plan = plan_from_sweep(sweep)
    checks = [functools.partial(lookup_model, ref.name, cache_dir, weights) for ref, weights in plan.models.values()]
    checks += [functools.partial(lookup_tokenized, ref.dataset.name, ref.model.name, ref.seq_len, cache_dir, ref.text_column)
               for ref in plan.tokenized.values()]
    misses = []
    for check in checks:
        try:
            check()
        except CacheMissError as exc:
            misses.append(str(exc))
    return misses


__all__ = [
    "CacheMissError",
    "DownloadError",
    "Plan",
    "Request",
    "build_plan",
    "cache_misses",
    "download_dataset",
    "download_main",
    "download_model",
    "download_plan",
    "plan_from_sweep",
    "tokenize_dataset",
    "verify_cache",
]
