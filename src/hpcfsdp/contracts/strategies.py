"""The registry of strategies: what each strategy name means. Validation (spec.py), the wrappers
(cell/strategies.py), the memory prediction and the collector read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

StrategyName = Literal[
    "single",
    "ddp",
    "fsdp1_full_shard",
    "fsdp1_shard_grad_op",
    "fsdp1_hybrid_shard",
    "fsdp1_hybrid_zero2",
    "fsdp1_no_shard",
    "fsdp2_zero3",
    "fsdp2_zero2",
    "fsdp2_hsdp",
]
Family = Literal["single", "ddp", "fsdp1", "fsdp2"]


@dataclass(frozen=True)
class StrategyInfo:
    """What a strategy name means: its family (which wrapper applies it) and how it shards."""

    family: Family
    hybrid: bool = False  # replicate across shard groups (a 2-D mesh; reads hsdp_shard_size)
    reshard_after_forward: bool = True  # False: ZeRO-2 (parameters stay gathered until backward)
    fsdp1_sharding: str = ""  # torch.distributed.fsdp.ShardingStrategy member
    single_replica: str = ""  # a hybrid's: the strategy it is with one shard group of every rank (plan notes it)


STRATEGIES: dict[StrategyName, StrategyInfo] = {
    "single": StrategyInfo("single"),  # one process, no wrapper: the plain model (torchtitan on one GPU)
    "ddp": StrategyInfo("ddp"),
    "fsdp1_full_shard": StrategyInfo("fsdp1", fsdp1_sharding="FULL_SHARD"),
    "fsdp1_shard_grad_op": StrategyInfo("fsdp1", reshard_after_forward=False, fsdp1_sharding="SHARD_GRAD_OP"),
    "fsdp1_hybrid_shard": StrategyInfo(
        "fsdp1", hybrid=True, fsdp1_sharding="HYBRID_SHARD", single_replica="fsdp1_full_shard"
    ),
    "fsdp1_hybrid_zero2": StrategyInfo(
        "fsdp1",
        hybrid=True,
        reshard_after_forward=False,
        fsdp1_sharding="_HYBRID_SHARD_ZERO2",
        single_replica="fsdp1_shard_grad_op",
    ),
    "fsdp1_no_shard": StrategyInfo("fsdp1", fsdp1_sharding="NO_SHARD"),
    "fsdp2_zero3": StrategyInfo("fsdp2"),
    "fsdp2_zero2": StrategyInfo("fsdp2", reshard_after_forward=False),
    "fsdp2_hsdp": StrategyInfo("fsdp2", hybrid=True, single_replica="fsdp2_zero3"),
}
assert set(STRATEGIES) == set(get_args(StrategyName)), "every StrategyName needs a registry entry"
