"""Gradient reduction for ZeRO: fp32 accumulation across micro-batches (BLOOM's BF16Optimizer,
DeepSpeed `runtime/bf16_optimizer.py`: `hp_grad.add_(lp.grad)`), then the sums over dp, tp and
the embedding group. After the dp reduction the linear sums are taken on the shard (1/dp of the
bytes): partial sequence-parallel gradients over tp, the two tied-embedding copies over the
embedding group. Every wait for a dp collective is timed by the engine's WaitClock (waits.py).
"""
from __future__ import annotations

import torch
from torch.autograd import Variable

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero import compress, feedback
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.memory import Counters
from bloomtrain.parallel.zero.segments import Segment, Slot, clip_ranges
from bloomtrain.parallel.zero.waits import WaitClock

DP = "dp"
# Reductions in flight at once: enough to overlap backward; more would only hold staging memory.
MAX_IN_FLIGHT = 2
# Finished staging and output buffers kept for the next segment of the same size, at most this
# many: on the CPU a fresh 20 MB buffer costs page faults on first touch (profiled, bf16 ZeRO-2,
# 5.3M params in one segment: torch.zeros' fill 15 ms per micro-batch, against 0.3 ms reused).
KEEP_FREE = 2 * (MAX_IN_FLIGHT + 1)


