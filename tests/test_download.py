"""The offline pre-downloader, end to end against a local hub (tests/hub_server.py), no internet.

The download runs as the real command (`python download_models.py ...`) in a subprocess whose
HF_ENDPOINT points at the local server; everything on the "compute node" side runs in a fresh
subprocess after the server is stopped, so any network access would fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hpcfsdp.cache.hub import CacheMissError, lookup_tokenized
from hpcfsdp.cache.plan import DownloadError, Request, build_plan, cache_misses, plan_from_sweep
from hpcfsdp.contracts.names import DatasetRef, ModelRef, TokenizedRef
from hpcfsdp.contracts.sources import model_source
from hpcfsdp.sweep.define.matrix import load_sweep, parse_sweep
from hub_server import HubServer, build_model_folder, chess_dataset_files, chess_games, dataset_files

ROOT = Path(__file__).resolve().parents[1]
MODEL = "acme/tiny-qwen"
DATASET = "acme/tiny-stories"
CHESS = "laion/strategic_game_chess"  # what the `chess` preset names; served locally with a few games
SEQ_LEN = 16
FAKE_TOKEN = "hf_TESTONLYfakeToken_9d1c7e2a5b"  # distinctive: must appear in no file and no output
HF_VARS = (
    "HF_ENDPOINT",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_CACHE",
    "HPCFSDP_CACHE",
)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    env["HF_HOME"] = str(tmp / "hf-home")  # never the user's own hub cache or login
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    folder = build_model_folder(tmp_path_factory.mktemp("repo") / "model", ROOT / "src/hpcfsdp/presets/tiny.json")
    return SimpleNamespace(model_dir=folder, dataset=dataset_files())


def _serve(repos: SimpleNamespace) -> HubServer:
    hub = HubServer().start()
    hub.add_folder("model", MODEL, repos.model_dir)
    hub.add_repo("dataset", DATASET, repos.dataset)
    return hub


@pytest.fixture(scope="module")
def downloaded(repos: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One real download (jobs YAML + flags) with a token in the environment; the server is stopped after."""
    tmp = tmp_path_factory.mktemp("dl")
    cache = tmp / "cache"
    jobs = tmp / "jobs.yaml"
    jobs.write_text(f"name: dl\nbase: {{device: cpu}}\nmatrix:\n  model: [tiny, {MODEL}]\n")
    hub = _serve(repos)
    url = hub.url
    try:
        started = time.monotonic()
        proc = _run(
            [
                "download_models.py",
                str(jobs),
                "--weights",
                "--dataset",
                DATASET,
                "--tokenize-for",
                MODEL,
                "--seq-len",
                str(SEQ_LEN),
                "--cache-dir",
                str(cache),
            ],
            _env(tmp, HF_ENDPOINT=hub.url, HF_TOKEN=FAKE_TOKEN),
        )
        seconds = time.monotonic() - started
    finally:
        hub.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # dead_endpoint: the stopped server's address, where nothing listens any more.
    return SimpleNamespace(
        tmp=tmp,
        cache=cache,
        proc=proc,
        seconds=seconds,
        hub=hub,
        dead_endpoint=url,
        model_sha=hub.repos[("model", MODEL)].sha,
        dataset_sha=hub.repos[("dataset", DATASET)].sha,
        repos=repos,
    )


# -- the download itself -----------------------------------------------------------------------


