"""torchtitan's own trainer on random tokens: the peer of bench/versus_torchtitan.sh.

Run as torchtitan's train.py is run (`torchrun ... bench/torchtitan_random.py --job.config_file
... --model.name qwen3_random ...`), with a torchtitan source checkout on PYTHONPATH (the pinned
release, TORCHTITAN_DIR; never copied into this repository). It registers one train spec,
`qwen3_random`: torchtitan's `qwen3` spec (model, parallelisation, optimizer, compiled loss, all
unchanged) with a dataloader of uniformly random tokens instead of its text datasets, so that both
sides of the comparison train on the same kind of input as `hpcfsdp run data=synthetic`, and no
tokenizer or dataset has to reach an offline GPU machine.

torchtitan imports `datasets` (its text datasets) and `torch.utils.tensorboard` (its metrics
writer) at module import. Where the GPU image lacks them (no pyarrow, no tensorboard), empty
stand-ins are registered first: neither is used with this train spec and tensorboard off.

    python3 bench/torchtitan_random.py --check-args ARGS...   # parse ARGS with torchtitan's
                                                              # ConfigManager and exit (no GPU)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset


def _stand_in_for_missing_imports() -> None:
    try:
        importlib.import_module("datasets")
    except ImportError:
        datasets = types.ModuleType("datasets")
        datasets.Dataset = datasets.IterableDataset = object  # type: ignore[attr-defined]
        datasets.load_dataset = None  # type: ignore[attr-defined]
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = None  # type: ignore[attr-defined]
        datasets.distributed = distributed  # type: ignore[attr-defined]
        sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError:
        writer = types.ModuleType("torch.utils.tensorboard")
        writer.SummaryWriter = object  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = writer


class RandomTokens(IterableDataset):
    """Endless samples of seq_len + 1 uniformly random token ids, as torchtitan's datasets yield
    them: ({"input": tokens[:-1]}, labels = tokens[1:])."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": tokens[:-1]}, tokens[1:]


def build_random_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.models.qwen3 import qwen3_args

    vocab_size = qwen3_args[job_config.model.flavor].vocab_size
    dataset = RandomTokens(vocab_size, job_config.training.seq_len, seed=dp_rank)
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
    )


def register() -> None:
    _stand_in_for_missing_imports()
    from torchtitan.models.qwen3 import get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec

    spec = dataclasses.replace(get_train_spec(), build_dataloader_fn=build_random_dataloader, build_tokenizer_fn=None)
    register_train_spec("qwen3_random", spec)


def main() -> None:
    register()
    if sys.argv[1:2] == ["--check-args"]:
        from torchtitan.config import ConfigManager

        config = ConfigManager().parse_args(sys.argv[2:])
        print(
            f"ok: {config.model.name} {config.model.flavor} batch {config.training.local_batch_size} "
            f"seq {config.training.seq_len} compile {config.compile.enable} converters {config.model.converters} "
            f"reshard {config.parallelism.fsdp_reshard_after_forward} ac {config.activation_checkpoint.mode}"
        )
        return
    from torchtitan.train import Trainer
    from torchtitan.train import main as train_main

    train_main(Trainer)


if __name__ == "__main__":
    main()
