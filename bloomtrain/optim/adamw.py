"""AdamW (Loshchilov & Hutter, arXiv 1711.05101: decoupled weight decay, as torch's AdamW and
apex's FusedAdam(adam_w_mode=True)) on lists of tensors, and the one multiply that unscales and
clips the gradients before it. Pure maths: where the tensors live and how they are cut is the
caller's (bloomtrain.parallel.zero.optimizer steps views of a ZeroEngine's flat buffers)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.optimizer import _get_fused_kernels_supported_devices

FUSED_DEVICES = frozenset(_get_fused_kernels_supported_devices())


@dataclass(frozen=True)
class AdamWHyper:
    """The step's constants: lr varies per step (the schedule's), the betas and eps do not."""

    lr: float
    beta1: float
    beta2: float
    eps: float


def fused_supported(device: torch.device) -> bool:
    return device.type in FUSED_DEVICES


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], hyper: AdamWHyper, step_count: int,
           weight_decay: float, step: torch.Tensor | None = None) -> torch.Tensor | None:
    """One in-place AdamW update of fp32 `params` and their moments by torch's own kernel;
    returns the step tensor to pass to the next call of the same step (or None).

    Kernel: the fused one (torch._fused_adamw_, on CPU too since torch 2.4) where the device has
    it, else the foreach one. Both are torch AdamW; fused reads and writes each element once
    where foreach makes a pass per operation, which matters most on the host (ZeRO-Offload).
    torch's kernels treat each tensor on its own, vectorized from its first element with a
    scalar tail, so a list cut the same way gives the same bits in one call or many. Weight decay
    is the kernel's own (`param *= 1 - lr * wd` before the update, in the same pass over
    memory). No autograd: call it on tensors that are no graph's leaves (a no_grad context per
    call costs what shows when a caller steps many small batches)."""
    device = params[0].device
    if device.type in FUSED_DEVICES:
        # The kernel torch.optim.AdamW(fused=True) runs, called as its _fused_adam calls it
        # less the grouping by device and dtype (ours are all fp32 on one device) and the step
        # counters' increment: called per chunk under offload, that Python was a tenth of the
        # host step. The step is read, never written: one tensor serves every parameter.
        if step is None:
            step = step_tensor(device, step_count)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params),
                            amsgrad=False, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                            weight_decay=weight_decay, eps=hyper.eps, maximize=False,
                            grad_scale=None, found_inf=None)
        return step
    # Steps as torch keeps them, one per tensor (the foreach kernel adds 1 before using them).
    steps = list(torch.full((len(params),), float(step_count - 1)).unbind())
    torch_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, fused=False,
                amsgrad=False, beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.lr,
                weight_decay=weight_decay, eps=hyper.eps, maximize=False)
    return None


@functools.lru_cache(maxsize=4)
def step_tensor(device: torch.device, step_count: int) -> torch.Tensor:
    """The step count as the fused kernel reads it, made once per step and device: made per
    call, it cost ~90 us each under offload (a call per chunk, each after the chunk before has
    streamed the caches cold), a twentieth of the host step. The kernel only reads it."""
    return torch.tensor(float(step_count), device=device)


def clip_coefficient(norm: float, clip: float, loss_scale: float | None) -> float:
    """One multiply that unscales the fp16 loss scale and clips to `clip` (0: no clipping)."""
    coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
    return min(coeff, 1.0) / (loss_scale or 1.0)
