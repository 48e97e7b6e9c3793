"""Text to token blocks: the project's one packing rule, shared by the downloader (cache/) and a
cell's text folders (cell/data.py). Pure Python: importing it loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import Iterable, Iterator


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
