"""A download cache filled by the real downloader from the local hub (hub_server.py), and the
compute-node view of it (offline), for tests of what `hpcfsdp run` reads from the cache."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT
from hpcfsdp.sweep.launch.environment import OFFLINE_ENV
from hub_server import HubServer, build_model_folder, dataset_files
from test_download import DATASET, FAKE_TOKEN, MODEL, _env, _run

PRESET = ROOT / "src/hpcfsdp/presets/tiny.json"

__all__ = ["DATASET", "FAKE_TOKEN", "MODEL", "PRESET", "build_model_folder", "download", "offline"]


def download(tmp: Path, *args: str, weights: bool = False) -> SimpleNamespace:
    """Serve MODEL (tiny qwen2 + tokenizer[, weights]) and DATASET, run `download_models.py ARGS`
    into tmp/cache, stop the server. Returns cache, the served model folder and shas, and the
    stopped server's address (where any network access now fails)."""
    repo = build_model_folder(tmp / "repo", PRESET, weights=weights)
    with HubServer() as hub:
        hub.add_folder("model", MODEL, repo)
        hub.add_repo("dataset", DATASET, dataset_files())
        proc = _run(["download_models.py", *args, "--cache-dir", str(tmp / "cache")], _env(tmp, HF_ENDPOINT=hub.url))
        endpoint = hub.url
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return SimpleNamespace(
        cache=tmp / "cache",
        repo=repo,
        endpoint=endpoint,
        model_sha=hub.repos[("model", MODEL)].sha,
        dataset_sha=hub.repos[("dataset", DATASET)].sha,
    )


def offline(monkeypatch: pytest.MonkeyPatch, cached: SimpleNamespace) -> None:
    """Point this process at the cache, with the hub unreachable; what hubcache's resolvers switch
    offline (environment and library flags) is restored after the test."""
    monkeypatch.setenv("HPCFSDP_CACHE", str(cached.cache))
    monkeypatch.setenv("HF_ENDPOINT", cached.endpoint)
    for var, value in OFFLINE_ENV.items():
        monkeypatch.setenv(var, value)
    for module, flags in (
        ("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
    ):
        if module in sys.modules:
            for flag in flags:
                monkeypatch.setattr(sys.modules[module], flag, True)
