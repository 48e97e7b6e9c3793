"""Data sources: local text files, a save_to_disk folder, a pre-tokenised cache item; packing,
rank sharding, determinism; and 2-process cells that train on a local folder, and offline on a hub
model and hub data from the download cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run_torchrun_cell
from hpcfsdp.cache.hub import CacheMissError, lookup_dataset, lookup_model
from hpcfsdp.cell.data import open_data, pack, rank_indices, training_batches
from hpcfsdp.cli import main
from hpcfsdp.contracts.fields import SpecError
from hpcfsdp.contracts.sources import data_source, model_source
from hpcfsdp.contracts.spec import RunSpec
from tinyhub import DATASET, FAKE_TOKEN, MODEL, PRESET, build_model_folder, download, offline

SEQ_LEN = 16
STORIES = [f"Story {i}: the cat and the dog played in the garden until the sun went down." for i in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 config with a byte-level BPE tokenizer (no weights needed for random init)."""
    return build_model_folder(tmp_path_factory.mktemp("model") / "tiny", PRESET, weights=False)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The same 12 documents as .txt (one file each), .json (a list) and .jsonl, in file-name order."""
    folder = tmp_path_factory.mktemp("text") / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(STORIES[0])
    (folder / "b.json").write_text(json.dumps([{"text": s} for s in STORIES[1:4]]))
    (folder / "c.jsonl").write_text(
        "".join(json.dumps({"text": s, "id": i}) + "\n\n" for i, s in enumerate(STORIES[4:10]))
    )
    (folder / "sub" / "d.txt").write_text(STORIES[10])
    (folder / "sub" / "e.json").write_text(json.dumps({"text": STORIES[11]}))
    (folder / ".hidden.txt").write_text("never read")
    (folder / "notes.csv").write_text("never,read")
    return SimpleNamespace(path=folder, documents=STORIES)


def _expected_blocks(model_dir: Path, documents: list[str]) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    flat = [t for doc in documents for t in tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]]
    count = len(flat) // SEQ_LEN
    return torch.tensor(flat[: count * SEQ_LEN]).view(count, SEQ_LEN)


def test_text_column_names_the_field_documents_are_in(model_dir: Path, tmp_path: Path) -> None:
    """text_column: another field of .jsonl rows (a list of strings joined by spaces) or of a saved dataset."""
    import datasets

    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "x.jsonl").write_text("".join(json.dumps({"body": s.split(" ", 1)}) + "\n" for s in STORIES))
    datasets.Dataset.from_dict({"body": STORIES}).save_to_disk(str(tmp_path / "saved"))
    expected = _expected_blocks(model_dir, STORIES)
    for data in ("rows", "saved"):
        blocks = open_data(data_source(str(tmp_path / data)), model_source(str(model_dir)), SEQ_LEN, text_column="body")
        assert (
            torch.equal(blocks.read(list(range(blocks.count))), expected) and blocks.provenance["text_column"] == "body"
        )
    with pytest.raises(ValueError, match="saved: no 'text' column \\(columns: body\\); set text_column"):
        open_data(data_source(str(tmp_path / "saved")), model_source(str(model_dir)), SEQ_LEN)


def test_text_folder_is_tokenised_and_packed(model_dir: Path, text_folder: SimpleNamespace) -> None:
    blocks = open_data(data_source(str(text_folder.path)), model_source(str(model_dir)), SEQ_LEN)
    expected = _expected_blocks(model_dir, text_folder.documents)
    assert blocks.count == len(expected) > 10
    assert torch.equal(blocks.read(list(range(blocks.count))), expected)
    p = blocks.provenance
    assert (p["kind"], p["path"], p["files"], p["documents"]) == ("text_files", str(text_folder.path), 5, 12)
    assert p["blocks"] == blocks.count and p["tokens"] == blocks.count * SEQ_LEN and p["eos_appended"]
    assert p["tokenizer"] == {"kind": "local", "path": str(model_dir)}


def test_saved_dataset_gives_the_same_blocks(model_dir: Path, text_folder: SimpleNamespace, tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": text_folder.documents}).save_to_disk(str(tmp_path / "saved"))
    blocks = open_data(data_source(str(tmp_path / "saved")), model_source(str(model_dir)), SEQ_LEN)
    assert blocks.provenance["kind"] == "saved_dataset" and blocks.provenance["documents"] == 12
    assert torch.equal(blocks.read(list(range(blocks.count))), _expected_blocks(model_dir, text_folder.documents))


def test_ranks_draw_disjoint_blocks_deterministically_and_cycle(model_dir: Path, text_folder: SimpleNamespace) -> None:
    blocks = open_data(data_source(str(text_folder.path)), model_source(str(model_dir)), SEQ_LEN)
    per_rank = blocks.count // 2

    def take(seed: int, rank: int, n: int) -> list[int]:
        order = rank_indices(blocks.count, seed, rank, world_size=2)
        return [next(order) for _ in range(n)]

    rank0, rank1 = take(0, 0, per_rank), take(0, 1, per_rank)
    assert not set(rank0) & set(rank1) and len(set(rank0)) == len(set(rank1)) == per_rank
    assert take(0, 0, 3 * per_rank) == take(0, 0, 3 * per_rank)  # deterministic for (seed, rank), across epochs
    assert take(0, 0, 3 * per_rank)[:per_rank] == rank0
    assert take(1, 0, per_rank) != rank0  # the seed decides the order
    assert take(0, 0, 2 * per_rank)[per_rank:] != rank0  # each epoch is shuffled again

    batches = training_batches(blocks, 512, 3, SEQ_LEN, seed=0, rank=1, world_size=2, device=torch.device("cpu"))
    first = [next(batches) for _ in range(per_rank)]  # cycles past the end of an epoch
    assert all(b.shape == (3, SEQ_LEN) and b.dtype == torch.long for b in first)
    assert torch.equal(first[0], blocks.read(rank1[:3]))
    with pytest.raises(ValueError, match="out of range for the model's vocab_size 100"):
        next(training_batches(blocks, 100, 3, SEQ_LEN, 0, 0, 2, torch.device("cpu")))


def test_bad_rows_and_plan_time_checks(model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: expected a JSON object with a 'text' field of text"):
        open_data(data_source(str(bad)), model_source(str(model_dir)), SEQ_LEN)
    with pytest.raises(SpecError, match="text_column: synthetic data has no documents"):
        RunSpec.from_dict({"text_column": "body"})
    with pytest.raises(SpecError, match=r"tokenizer: data .* needs one, and model 'tiny' is a preset"):
        RunSpec.from_dict({"data": str(bad)})
    with pytest.raises(SpecError, match=r"data: no such file or folder: \./no/such/corpus"):
        RunSpec.from_dict({"data": "./no/such/corpus", "tokenizer": str(model_dir)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"data: .*/empty: expected .txt/.json/.jsonl files"):
        RunSpec.from_dict({"data": str(tmp_path / "empty"), "model": str(model_dir)})
    with pytest.raises(SpecError, match="hub data 'tinystories' is read pre-tokenised from the cache"):
        RunSpec.from_dict({"data": "tinystories", "model": str(model_dir)})
    _, sources = RunSpec.resolved({"data": "tinystories", "model": "tiny", "tokenizer": "acme/tok"})
    assert sources.tokenizer is not None and sources.tokenizer.model_ref.name == "acme/tok"


def test_the_shipped_tiny_tokenizer_lets_a_preset_model_train_on_a_text_folder(
    text_folder: SimpleNamespace, tmp_path: Path
) -> None:
    """`tokenizer: tiny`: the package's own small tokenizer (no download, no model folder), whose
    ids fit the tiny preset's vocabulary; its EOS ends each document."""
    _, sources = RunSpec.resolved({"model": "tiny", "tokenizer": "tiny", "data": str(text_folder.path)})
    assert sources.tokenizer is not None and sources.tokenizer.kind == "local"
    assert Path(sources.tokenizer.path, "tokenizer.json").stat().st_size < 20_000  # a few KB, in the package
    blocks = open_data(sources.data, sources.tokenizer, SEQ_LEN)
    ids = blocks.read(list(range(blocks.count)))
    assert blocks.provenance["eos_appended"] and int(ids.min()) >= 0 and int(ids.max()) < 512
    record = run_torchrun_cell(
        tmp_path, 2, strategy="ddp", model="tiny", tokenizer="tiny", data=str(text_folder.path),
        seq_len=SEQ_LEN, batch_size=2, steps=3, comm_profile_steps=0,
    )  # fmt: skip
    assert record["status"] == "ok", record.get("error")
    assert record["data_source"]["tokenizer"]["path"] == sources.tokenizer.path and 0 < record["losses"][0] < 10


