"""Training batches. Each rank draws different samples; the same (seed, rank) gives the same data."""

from __future__ import annotations

from typing import Iterator

import torch


def synthetic_batches(
    vocab_size: int, batch_size: int, seq_len: int, seed: int, rank: int, device: torch.device
) -> Iterator[torch.Tensor]:
    """Uniform random token ids, as the reference benchmarks use: no tokenizer, no I/O."""
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    while True:
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
        yield tokens.to(device, non_blocking=True)
