"""AdamW (Loshchilov & Hutter, arXiv 1711.05101: decoupled weight decay, as torch's AdamW and
apex's FusedAdam(adam_w_mode=True)) on a ZeroEngine's flat fp32 buffers, and the one multiply
that unscales and clips the gradients before it."""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.segments import Segment, clip_ranges


def fused_supported(device: torch.device) -> bool:
    return device.type in _get_fused_kernels_supported_devices()


@torch.no_grad()
def adamw(bufs: FlatBuffers, segments: list[Segment], grad: torch.Tensor | None, cfg, lr: float,
          step_count: int, coeff: float) -> None:
    """One AdamW update of this rank's own range of `segments`, by torch's own AdamW on views of
    the flat buffers, wherever they live (the device; the host under offload). `grad` is the
    buffer the own gradients are read from, laid out like the masters (offload: the host copy),
    or None for the reduced gradient buffer itself. `coeff` unscales and clips the gradients
    first.

    One tensor per segment, whichever caller: torch's kernels treat each tensor on its own, so
    the offloaded step (a call per segment, to overlap copies) and the plain one (one call) make
    the same bits. Weight decay is torch AdamW's own `param.mul_(1 - lr * wd)` before the update,
    applied here to the decayed ranges only (no biases, no LayerNorms); the update then runs
    with weight_decay 0.

    Kernel: the fused one (torch._fused_adamw_, on CPU too since torch 2.4) where the device has
    it, else the foreach one. Both are torch AdamW; fused reads and writes each element once
    where foreach makes a pass per operation, which matters most on the host (ZeRO-Offload):
    about 3x faster there."""
    b1, b2, eps, wd = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay
    params = [bufs.state_view(bufs.master, s) for s in segments]
    grads = [bufs.state_view(grad, s) if grad is not None else bufs.grad_view(s)
             for s in segments]
    if coeff != 1.0:
        torch._foreach_mul_(grads, coeff)
    if wd:
        decayed = []
        for seg, w in zip(segments, params):
            lo, hi = bufs.own(seg)
            decayed += [w[a - lo:b - lo] for a, b in clip_ranges(seg.decay, lo, hi)]
        if decayed:
            torch._foreach_mul_(decayed, 1.0 - lr * wd)
    device = params[0].device if params else bufs.host
    fused = fused_supported(device)
    # Steps as torch keeps them, one per tensor (the kernel adds 1 before using them): fp32, on
    # the device for the fused kernel, on the CPU for foreach.
    steps = list(torch.full((len(params),), float(step_count - 1),
                            device=device if fused else "cpu").unbind())
    torch_adamw(params, grads, [bufs.state_view(bufs.exp_avg, s) for s in segments],
                [bufs.state_view(bufs.exp_avg_sq, s) for s in segments], [], steps,
                foreach=not fused, fused=fused, amsgrad=False, beta1=b1, beta2=b2, lr=lr,
                weight_decay=0.0, eps=eps, maximize=False)


def clip_coefficient(norm: float, clip: float, loss_scale: float | None) -> float:
    """One multiply that unscales the fp16 loss scale and clips to `clip` (0: no clipping)."""
    coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
    return min(coeff, 1.0) / (loss_scale or 1.0)
