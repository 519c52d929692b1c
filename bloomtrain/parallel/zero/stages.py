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

from dataclasses import dataclass

from bloomtrain.errors import UserError


@dataclass(frozen=True)
class StageRules:
    stage: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool


STAGES = {
    0: StageRules(0, shard_optimizer=False, shard_grads=False, shard_params=False),
    1: StageRules(1, shard_optimizer=True, shard_grads=False, shard_params=False),
    2: StageRules(2, shard_optimizer=True, shard_grads=True, shard_params=False),
    3: StageRules(3, shard_optimizer=True, shard_grads=True, shard_params=True),
}


def stage_rules(stage: int) -> StageRules:
    if stage not in STAGES:
        raise UserError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {stage}")
    return STAGES[stage]
