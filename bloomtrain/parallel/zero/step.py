"""The optimizer step on this rank's fp32 shard: global gradient norm, fp16 loss-scale check,
clipping, AdamW (decoupled weight decay, as apex FusedAdam(adam_w_mode=True) and torch AdamW), and
the refresh of the compute copy.

A step: reduced gradients -> global norm of the (scaled) gradients -> non-finite: skip (every rank
agrees, the norm is global; the caller logs it) -> unscale and clip in one multiply -> AdamW on
the shard -> cast to the compute dtype (stages 1-2: all-gather it; stage 3 casts when it
gathers) -> zero the accumulators.

The global norm counts every logical parameter once: the last stage's tied-embedding copy never,
tp-replicated parameters on tp rank 0 only. Squares are summed in fp64 over this rank's own
range, then over dp (when ranks own different ranges) and over the model group (tp x pp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.reduce import _clip

DP = "dp"


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float | None


def grad_norm(bufs: FlatBuffers, topo) -> torch.Tensor:
    # fp64: an fp32 sum over millions of elements drifts by ~1e-5 relative, which would make the
    # norm depend on the bucket layout. Chunks bound the fp64 temporaries.
    sq = torch.zeros((), dtype=torch.float64, device=bufs.device)
    for seg in bufs.layout.segments:
        lo, hi = bufs.own(seg)
        g = bufs.grad_view(seg)
        for a, b in _clip(seg.counted, lo, hi):
            for chunk in g[a - lo:b - lo].split(1 << 20):
                sq += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
    if bufs.rules.shard_optimizer:
        comm.all_reduce(sq, topo.dp_group, DP)
    comm.all_reduce(sq, topo.model_group, "model")
    return sq.sqrt()


@torch.no_grad()
def adamw(bufs: FlatBuffers, cfg, lr: float, step_count: int, coeff: float) -> None:
    """One AdamW update of this rank's shard; `coeff` unscales and clips the gradients."""
    b1, b2, eps, wd = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay
    bc1 = 1.0 - b1 ** step_count
    bc2 = 1.0 - b2 ** step_count
    for seg in bufs.layout.segments:
        g = bufs.grad_view(seg)
        if coeff != 1.0:
            g.mul_(coeff)
        m, v = bufs.state_view(bufs.exp_avg, seg), bufs.state_view(bufs.exp_avg_sq, seg)
        w = bufs.state_view(bufs.master, seg)
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        if wd:
            lo, hi = bufs.own(seg)
            for a, b in _clip(seg.decay, lo, hi):
                w[a - lo:b - lo].mul_(1.0 - lr * wd)
        w.addcdiv_(m, denom, value=-lr / bc1)


@torch.no_grad()
def refresh_compute(bufs: FlatBuffers, topo) -> None:
    """Cast the updated masters into the compute copy; where the masters are sharded, all-gather
    the cast shards, one collective per segment in the compute dtype."""
    if bufs.compute is None:
        return  # stage 3 casts from the masters whenever it gathers
    if not bufs.rules.shard_optimizer:
        bufs.compute.copy_(bufs.master)
        return
    for seg in bufs.layout.segments:
        shard = bufs.state_view(bufs.master, seg).to(bufs.compute_dtype)
        full = bufs.compute[seg.full_off:seg.full_off + seg.padded]
        comm.all_gather_into_tensor(full, shard, topo.dp_group, DP)


def clip_coefficient(norm: float, clip: float, loss_scale: float | None) -> float:
    """One multiply that unscales the fp16 loss scale and clips to `clip` (0: no clipping)."""
    coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
    return min(coeff, 1.0) / (loss_scale or 1.0)