@pytest.fixture(scope="module")
def tokenized_cache(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The real downloader, against the local hub: a dataset split tokenized for a model (no weights)."""
    return download(
        tmp_path_factory.mktemp("dl"),
        "--model",
        MODEL,
        "--dataset",
        DATASET,
        "--tokenize-for",
        MODEL,
        "--seq-len",
        str(SEQ_LEN),
    )


def test_cached_tokenized_dataset(tokenized_cache: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    offline(monkeypatch, tokenized_cache)
    blocks = open_data(data_source(DATASET), model_source(MODEL), SEQ_LEN)
    manifest = json.loads((tokenized_cache.cache / "manifest.json").read_text())
    entry = manifest["items"][f"tokenized:{DATASET}:default@train|{MODEL}@main|seq_len={SEQ_LEN}"]
    p = blocks.provenance
    assert (
        p["kind"] == "hub" and p["sha"] == tokenized_cache.dataset_sha and p["tokenizer_sha"] == entry["tokenizer_sha"]
    )
    assert blocks.count == p["blocks"] == entry["num_blocks"] > 10 and p["seq_len"] == SEQ_LEN
    batch = next(training_batches(blocks, 512, 4, SEQ_LEN, seed=0, rank=0, world_size=2, device=torch.device("cpu")))
    assert batch.shape == (4, SEQ_LEN) and batch.dtype == torch.long
    # The downloader packs as a text folder is packed: the same documents give the same blocks.
    import datasets
    from transformers import AutoTokenizer

    texts = list(datasets.load_from_disk(str(lookup_dataset(DATASET).path))["text"])
    tokenizer = AutoTokenizer.from_pretrained(lookup_model(MODEL).path)
    expected = pack(tokenizer(texts)["input_ids"], SEQ_LEN, tokenizer.eos_token_id)
    assert torch.equal(blocks.read(list(range(blocks.count))), expected)
    started = time.monotonic()
    with pytest.raises(CacheMissError, match="--tokenize-for acme/tiny-qwen --seq-len 32"):
        open_data(data_source(DATASET), model_source(MODEL), 32)
    assert time.monotonic() - started < 5


def test_two_process_cell_trains_on_a_text_folder(
    model_dir: Path, text_folder: SimpleNamespace, tmp_path: Path
) -> None:
    record = run_torchrun_cell(
        tmp_path,
        2,
        strategy="fsdp2_zero3",
        model=str(model_dir),
        data=str(text_folder.path),
        seq_len=SEQ_LEN,
        batch_size=2,
        steps=3,
        comm_profile_steps=0,
    )
    assert record["status"] == "ok", record.get("error")
    source = record["data_source"]
    assert source["kind"] == "text_files" and source["path"] == str(text_folder.path) and source["documents"] == 12
    assert record["model_source"] == {"kind": "local", "path": str(model_dir)}
    assert record["spec"]["data"] == str(text_folder.path) and 0 < record["losses"][0] < 10


def test_two_process_cell_trains_offline_from_the_cache(
    tokenized_cache: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compute-node case: downloaded through the real downloader, hub stopped, network switched
    off; a token in the environment (as a login shell may export) ends up in no written file."""
    offline(monkeypatch, tokenized_cache)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # not the user's own hub cache
    record = run_torchrun_cell(
        tmp_path,
        2,
        strategy="fsdp2_zero3",
        model=MODEL,
        data=DATASET,
        seq_len=SEQ_LEN,
        batch_size=2,
        steps=3,
        comm_profile_steps=0,
    )
    assert record["status"] == "ok", record.get("error")
    model, data = record["model_source"], record["data_source"]
    assert (model["kind"], model["item"], model["sha"]) == ("hub", MODEL, tokenized_cache.model_sha)
    assert Path(model["path"]).is_relative_to(tokenized_cache.cache)
    assert (data["kind"], data["sha"], data["tokenizer_sha"]) == (
        "hub",
        tokenized_cache.dataset_sha,
        tokenized_cache.model_sha,
    )
    assert data["seq_len"] == SEQ_LEN and Path(data["path"]).is_relative_to(tokenized_cache.cache)
    assert len(record["losses"]) == 3 and 0 < record["losses"][0] < 20
    written = [p for p in (tmp_path / "results").rglob("*") if p.is_file()] + [tokenized_cache.cache / "manifest.json"]
    assert any(p.name == "result.json" for p in written)
    assert not [p for p in written if FAKE_TOKEN.encode() in p.read_bytes()]


def test_plan_refuses_a_jsonl_folder_whose_first_record_lacks_the_text_column_in_one_line(tmp_path, capsys) -> None:
    """Issue 54, item 4: a local jsonl folder without the configured column fails at plan, naming the
    file and the column, not on the node after an allocation."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('\n{"body": "a document", "id": 1}\n')
    (corpus / "b.jsonl").write_text('{"text": "the text field, in a later file"}\n')
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"name: col\nbase: {{model: tiny, tokenizer: tiny, data: {corpus}, device: cpu}}\n")
    assert main(["plan", str(jobs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {jobs}:2")
    assert f"data: {corpus / 'a.jsonl'}:2: the first record has no 'text' field of text (it has: body, id)" in err
    jobs.write_text(f"name: col\nbase: {{model: tiny, tokenizer: tiny, data: {corpus}, text_column: body}}\n")
    assert main(["plan", str(jobs)]) == 0
    capsys.readouterr()
    jobs.write_text(f"name: col\nbase: {{model: tiny, tokenizer: tiny, data: {corpus}, text_column: title}}\n")
    assert main(["plan", str(jobs)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "text_column: " in err and "has no 'title' field" in err
