"""AdamW (Loshchilov & Hutter, arXiv 1711.05101: decoupled weight decay, as torch's AdamW and
apex's FusedAdam(adam_w_mode=True)) on a ZeroEngine's flat fp32 buffers, and the one multiply
that unscales and clips the gradients before it."""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.segments import Segment

# (segment, a, b): elements [a, b) of the segment's own range (FlatBuffers.chunks).
Chunk = tuple[Segment, int, int]


FUSED_DEVICES = frozenset(_get_fused_kernels_supported_devices())


def fused_supported(device: torch.device) -> bool:
    return device.type in FUSED_DEVICES


def all_chunks(bufs: FlatBuffers, segments: list[Segment]) -> list[Chunk]:
    return [(seg, a, b) for seg in segments for a, b in bufs.chunks(seg)]


def adamw(bufs: FlatBuffers, chunks: list[Chunk], grads: list[torch.Tensor] | None, cfg,
          lr: float, step_count: int, coeff: float) -> None:
    """One AdamW update of `chunks` of this rank's own ranges, by torch's own AdamW on views of
    the flat buffers, wherever they live (the device; the host under offload). `grads` holds
    each chunk's gradients (offload: the staging slots they landed in), or None for the reduced
    gradient buffer itself. `coeff` unscales and clips the gradients first.

    The tensors torch sees are the same whichever caller: every chunk (the optimizer's unit,
    FlatBuffers.chunks), cut where weight decay starts or stops. torch's kernels treat each
    tensor on its own, vectorized from its first element with a scalar tail, so the offloaded
    step (a call per chunk, to overlap the copies) and the plain one (one call) make the same
    bits. Weight decay is the kernel's own (torch AdamW's `param *= 1 - lr * wd` before the
    update, in the same pass over memory), on the decayed ranges only (no biases, no
    LayerNorms): one call for those, one with weight_decay 0 for the rest.

    Kernel: the fused one (torch._fused_adamw_, on CPU too since torch 2.4) where the device has
    it, else the foreach one. Both are torch AdamW; fused reads and writes each element once
    where foreach makes a pass per operation, which matters most on the host (ZeRO-Offload).
    No autograd: the buffers are not leaves of any graph (and the offloaded step calls this per
    batch of chunks, where a no_grad context's cost shows)."""
    if not chunks:
        return
    decayed: tuple[list, list, list, list] = ([], [], [], [])
    plain: tuple[list, list, list, list] = ([], [], [], [])
    all_grads = []
    for i, (seg, a, b) in enumerate(chunks):
        states = [bufs.state_view(buf, seg) for buf in (bufs.master, bufs.exp_avg,
                                                         bufs.exp_avg_sq)]
        g = grads[i] if grads is not None else bufs.grad_view(seg)[a:b]
        all_grads.append(g)
        lo = bufs.own(seg)[0]
        for x, y, decay in decay_runs(seg, lo + a, lo + b):
            x, y = x - lo, y - lo
            out = decayed if decay else plain
            out[0].append(states[0][x:y])
            out[1].append(g[x - a:y - a])
            out[2].append(states[1][x:y])
            out[3].append(states[2][x:y])
    if coeff != 1.0:
        torch._foreach_mul_(all_grads, coeff)
    step = None
    for (params, gs, ms, vs), wd in ((decayed, cfg.weight_decay), (plain, 0.0)):
        if params:
            step = _torch_adamw(params, gs, ms, vs, cfg, lr, step_count, wd, step)


def decay_runs(seg: Segment, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """[lo, hi) of `seg` (segment coordinates) cut into runs with and without weight decay."""
    out, at = [], lo
    for a, b in seg.decay:
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if at < a:
            out.append((at, a, False))
        out.append((a, b, True))
        at = b
    if at < hi:
        out.append((at, hi, False))
    return out


def _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, cfg, lr, step_count, wd, step):
    """One call of torch's AdamW kernel; returns the step tensor for the next call."""
    device = params[0].device
    if device.type in FUSED_DEVICES:
        # The kernel torch.optim.AdamW(fused=True) runs, called as its _fused_adam calls it
        # less the grouping by device and dtype (ours are all fp32 on one device) and the step
        # counters' increment: called per chunk under offload, that Python was a tenth of the
        # host step. The step is read, never written: one tensor serves every parameter.
        if step is None:
            step = torch.tensor(float(step_count), device=device)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params),
                            amsgrad=False, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                            weight_decay=wd, eps=cfg.eps, maximize=False, grad_scale=None,
                            found_inf=None)
        return step
    # Steps as torch keeps them, one per tensor (the foreach kernel adds 1 before using them).
    steps = list(torch.full((len(params),), float(step_count - 1)).unbind())
    torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, fused=False,
                amsgrad=False, beta1=cfg.beta1, beta2=cfg.beta2, lr=lr, weight_decay=wd,
                eps=cfg.eps, maximize=False)
    return None


def clip_coefficient(norm: float, clip: float, loss_scale: float | None) -> float:
    """One multiply that unscales the fp16 loss scale and clips to `clip` (0: no clipping)."""
    coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
    return min(coeff, 1.0) / (loss_scale or 1.0)
