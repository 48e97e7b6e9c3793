"""`hpcfsdp download`: models, tokenizers and datasets, cached on a node with internet.

`hpcfsdp download` (or `python download_models.py`) fetches everything the cells of a jobs YAML
need, or what --model / --dataset name, into one cache folder (see cache/hub.py for the layout), and
records each item in manifest.json: kind, requested revision, resolved commit sha, and every file
with its size and sha256. Compute nodes then resolve items from that folder only (cache/hub.py).

This module runs the command: plan.py says what to fetch, fetch.py fetches, tokenize.py tokenizes,
verify.py hashes the files and manifest.py records each item.

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

import functools
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from ..contracts.fs.beneath import make_folders
from ..contracts.names import name_problem
from .fetch import HUB_DIR, auth_source, download_config, download_dataset, download_model, hub_endpoint
from .hub import (
    MANIFEST_NAME,
    CacheMissError,
    default_cache_dir,
)
from .plan import DownloadError, Plan, Request, build_plan, plan_items
from .tokenize import tokenize_dataset
from .verify import human_size, verify_cache


def download_main(
    request: Request,
    cache_dir: str | None = None,
    verify_only: bool = False,
    allow_patterns: Iterable[str] = (),
    text_column: str | None = None,
    num_proc: int | None = None,
    force: bool = False,
    out: Callable[[str], None] = print,
    config_only: bool = False,
) -> int:
    """`hpcfsdp download`: fetch (or with verify_only, check) the items; returns the exit status.
    config_only: each hub model's config.json alone, for `plan --memory` (nothing else)."""
    problem = name_problem(cache_dir) if cache_dir else ""
    if problem:  # a newline would make the path printed for `export HPCFSDP_CACHE=` two lines
        raise DownloadError(f"--cache-dir: {problem}: {cache_dir!r}")
    cache = default_cache_dir(cache_dir)
    if cache.exists() and not cache.is_dir():  # a FIFO, a file: not "a cache with no items"
        kind = "a regular file" if cache.is_file() else "a FIFO, device or socket"
        raise DownloadError(f"--cache-dir: {cache}: {kind}, not a folder; give the cache's folder")
    plan = build_plan(request, text_column)
    if verify_only:
        if request.names_items and not plan:
            out("nothing from the hub is needed (preset models, synthetic data)")
            return 0
        return 0 if verify_cache(cache, plan if request.names_items else None, out=out) else 1
    if not plan and request.sweep is not None:  # a jobs YAML whose cells need nothing from the hub
        out(
            f"nothing to download: the cells of {request.sweep.source} use preset models and local or synthetic "
            "data (hub models are ORG/NAME[@REV])"
        )
        return 0
    if not plan:
        raise DownloadError("nothing to download: give a jobs YAML, --model ORG/NAME or --dataset ORG/NAME")
    make_folders(cache)
    # Raw dataset files fetched by `datasets` go to huggingface_hub's cache; keep them under the cache
    # folder too (huggingface_hub reads HF_HUB_CACHE once, when first imported).
    if "huggingface_hub" not in sys.modules:
        os.environ.setdefault("HF_HUB_CACHE", str(cache / HUB_DIR))
    out(f"cache: {cache}")
    out(f"hub: {hub_endpoint()} ({auth_source()})")
    if config_only:
        for ref, _ in plan.models.values():
            download_config(ref, cache, out)
        out("`hpcfsdp plan --memory` predicts from these; the cells still need the models downloaded")
        return 0
    items = plan_items(plan, str(cache))
    missing = sum(bool(item.missing) for item in items)
    out(f"needs {len(items)} item(s), {missing} of them not in the cache:")
    for item in items:
        out(f"  {item.kind:9} {item.name}  {'missing' if item.missing else 'cached'}")
    entries, failed = download_plan(plan, cache, allow_patterns=allow_patterns, num_proc=num_proc, force=force, out=out)
    out("")
    for entry in entries:
        out(
            f"  {entry['kind']:9} {entry['item']}  sha {entry.get('sha', '')[:12]}  "
            f"{len(entry['files'])} files, {human_size(entry['total_bytes'])}"
        )
    out(f"manifest: {cache / MANIFEST_NAME}")
    if failed:
        for problem in failed:
            print(f"error: {problem}", file=sys.stderr)
        raise DownloadError(
            f"{len(failed)} of {len(entries) + len(failed)} item(s) not downloaded: run the same command where "
            f"the hub at {hub_endpoint()} answers (a login node with internet), or set HF_ENDPOINT to a mirror "
            "that does; run again, it resumes (what is cached stays, partial files go on where they stopped)"
        )
    out(f"on compute nodes: export HPCFSDP_CACHE={cache}  (read offline; nothing is downloaded there)")
    return 0


def download_plan(
    plan: Plan,
    cache: Path,
    allow_patterns: Iterable[str] = (),
    num_proc: int | None = None,
    force: bool = False,
    out: Callable[[str], None] = print,
) -> tuple[list[dict], list[str]]:
    """Fetch every item of the plan, going on past one that fails (a hub that does not answer, a
    gated repo): the manifest entries of those fetched, and one line per item that was not."""
    # (the keys it needs fetched first, its key, its name, the fetch): tokenizing needs its model and dataset
    fetches: list[tuple[tuple[str, ...], str, str, Callable[[], dict]]] = [
        (
            (),
            model.key,
            f"model {model.name}",
            functools.partial(
                download_model, model, cache, weights=weights, allow_patterns=allow_patterns, force=force, out=out
            ),
        )
        for model, weights in plan.models.values()
    ]
    fetches += [
        (
            (),
            ref.key,
            f"dataset {ref.name}",
            functools.partial(download_dataset, ref, cache, num_proc=num_proc, force=force, out=out),
        )
        for ref in plan.datasets.values()
    ]
    fetches += [
        (
            (ref.model.key, ref.dataset.key),
            ref.key,
            f"tokenized dataset {ref.name}",
            functools.partial(tokenize_dataset, ref, cache, num_proc=num_proc, force=force, out=out),
        )
        for ref in plan.tokenized.values()
    ]
    entries: list[dict] = []
    failed: dict[str, str] = {}  # key -> why
    for needs, key, name, fetch in fetches:
        if any(need in failed for need in needs):
            failed[key] = f"{name}: not made: its model or dataset was not downloaded"
            continue
        try:
            entries.append(fetch())
        except (DownloadError, CacheMissError) as exc:
            failed[key] = str(exc)
            out(f"  -> not downloaded: {exc}")
    return entries, list(failed.values())
