"""Text to token blocks: the project's one packing rule, shared by the downloader (cache/) and a
cell's text folders (cell/data.py), and the downloader's tokenising of a cached dataset split
(`tokenize_dataset`). Importing it loads neither torch nor transformers: `tokenize_dataset`
imports datasets and transformers when it runs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..contracts.fs.beneath import make_folders, remove_tree
from ..contracts.names import TokenizedRef
from .fetch import DATASETS_WORK_DIR, save_dataset_atomically
from .hub import lookup_dataset, lookup_model, read_cache_manifest
from .manifest import add_to_manifest, item_lock, manifest_entry
from .plan import DownloadError
from .verify import file_records, files_complete


def document_text(value: str | list[str] | None) -> str:
    """One row's document: a string as it is, a list of strings (a chess game's moves) joined by spaces."""
    if value is None:
        return ""
    return value if isinstance(value, str) else " ".join(value)


def packed_blocks(documents: Iterable[list[int]], seq_len: int, eos: int | None) -> Iterator[list[int]]:
    """Each document's ids then EOS (unless it already ends with it), concatenated and cut into
    blocks of seq_len, as a stream; the tail shorter than seq_len is dropped.

    The project's one packing rule: the downloader's cached blocks and a text folder's are the
    same blocks for the same documents and tokenizer.
    """
    buffer: list[int] = []
    for ids in documents:
        buffer.extend(ids)
        if eos is not None and ids[-1:] != [eos]:
            buffer.append(eos)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]


def tokenize_dataset(
    ref: TokenizedRef, cache: Path, num_proc: int | None = None, force: bool = False, out: Callable[[str], None] = print
) -> dict:
    """Tokenize a saved split's text column with a cached model's tokenizer, pack into seq_len blocks, save."""
    out(f"tokenize {ref.name}")
    with item_lock(cache, ref.key, ref.name, out):
        source = lookup_dataset(ref.dataset.name, cache)
        model = lookup_model(ref.model.name, cache)
        previous = read_cache_manifest(cache)["items"].get(ref.key)
        if (
            previous
            and not force
            and previous.get("dataset_sha") == source.sha
            and previous.get("tokenizer_sha") == model.sha
            and files_complete(cache, previous)
        ):
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

        def encode(batch: dict) -> dict:
            texts = [document_text(value) for value in batch[text_column]]
            return {"input_ids": tokenizer(texts, return_attention_mask=False)["input_ids"]}

        list_type = getattr(datasets, "List", None) or datasets.Sequence
        features = datasets.Features({"input_ids": list_type(datasets.Value("int32"), length=seq_len)})
        work = cache / DATASETS_WORK_DIR / "tokenize" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        make_folders(work)
        try:
            encoded = ds.map(
                encode,
                batched=True,
                remove_columns=ds.column_names,
                num_proc=num_proc,
                load_from_cache_file=False,
                cache_file_name=str(work / "encoded.arrow"),
                desc=f"Tokenizing for {ref.model.name}",
            )
            encoded.save_to_disk(str(work / "encoded"))  # what the packing generator reads, by path
            packed = datasets.Dataset.from_generator(
                _packed_rows,
                features=features,
                cache_dir=str(work / "packed"),
                gen_kwargs={"encoded": str(work / "encoded"), "seq_len": seq_len, "eos": eos},
            )
            if packed.num_rows == 0:
                raise DownloadError(
                    f"{ref.name}: fewer than {seq_len} tokens in all; nothing to train on (use a smaller --seq-len)"
                )
            folder = cache / ref.relpath
            save_dataset_atomically(packed, folder)
            num_blocks = packed.num_rows
        finally:
            remove_tree(work)
        files = file_records(folder, None, label=ref.name)
        entry = manifest_entry(
            ref.key,
            "tokenized",
            ref.name,
            folder,
            cache,
            files,
            dataset=ref.dataset.name,
            dataset_sha=source.sha,
            sha=source.sha,
            tokenizer=ref.model.name,
            tokenizer_sha=model.sha,
            seq_len=seq_len,
            num_blocks=num_blocks,
            text_column=text_column,
            eos_appended=eos is not None,
            column="input_ids",
        )
        add_to_manifest(cache, entry)
    out(f"  -> {num_blocks} blocks of {seq_len} tokens")
    return entry


def _packed_rows(encoded: str, seq_len: int, eos: int | None) -> Iterator[dict[str, list[int]]]:
    """Dataset.from_generator's source: the saved token ids, packed as a text folder's are."""
    import datasets

    documents = (ids for batch in datasets.load_from_disk(encoded).iter(batch_size=1000) for ids in batch["input_ids"])
    for block in packed_blocks(documents, seq_len, eos):  # datasets draws the progress bar
        yield {"input_ids": block}


def _check_text_column(features: Any, column: str, dataset: str) -> None:
    """The column exists and holds strings, or lists of strings (what data.document_text turns into text)."""
    if column not in features:
        raise DownloadError(
            f"dataset {dataset}: no column {column!r} (columns: {', '.join(features)}); pass --text-column"
        )
    feature = features[column]
    inner = getattr(feature, "feature", feature)  # List / Sequence / LargeList: their items
    if getattr(inner, "dtype", None) not in ("string", "large_string"):
        raise DownloadError(
            f"dataset {dataset}: column {column!r} holds {feature}, not text or a list of strings; pass --text-column"
        )
