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

from bloomtrain.parallel.zero.stages import StageRules, stage_rules

# ZeRO-Offload's staging ring (offload.py): every device-to-host gradient copy and host-to-device
# weight copy goes through one of RING_SLOTS page-locked fp32 buffers of one chunk each, so that
# only the ring is pinned, not the states. Four slots keep a copy landing, one being stepped and
# one going back in flight at once.
RING_SLOTS = 4
# The smallest chunk: a whole number of pages, cache lines and any SIMD width.
CHUNK_ALIGN = 4096
# The largest: a ring of 8 MiB, the locked-memory limit most Linux distributions set by default
# (ulimit -l 8192), so that the ring alone never needs it raised; a 2 MiB copy still runs at
# PCIe's rate, and the host steps 512K elements between two calls.
CHUNK_MAX = 1 << 19


def pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def staging_chunk(largest_own: int, bucket: int) -> int:
    """Elements of one chunk of the optimizer step: the unit the host steps and the ring's slot
    size. Both the offloaded step and the plain one cut every segment's own range at multiples of
    it, so that torch's kernels see the same tensors either way (the same bits; adamw.py). A
    power of two, which torch's pinned allocator would round a slot up to anyway: a quarter of a
    reduction bucket rounded down (the ring then holds half to one bucket) up to CHUNK_MAX, or the
    largest own segment range rounded up where that is smaller."""
    want = max(CHUNK_ALIGN, 1 << (max(1, bucket // RING_SLOTS).bit_length() - 1))
    return min(pow2_ceil(largest_own), want, CHUNK_MAX)


def host_bytes(own: int, chunk: int) -> dict[str, int]:
    """One offloading rank's host memory, by category: the fp32 masters and Adam moments of its
    own range (`own` elements; 12 bytes each) and the pinned staging ring (RING_SLOTS fp32
    chunks)."""
    return {"fp32_master": 4 * own, "adam_m": 4 * own, "adam_v": 4 * own,
            "staging_ring": 4 * RING_SLOTS * chunk}


def pinned_size(nbytes: int) -> int:
    """What a page-locked allocation of `nbytes` takes: torch's pinned (caching host) allocator
    rounds every request up to a power of two before cudaHostAlloc."""
    return pow2_ceil(nbytes) if nbytes else 0


def pinned_bytes(own: int, chunk: int, pin_states: bool) -> int:
    """The page-locked part of a rank's host memory on CUDA: the ring, and with
    `parallel.offload_pin_memory` the three state buffers too, each rounded up to a power of
    two (pinned_size: up to twice their size)."""
    return (RING_SLOTS * pinned_size(4 * chunk)
            + (3 * pinned_size(4 * own) if pin_states else 0))


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


def state_bytes(rules: StageRules, full: float, shard: float, compute_bytes: int,
                offload: bool = False, chunk: int = 0) -> dict:
    """The one model of a rank's ZeRO model-state bytes, torch-free: the engine's flat buffers by
    category on the training device (`device`, as FlatBuffers.nbytes measures them), the host's
    under offload (`host`, as FlatBuffers.host_nbytes: the states and the staging ring of
    `chunk`-element slots), and `own`, the elements of the states this rank steps. `full`: the
    elements of this rank's full flat buffers (padded as the engine lays them out, or Ψ for the
    paper's formula); `shard`: its 1/dp. Every choice reads the stage's rules (stages.py), never
    the stage number. The planner, formula() and the engine's report all take it from here."""
    own = shard if rules.shard_optimizer else full
    state_here = 0 if offload else 1
    if not rules.shard_params:
        compute = full
    else:  # stage 3 gathers each unit from the masters; under offload from its own shard
        compute = shard if offload else 0
    device = {"compute_params": compute_bytes * compute,
              "fp32_master": 4 * own * state_here,
              "fp32_grads": 4 * (shard if rules.shard_grads else full),
              "adam_m": 4 * own * state_here,
              "adam_v": 4 * own * state_here}
    return {"device": device, "host": host_bytes(own, chunk) if offload else {}, "own": own}


def formula(stage: int, psi: int, dp: int, compute_bytes: int = 2,
            working: int = 0, offload: bool = False) -> dict:
    """Model-state bytes per rank for `psi` parameters on this rank: our layout (state_bytes,
    by category and total, on the training device) and the ZeRO paper's figure (fp16 params and
    grads, K = 12). `working` is stage 3's gathered working set in bytes, reported beside ours.

    `offload` (ZeRO-Offload, arXiv 2101.06840): the masters and moments (K = 12 bytes per
    parameter, over N where sharded) leave the device for the host; stage 3 then keeps its own
    shard in the compute dtype on the device (cΨ/N), which its gathers read. `host` holds the
    host's state bytes by category (the staging ring, a fixed size that does not grow with Ψ, is
    left out here); the paper's figure is its own less the same 12Ψ/N."""
    rules = stage_rules(stage)
    n = dp
    model = state_bytes(rules, psi, psi / n, compute_bytes, offload)
    ours = model["device"]
    host = {k: float(model["host"].get(k, 0.0)) for k in ("fp32_master", "adam_m", "adam_v")}
    host["total"] = sum(host.values())
    # fp16 parameters and gradients (2 bytes each) and K = 12 bytes of optimizer state, each
    # over N where the stage shards it.
    paper = (2 * psi / (n if rules.shard_params else 1) + 2 * psi / (n if rules.shard_grads else 1)
             + 12 * psi / (n if rules.shard_optimizer else 1)) - host["total"]
    return {**ours, "ours": sum(ours.values()), "working": float(working), "paper": paper,
            "host": host}