def test_download_records_revision_and_files(downloaded: SimpleNamespace) -> None:
    manifest = json.loads((downloaded.cache / "manifest.json").read_text())
    items = manifest["items"]
    assert set(items) == {
        f"model:{MODEL}@main",
        f"dataset:{DATASET}:default@train",
        f"tokenized:{DATASET}:default@train|{MODEL}@main|seq_len={SEQ_LEN}",
    }
    model = items[f"model:{MODEL}@main"]
    assert model["sha"] == downloaded.model_sha and model["revision"] == "main" and model["weights"] is True
    names = {f["path"] for f in model["files"]}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names
    for f in model["files"]:
        data = (downloaded.repos.model_dir / f["path"]).read_bytes()
        assert f["size"] == len(data)
        assert f["sha256"] == hashlib.sha256(data).hexdigest()
    dataset = items[f"dataset:{DATASET}:default@train"]
    assert dataset["sha"] == downloaded.dataset_sha and dataset["num_rows"] == 40
    tokenized = items[f"tokenized:{DATASET}:default@train|{MODEL}@main|seq_len={SEQ_LEN}"]
    assert tokenized["tokenizer_sha"] == downloaded.model_sha and tokenized["num_blocks"] > 10
    # The preset cell ("tiny") needed nothing from the hub.
    assert not any("/tiny/" in p for _, p, _ in downloaded.hub.requests)
    # Progress: datasets' own bars; huggingface_hub's, in a log (not a terminal), replaced by a line
    # per file (test_a_download_into_a_log_says_each_file_it_fetched).
    assert "Fetching" not in downloaded.proc.stderr and "Tokenizing" in downloaded.proc.stderr
    assert not list(downloaded.cache.rglob("*.incomplete")) and not list(downloaded.cache.rglob(".*.tmp*"))


def test_token_from_environment_is_used_but_written_nowhere(downloaded: SimpleNamespace) -> None:
    # The clients sent it (read from HF_TOKEN by huggingface_hub) ...
    assert any(h.get("Authorization") == "<present>" for _, _, h in downloaded.hub.requests)
    # ... and it is in no output and no file under the cache (links followed: blobs read once each).
    assert FAKE_TOKEN not in downloaded.proc.stdout and FAKE_TOKEN not in downloaded.proc.stderr
    needle = FAKE_TOKEN.encode()
    checked = 0
    for path in downloaded.cache.rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes(), path
            checked += 1
    assert checked > 15


# -- compute-node side: offline, from the cache only -------------------------------------------

OFFLINE_SCRIPT = r"""
import json, os, sys, time
MODEL, DATASET, SEQ_LEN, SERVED = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
started = time.monotonic()
from hpcfsdp.cache.hub import resolve_cached_model, resolve_dataset_dir, resolve_tokenized
model_item = resolve_cached_model(MODEL, weights=True)
tokenized = resolve_tokenized(DATASET, MODEL, SEQ_LEN)
resolve_seconds = time.monotonic() - started
offline = {v: os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}

import datasets, torch
import huggingface_hub.constants
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

config = AutoConfig.from_pretrained(model_item.path)
tokenizer = AutoTokenizer.from_pretrained(model_item.path)
blocks = datasets.load_from_disk(str(tokenized.path)).with_format("torch")
batch = blocks[:4]["input_ids"].long()
model = AutoModelForCausalLM.from_pretrained(model_item.path, attn_implementation="sdpa")
model.train()
out = model(input_ids=batch, labels=batch)
out.loss.backward()
grad_norm = float(sum(p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5)
served = load_file(os.path.join(SERVED, "model.safetensors"))
name = "model.embed_tokens.weight"
text = datasets.load_from_disk(str(resolve_dataset_dir(DATASET)))[0]["text"]
print(json.dumps({
    "resolve_seconds": resolve_seconds,
    "offline_env": offline,
    "hub_offline_flag": huggingface_hub.constants.HF_HUB_OFFLINE,
    "sha": model_item.sha,
    "provenance": tokenized.provenance(),
    "model_type": config.model_type,
    "batch_shape": list(batch.shape),
    "loss": float(out.loss),
    "grad_norm": grad_norm,
    "weights_equal": bool(torch.equal(model.state_dict()[name], served[name])),
    "first_doc_ids": tokenizer(text)["input_ids"],
    "first_block": blocks[0]["input_ids"].tolist(),
    "eos": tokenizer.eos_token_id,
    "round_trip": tokenizer.decode(tokenizer(text)["input_ids"]) == text,
    "max_id": int(batch.max()), "vocab_size": config.vocab_size,
}))
"""


