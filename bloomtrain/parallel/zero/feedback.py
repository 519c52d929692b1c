"""Error feedback for the compressed gradient reductions (parallel.grad_error_feedback; Seide et
al. 2014, Karimireddy et al., arXiv 1901.09847), its whole life in one module:

- the residual: FlatBuffers.grad_residual, allocated with the other flat buffers (whose bytes
  the engine and the planner count), fp32, laid out like the full gradient, this rank's own
  (each rank's input differs), on the device that reduces;
- encode (`encode_with_feedback`, which compress.py's reductions call with `segment_residual`):
  the rank sends Q(g + e) and keeps e <- (g + e) - D(Q(g + e)), so what quantization drops in one
  reduction is sent in a later one;
- after a step (`after_step`, from the optimizer): reset on an overflow, rescaled on a change
  of the fp16 loss scale (`rescale`; on resume too, from the saved scale to this run's);
- checkpoint and reshard (`residuals_here` for state.fragments, `load` for state.load_state):
  every dp rank's residual is saved, one kind per saving rank (`grad_residual_dp{s}`); on
  resume at the same dp size rank r takes its own, at another every rank takes the saved ones'
  sum over its new dp size (the total owed, the sum over ranks, is kept), and a checkpoint
  without residuals gives zeros (state.py's docstring has the rule in full).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from bloomtrain.checkpoint import residual_kind
from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.codec import decode, encode
from bloomtrain.parallel.zero.segments import Segment

DP = "dp"


def encode_with_feedback(x: torch.Tensor, dtype: str, residual: torch.Tensor | None):
    """encode(x + residual) ([n, m] rows), the residual updated to what the encoding lost."""
    if residual is None:
        return encode(x, dtype)
    residual.add_(x)
    payload = encode(residual, dtype)
    residual.sub_(decode(payload, x.shape[1], dtype))
    return payload


def segment_residual(bufs: FlatBuffers, seg: Segment) -> torch.Tensor | None:
    """`seg`'s part of the residual, as its full gradient is laid out (None without feedback)."""
    r = bufs.grad_residual
    return None if r is None else r[seg.full_off:seg.full_off + seg.padded]


def after_step(bufs: FlatBuffers, found_inf: bool, scale: float | None,
               next_scale: float | None) -> None:
    """The residual's upkeep once a step is decided. An overflowing step (a non-finite gradient,
    fp16): what the residual owes is lost with the step, or it would poison every later
    reduction. A taken step whose loss scale then changed: what the residual owes is in the units
    of the gradients it came from, which carried `scale`; the next step's carry `next_scale`
    (a power of two: exact)."""
    residual = bufs.grad_residual
    if residual is None:
        return
    if found_inf:
        residual.zero_()
    elif scale is not None and next_scale is not None:
        rescale(bufs, scale, next_scale)


def rescale(bufs: FlatBuffers, scale: float, next_scale: float) -> None:
    """The residual, owed in gradients that carried loss scale `scale`, in the units of ones
    that carry `next_scale` (1 without fp16 scaling): a change of the fp16 scale, or a resume
    into another precision (an fp16 checkpoint's residual is scaled, a bf16 run's is not)."""
    if bufs.grad_residual is not None and next_scale != scale:
        bufs.grad_residual.mul_(next_scale / scale)


def residuals_here(bufs: FlatBuffers, seg: Segment, topo) -> torch.Tensor | None:
    """[dp, shard]: every dp rank's residual on this rank's partition of `seg` (an all-to-all),
    for the checkpoint's fragments."""
    if bufs.grad_residual is None:
        return None
    mine = bufs.grad_residual[seg.full_off:seg.full_off + seg.padded].view(bufs.dp_size, -1)
    out = torch.empty_like(mine)
    comm.all_to_all_single(out, mine.contiguous(), topo.dp_group, DP)
    return out


def load(bufs: FlatBuffers, pieces: dict, optim: Mapping) -> None:
    """The residual from a checkpoint's tensors (`optim`, by `grad_residual_dp{s}.NAME`; `pieces`:
    each slot's (segment, piece) list): this dp rank's saved residual; under another dp size the
    saved ones' sum over this dp size; or zeros. A run without feedback ignores them."""
    if bufs.grad_residual is None:
        return
    first = bufs.layout.slots[0].name
    saved = 0
    while f"{residual_kind(saved)}.{first}" in optim:
        saved += 1
    bufs.grad_residual.zero_()
    if saved == 0:
        return
    ranks = [bufs.dp_rank] if saved == bufs.dp_size else range(saved)
    for slot in bufs.layout.slots:
        flat = None
        for s in ranks:
            t = optim[f"{residual_kind(s)}.{slot.name}"].reshape(-1).to(torch.float32)
            flat = t.clone() if flat is None else flat.add_(t)
        if len(ranks) > 1:
            flat.div_(bufs.dp_size)
        for seg, piece in pieces[id(slot)]:
            if not piece.counted:
                # Another copy's (a tp rank's replica of a sequence-parallel LayerNorm, the
                # last stage's tied embedding): its own residual is not in the checkpoint (only
                # the counted copy's is written), and the counted copy's is not its own. It
                # starts at zero, what it owed lost as at an overflow; taking the other copy's
                # counted that amount twice. Not bitwise, unlike every counted piece.
                continue
            base = seg.full_off + piece.seg_start
            bufs.grad_residual[base:base + piece.numel].copy_(
                flat[piece.param_start:piece.param_start + piece.numel])
