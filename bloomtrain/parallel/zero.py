"""ZeRO data parallelism, stages 0-3 (Rajbhandari et al., arXiv 1910.02054), over flat buffers,
with the semantics of BLOOM's BF16Optimizer (DeepSpeed `runtime/bf16_optimizer.py`): compute
parameters in bf16 (or fp16/fp32), fp32 master weights, **fp32 gradient accumulation across
micro-batches**, fp32 gradient reduction, AdamW on the fp32 masters.

Layout. The parameters are packed into *segments*, each a contiguous run of a flat buffer and each
sharded across the dp ranks on its own: a segment of P elements (padded to a multiple of dp) is
split into dp shards of S = P/dp, and dp rank r owns [r*S, (r+1)*S). Stages 0-2 form segments by
greedily filling buckets of `bucket_size_mb` (of fp32 gradient), so a segment is also the unit of
every bucketed collective; stage 3 makes one segment per *unit* (each BloomBlock, and each other
module that owns parameters: embedding, its LayerNorm, ln_f, an untied head), so a unit is gathered
by one all-gather. A tied embedding is always a segment of its own: its first- and last-stage
copies then shard identically, so their shards can be all-reduced over the embedding group.
Within a segment the weight-decay parameters come first, so a shard's decayed part is one range.

Buffers per rank (Ψ = parameters on this rank, i.e. tp-local and of this pipeline stage; N = dp;
c = bytes of the compute dtype, 2 for bf16):

    stage  compute  master  grad   Adam m+v  ours (bf16)       ZeRO paper (fp16 grads)
    0      cΨ       4Ψ      4Ψ     8Ψ        18Ψ               baseline  16Ψ
    1      cΨ       4Ψ/N    4Ψ     8Ψ/N      2Ψ + 4Ψ + 12Ψ/N   P_os      4Ψ + 12Ψ/N
    2      cΨ       4Ψ/N    4Ψ/N   8Ψ/N      2Ψ + 16Ψ/N        P_os+g    2Ψ + 14Ψ/N
    3      cΨ/N     4Ψ/N    4Ψ/N   8Ψ/N      18Ψ/N + W         P_os+g+p  16Ψ/N

We differ from the paper by keeping gradients in fp32 (the paper counts 2Ψ of fp16 gradients):
stage 1 holds BF16Optimizer's full fp32 accumulator (4Ψ, as BLOOM did), and stages 2-3 shard an
fp32 accumulator (4Ψ/N instead of 2Ψ/N). W is stage 3's working set of gathered units, at most
c·(two blocks + the tied embedding), independent of N (the embedding stays gathered from the
head's backward to its own, because its one gradient only exists then). `formula()` computes
both columns; `memory_report()` measures the buffers.

Communication per step over dp, in elements (Ψ): stage 0 all-reduces fp32 gradients (2Ψ as
reduce-scatter + all-gather); stages 1-2 reduce-scatter fp32 gradients (Ψ) and all-gather compute
parameters (Ψ) = 2Ψ; stage 3 all-gathers compute parameters in forward (Ψ) and backward (Ψ) and
reduce-scatters fp32 gradients (Ψ) = 3Ψ, plus Ψ_emb when the head is tied to the embedding in
one stage (every use is a gather: the head's forward is a second use). Stages 2 and 3 reduce
every micro-batch (they keep no full accumulator), so with m micro-batches their reduce-scatter
moves mΨ. `bucket_size_mb` sizes stage 0-2 segments; stage 3's segments are its units.

Overlap. Stages 2-3 reduce-scatter a segment asynchronously from the post-accumulate-grad hook
of its last parameter, so reduction overlaps the rest of backward; a callback at the end of each
backward pass flushes partial segments and waits. This works per backward call, so it works under
any pipeline schedule. Stage 3 prefetches the next unit's all-gather (in the recorded forward
order; the previous one in backward). Stages 0-1 cannot overlap: they reduce once per step, after
the last micro-batch, and which backward is the last is known only to the caller (under a
pipeline schedule a stage's last backward is interleaved with its neighbours' sends), so they
reduce in bucketed collectives at `step()`.

Tensor and pipeline parallelism (attributes set by bloomtrain.parallel.tensor / .pipeline):
`grad_needs_tp_allreduce` grads (sequence parallelism) are summed over tp and `tied_embedding`
grads over the embedding group. Both sums are linear, so they are taken on the dp-reduced shard
(1/N of the bytes) rather than before the dp reduction. The global grad norm counts every logical
parameter once: `tied_embedding_copy` never, `tp_replicated` on tp rank 0 only; squares are summed
over this rank's shard, then over dp (stages 1-3, where ranks hold different shards) and over the
model group (tp × pp).

A step: finish reductions -> tp / embedding sums -> global norm of the (scaled) gradients ->
non-finite: skip (every rank agrees, the norm is global; the caller logs it) -> unscale and clip
in one multiply -> AdamW on this rank's fp32 shard -> cast to the compute dtype -> all-gather
(stages 1-2) -> zero the accumulators.

State is exposed in logical coordinates, by HF parameter name, tp-local: `master_state()` and
`optim_state()` return full tensors (a collective over dp in stages 1-3: every dp rank must call
them), `sharded_state()` returns this rank's fragment of each parameter with its (offset, numel)
in the flattened parameter, and `load_state()` takes full tensors and keeps its shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from bloomtrain.optim import DynamicLossScaler, no_weight_decay
from bloomtrain.parallel import comm
from bloomtrain.topology import Topology
from bloomtrain.utils import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DP = "dp"


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float | None


@dataclass
class _Entry:
    name: str
    param: nn.Parameter
    start: int          # offset in its segment
    numel: int
    shape: torch.Size
    counted: bool       # counts towards the global grad norm on this rank
    tp_sum: bool        # grad is a partial sum over tp (sequence parallelism)


@dataclass
class _Segment:
    index: int
    entries: list[_Entry]
    numel: int
    padded: int         # P, a multiple of dp
    shard: int          # S = P / dp
    decay_end: int      # [0, decay_end) gets weight decay
    full_off: int = 0   # offset in full-size flat buffers
    shard_off: int = 0  # offset in shard-size flat buffers
    tied: bool = False
    # stage 3: the gathered compute copy, whose storage is resized to 0 when freed
    full: torch.Tensor | None = None
    gathered: bool = False
    gather_handle: object = None
    # stages 2-3: this micro-batch's fp32 gradients of the segment, until reduce-scattered
    staging: torch.Tensor | None = None
    received: int = 0


@dataclass
class _Unit:
    module: nn.Module
    segments: list[_Segment] = field(default_factory=list)


def _named_params(model) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Module]]:
    """(name, param) pairs, deduplicated by identity, and the modules they came from."""
    if isinstance(model, nn.Module):
        modules = [model]
    elif all(isinstance(m, nn.Module) for m in model):
        modules = list(model)
    else:
        return _dedup(list(model)), []
    return _dedup([np for m in modules for np in m.named_parameters()]), modules


def _dedup(named):
    seen, out = set(), []
    for n, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _find_units(modules: list[nn.Module], unit_types: tuple) -> list[nn.Module]:
    """Modules that get gather/free hooks in stage 3: each `unit_types` module as a whole, and
    every other module that owns parameters directly (not inside a unit)."""
    units = []

    def visit(m):
        if isinstance(m, unit_types):
            units.append(m)
            return
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            units.append(m)
        for child in m.children():
            visit(child)
    for m in modules:
        visit(m)
    return units


def _unit_params(m: nn.Module, unit_types: tuple) -> list[nn.Parameter]:
    return [p for p in m.parameters(recurse=isinstance(m, unit_types)) if p.requires_grad]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def formula(stage: int, psi: int, dp: int, compute_bytes: int = 2,
            working: int = 0) -> dict[str, float]:
    """Model-state bytes per rank for `psi` parameters on this rank: our layout (by category and
    total) and the ZeRO paper's figure (fp16 params and grads, K = 12). `working` is stage 3's
    gathered working set in bytes, added to ours."""
    c, n = compute_bytes, dp
    sharded = {0: (False, False, False), 1: (True, False, False),
               2: (True, True, False), 3: (True, True, True)}[stage]
    opt_div, grad_div, param_div = (n if s else 1 for s in sharded)
    ours = {
        "compute_params": c * psi / param_div,
        "fp32_master": 4 * psi / opt_div,
        "fp32_grads": 4 * psi / grad_div,
        "adam_m": 4 * psi / opt_div,
        "adam_v": 4 * psi / opt_div,
    }
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
             3: 16 * psi / n}[stage]
    return {**ours, "ours": sum(ours.values()), "working": float(working), "paper": paper}


class MixedPrecisionOptimizer:
    """AdamW with BF16Optimizer semantics and ZeRO sharding over dp.

    `model`: a module, a list of modules (pipeline chunks), or a list of (name, param); names are
    HF names. Stage 3 needs modules (it hooks them). With fp16, scale the loss with
    `scale_loss()`. Call `step(lr)` once per global batch, after every micro-batch's backward."""

    def __init__(self, model, optim_cfg, precision: str, topo: Topology | None = None,
                 zero_stage: int = 0, bucket_size_mb: float = 25, prefetch: bool = True,
                 unit_types: tuple | None = None):
        if zero_stage not in (0, 1, 2, 3):
            raise UserError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        self.cfg = optim_cfg
        self.precision = precision
        self.compute_dtype = DTYPES[precision]
        self.topo = topo or Topology.single()
        self.stage = zero_stage
        self.prefetch = prefetch
        self.step_count = 0
        self.scaler = (DynamicLossScaler(optim_cfg.initial_loss_scale, optim_cfg.loss_scale_window,
                                         optim_cfg.hysteresis, optim_cfg.min_loss_scale)
                       if precision == "fp16" else None)
        self.dp_group = self.topo.dp_group
        self.dp_size = comm.group_size(self.dp_group)
        self.dp_rank = comm.group_rank(self.dp_group)
        if unit_types is None:
            from bloomtrain.model.bloom import BloomBlock
            unit_types = (BloomBlock,)
        named, modules = _named_params(model)
        if not named:
            raise UserError("the optimizer got no trainable parameters")
        if zero_stage == 3 and not modules:
            raise UserError("parallel.zero_stage=3 gathers parameters by module hooks: pass the "
                            "model (or its pipeline chunks) as modules, not (name, param) pairs")
        self.device = named[0][1].device
        self.names = [n for n, _ in named]
        self._param_name = {id(p): n for n, p in named}

        # Units: the granularity of stage-3 gathers, and of bucket filling otherwise.
        if modules:
            unit_modules = _find_units(modules, unit_types)
            grouped, assigned = [], set()
            for m in unit_modules:
                ps = [p for p in _unit_params(m, unit_types)
                      if id(p) in self._param_name and id(p) not in assigned]
                assigned.update(id(p) for p in ps)
                grouped.append(ps)
            leftovers = [p for _, p in named if id(p) not in assigned]
            if leftovers and zero_stage == 3:
                raise UserError("zero_stage=3: parameters " + ", ".join(
                    self._param_name[id(p)] for p in leftovers) + " belong to no module")
            grouped += [[p] for p in leftovers]
        else:
            unit_modules, grouped = [], [[p] for _, p in named]

        bucket_elems = max(1, int(bucket_size_mb * 2 ** 20 / 4))
        runs: list[list[nn.Parameter]] = []   # parameter runs that become segments
        open_run = False                       # may the last run take more parameters?
        for ps in grouped:
            plain = [p for p in ps if not getattr(p, "tied_embedding", False)]
            runs += [[p] for p in ps if getattr(p, "tied_embedding", False)]
            if any(getattr(p, "tied_embedding", False) for p in ps):
                open_run = False
            if not plain:
                continue
            size = sum(q.numel() for q in plain)
            if zero_stage == 3 or not open_run or sum(q.numel() for q in runs[-1]) + size \
                    > bucket_elems:
                runs.append([])
            runs[-1].extend(plain)
            open_run = zero_stage != 3
        self.segments = [self._make_segment(i, run) for i, run in enumerate(runs)]
        full_off = shard_off = 0
        for seg in self.segments:
            seg.full_off, seg.shard_off = full_off, shard_off
            full_off += seg.padded
            shard_off += seg.shard
        self.full_numel, self.shard_numel = full_off, shard_off
        self._build_buffers(named)
        self._entry_of = {id(e.param): (seg, e) for seg in self.segments for e in seg.entries}

        self.units: list[_Unit] = []
        if zero_stage == 3:
            for m in unit_modules:
                seg_ids = {self._entry_of[id(p)][0].index for p in _unit_params(m, unit_types)
                           if id(p) in self._entry_of}
                self.units.append(_Unit(m, [self.segments[i] for i in sorted(seg_ids)]))
        self._unit_of = {id(u.module): u for u in self.units}
        self._forward_order: list[_Unit] = []
        self._order_done = False
        # (segment, fp32 staging being reduced, output shard, work handle)
        self._inflight: list[tuple[_Segment, torch.Tensor, torch.Tensor, object]] = []
        self._callback_queued = False
        self.gathered_bytes = 0
        self.gathered_peak = 0
        self.staging_bytes = 0
        self.staging_peak = 0
        self.num_prefetches = 0
        self._hooks = []
        self._install_hooks()

    # ---- layout ----------------------------------------------------------------------------
    def _make_segment(self, index: int, params: list[nn.Parameter]) -> _Segment:
        tp_rank = self.topo.tp_rank
        decay = [p for p in params if not no_weight_decay(self._param_name[id(p)], p.ndim)]
        no_decay = [p for p in params if no_weight_decay(self._param_name[id(p)], p.ndim)]
        entries, off = [], 0
        for p in decay + no_decay:
            counted = not getattr(p, "tied_embedding_copy", False) and not (
                getattr(p, "tp_replicated", False) and tp_rank != 0)
            entries.append(_Entry(self._param_name[id(p)], p, off, p.numel(), p.shape, counted,
                                  bool(getattr(p, "grad_needs_tp_allreduce", False))))
            off += p.numel()
        padded = -(-off // self.dp_size) * self.dp_size
        return _Segment(index, entries, off, padded, padded // self.dp_size,
                        sum(p.numel() for p in decay),
                        tied=any(getattr(p, "tied_embedding", False) for p in params))

    def _own(self, seg: _Segment) -> tuple[int, int]:
        """The range of `seg` whose master weights and moments this rank holds and updates."""
        if self.stage == 0:
            return 0, seg.padded
        return self.dp_rank * seg.shard, (self.dp_rank + 1) * seg.shard

    def _partition(self, seg: _Segment) -> tuple[int, int]:
        """This dp rank's 1/N of `seg`, at every stage (the checkpoint fragments)."""
        return self.dp_rank * seg.shard, (self.dp_rank + 1) * seg.shard

    def _state_view(self, buf: torch.Tensor, seg: _Segment) -> torch.Tensor:
        lo, hi = self._own(seg)
        off = seg.full_off if self.stage == 0 else seg.shard_off
        return buf[off:off + hi - lo]

    def _grad_view(self, seg: _Segment) -> torch.Tensor:
        """fp32 gradient of the own range (valid after the dp reduction)."""
        if self.stage >= 2:
            return self.grad[seg.shard_off:seg.shard_off + seg.shard]
        lo, hi = self._own(seg)
        return self.grad[seg.full_off + lo:seg.full_off + hi]

    @torch.no_grad()
    def _build_buffers(self, named) -> None:
        cd, dev = self.compute_dtype, self.device
        state_numel = self.full_numel if self.stage == 0 else self.shard_numel
        self.master = torch.zeros(state_numel, dtype=torch.float32, device=dev)
        self.exp_avg = torch.zeros(state_numel, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(state_numel, dtype=torch.float32, device=dev)
        self.grad = torch.zeros(self.full_numel if self.stage <= 1 else self.shard_numel,
                                dtype=torch.float32, device=dev)
        self.compute = torch.zeros(self.full_numel if self.stage <= 2 else self.shard_numel,
                                   dtype=cd, device=dev)
        for seg in self.segments:
            lo, hi = self._own(seg)
            # Every rank starts from the same full weights; each keeps its own range of them.
            values = torch.zeros(seg.padded, dtype=torch.float32, device=dev)
            for e in seg.entries:
                values[e.start:e.start + e.numel].copy_(e.param.detach().reshape(-1))
            self._state_view(self.master, seg).copy_(values[lo:hi])
            if self.stage <= 2:
                base = self.compute[seg.full_off:seg.full_off + seg.padded]
                base.copy_(values)
            else:
                self.compute[seg.shard_off:seg.shard_off + seg.shard].copy_(values[lo:hi])
                base = torch.empty(seg.padded, dtype=cd, device=dev)
                seg.full = base
            for e in seg.entries:
                # The parameter becomes a view into the flat compute buffer (stage 3: into the
                # unit's gathered buffer, whose storage is released right below).
                e.param.data = base[e.start:e.start + e.numel].view(e.shape)
            if self.stage == 3:
                base.untyped_storage().resize_(0)

    # ---- hooks -----------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for seg in self.segments:
            for e in seg.entries:
                if self.stage <= 1:
                    hook = self._accumulate_hook(seg, e)
                else:
                    hook = self._reduce_hook(seg, e)
                self._hooks.append(e.param.register_post_accumulate_grad_hook(hook))
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda m, args, u=unit: self._pre_forward(u)))
            self._hooks.append(unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self._post_forward(u, out)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _accumulate_hook(self, seg: _Segment, e: _Entry):
        start = seg.full_off + e.start

        def hook(p):
            # fp32 += 16-bit: the accumulation across micro-batches happens in fp32 (DeepSpeed's
            # hp_grad.add_(lp.grad)), and only one micro-batch of 16-bit gradient is ever alive.
            self.grad[start:start + e.numel].add_(p.grad.reshape(-1))
            p.grad = None
        return hook

    def _reduce_hook(self, seg: _Segment, e: _Entry):
        def hook(p):
            self._queue_end_of_backward()
            if seg.staging is None:
                # Zeros: padding, and parameters that get no gradient this pass, add nothing.
                seg.staging = torch.zeros(seg.padded, dtype=torch.float32, device=self.device)
                self._track_staging(seg.padded * 4)
            seg.staging[e.start:e.start + e.numel].copy_(p.grad.reshape(-1))
            p.grad = None
            seg.received += 1
            if seg.received == len(seg.entries):
                self._launch_reduce_scatter(seg)
                if self.stage == 3:
                    # Every use of these weights in this backward is done: the last gradient
                    # contribution has been accumulated.
                    self._free(seg)
        return hook

    def _track_staging(self, delta: int) -> None:
        self.staging_bytes += delta
        self.staging_peak = max(self.staging_peak, self.staging_bytes)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._finish_reductions()
        if self.stage == 3:
            for seg in self.segments:
                self._free(seg)

    def _launch_reduce_scatter(self, seg: _Segment) -> None:
        out = torch.empty(seg.shard, dtype=torch.float32, device=self.device)
        # Reduced in fp32; summed here, averaged over dp at the step.
        handle = comm.reduce_scatter_tensor(out, seg.staging, self.dp_group, DP, async_op=True)
        # The next micro-batch's gradients go to a fresh staging buffer while this one is read.
        self._inflight.append((seg, seg.staging, out, handle))
        seg.staging, seg.received = None, 0
        # Two reductions in flight overlap backward enough; more would only hold staging memory.
        while len(self._inflight) > 2:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        seg, staging, out, handle = self._inflight.pop(0)
        if handle is not None:
            handle.wait()
        self.grad[seg.shard_off:seg.shard_off + seg.shard].add_(out)
        self._track_staging(-staging.numel() * 4)

    def _finish_reductions(self) -> None:
        if self.stage < 2:
            return
        for seg in self.segments:
            if seg.received:
                self._launch_reduce_scatter(seg)
        while self._inflight:
            self._complete_oldest()

    # ---- stage 3: gather before use, free after ----------------------------------------------
    def _gather(self, seg: _Segment, async_op: bool = False) -> None:
        if seg.gathered:
            if seg.gather_handle is not None and not async_op:
                seg.gather_handle.wait()
                seg.gather_handle = None
            return
        nbytes = seg.padded * seg.full.element_size()
        seg.full.untyped_storage().resize_(nbytes)
        self.gathered_bytes += nbytes
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)
        shard = self.compute[seg.shard_off:seg.shard_off + seg.shard]
        handle = comm.all_gather_into_tensor(seg.full, shard, self.dp_group, DP, async_op=async_op)
        seg.gathered = True
        seg.gather_handle = handle if async_op else None

    def _free(self, seg: _Segment) -> None:
        if not seg.gathered:
            return
        if seg.gather_handle is not None:
            seg.gather_handle.wait()
            seg.gather_handle = None
        seg.full.untyped_storage().resize_(0)
        seg.gathered = False
        self.gathered_bytes -= seg.padded * seg.full.element_size()

    def _prefetch(self, unit: _Unit | None) -> None:
        if unit is None or not self.prefetch:
            return
        for seg in unit.segments:
            if not seg.gathered:
                self.num_prefetches += 1
                self._gather(seg, async_op=True)

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        if not self._order_done:
            return None
        try:
            i = next(k for k, u in enumerate(self._forward_order) if u is unit)
        except StopIteration:
            return None
        j = i + step
        return self._forward_order[j] if 0 <= j < len(self._forward_order) else None

    def _pre_forward(self, unit: _Unit) -> None:
        in_backward = _in_backward()
        if not in_backward and not self._order_done:
            # The first forward records the order of units, which prefetching follows (in
            # reverse for backward); a unit seen twice means the pass has wrapped around.
            if any(u is unit for u in self._forward_order):
                self._order_done = True
            else:
                self._forward_order.append(unit)
        for seg in unit.segments:
            self._gather(seg)
        if not in_backward:
            self._prefetch(self._neighbour(unit, +1))

    def _post_forward(self, unit: _Unit, output) -> None:
        if _in_backward():
            # Recomputation under activation checkpointing: backward needs these weights next.
            return
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))
        for seg in unit.segments:
            self._free(seg)

    def _pre_backward(self, unit: _Unit) -> None:
        self._queue_end_of_backward()
        for seg in unit.segments:
            self._gather(seg)
        self._prefetch(self._neighbour(unit, -1))

    # ---- loss scaling ------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler else loss

    def zero_grad(self) -> None:
        self.grad.zero_()

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def _reduce_grads(self) -> None:
        """Sum gradients over dp (and tp / embedding partial sums), then average over dp."""
        self._finish_reductions()
        if self.stage <= 1 and self.dp_group is not None:
            for seg in self.segments:
                full = self.grad[seg.full_off:seg.full_off + seg.padded]
                if self.stage == 0:
                    comm.all_reduce(full, self.dp_group, DP)
                else:
                    out = torch.empty(seg.shard, dtype=torch.float32, device=self.device)
                    comm.reduce_scatter_tensor(out, full, self.dp_group, DP)
                    self._grad_view(seg).copy_(out)
        tp_parts = []
        for seg in self.segments:
            lo, hi = self._own(seg)
            g = self._grad_view(seg)
            for e in seg.entries:
                a, b = max(lo, e.start), min(hi, e.start + e.numel)
                if e.tp_sum and a < b:
                    tp_parts.append(g[a - lo:b - lo])
        comm.all_reduce_coalesced(tp_parts, self.topo.tp_group, "tp")
        comm.all_reduce_coalesced([self._grad_view(s) for s in self.segments if s.tied],
                              self.topo.embedding_group, "emb")
        if self.dp_size > 1:
            for seg in self.segments:
                self._grad_view(seg).div_(self.dp_size)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, every logical parameter counted once. A
        collective over dp and the model group."""
        # Squares are summed in fp64: an fp32 sum over millions of elements drifts by ~1e-5
        # relative, which would make the norm depend on the bucket layout. Chunks bound the
        # fp64 temporaries.
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for seg in self.segments:
            lo, hi = self._own(seg)
            g = self._grad_view(seg)
            for a, b in _counted_ranges(seg, lo, hi):
                for chunk in g[a - lo:b - lo].split(1 << 20):
                    sq += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
        if self.stage >= 1:
            comm.all_reduce(sq, self.dp_group, DP)
        comm.all_reduce(sq, self.topo.model_group, "model")
        return sq.sqrt()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        self._reduce_grads()
        norm = float(self.grad_norm())
        old_scale = self.scaler.scale if self.scaler else None
        if self.scaler:
            norm /= old_scale
        found_inf = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(found_inf)
        if found_inf:
            self.zero_grad()
            return StepResult(grad_norm=norm, skipped=True, loss_scale=old_scale)
        clip = self.cfg.clip_grad
        coeff = clip / (norm + 1e-6) if clip and clip > 0 else 1.0
        coeff = min(coeff, 1.0) / (old_scale or 1.0)
        self.step_count += 1
        b1, b2, eps = self.cfg.beta1, self.cfg.beta2, self.cfg.eps
        bc1 = 1.0 - b1 ** self.step_count
        bc2 = 1.0 - b2 ** self.step_count
        wd = self.cfg.weight_decay
        for seg in self.segments:
            g = self._grad_view(seg)
            if coeff != 1.0:
                g.mul_(coeff)
            m, v = self._state_view(self.exp_avg, seg), self._state_view(self.exp_avg_sq, seg)
            w = self._state_view(self.master, seg)
            # AdamW (decoupled weight decay), as apex FusedAdam(adam_w_mode=True) / torch AdamW.
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
            lo, hi = self._own(seg)
            if wd and seg.decay_end > lo:
                w[:min(hi, seg.decay_end) - lo].mul_(1.0 - lr * wd)
            w.addcdiv_(m, denom, value=-lr / bc1)
        self._refresh_compute()
        self.zero_grad()
        return StepResult(grad_norm=norm, skipped=False, loss_scale=old_scale)

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        """Cast the updated fp32 masters into the compute parameters (stages 1-2: then
        all-gather them, one bucketed collective per segment, in the compute dtype)."""
        if self.stage in (0, 3):
            self.compute.copy_(self.master)
            return
        for seg in self.segments:
            shard = self._state_view(self.master, seg).to(self.compute_dtype)
            full = self.compute[seg.full_off:seg.full_off + seg.padded]
            comm.all_gather_into_tensor(full, shard, self.dp_group, DP)

    # ---- state in logical (per-parameter) coordinates ------------------------------------------
    @torch.no_grad()
    def _full_segment(self, buf: torch.Tensor, seg: _Segment) -> torch.Tensor:
        view = self._state_view(buf, seg)
        if self.stage == 0 or self.dp_group is None:
            return view
        full = torch.empty(seg.padded, dtype=buf.dtype, device=buf.device)
        comm.all_gather_into_tensor(full, view.contiguous(), self.dp_group, DP)
        return full

    def _full_state(self, buf: torch.Tensor, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {}
        for seg in self.segments:
            full = self._full_segment(buf, seg)
            for e in seg.entries:
                out[prefix + e.name] = full[e.start:e.start + e.numel].view(e.shape).clone()
        return out

    def master_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 master weights by name (tp-local). Stages 1-3: a collective over dp, which
        every dp rank must call."""
        return self._full_state(self.master)

    def optim_state(self) -> dict[str, torch.Tensor]:
        """Full Adam moments, keys `exp_avg.NAME` / `exp_avg_sq.NAME`. Collective like
        master_state()."""
        return {**self._full_state(self.exp_avg, "exp_avg."),
                **self._full_state(self.exp_avg_sq, "exp_avg_sq.")}

    def sharded_state(self) -> dict[str, dict]:
        """This dp rank's fragment of each parameter, without communication: per name,
        {offset, numel, shape, master, exp_avg, exp_avg_sq, duplicate}, where offset/numel place
        the fragment in the flattened full (tp-local) parameter. Over the dp ranks the fragments
        of a parameter partition it (at stage 0 too, where each rank could write all of it).
        `duplicate` marks fragments another rank also holds (a tp-replicated parameter off tp
        rank 0, the last stage's copy of the tied embedding): a writer can skip them."""
        out = {}
        for seg in self.segments:
            plo, phi = self._partition(seg)
            olo, _ = self._own(seg)
            for e in seg.entries:
                a, b = max(plo, e.start), min(phi, e.start + e.numel)
                if a >= b:
                    continue
                frag = {"offset": a - e.start, "numel": b - a, "shape": tuple(e.shape),
                        "duplicate": not e.counted}
                for key, buf in (("master", self.master), ("exp_avg", self.exp_avg),
                                 ("exp_avg_sq", self.exp_avg_sq)):
                    frag[key] = self._state_view(buf, seg)[a - olo:b - olo].clone()
                out[e.name] = frag
        return out

    def scalar_state(self) -> dict:
        return {"step_count": self.step_count, "zero_stage": self.stage,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    @torch.no_grad()
    def load_state(self, master: dict[str, torch.Tensor], optim: dict[str, torch.Tensor] | None,
                   scalars: dict | None) -> None:
        """Take full (tp-local) per-parameter tensors, keep this rank's shard and refresh the
        compute parameters. No communication."""
        for seg in self.segments:
            lo, hi = self._own(seg)
            sources = [(self.master, master, "")]
            if optim:
                sources += [(self.exp_avg, optim, "exp_avg."),
                            (self.exp_avg_sq, optim, "exp_avg_sq.")]
            for buf, tensors, prefix in sources:
                view = self._state_view(buf, seg)
                for e in seg.entries:
                    key = prefix + e.name
                    if key not in tensors:
                        raise KeyError(f"checkpoint has no {prefix or 'weights '}"
                                       f"{'' if prefix else 'for parameter '}{e.name}")
                    a, b = max(lo, e.start), min(hi, e.start + e.numel)
                    if a < b:
                        flat = tensors[key].reshape(-1)
                        view[a - lo:b - lo].copy_(flat[a - e.start:b - e.start])
            if self.stage in (1, 2):
                for e in seg.entries:
                    base = self.compute[seg.full_off + e.start:seg.full_off + e.start + e.numel]
                    base.copy_(master[e.name].reshape(-1))
        if self.stage in (0, 3):
            self.compute.copy_(self.master)
        if scalars:
            self.step_count = int(scalars.get("step_count", 0))
            if self.scaler and scalars.get("scaler"):
                self.scaler.load_state_dict(scalars["scaler"])

    # ---- accounting ----------------------------------------------------------------------------
    def num_local_parameters(self) -> int:
        return sum(seg.numel for seg in self.segments)

    def memory_report(self) -> dict:
        """Model-state bytes on this rank by category, measured from the buffers' storage, plus
        stage 3's peak of gathered working copies and the peak of in-flight fp32 gradient
        buckets (stages 2-3; transient, not model state), next to formula()."""
        def nbytes(t):
            return t.untyped_storage().nbytes()
        measured = {
            "compute_params": nbytes(self.compute),
            "fp32_master": nbytes(self.master),
            "fp32_grads": nbytes(self.grad),
            "adam_m": nbytes(self.exp_avg),
            "adam_v": nbytes(self.exp_avg_sq),
        }
        measured["total"] = sum(measured.values())
        measured["gathered_peak"] = self.gathered_peak
        measured["grad_staging_peak"] = self.staging_peak
        return {"stage": self.stage, "dp": self.dp_size, "psi": self.num_local_parameters(),
                "measured": measured,
                "formula": formula(self.stage, self.num_local_parameters(), self.dp_size,
                                   torch.empty(0, dtype=self.compute_dtype).element_size())}

    def working_set_bound(self) -> int:
        """Stage 3's gathered bytes can reach: two units (current + prefetched) plus a tied
        embedding held from the head's backward to its own."""
        if self.stage != 3:
            return 0
        c = self.compute.element_size()
        sizes = sorted((sum(s.padded for s in u.segments) for u in self.units), reverse=True)
        tied = sum(s.padded for s in self.segments if s.tied or len(self._units_using(s)) > 1)
        return c * (sum(sizes[:2]) + tied)

    def _units_using(self, seg: _Segment) -> list[_Unit]:
        return [u for u in self.units if any(s is seg for s in u.segments)]


def _counted_ranges(seg: _Segment, lo: int, hi: int) -> list[tuple[int, int]]:
    """Ranges of [lo, hi) in segment coordinates that count towards the grad norm, merged."""
    out: list[list[int]] = []
    for e in seg.entries:
        if not e.counted:
            continue
        a, b = max(lo, e.start), min(hi, e.start + e.numel)
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
