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
            working: int = 0, offload: bool = False) -> dict:
    """Model-state bytes per rank for `psi` parameters on this rank: our layout (by category and
    total, on the training device) and the ZeRO paper's figure (fp16 params and grads, K = 12).
    `working` is stage 3's gathered working set in bytes, reported beside ours.

    `offload` (ZeRO-Offload, arXiv 2101.06840): the masters and moments (K = 12 bytes per
    parameter, over N where sharded) leave the device for the host, which also holds a copy of
    the own fp32 gradient range; stage 3 then keeps its own shard in the compute dtype on the
    device (cΨ/N), which its gathers read. `host` holds the host's bytes by category; the
    paper's figure is its own less the same 12Ψ/N."""
    rules = stage_rules(stage)
    n = dp
    state = 4 * psi / (n if rules.shard_optimizer else 1)
    on_device = 0.0 if offload else 1.0
    ours = {
        "compute_params": (compute_bytes * psi if not rules.shard_params
                           else compute_bytes * psi / n if offload else 0.0),
        "fp32_master": state * on_device,
        "fp32_grads": 4 * psi / (n if rules.shard_grads else 1),
        "adam_m": state * on_device,
        "adam_v": state * on_device,
    }
    host = {k: state * (1.0 - on_device) for k in ("fp32_master", "adam_m", "adam_v",
                                                    "fp32_grads")}
    host["total"] = sum(host.values())
    # fp16 parameters and gradients (2 bytes each) and K = 12 bytes of optimizer state, each
    # over N where the stage shards it.
    paper = (2 * psi / (n if rules.shard_params else 1) + 2 * psi / (n if rules.shard_grads else 1)
             + 12 * psi / (n if rules.shard_optimizer else 1)) - 3 * state * (1.0 - on_device)
    return {**ours, "ours": sum(ours.values()), "working": float(working), "paper": paper,
            "host": host}
