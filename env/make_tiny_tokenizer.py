"""Build the tiny tokenizer the package ships (src/hpcfsdp/presets/tokenizers/tiny/): a byte-level
BPE of 512 ids (the `tiny` preset's vocab_size, so its ids fit every shipped model), trained on the
project's own docs, for trying text data on a laptop with `tokenizer: tiny` (docs/models_and_data.md).

Byte-level, so any text encodes (no unknown token); `<|endoftext|>` is its EOS, which the packing
rule appends to each document. Rebuild after a change here:

    python env/make_tiny_tokenizer.py            # writes src/hpcfsdp/presets/tokenizers/tiny/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>"]


def corpus() -> list[str]:
    """The docs' paragraphs, in file-name order: English prose with the project's words in it."""
    return [
        paragraph
        for page in sorted((ROOT / "docs").glob("*.md"))
        for paragraph in page.read_text().split("\n\n")
        if paragraph.strip()
    ]


def build(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"), pretty=False)
    # Written by hand, not by save_pretrained: transformers 5 names its class TokenizersBackend,
    # which transformers 4 cannot load; both load PreTrainedTokenizerFast.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[1],
        "model_max_length": 1 << 20,  # packing cuts the blocks: no warning for a long document
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=ROOT / "src/hpcfsdp/presets/tokenizers/tiny")
    print(build(parser.parse_args().folder))


if __name__ == "__main__":
    main()