def test_offline_resolve_load_and_train_step(downloaded: SimpleNamespace) -> None:
    """The strongest proof: server stopped, fresh process, from_pretrained + forward/backward from the cache."""
    env = _env(downloaded.tmp, HPCFSDP_CACHE=str(downloaded.cache), HF_ENDPOINT=downloaded.dead_endpoint)
    proc = _run(["-c", OFFLINE_SCRIPT, MODEL, DATASET, str(SEQ_LEN), str(downloaded.repos.model_dir)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["offline_env"] == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    assert result["hub_offline_flag"] is True
    assert result["resolve_seconds"] < 2
    assert result["sha"] == downloaded.model_sha
    assert result["provenance"]["seq_len"] == SEQ_LEN and result["provenance"]["tokenizer_sha"] == downloaded.model_sha
    assert result["model_type"] == "qwen2" and result["batch_shape"] == [4, SEQ_LEN]
    assert result["max_id"] < result["vocab_size"]
    assert 0 < result["loss"] < 20 and result["grad_norm"] > 0
    assert result["weights_equal"], "from_pretrained did not load the served weights"
    # The blocks are the tokenizer's ids for the documents, in order, each followed by eos.
    ids, block = result["first_doc_ids"], result["first_block"]
    expected = (ids + [result["eos"]])[:SEQ_LEN]
    assert block[: len(expected)] == expected and result["round_trip"]


def test_a_hub_models_positions_bound_seq_len_on_the_compute_node(downloaded: SimpleNamespace, tmp_path: Path) -> None:
    """Plan cannot read a hub model's config (the cache may be elsewhere); the cell reads it offline and
    refuses a seq_len beyond max_position_embeddings (the tiny preset's 4096) with an error record."""
    env = _env(
        downloaded.tmp, HPCFSDP_CACHE=str(downloaded.cache), HF_ENDPOINT=downloaded.dead_endpoint, OMP_NUM_THREADS="1"
    )
    proc = _run(
        [
            "-m",
            "hpcfsdp",
            "run",
            "--results-dir",
            str(tmp_path),
            f"model={MODEL}",
            "seq_len=4097",
            "device=cpu",
            "precision=fp32",
            "steps=2",
            "warmup_steps=1",
        ],
        env,
    )
    assert proc.returncode != 0
    (path,) = tmp_path.glob("manual/cells/*/result.json")
    record = json.loads(path.read_text())
    assert (record["status"], record["stage"]) == ("error", "model")
    assert record["error"] == (
        f"SpecError: model {MODEL}: seq_len: 4097 is beyond the model's max_position_embeddings (4096)"
    )


def test_missing_item_fails_fast_with_one_line_naming_the_command(downloaded: SimpleNamespace) -> None:
    script = r"""
import sys, time
from hpcfsdp.cache.hub import CacheMissError, resolve_cached_model, resolve_tokenized
for call in (lambda: resolve_cached_model("acme/absent-model"),
             lambda: resolve_tokenized("acme/tiny-stories", "acme/tiny-qwen", 32)):
    started = time.monotonic()
    try:
        call()
    except CacheMissError as exc:
        print(f"{time.monotonic() - started:.3f}|{exc}")
    else:
        sys.exit("no error")
"""
    env = _env(downloaded.tmp, HPCFSDP_CACHE=str(downloaded.cache), HF_ENDPOINT=downloaded.dead_endpoint)
    started = time.monotonic()
    proc = _run(["-c", script], env, timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2  # one line per miss
    (t1, model_msg), (t2, tok_msg) = (line.split("|", 1) for line in lines)
    assert float(t1) < 1 and float(t2) < 1
    assert "acme/absent-model" in model_msg and "python download_models.py" in model_msg
    assert f"--cache-dir {downloaded.cache}" in model_msg and "--model acme/absent-model" in model_msg
    assert "--tokenize-for acme/tiny-qwen --seq-len 32" in tok_msg and "--dataset acme/tiny-stories" in tok_msg
    # The same item through the command line: non-zero, named.
    proc = _run(
        ["download_models.py", "--verify", "--model", "acme/absent-model", "--cache-dir", str(downloaded.cache)], env
    )
    assert proc.returncode == 1 and "acme/absent-model" in proc.stdout


def test_verify_catches_corrupted_and_missing_files(downloaded: SimpleNamespace, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(downloaded.cache, cache, symlinks=True)  # the hub cache's links are relative
    env = _env(tmp_path)
    proc = _run(["download_models.py", "--verify", "--cache-dir", str(cache)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 3

    weights = next(cache.glob("hub/models--acme--tiny-qwen/snapshots/*/model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed: only the hash can tell
    weights.write_bytes(bytes(data))
    state = next(cache.glob("tokenized/**/state.json"))
    state.unlink()
    proc = _run(["download_models.py", "--verify", "--cache-dir", str(cache)], env)
    assert proc.returncode == 1
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert any("model.safetensors: corrupted (sha256" in line for line in bad), proc.stdout
    assert any("state.json: missing" in line for line in bad), proc.stdout
    assert any(line.startswith("ok") and "dataset" in line for line in proc.stdout.splitlines())
    # A sweep of presets needs nothing from the hub: nothing to verify.
    jobs = tmp_path / "presets.yaml"
    jobs.write_text("base: {device: cpu}\nmatrix:\n  model: [tiny]\n")
    proc = _run(["download_models.py", "--verify", str(jobs), "--cache-dir", str(cache)], env)
    assert proc.returncode == 0 and "nothing from the hub" in proc.stdout
    # The compute-node resolver notices the missing file too, without hashing.
    proc = _run(
        [
            "-c",
            f"from hpcfsdp.cache.hub import resolve_tokenized; resolve_tokenized('{DATASET}', '{MODEL}', {SEQ_LEN})",
        ],
        _env(tmp_path, HPCFSDP_CACHE=str(cache)),
    )
    assert proc.returncode == 1 and "state.json is missing" in proc.stderr


# -- interruptions, concurrency, errors --------------------------------------------------------


def test_interrupted_downloads_resume(repos: SimpleNamespace, tmp_path: Path) -> None:
    """A killed run keeps its complete files; a dropped connection continues with an HTTP Range request."""
    big = os.urandom(12 * 2**20)  # > huggingface_hub's 10 MiB read chunk, so a partial body gets written
    files = {p.name: p.read_bytes() for p in repos.model_dir.iterdir() if p.suffix == ".json"}
    files["model.safetensors"] = big
    repo = "acme/resume-me"
    cache = tmp_path / "cache"
    args = ["download_models.py", "--cache-dir", str(cache), "--model", repo, "--weights"]
    with HubServer() as hub:
        hub.add_repo("model", repo, files)
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        # 1. Killed while the weights are in flight.
        hub.slow["model.safetensors"] = 30
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while not any(m == "GET" and p.endswith("/model.safetensors") for m, p, _ in hub.requests):
            assert time.monotonic() < deadline and proc.poll() is None, "download never reached the weights"
            time.sleep(0.05)
        small = [name for name in files if name.endswith(".json")]
        snapshots = cache / "hub/models--acme--resume-me/snapshots"
        while not (snapshots.is_dir() and all(any(snapshots.glob(f"*/{name}")) for name in small)):
            assert time.monotonic() < deadline and proc.poll() is None, "small files never completed"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        snapshot = next(snapshots.iterdir())
        assert (snapshot / "config.json").is_file() and not (snapshot / "model.safetensors").exists()
        assert not (cache / "manifest.json").exists()  # nothing recorded for a half-done item
        # 2. Rerun; this time the connection drops after 11 MiB of the weights.
        hub.slow.clear()
        hub.cut_after["model.safetensors"] = 11 * 2**20
        first = len(hub.requests)
        done = _run(args, env)
        again = hub.requests[first:]
    assert done.returncode == 0, done.stdout + done.stderr
    gets = [(p.rsplit("/", 1)[1], h.get("Range")) for m, p, h in again if m == "GET" and "/resolve/" in p]
    assert ("config.json", None) not in gets  # complete files were kept
    assert gets.count(("model.safetensors", None)) == 1
    resumed = [int(r.split("=")[1].rstrip("-")) for name, r in gets if name == "model.safetensors" and r]
    assert resumed and all(0 < start < len(big) for start in resumed), gets  # continued, not restarted
    entry = json.loads((cache / "manifest.json").read_text())["items"][f"model:{repo}@main"]
    weights = next(f for f in entry["files"] if f["path"] == "model.safetensors")
    assert weights["sha256"] == hashlib.sha256(big).hexdigest()


def test_two_downloaders_on_one_cache(repos: SimpleNamespace, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with _serve(repos) as hub:
        hub.delay = 0.2  # file bodies are slow, so the two runs overlap
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        common = [
            "download_models.py",
            "--cache-dir",
            str(cache),
            "--model",
            MODEL,
            "--weights",
            "--dataset",
            DATASET,
            "--tokenize-for",
            MODEL,
            "--seq-len",
            str(SEQ_LEN),
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, *common, *extra],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for extra in ([], ["--seq-len", "8"])
        ]
        outputs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, out + err
        missing = _run(["download_models.py", "--cache-dir", str(cache), "--model", "acme/no-such-model"], env)
    assert missing.returncode == 1
    assert (
        missing.stderr.startswith("error: model acme/no-such-model was not found") and missing.stderr.count("\n") == 2
    )
    items = json.loads((cache / "manifest.json").read_text())["items"]
    assert len(items) == 4  # model, dataset, tokenized at 16 and at 8
    proc = _run(["download_models.py", "--verify", "--cache-dir", str(cache)], _env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    leftovers = [p for p in cache.rglob("*") if ".tmp" in p.name or ".old-" in p.name or p.name.endswith(".incomplete")]
    assert not leftovers, leftovers


def test_download_rejects_a_file_that_does_not_match_the_hub(repos: SimpleNamespace, tmp_path: Path) -> None:
    config = (repos.model_dir / "config.json").read_bytes()
    with _serve(repos) as hub:
        hub.tamper["config.json"] = config.replace(b'"qwen2"', b'"QWEN2"')  # same size, other bytes
        proc = _run(
            ["download_models.py", "--cache-dir", str(tmp_path / "cache"), "--model", MODEL],
            _env(tmp_path, HF_ENDPOINT=hub.url),
        )
    assert proc.returncode == 1
    assert "config.json does not match the hub's hash" in proc.stderr and "--force" in proc.stderr
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_chess_preset_tokenizes_its_list_of_moves(repos: SimpleNamespace, tmp_path: Path) -> None:
    """`data: chess` in a jobs YAML, and --dataset chess without --text-column, tokenize the preset's
    `Moves` (a list of strings, joined by spaces); another --text-column is a separate item."""
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"name: chess\nbase: {{device: cpu, model: {MODEL}, data: chess, seq_len: {SEQ_LEN}}}\n")
    with _serve(repos) as hub:
        hub.add_repo("dataset", CHESS, chess_dataset_files())
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        first = _run(
            [
                "download_models.py",
                str(jobs),
                "--dataset",
                "chess",
                "--tokenize-for",
                MODEL,
                "--seq-len",
                "8",
                "--cache-dir",
                str(cache),
            ],
            env,
        )
        second = _run(
            [
                "download_models.py",
                "--dataset",
                "chess",
                "--tokenize-for",
                MODEL,
                "--seq-len",
                str(SEQ_LEN),
                "--text-column",
                "Result",
                "--cache-dir",
                str(cache),
            ],
            env,
        )
    for proc in (first, second):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    prefix = f"tokenized:{CHESS}:default@train|{MODEL}@main"
    items = json.loads((cache / "manifest.json").read_text())["items"]
    moves, short, results = (
        items[f"{prefix}|seq_len={n}|text_column={column}"]
        for n, column in ((SEQ_LEN, "Moves"), (8, "Moves"), (SEQ_LEN, "Result"))
    )
    assert (moves["text_column"], short["text_column"], results["text_column"]) == ("Moves", "Moves", "Result")
    assert len({moves["path"], short["path"], results["path"]}) == 3  # neither overwrote the other

    tokenizer = AutoTokenizer.from_pretrained(repos.model_dir)
    games = chess_games()
    for entry, texts in ((moves, [" ".join(g["Moves"]) for g in games]), (results, [g["Result"] for g in games])):
        flat = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
        assert _blocks(cache / entry["path"])[:3] == [flat[i : i + SEQ_LEN] for i in range(0, 3 * SEQ_LEN, SEQ_LEN)]

    # What a compute node reads for `data: chess`: the Moves item, or with `text_column: Result` that
    # one (which plan finds in the cache); a missing one names the command.
    assert lookup_tokenized("chess", MODEL, SEQ_LEN, cache).path == cache / moves["path"]
    assert lookup_tokenized("chess", MODEL, SEQ_LEN, cache, text_column="Result").path == cache / results["path"]
    jobs.write_text(
        f"name: chess\nbase: {{device: cpu, model: {MODEL}, data: chess, seq_len: {SEQ_LEN}, text_column: Result}}\n"
    )
    assert cache_misses(load_sweep(jobs), str(cache)) == []
    jobs.write_text(
        f"name: chess\nbase: {{device: cpu, model: {MODEL}, data: chess, seq_len: 8, text_column: Result}}\n"
    )
    (miss, command) = cache_misses(load_sweep(jobs), str(cache))
    assert miss.startswith(f"{jobs}:2: tokenized dataset ") and "--seq-len" not in miss, miss
    assert (
        command
        == f"on a machine with internet, `python download_models.py {jobs} --cache-dir {cache}` fetches all of them"
    )
    with pytest.raises(CacheMissError, match=rf"column Moves' is not in the cache .* --dataset {CHESS}:default@train "):
        lookup_tokenized("chess", MODEL, 32, cache)


def _blocks(folder: Path) -> list[list[int]]:
    import datasets

    return datasets.load_from_disk(str(folder))["input_ids"]


def _closed_port() -> int:
    """A local port where nothing listens (bound for a moment, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_hub_fails_in_one_line_naming_the_item(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = _env(tmp_path, HF_ENDPOINT=endpoint)
    for kind, name, item in (("dataset", DATASET, f"{DATASET}:default@train"), ("model", MODEL, MODEL)):
        proc = _run(["download_models.py", f"--{kind}", name, "--cache-dir", str(tmp_path / "cache")], env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.splitlines() == [
            f"error: {kind} {item} could not be fetched: the hub at {endpoint} is not reachable from here",
            f"error: 1 of 1 item(s) not downloaded: {what_to_do(endpoint)}",
        ]


def what_to_do(endpoint: str) -> str:
    return (
        f"run the same command where the hub at {endpoint} answers (a login node with internet), or set HF_ENDPOINT "
        "to a mirror that does; run again, it resumes (what is cached stays, partial files go on where they stopped)"
    )


def test_with_the_hub_stopped_download_lists_every_item_tries_each_and_says_what_to_do(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        f"name: dl\nbase: {{device: cpu, seq_len: {SEQ_LEN}}}\nmatrix:\n  model: [{MODEL}]\n  data: [{DATASET}]\n"
    )
    proc = _run(
        ["download_models.py", str(jobs), "--cache-dir", str(tmp_path / "cache")], _env(tmp_path, HF_ENDPOINT=endpoint)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    listed = proc.stdout[proc.stdout.index("needs ") :].splitlines()[:4]
    assert listed == [
        "needs 3 item(s), 3 of them not in the cache:",
        f"  model     {MODEL}  missing",
        f"  dataset   {DATASET}:default@train  missing",
        f"  tokenized {DATASET}:default@train tokenized for {MODEL}, seq_len {SEQ_LEN}  missing",
    ]
    unreachable = f"could not be fetched: the hub at {endpoint} is not reachable from here"
    assert proc.stderr.splitlines() == [
        f"error: model {MODEL} {unreachable}",  # the first failure, and then the next item all the same
        f"error: dataset {DATASET}:default@train {unreachable}",
        f"error: tokenized dataset {DATASET}:default@train tokenized for {MODEL}, seq_len {SEQ_LEN}: not made: "
        "its model or dataset was not downloaded",
        f"error: 3 of 3 item(s) not downloaded: {what_to_do(endpoint)}",
    ]


def test_one_item_the_hub_lacks_does_not_stop_the_others_which_a_rerun_lists_as_cached(
    repos: SimpleNamespace, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    args = ["download_models.py", "--model", "acme/not-there", "--model", MODEL, "--cache-dir", str(cache)]
    with _serve(repos) as hub:
        proc = _run(args, _env(tmp_path, HF_ENDPOINT=hub.url))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "needs 2 item(s), 2 of them not in the cache:" in proc.stdout
        assert proc.stderr.splitlines()[0].startswith("error: model acme/not-there was not found on the hub")
        assert proc.stderr.splitlines()[1] == f"error: 1 of 2 item(s) not downloaded: {what_to_do(hub.url)}"
        manifest = json.loads((cache / "manifest.json").read_text())
        assert [entry["item"] for entry in manifest["items"].values()] == [MODEL]  # fetched all the same
        again = _run([args[0], *args[3:]], _env(tmp_path, HF_ENDPOINT=hub.url))  # the one the hub has
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"needs 1 item(s), 0 of them not in the cache:\n  model     {MODEL}  cached" in again.stdout


def test_verify_a_sweep_checks_weights_and_finds_a_model_by_commit_sha(repos: SimpleNamespace, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with _serve(repos) as hub:
        proc = _run(
            ["download_models.py", "--model", MODEL, "--cache-dir", str(cache)], _env(tmp_path, HF_ENDPOINT=hub.url)
        )
        sha = hub.repos[("model", MODEL)].sha
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def verify(init: str, model: str) -> subprocess.CompletedProcess:
        jobs = tmp_path / f"{init}.yaml"
        jobs.write_text(f"name: v\nbase: {{device: cpu, model: '{model}', init: {init}}}\n")
        return _run(["download_models.py", "--verify", str(jobs), "--cache-dir", str(cache)], _env(tmp_path))

    by_sha = verify("random", f"{MODEL}@{sha}")
    assert by_sha.returncode == 0, by_sha.stdout + by_sha.stderr
    assert by_sha.stdout.startswith(f"ok       model {MODEL} (")
    pretrained = verify("pretrained", MODEL)
    assert pretrained.returncode == 1
    assert (
        f"BAD      model {MODEL}: cached without weights, which init: pretrained needs; "
        f"run python download_models.py --cache-dir {cache} --model {MODEL} --weights\n"
    ) in pretrained.stdout


# -- names and plans (no network, no subprocess) -----------------------------------------------


def test_names_presets_and_plans() -> None:
    assert ModelRef.parse("Qwen/Qwen2.5-1.5B") == ModelRef("Qwen/Qwen2.5-1.5B", "main")
    assert ModelRef.parse("Qwen/Qwen2.5-1.5B@v1.0").key == "model:Qwen/Qwen2.5-1.5B@v1.0"
    assert DatasetRef.parse("tinystories") == DatasetRef("roneneldan/TinyStories", "default", "train")
    assert DatasetRef.parse("chess@train").repo_id == "laion/strategic_game_chess"
    ref = DatasetRef.parse("org/set:en@validation[:1000]")
    assert (ref.config, ref.split, ref.load_config) == ("en", "validation[:1000]", "en")
    assert "[" not in ref.relpath and ":" not in ref.relpath
    for bad in ("noslash", "a/b/c", "org/name@"):
        with pytest.raises(ValueError):
            ModelRef.parse(bad)
    with pytest.raises(ValueError):
        DatasetRef.parse("org/name@")
    assert [model_source(m).kind for m in ("tiny", "qwen2.5-1.5b", "org/model")] == ["preset", "preset", "hub"]

    sweep = parse_sweep({"base": {"device": "cpu"}, "matrix": {"model": ["tiny", "org/a", "org/b@dev"]}})
    plan = plan_from_sweep(sweep)
    assert list(plan.models) == ["model:org/a@main", "model:org/b@dev"]
    assert not any(weights for _, weights in plan.models.values())
    plan = build_plan(
        Request(
            models=("org/c",), datasets=("tinystories",), weights=True, tokenize_for=("org/c",), seq_lens=(128, 256)
        )
    )
    assert plan.models["model:org/c@main"][1] is True
    assert {t.seq_len for t in plan.tokenized.values()} == {128, 256}
    assert isinstance(next(iter(plan.tokenized.values())), TokenizedRef)
    with pytest.raises(DownloadError, match="go together"):
        build_plan(Request(datasets=("tinystories",), tokenize_for=("org/c",)))
    with pytest.raises(DownloadError, match="presets have no tokenizer"):
        build_plan(Request(datasets=("tinystories",), tokenize_for=("tiny",), seq_lens=(8,)))


def test_text_column_is_part_of_a_tokenized_item_unless_it_is_text() -> None:
    model = ModelRef.parse("org/m")
    stories = TokenizedRef(DatasetRef.parse("tinystories"), model, 8)
    assert stories.text_column == "text"
    assert stories.key == "tokenized:roneneldan/TinyStories:default@train|org/m@main|seq_len=8"  # as before columns
    assert stories.relpath.endswith("/org--m/seq8")
    chess = TokenizedRef(DatasetRef.parse("chess"), model, 8)
    assert chess == TokenizedRef(DatasetRef.parse("laion/strategic_game_chess"), model, 8, "Moves")
    assert chess.key.endswith("|seq_len=8|text_column=Moves") and chess.relpath.endswith("/seq8-Moves")
    assert chess.name.endswith("seq_len 8, column Moves")

    def columns(text_column: str | None) -> set[str]:
        plan = build_plan(Request(datasets=("chess", "org/d"), tokenize_for=("org/m",), seq_lens=(8,)), text_column)
        return {f"{ref.dataset.repo_id}:{ref.text_column}" for ref in plan.tokenized.values()}

    # Without --text-column each dataset keeps its own column; with it, every --dataset uses that one.
    assert columns(None) == {"laion/strategic_game_chess:Moves", "org/d:text"}
    assert columns("text") == {"laion/strategic_game_chess:text", "org/d:text"}
    assert columns("Result") == {"laion/strategic_game_chess:Result", "org/d:Result"}
    with pytest.raises(DownloadError, match="--text-column Moves applies to the --dataset items"):
        build_plan(Request(datasets=("chess",)), "Moves")


def test_a_download_into_a_log_says_each_file_it_fetched(downloaded: SimpleNamespace) -> None:
    """stdout and stderr are files here, not a terminal, so huggingface_hub draws no bars: one line per file."""
    out = downloaded.proc.stdout
    counted = [line.strip() for line in out.splitlines() if line.strip().startswith("file ")]
    (fetched,) = re.findall(rf"-> {MODEL} at \w+ \((\d+) files\)", out)
    assert counted == [f"file {n}/{fetched}" for n in range(1, int(fetched) + 1)], out
    assert "\r" not in out and "Fetching" not in downloaded.proc.stderr  # no bar of huggingface_hub's


def test_config_only_fetches_one_file_in_a_second_and_plan_memory_predicts_from_it(
    repos: SimpleNamespace, tmp_path: Path
) -> None:
    """Issue 54, item 3: review before download. `download --config-only` fetches the model's
    config.json alone; `plan --memory` then predicts the hub model that is not downloaded."""
    cache = tmp_path / "cache"
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        f"name: review\nbase: {{model: {MODEL}, gpus_per_node: 2, strategy: fsdp2_zero3}}\n"
        f"slurm: {{gpu_memory_gib: 80, cache_dir: {cache}}}\n"
    )
    env = _env(tmp_path)
    before = _run(["-m", "hpcfsdp", "plan", str(jobs), "--memory"], env)
    assert "1 cell(s) not predicted, so not known to fit: model" in before.stdout, before.stdout + before.stderr
    assert "predicted not to fit" not in before.stdout and "--model acme/tiny-qwen --config-only" in before.stdout
    hub = _serve(repos)
    url = hub.url
    try:
        started = time.monotonic()
        proc = _run(["download_models.py", str(jobs), "--config-only"], _env(tmp_path, HF_ENDPOINT=url))
        seconds = time.monotonic() - started
    finally:
        hub.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fetched = [path for path in hub.paths_requested("GET") if "/resolve/" in path]
    assert [path.rsplit("/", 1)[-1] for path in fetched] == ["config.json"] and seconds < 30
    after = _run(["-m", "hpcfsdp", "plan", str(jobs), "--memory"], _env(tmp_path, HF_ENDPOINT=url))  # hub stopped
    assert after.returncode == 2  # the model itself is still not downloaded: plan says so
    row = next(line for line in after.stdout.splitlines() if line.startswith("fsdp2_zero3-"))
    assert row.split()[-1] != "-" and "its config.json alone" in row, after.stdout
    assert "0 cell(s) predicted not to fit" in after.stdout and "not predicted" not in after.stdout
