"""The ZeRO engine: BLOOM's BF16Optimizer semantics (compute in bf16/fp16/fp32, fp32 master
weights, fp32 gradient accumulation across micro-batches, fp32 reductions, AdamW on the masters)
with ZeRO data parallelism over dp (Rajbhandari et al., arXiv 1910.02054), stages 0-3.

The engine composes one piece per concern, each in its own module of this package: the stage
table (stages.py), the layout of parameters in flat buffers (segments.py), the buffers and the
parameters as views into them (buffers.py), gradient reduction (reduce.py), stage 3's gathers
(gather.py), the step (step.py; offload.py runs it in host memory under ZeRO-Offload), state in
logical coordinates (state.py), memory accounting (memory.py), the gradient analyser (stats.py)
and the clock of waits on dp peers (waits.py). Tensor and pipeline parallelism
reach it only through the parameters' specs (bloomtrain.model.params): partial-over-tp
gradients, the tied embedding's copies, which parameters the global norm counts.

Usage: `step(lr)` once per global batch, after every micro-batch's backward of
`scale_loss(loss)` (the fp16 loss scale; identity otherwise). `step(lr, grad_stats=True)` also
returns the per-block gradient statistics on the StepResult (every rank on the same step: they
take one collective). `waits.take()` is the time stalled on dp peers since the last take.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from bloomtrain.errors import UserError
from bloomtrain.model.bloom import BloomBlock
from bloomtrain.model.params import EMBEDDING
from bloomtrain.optim import DynamicLossScaler
from bloomtrain.parallel.zero import state, stats
from bloomtrain.parallel.zero.buffers import FlatBuffers, Values
from bloomtrain.parallel.zero.gather import Stage3Gatherer, Unit
from bloomtrain.parallel.zero.memory import Counters, formula
from bloomtrain.parallel.zero.offload import HostOptimizer
from bloomtrain.parallel.zero.reduce import GradReducer
from bloomtrain.parallel.zero.segments import build_layout
from bloomtrain.parallel.zero.stages import stage_rules
from bloomtrain.parallel.zero.step import (StepResult, adamw, clip_coefficient, grad_norm,
                                           refresh_compute)
from bloomtrain.parallel.zero.waits import WaitClock
from bloomtrain.runtime import torch_dtype



def find_units(modules: list[nn.Module], unit_types: tuple) -> list[nn.Module]:
    """Each `unit_types` module as a whole, and every other module that owns parameters
    directly, in module order."""
    units = []

    def visit(m):
        if isinstance(m, unit_types):
            units.append(m)
            return
        if any(True for _ in m.parameters(recurse=False)):
            units.append(m)
        for child in m.children():
            visit(child)
    for m in modules:
        visit(m)
    return units


def _group_units(modules, specs, unit_types):
    """(groups of (name, param, spec) in forward order, units with the groups they use). A
    parameter belongs to the first unit that holds it; a later user (the LM head of a tied
    embedding) uses that group."""
    names = {}
    for m in modules:
        for n, p in m.named_parameters():
            names.setdefault(id(p), n)
    groups, group_of, units = [], {}, []
    for m in find_units(modules, unit_types):
        params = list(m.parameters(recurse=isinstance(m, unit_types)))
        fresh = [p for p in params if id(p) not in group_of and p.requires_grad]
        if fresh:
            for p in fresh:
                group_of[id(p)] = len(groups)
            groups.append([(names[id(p)], p, specs[names[id(p)]]) for p in fresh])
        used = sorted({group_of[id(p)] for p in params if id(p) in group_of})
        units.append(Unit(m, used))
    return groups, units


class ZeroEngine:
    def __init__(self, modules: list[nn.Module], specs: dict, topo, optim_cfg, precision: str,
                 zero_stage: int = 0, bucket_size_mb: float = 25, device=None,
                 values: Values | None = None, prefetch: bool = True,
                 unit_types: tuple = (BloomBlock,), offload: bool = False):
        self.cfg, self.topo, self.precision = optim_cfg, topo, precision
        self.rules = stage_rules(zero_stage)
        self.compute_dtype = torch_dtype(precision)
        self.step_count = 0
        self.scaler = (DynamicLossScaler(optim_cfg.initial_loss_scale, optim_cfg.loss_scale_window,
                                         optim_cfg.hysteresis, optim_cfg.min_loss_scale)
                       if precision == "fp16" else None)
        frozen = [n for m in modules for n, p in m.named_parameters() if not p.requires_grad]
        if frozen:
            raise UserError(f"parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} do not "
                            f"require grad; the engine trains every parameter of the model")
        groups, units = _group_units(modules, specs, unit_types)
        if not groups:
            raise UserError("the optimizer got no trainable parameters")
        bucket = max(1, int(bucket_size_mb * 2 ** 20 / 4))
        layout = build_layout(groups, topo.dp_size, topo.tp_rank, bucket,
                              per_group=self.rules.shard_params)
        if device is None:
            device = groups[0][0][1].device
        self.bufs = FlatBuffers(layout, self.rules, topo.dp_size, topo.dp_rank,
                                self.compute_dtype, device, offload=offload)
        self.host = HostOptimizer(self.bufs, topo) if offload else None
        if self.bufs.device.type != "meta":
            self.bufs.materialize(values or _copy_values)
        self.bufs.bind(modules)
        self.counters = Counters()
        self.waits = WaitClock(self.bufs.device)
        self.reducer = GradReducer(self.bufs, topo, self.counters, waits=self.waits)
        self.gatherer = (Stage3Gatherer(self.bufs, topo, self.counters, units, prefetch,
                                        on_backward=self.reducer.queue_end_of_backward,
                                        waits=self.waits)
                         if self.rules.shard_params else None)
        self._num_blocks = stats.num_blocks_of(modules)
        self._analyser: stats.Analyser | None = None  # built on the first analysed step
        if self.gatherer is not None:
            self.reducer.on_group_done = self.gatherer.free
        self._hooks: list = []
        self.install_hooks()

    @property
    def stage(self) -> int:
        return self.rules.stage

    # ---- loss scaling ----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler else loss

    def zero_grad(self) -> None:
        self.bufs.grad.zero_()

    # ---- the step --------------------------------------------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.bufs, self.topo)

    @torch.no_grad()
    def step(self, lr: float, grad_stats: bool = False) -> StepResult:
        self.reducer.reduce_for_step()
        if self.host:
            self.host.grads_to_host()  # in flight while the norm is computed
        norm = float(self.grad_norm())
        scale = self.scaler.scale if self.scaler else None
        if self.scaler:
            norm /= scale
        found_inf = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(found_inf)
        analysed = self._analyse(scale) if grad_stats else None
        if analysed is not None:
            # Before a skip zeroes them: an overflowing step's statistics say where it overflowed.
            analysed.grads()
        if found_inf:
            if self.host:
                self.host.wait()  # the copies still read the gradients about to be zeroed
            self.zero_grad()
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale,
                              grad_stats=analysed.finish() if analysed is not None else None)
        self.step_count += 1
        coeff = clip_coefficient(norm, self.cfg.clip_grad, scale)
        segments = self.bufs.layout.segments
        if self.host:
            self.host.step(self.cfg, lr, self.step_count, coeff, observe=analysed)
        elif analysed is not None:
            for seg in segments:  # the same bits as one call (stats.py)
                with analysed.update(seg):
                    adamw(self.bufs, [seg], None, self.cfg, lr, self.step_count, coeff)
            refresh_compute(self.bufs, self.topo)
        else:
            adamw(self.bufs, segments, None, self.cfg, lr, self.step_count, coeff)
            refresh_compute(self.bufs, self.topo)
        self.zero_grad()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=scale,
                          grad_stats=analysed.finish() if analysed is not None else None)

    def _analyse(self, loss_scale: float | None) -> stats.StepStats:
        if self._analyser is None:
            if self._num_blocks is None:
                raise ValueError("the gradient analyser needs BLOOM modules (a model shape with "
                                 "num_layers)")
            self._analyser = stats.Analyser(self.bufs, self.topo, self._num_blocks)
        return self._analyser.begin(loss_scale)

    # ---- state -----------------------------------------------------------------------------------
    def fragments(self) -> list:
        return state.fragments(self.bufs, self.topo)

    def load_state(self, master, optim, scalars: dict | None) -> None:
        state.load_state(self.bufs, master, optim)
        if scalars:
            self.step_count = int(scalars.get("step_count", 0))
            if self.scaler and scalars.get("scaler"):
                self.scaler.load_state_dict(scalars["scaler"])

    def scalar_state(self) -> dict:
        return {"step_count": self.step_count, "zero_stage": self.stage,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def master_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 masters by local name (tp-local); a collective over dp."""
        return state.full_state(self.bufs, self.bufs.master, self.topo)

    def optim_state(self) -> dict[str, torch.Tensor]:
        """Full Adam moments, keys `exp_avg.NAME` / `exp_avg_sq.NAME`; a collective over dp."""
        return {**state.full_state(self.bufs, self.bufs.exp_avg, self.topo, "exp_avg."),
                **state.full_state(self.bufs, self.bufs.exp_avg_sq, self.topo, "exp_avg_sq.")}

    # ---- accounting ------------------------------------------------------------------------------
    def num_local_parameters(self) -> int:
        return sum(s.numel for s in self.bufs.layout.slots)

    def memory_report(self) -> dict:
        """Model-state bytes on the training device by category from the buffers, next to
        formula(); plus the transient terms of the step's peak (memory.py). Under offload,
        `measured["host"]` holds the host's bytes by category (formula: `["host"]`)."""
        measured = self.bufs.nbytes()
        measured["total"] = sum(measured.values())
        host = self.bufs.host_nbytes()
        measured["host"] = {**host, "total": sum(host.values())}
        measured["gathered_peak"] = self.counters.gathered_peak
        measured["grad_staging_peak"] = self.counters.staging_peak
        measured["compute_grads_held"] = self.compute_grads_held()
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        return {"stage": self.stage, "dp": self.topo.dp_size, "offload": self.bufs.offload,
                "psi": self.num_local_parameters(), "measured": measured,
                "formula": formula(self.stage, self.num_local_parameters(), self.topo.dp_size, c,
                                   offload=self.bufs.offload)}

    def compute_grads_held(self) -> int:
        """Bound on the compute-dtype parameter gradients alive at once before the engine takes
        them. One parameter's at a time, except for a tied LM head and embedding on one stage
        (one Parameter used twice): autograd holds the head's share of the embedding gradient
        from the head's backward to the embedding's, then adds the embedding's share to it, so
        three embedding-sized gradients exist at that moment."""
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        largest = max(s.numel for s in self.bufs.layout.slots)
        tied_here = [s.numel for s in self.bufs.layout.slots
                     if s.spec.name == EMBEDDING and not s.spec.tied]
        return c * max([largest] + [3 * n for n in tied_here])

    def working_set_bound(self) -> int:
        """Stage 3's gathered bytes can reach: the two largest units (current + prefetched) and
        the group of a tied embedding, which its LM head uses again."""
        if self.gatherer is None:
            return 0
        c = torch.empty(0, dtype=self.compute_dtype).element_size()
        size = {g.index: g.padded for g in self.bufs.layout.groups if g.segments}
        per_unit = sorted((sum(size[g] for g in u.groups) for u in self.gatherer.units),
                          reverse=True)
        used = [g for u in self.gatherer.units for g in u.groups]
        shared = sum(size[g] for g in set(used) if used.count(g) > 1)
        return c * (sum(per_unit[:2]) + shared)

    def install_hooks(self) -> None:
        """The gradient hooks on the parameters and stage 3's gather hooks on the units."""
        self.remove_hooks()
        self._hooks = self.reducer.hooks() + (self.gatherer.hooks() if self.gatherer else [])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _copy_values(param: nn.Parameter, spec, start: int, out: torch.Tensor) -> None:
    """Default first values: the parameter's own (a module built on a device)."""
    out.copy_(param.detach().reshape(-1)[start:start + out.numel()])
