"""Mixed-precision AdamW over flat buffers with the semantics of BLOOM's BF16Optimizer
(DeepSpeed `runtime/bf16_optimizer.py`), the base that ZeRO (arXiv 1910.02054) shards.

Per weight-decay group the parameters are packed into contiguous flat buffers:
- `compute`: the model's parameters in the compute dtype (bf16/fp16/fp32). Each model parameter is
  a view into it, so copying the master weights back is one flat cast-copy.
- `master`: fp32 master weights; the optimizer steps these, never the compute copy.
- `grad`: fp32 gradient accumulator. A post-accumulate-grad hook adds each parameter's 16-bit
  gradient into it as soon as backward produces it and frees the 16-bit gradient, so gradients are
  **accumulated across micro-batches in fp32**, as BLOOM did (DeepSpeed's `hp_grad.add_(lp.grad)`),
  and only one micro-batch's worth of 16-bit gradient is ever alive.
- `exp_avg`, `exp_avg_sq`: AdamW moments, fp32.

Every tensor is addressable by its HF parameter name through `offsets`, so checkpoints are written
in logical coordinates whatever the layout.

A step: reduce gradients over data parallel (mean) -> unscale (fp16) -> global grad norm -> skip the
step if it is not finite (logged by the caller, never silent) -> clip -> AdamW on fp32 masters ->
copy masters into the compute parameters -> zero the accumulators.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bloomtrain.optim import DynamicLossScaler, no_weight_decay
from bloomtrain.topology import Topology

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float | None


class _FlatGroup:
    def __init__(self, named_params, weight_decay: float, compute_dtype, device):
        self.weight_decay = weight_decay
        self.names = [n for n, _ in named_params]
        self.offsets: dict[str, tuple[int, int, torch.Size]] = {}
        off = 0
        for name, p in named_params:
            self.offsets[name] = (off, p.numel(), p.shape)
            off += p.numel()
        self.numel = off
        self.compute = torch.empty(off, dtype=compute_dtype, device=device)
        self.master = torch.empty(off, dtype=torch.float32, device=device)
        self.grad = torch.zeros(off, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(off, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(off, dtype=torch.float32, device=device)
        with torch.no_grad():
            for name, p in named_params:
                start, n, shape = self.offsets[name]
                self.master[start:start + n].copy_(p.detach().reshape(-1))
                self.compute[start:start + n].copy_(p.detach().reshape(-1))
                # The parameter becomes a view into the flat compute buffer.
                p.data = self.compute[start:start + n].view(shape)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        start, n, shape = self.offsets[name]
        return buf[start:start + n].view(shape)


class MixedPrecisionOptimizer:
    def __init__(self, model: torch.nn.Module, optim_cfg, precision: str,
                 topo: Topology | None = None):
        self.cfg = optim_cfg
        self.precision = precision
        self.compute_dtype = DTYPES[precision]
        self.topo = topo or Topology.single()
        self.step_count = 0
        self.scaler = (DynamicLossScaler(optim_cfg.initial_loss_scale, optim_cfg.loss_scale_window,
                                         optim_cfg.hysteresis, optim_cfg.min_loss_scale)
                       if precision == "fp16" else None)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        device = named[0][1].device
        decay = [(n, p) for n, p in named if not no_weight_decay(n, p.ndim)]
        no_decay = [(n, p) for n, p in named if no_weight_decay(n, p.ndim)]
        self.groups = [_FlatGroup(g, wd, self.compute_dtype, device)
                       for g, wd in ((decay, optim_cfg.weight_decay), (no_decay, 0.0)) if g]
        self._where = {n: g for g in self.groups for n in g.names}
        self._hooks = []
        for g in self.groups:
            for name in g.names:
                p = dict(named)[name]
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(g, name)))

    # ---- gradient accumulation -------------------------------------------------------------
    @staticmethod
    def _make_hook(group: _FlatGroup, name: str):
        start, n, _ = group.offsets[name]

        def hook(p):
            # fp32 += 16-bit: the accumulation across micro-batches happens in fp32.
            group.grad[start:start + n].add_(p.grad.reshape(-1))
            p.grad = None
        return hook

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler else loss

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad.zero_()

    # ---- the step ---------------------------------------------------------------------------
    def _reduce_grads(self) -> None:
        group = self.topo.dp_group
        if group is None:
            return
        world = dist.get_world_size(group)
        for g in self.groups:
            # Reduced in fp32, averaged over data-parallel replicas (Megatron's convention).
            g.grad.div_(world)
            dist.all_reduce(g.grad, group=group)

    def grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.groups[0].grad.device)
        for g in self.groups:
            sq += g.grad.double().pow(2).sum().float() if g.grad.numel() else 0.0
        return sq.sqrt()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        self._reduce_grads()
        if self.scaler:
            inv = 1.0 / self.scaler.scale
            for g in self.groups:
                g.grad.mul_(inv)
        norm_t = self.grad_norm()
        norm = float(norm_t)
        found_inf = not math.isfinite(norm)
        if self.scaler:
            old_scale = self.scaler.scale
            self.scaler.update(found_inf)
        else:
            old_scale = None
        if found_inf:
            self.zero_grad()
            return StepResult(grad_norm=norm, skipped=True, loss_scale=old_scale)
        clip = self.cfg.clip_grad
        coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
        if coeff < 1.0:
            for g in self.groups:
                g.grad.mul_(coeff)
        self.step_count += 1
        b1, b2, eps = self.cfg.beta1, self.cfg.beta2, self.cfg.eps
        bc1 = 1.0 - b1 ** self.step_count
        bc2 = 1.0 - b2 ** self.step_count
        for g in self.groups:
            # AdamW (decoupled weight decay), as apex FusedAdam(adam_w_mode=True) / torch AdamW.
            g.exp_avg.mul_(b1).add_(g.grad, alpha=1.0 - b1)
            g.exp_avg_sq.mul_(b2).addcmul_(g.grad, g.grad, value=1.0 - b2)
            denom = (g.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
            if g.weight_decay:
                g.master.mul_(1.0 - lr * g.weight_decay)
            g.master.addcdiv_(g.exp_avg, denom, value=-lr / bc1)
            g.compute.copy_(g.master)
        self.zero_grad()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=old_scale)

    # ---- state in logical (per-parameter) coordinates ----------------------------------------
    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: g.view(g.master, n) for g in self.groups for n in g.names}

    def optim_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.groups:
            for n in g.names:
                out[f"exp_avg.{n}"] = g.view(g.exp_avg, n)
                out[f"exp_avg_sq.{n}"] = g.view(g.exp_avg_sq, n)
        return out

    def scalar_state(self) -> dict:
        return {"step_count": self.step_count,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    @torch.no_grad()
    def load_state(self, master: dict[str, torch.Tensor], optim: dict[str, torch.Tensor] | None,
                   scalars: dict | None) -> None:
        for g in self.groups:
            for n in g.names:
                if n not in master:
                    raise KeyError(f"checkpoint has no weights for parameter {n}")
                g.view(g.master, n).copy_(master[n])
                if optim:
                    g.view(g.exp_avg, n).copy_(optim[f"exp_avg.{n}"])
                    g.view(g.exp_avg_sq, n).copy_(optim[f"exp_avg_sq.{n}"])
            g.compute.copy_(g.master)
        if scalars:
            self.step_count = int(scalars.get("step_count", 0))
            if self.scaler and scalars.get("scaler"):
                self.scaler.load_state_dict(scalars["scaler"])
