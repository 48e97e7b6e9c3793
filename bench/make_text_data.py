"""Build the small real-text corpus and BPE tokenizer that bench/loss_agreement.sh trains on.

The GPU machine has no network, so the text is taken from this machine (Debian's package
documentation under /usr/share/doc, and the Python standard library's own sources), a byte-level
BPE tokenizer is trained on it with the `tokenizers` library, and both are written under .data/
(git-ignored; carry it to the GPU machine):

    .data/loss_text/corpus.jsonl    one {"text": ...} document per line (RunSpec data: a text folder)
    .data/tokenizer/                tokenizer.json + tokenizer_config.json (RunSpec tokenizer)
    .data/manifest.json             sources, sizes and the sha256 of both, to tell two builds apart

    python3 bench/make_text_data.py [--out .data] [--mb 10]

Deterministic: files are taken in sorted path order until the size is reached.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"
VOCAB_SIZE = 16384
DOC_SUFFIXES = (".txt", ".md", ".rst", ".gz")
MIN_DOC_CHARS = 500


def doc_files() -> list[Path]:
    """Package documentation: changelogs (gzipped), READMEs, copyright notices."""
    root = Path("/usr/share/doc")
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and (p.suffix in DOC_SUFFIXES or p.name == "copyright")
    )


def python_files() -> list[Path]:
    """The standard library's modules (not its tests), of the Python running this script."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="ignore")


def take(files: list[Path], budget: int) -> tuple[list[str], list[str]]:
    """Documents from `files` in order until `budget` characters; and their paths."""
    texts, names, size = [], [], 0
    for path in files:
        if size >= budget:
            break
        try:
            text = read_text(path)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if len(text) < MIN_DOC_CHARS or EOS in text:
            continue
        texts.append(text)
        names.append(str(path))
        size += len(text)
    return texts, names


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(str(out))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".data", help="output folder (default .data)")
    parser.add_argument("--mb", type=float, default=10.0, help="characters of text, in millions (default 10)")
    args = parser.parse_args()
    out = Path(args.out)
    budget = int(args.mb * 1e6)
    docs, doc_names = take(doc_files(), budget // 2)
    code, code_names = take(python_files(), budget - sum(map(len, docs)))
    texts = docs + code
    if sum(map(len, texts)) < budget // 2:
        print(f"make_text_data: found only {sum(map(len, texts)):,} characters of text", file=sys.stderr)
        return 1
    (out / "loss_text").mkdir(parents=True, exist_ok=True)
    corpus = out / "loss_text" / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    train_tokenizer(texts, out / "tokenizer")
    manifest = {
        "documents": len(texts),
        "characters": sum(map(len, texts)),
        "vocab_size": VOCAB_SIZE,
        "eos": EOS,
        "corpus_sha256": sha256(corpus),
        "tokenizer_sha256": sha256(out / "tokenizer" / "tokenizer.json"),
        "python": sys.version.split()[0],
        "sources": doc_names + code_names,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(
        f"make_text_data: {len(texts)} documents, {manifest['characters']:,} characters -> {corpus}; "
        f"tokenizer ({VOCAB_SIZE} tokens) -> {out / 'tokenizer'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
