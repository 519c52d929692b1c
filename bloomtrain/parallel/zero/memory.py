"""Memory accounting of the ZeRO engine: the model-state formula (ours and the ZeRO paper's), and
the transient terms that add to it during a step.

The peak of a rank is model states + the stage-3 units gathered at once + the fp32 gradient
buckets staged for reduce-scatter (stages 2-3) + the compute-dtype gradients autograd holds before
the engine takes them. The engine counts the first three as they happen (`Counters`); the last is
bounded from the layout: one parameter's gradient at a time, except that with the tied embedding
and LM head on one stage autograd keeps the head's share of the embedding gradient from the
head's backward to the embedding's.
"""
from __future__ import annotations

from dataclasses import dataclass

from bloomtrain.parallel.zero.stages import stage_rules


@dataclass
class Counters:
    gathered_bytes: int = 0
    gathered_peak: int = 0
    staging_bytes: int = 0
    staging_peak: int = 0
    num_prefetches: int = 0

    def gathered(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def staged(self, delta: int) -> None:
        self.staging_bytes += delta
        self.staging_peak = max(self.staging_peak, self.staging_bytes)


def formula(stage: int, psi: int, dp: int, compute_bytes: int = 2,
            working: int = 0) -> dict[str, float]:
    """Model-state bytes per rank for `psi` parameters on this rank: our layout (by category and
    total) and the ZeRO paper's figure (fp16 params and grads, K = 12). `working` is stage 3's
    gathered working set in bytes, reported beside ours."""
    rules = stage_rules(stage)
    n = dp
    ours = {
        "compute_params": 0.0 if rules.shard_params else compute_bytes * psi,
        "fp32_master": 4 * psi / (n if rules.shard_optimizer else 1),
        "fp32_grads": 4 * psi / (n if rules.shard_grads else 1),
        "adam_m": 4 * psi / (n if rules.shard_optimizer else 1),
        "adam_v": 4 * psi / (n if rules.shard_optimizer else 1),
    }
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
             3: 16 * psi / n}[stage]
    return {**ours, "ours": sum(ours.values()), "working": float(working), "paper": paper}