class GradReducer:
    """Stages 0-1 add every micro-batch's compute-dtype gradient into a full fp32 accumulator
    from the parameter's post-accumulate-grad hook, so only one micro-batch of 16-bit gradient
    is ever alive, and reduce once per step (`reduce_for_step`): which backward is a stage's
    last is known only to the caller (under a pipeline schedule it is interleaved with the
    neighbours' sends), so these stages cannot overlap the reduction with backward. Stages 2-3
    keep no full accumulator: each segment's gradients are staged in fp32 as they arrive and
    reduce-scattered asynchronously once the segment is complete, overlapping the rest of
    backward; a callback at the end of every backward flushes incomplete segments and waits.
    That works per backward call, so under any pipeline schedule.

    `dtype` is the dp reduction's wire format (parallel.grad_reduce_dtype): fp32 takes comm's
    plain collectives, exactly as without the option; bf16 and int8 go through compress.py
    (quantize, all-to-all, dequantize, sum in fp32), with the error-feedback residual
    (feedback.py) when there is one. Without dp peers nothing is sent or compressed."""

    def __init__(self, bufs: FlatBuffers, topo, counters: Counters, on_group_done=None,
                 waits: WaitClock | None = None, dtype: str = "fp32"):
        self.bufs, self.topo, self.counters = bufs, topo, counters
        self.dtype = dtype if topo.dp_group is not None else "fp32"
        self.waits = waits or WaitClock(bufs.device)
        self.rules = bufs.rules
        self.dp_group = topo.dp_group
        # Stage 3: told when every gradient of a group has arrived in this backward.
        self.on_group_done = on_group_done
        self._pieces = {id(s): [] for s in bufs.layout.slots}
        for seg in bufs.layout.segments:
            for piece in seg.pieces:
                self._pieces[id(piece.slot)].append((seg, piece))
        self._staging: dict[int, torch.Tensor] = {}
        self._received: dict[int, int] = {}
        self._group_pending = {g.index: len(g.slots) for g in bufs.layout.groups}
        self._inflight: list[tuple[Segment, torch.Tensor, torch.Tensor, object]] = []
        self._free: list[torch.Tensor] = []  # finished fp32 buffers, for reuse (KEEP_FREE)
        self._callback_queued = False

    def hooks(self) -> list:
        handles = []
        for slot in self.bufs.layout.slots:
            fn = self._reduce_hook(slot) if self.rules.shard_grads else self._accumulate_hook(slot)
            handles.append(slot.param.register_post_accumulate_grad_hook(fn))
        return handles

    # ---- stages 0-1 ------------------------------------------------------------------------------
    def _accumulate_hook(self, slot: Slot):
        start, grad = slot.full_off, self.bufs.grad

        def hook(p):
            grad[start:start + slot.numel].add_(p.grad.reshape(-1))  # fp32 += 16-bit
            p.grad = None
        return hook

    # ---- stages 2-3 ------------------------------------------------------------------------------
    def _reduce_hook(self, slot: Slot):
        pieces = self._pieces[id(slot)]

        def hook(p):
            self.queue_end_of_backward()
            flat = p.grad.reshape(-1)
            for seg, piece in pieces:
                staging = self._staging.get(seg.index)
                if staging is None:
                    # Zeros: padding, and parameters that get no gradient this pass, add nothing.
                    # (Every dp rank must produce the same set of gradients in a backward, as
                    # every BLOOM parameter does, or the ranks would launch different
                    # reduce-scatters.)
                    staging = self._take(seg.padded, flat.device).zero_()
                    self._staging[seg.index] = staging
                    self.counters.staged(seg.padded * 4)
                a = piece.param_start
                staging[piece.seg_start:piece.seg_start + piece.numel].copy_(
                    flat[a:a + piece.numel])
                self._received[seg.index] = self._received.get(seg.index, 0) + 1
                if self._received[seg.index] == len(seg.pieces):
                    self._launch(seg)
            p.grad = None
            self._group_pending[slot.group] -= 1
            if self._group_pending[slot.group] == 0 and self.on_group_done is not None:
                # Every use of the group's weights in this backward is done.
                self.on_group_done(slot.group)
        return hook

    def _launch(self, seg: Segment) -> None:
        staging = self._staging.pop(seg.index)
        self._received.pop(seg.index, None)
        out = self._take(seg.shard, staging.device)
        # Summed in fp32 here, averaged over dp at the step.
        if self.dtype == "fp32":
            handle = comm.reduce_scatter_tensor(out, staging, self.dp_group, DP, async_op=True)
        else:
            residual = feedback.segment_residual(self.bufs, seg)
            handle = compress.reduce_scatter(out, staging, self.dp_group, DP, self.dtype,
                                             residual, async_op=True)
        self._inflight.append((seg, staging, out, handle))
        while len(self._inflight) > MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        seg, staging, out, handle = self._inflight.pop(0)
        if handle is not None:
            with self.waits.waiting():
                handle.wait()
        self.bufs.grad[seg.shard_off:seg.shard_off + seg.shard].add_(out)
        self.counters.staged(-staging.numel() * 4)
        for buf in (staging, out):
            if len(self._free) < KEEP_FREE:
                self._free.append(buf)

    def _take(self, numel: int, device) -> torch.Tensor:
        """An fp32 buffer of `numel` elements, uninitialized: a kept one of that size if any."""
        for i, buf in enumerate(self._free):
            if buf.numel() == numel and buf.device == torch.device(device):
                return self._free.pop(i)
        return torch.empty(numel, dtype=torch.float32, device=device)

    def queue_end_of_backward(self) -> None:
        """Run `_end_of_backward` when the current backward pass ends (once per pass)."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.finish()
        self._group_pending = {g.index: len(g.slots) for g in self.bufs.layout.groups}
        if self.on_group_done is not None:
            for g in self.bufs.layout.groups:
                self.on_group_done(g.index)

    def finish(self) -> None:
        """Launch incomplete segments and wait for every reduction in flight."""
        for index in sorted(self._staging):
            self._launch(self.bufs.layout.segments[index])
        while self._inflight:
            self._complete_oldest()

    def _reduce_accumulated(self, seg: Segment) -> None:
        """Stages 0-1: the step's dp sum of a segment's full accumulator."""
        full = self.bufs.full_grad(seg)
        if not self.rules.shard_optimizer:
            if self.dtype == "fp32":
                comm.all_reduce(full, self.dp_group, DP)
            else:
                compress.all_reduce(full, self.dp_group, DP, self.dtype,
                                    feedback.segment_residual(self.bufs, seg))
            return
        out = torch.empty(seg.shard, dtype=torch.float32, device=full.device)
        if self.dtype == "fp32":
            comm.reduce_scatter_tensor(out, full, self.dp_group, DP)
        else:
            compress.reduce_scatter(out, full, self.dp_group, DP, self.dtype,
                                    feedback.segment_residual(self.bufs, seg))
        self.bufs.grad_view(seg).copy_(out)

    # ---- at the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_for_step(self) -> None:
        """Sum the accumulated gradients over dp (stages 0-1; stages 2-3 did in backward), over
        tp where they are partial and over the embedding group, then average over dp."""
        self.finish()
        bufs = self.bufs
        if not self.rules.shard_grads and self.dp_group is not None:
            with self.waits.waiting():  # the first the peers see of this rank's step
                for seg in bufs.layout.segments:
                    self._reduce_accumulated(seg)
        partial = []
        for seg in bufs.layout.segments:
            lo, hi = bufs.own(seg)
            g = bufs.grad_view(seg)
            partial += [g[a - lo:b - lo] for a, b in clip_ranges(seg.tp_partial, lo, hi)]
        comm.all_reduce_coalesced(partial, self.topo.tp_group, "tp")
        comm.all_reduce_coalesced([bufs.grad_view(s) for s in bufs.layout.segments if s.tied],
                                  self.topo.embedding_group, "emb")
        if bufs.dp_size > 1:
            for seg in bufs.layout.segments:
                bufs.grad_view(seg).div_(bufs.dp_size)


@torch.no_grad()
def global_grad_norm(bufs: FlatBuffers, topo) -> torch.Tensor:
    """The norm of the reduced (still scaled) gradients of the whole model, every logical
    parameter counted once (`Segment.counted`: the last stage's tied-embedding copy never,
    tp-replicated parameters on tp rank 0 only): this rank's own ranges, then over dp (where
    ranks own different ranges) and over the model group (tp x pp).

    Squares in fp64: an fp32 sum over millions of elements drifts by ~1e-5 relative, which would
    make the norm depend on the bucket layout. Chunks bound the fp64 temporaries."""
    sq = torch.zeros((), dtype=torch.float64, device=bufs.device)
    for seg in bufs.layout.segments:
        lo, hi = bufs.own(seg)
        g = bufs.grad_view(seg)
        for a, b in clip_ranges(seg.counted, lo, hi):
            for chunk in g[a - lo:b - lo].split(1 << 20):
                sq += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
    if bufs.rules.shard_optimizer:
        comm.all_reduce(sq, topo.dp_group, DP)
    comm.all_reduce(sq, topo.model_group, "model")
    return sq.sqrt()
