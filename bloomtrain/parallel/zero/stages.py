"""What each ZeRO stage (Rajbhandari et al., arXiv 1910.02054) shards, as one table. Every
stage-dependent decision in the engine reads these three facts; nothing branches on the stage
number itself.

    stage  fp32 master + Adam m, v   fp32 gradient accumulator          compute parameters
    0      whole                     whole, reduced once per step       whole
    1      1/dp                      whole, reduced once per step       whole, all-gathered after
                                                                        the step
    2      1/dp                      1/dp, reduce-scattered every       whole, all-gathered after
                                     micro-batch during backward        the step
    3      1/dp                      1/dp, as stage 2                   none kept: each unit is
                                                                        gathered per use, cast
                                                                        from the master shards
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

from bloomtrain.config import DOMAINS, ZeroStage


@dataclass(frozen=True)
class StageRules:
    stage: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool


# Each stage shards what the one before it did, and one thing more.
STAGES = {s: StageRules(s, shard_optimizer=s >= 1, shard_grads=s >= 2, shard_params=s >= 3)
          for s in typing.get_args(ZeroStage)}


def stage_rules(stage: int) -> StageRules:
    DOMAINS["parallel.zero_stage"].check("parallel.zero_stage", stage)
    return STAGES[stage]
