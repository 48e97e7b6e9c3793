"""Training batches. Each rank draws different samples; the same (seed, rank) gives the same data.

Sources: `synthetic` (uniform random ids), a local folder of .txt/.json/.jsonl files or one saved
with datasets' save_to_disk (tokenised here, once per cell, by every rank on its own: no
collective, no shared scratch files; meant for small corpora), or a hub dataset read
pre-tokenised from the download cache (memory-mapped, not loaded whole). Text is packed as the
downloader packs it: each document's ids, then EOS, concatenated and cut into seq_len blocks.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ..cache.hub import resolve_tokenized
from ..cache.tokenize import document_text, packed_blocks
from ..contracts.sources import Source, is_saved_dataset, text_files
from .models import resolve_model

TEXT_FIELD = "text"  # where documents are unless RunSpec.text_column names another field
TOKENIZE_CHUNK = 1000  # documents per tokenizer call


@dataclass(frozen=True)
class TokenBlocks:
    """`count` training samples of seq_len token ids, read by index, and where they came from."""

    count: int
    read: Callable[[list[int]], torch.Tensor]  # block indices -> LongTensor [len(indices), seq_len]
    provenance: dict[str, Any]


def open_data(data: Source, tokenizer: Source | None, seq_len: int, text_column: str = "") -> TokenBlocks | None:
    """Resolved data -> its token blocks (None for synthetic); `tokenizer` is Sources.tokenizer,
    `text_column` RunSpec.text_column ("": a hub preset's own column, else `text`)."""
    if data.kind == "synthetic":
        return None
    if tokenizer is None:
        raise ValueError(f"data: {data.given!r} needs a tokenizer, and the model has none")
    if data.kind == "hub":
        return _cached_blocks(data, tokenizer, seq_len, text_column or None)
    path = Path(data.path).resolve()
    column = text_column or TEXT_FIELD
    if is_saved_dataset(path):
        source: dict[str, Any] = {"kind": "saved_dataset", "path": str(path)}
        documents = _saved_dataset_texts(path, column)
    else:
        files = sorted(text_files(path))
        documents = [text for f in files for text in read_documents(f, column)]
        source = {"kind": "text_files", "path": str(path), "files": len(files)}
    return _packed_blocks(documents, tokenizer, seq_len, {**source, "text_column": column})


def training_batches(
    blocks: TokenBlocks | None,
    vocab_size: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> Iterator[torch.Tensor]:
    """LongTensor [batch_size, seq_len] on `device`, forever."""
    if blocks is None:
        yield from synthetic_batches(vocab_size, batch_size, seq_len, seed, rank, device)
        return
    order = rank_indices(blocks.count, seed, rank, world_size)
    while True:
        tokens = blocks.read(list(itertools.islice(order, batch_size)))
        if int(tokens.max()) >= vocab_size:
            raise ValueError(
                f"data: token id {int(tokens.max())} is out of range for the model's vocab_size "
                f"{vocab_size}; the tokenizer does not belong to this model"
            )
        yield to_device(tokens, device)


def synthetic_batches(
    vocab_size: int, batch_size: int, seq_len: int, seed: int, rank: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """Uniform random token ids, as the reference benchmarks use: no tokenizer, no I/O."""
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    while True:
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
        yield to_device(tokens, device)


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a batch to the GPU without making the host wait: from pageable memory a copy is
    synchronous whatever non_blocking says, and the GPU then idles while the host has not yet
    launched the next step's first kernels. Pinned, it is queued like a kernel (the pinned block is
    not reused before the copy has run)."""
    if device.type != "cuda":
        return tokens.to(device)
    return tokens.pin_memory().to(device, non_blocking=True)


def rank_indices(count: int, seed: int, rank: int, world_size: int) -> Iterator[int]:
    """Block indices for one rank, cycling forever. Each epoch is a permutation of all blocks seeded
    by (seed, epoch), the same on every rank; rank r takes positions r, r + W, r + 2W, ..., so ranks
    see disjoint blocks within an epoch. The count % W blocks left over are skipped that epoch."""
    per_rank = count // world_size
    if per_rank == 0:
        raise ValueError(
            f"data: {count} blocks are fewer than the {world_size} ranks; use more data or a smaller seq_len"
        )
    for epoch in itertools.count():
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        yield from order[rank : per_rank * world_size : world_size].tolist()


def read_documents(path: Path, column: str = TEXT_FIELD) -> Iterator[str]:
    """A .txt file is one document; .jsonl one object per line; .json an object or a list of them,
    each with its document in `column`."""
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield _text_of(json.loads(line), column, f"{path}:{number}")
    else:
        value = json.loads(path.read_text(encoding="utf-8"))
        for index, row in enumerate(value if isinstance(value, list) else [value]):
            yield _text_of(row, column, f"{path}[{index}]" if isinstance(value, list) else str(path))


def pack(documents: Iterable[list[int]], seq_len: int, eos: int | None) -> torch.Tensor:
    """packed_blocks as a LongTensor [blocks, seq_len]."""
    return torch.tensor(list(packed_blocks(documents, seq_len, eos)), dtype=torch.long).reshape(-1, seq_len)


def _text_of(row: Any, column: str, where: str) -> str:
    value = row.get(column) if isinstance(row, dict) else None
    if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
        raise ValueError(
            f"data: {where}: expected a JSON object with a '{column}' field of text (or a list of strings)"
        )
    return document_text(value)


def _saved_dataset_texts(path: Path, column: str) -> list[str]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"data: {path}: a saved DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    if column not in loaded.column_names:
        raise ValueError(
            f"data: {path}: no '{column}' column (columns: {', '.join(loaded.column_names)}); set text_column"
        )
    return [document_text(value) for value in loaded[column]]


def _packed_blocks(documents: list[str], tokenizer: Source, seq_len: int, source: dict[str, Any]) -> TokenBlocks:
    tokenizer_source = resolve_model(tokenizer)
    encoder = AutoTokenizer.from_pretrained(tokenizer_source.path)
    encoded = (
        ids
        for start in range(0, len(documents), TOKENIZE_CHUNK)
        for ids in encoder(documents[start : start + TOKENIZE_CHUNK])["input_ids"]
    )
    blocks = pack(encoded, seq_len, encoder.eos_token_id)
    if len(blocks) == 0:
        raise ValueError(f"data: {source['path']}: fewer than seq_len = {seq_len} tokens; nothing to train on")
    provenance = {
        **source,
        "documents": len(documents),
        "tokens": blocks.numel(),
        "blocks": len(blocks),
        "seq_len": seq_len,
        "eos_appended": encoder.eos_token_id is not None,
        "tokenizer": tokenizer_source.provenance,
    }
    return TokenBlocks(len(blocks), lambda indices: blocks[indices], provenance)


def _cached_blocks(data: Source, tokenizer: Source, seq_len: int, text_column: str | None) -> TokenBlocks:
    import datasets

    item = resolve_tokenized(data.dataset_ref.name, tokenizer.model_ref.name, seq_len, text_column=text_column)
    table = datasets.load_from_disk(str(item.path)).with_format("numpy", columns=["input_ids"])
    provenance = {k: v for k, v in item.provenance().items() if k != "kind"}
    provenance.update(kind="hub", path=str(item.path), tokens=table.num_rows * seq_len, blocks=table.num_rows)
    return TokenBlocks(table.num_rows, lambda indices: torch.from_numpy(table[indices]["input_ids"]).long(), provenance)
