"""The optimizer of a ZeroEngine's fp32 master weights, with BLOOM's BF16Optimizer semantics
(DeepSpeed's `runtime/bf16_optimizer.py`; fp16 adds Megatron's dynamic loss scale): global
gradient norm, clipping, AdamW on this rank's own range of the masters, then the compute copy
refreshed from them. It sits beside the engine's buffers, as Megatron-Core's
DistributedOptimizer does: the maths (AdamW on tensor lists, the clip, the loss scale) is
bloomtrain.optim's, which knows nothing of buffers; this module cuts the buffers into the
tensors it steps and runs the offload sequence. The train step calls it in torchtitan's order:

    optimizer.zero_grad()
    forward and backward of every micro-batch, on optimizer.scale_loss(loss)
    engine.reduce_gradients()
    optimizer.clip_grad_norm()
    optimizer.step(lr)              # lr: a function of consumed samples (schedule.py)
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bloomtrain.optim.adamw import AdamWHyper, adamw_, clip_coefficient
from bloomtrain.optim.scaler import DynamicLossScaler
from bloomtrain.parallel.zero import feedback, grad_stats
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.grad_stats import GradStats
from bloomtrain.parallel.zero.segments import Segment


class Span(NamedTuple):
    """Elements [a, b) of `seg`'s own range (FlatBuffers.chunks), its gradients in staging
    slot `slot` (offload; HostCopies' Chunk has these fields too) or, None, in the gradient
    buffer."""

    seg: Segment
    a: int
    b: int
    slot: int | None = None


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float | None
    grad_stats: GradStats | None = None  # on the steps the caller asked for them


@dataclass
class _Clipped:
    """What clip_grad_norm found, for the step that follows it."""

    norm: float              # unscaled
    scale: float | None      # the loss scale the gradients carry (before the scaler's update)
    found_inf: bool


class ZeroAdamW:
    def __init__(self, engine, cfg, precision: str, num_blocks: int | None = None):
        """`cfg`: the OptimConfig; `num_blocks`: the model's transformer blocks, the entries of
        the gradient analyser (None: a model that is not BLOOM's, which it cannot analyse)."""
        self.engine, self.cfg = engine, cfg
        self.step_count = 0
        self.scaler = (DynamicLossScaler(cfg.initial_loss_scale, cfg.loss_scale_window,
                                         cfg.hysteresis, cfg.min_loss_scale)
                       if precision == "fp16" else None)
        self.num_blocks = num_blocks
        self._analyser: grad_stats.Analyser | None = None  # built on the first analysed step
        self._clipped: _Clipped | None = None

    # ---- before and during backward ----------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The fp16 loss scale applied (identity otherwise): call backward on this."""
        return loss * self.loss_scale if self.scaler else loss

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self) -> float:
        """The global norm of the reduced gradients, unscaled; the clip that step() applies.
        Under fp16 a non-finite norm (every rank agrees: the norm is global) updates the loss
        scale and makes the step a skip. A collective."""
        copies = self.engine.host_copies
        if copies:
            copies.grads_to_host()  # in flight while the norm is computed
        norm = float(self.engine.grad_norm())
        scale = self.scaler.scale if self.scaler else None
        if self.scaler:
            norm /= scale
        found_inf = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(found_inf)
        self._clipped = _Clipped(norm, scale, found_inf)
        return norm

    @torch.no_grad()
    def step(self, lr: float, grad_stats: bool = False) -> StepResult:
        """AdamW on the masters with the gradients clipped by clip_grad_norm() (called first),
        then the compute copy; nothing but the scaler's count when the norm was not finite.
        `grad_stats`: the gradient analyser's figures too (every rank on the same step: they
        take one collective)."""
        clipped, self._clipped = self._clipped, None
        if clipped is None:
            raise RuntimeError("step() needs clip_grad_norm() first: the global norm decides "
                               "the clip and whether the step is taken")
        analysed = self._analyse(clipped.scale) if grad_stats else None
        if analysed is not None:
            # Before anything else touches them: an overflowing step's statistics say where it
            # overflowed.
            analysed.grads()
        if clipped.found_inf:
            if self.engine.host_copies:
                self.engine.host_copies.wait()  # the copies still read the gradients
        else:
            self.step_count += 1
            self._update(lr, clip_coefficient(clipped.norm, self.cfg.clip_grad, clipped.scale),
                         analysed)
        feedback.after_step(self.engine.bufs, clipped.found_inf, clipped.scale,
                            self.scaler.scale if self.scaler else None)
        return StepResult(grad_norm=clipped.norm, skipped=clipped.found_inf,
                          loss_scale=clipped.scale,
                          grad_stats=analysed.finish() if analysed is not None else None)

    def _update(self, lr: float, coeff: float, analysed) -> None:
        engine, bufs = self.engine, self.engine.bufs

        def observed(seg):
            return analysed.update(seg) if analysed is not None else contextlib.nullcontext()
        copies = engine.host_copies
        if copies:
            # Chunk by chunk as they land in the staging ring, each stepped, cast and sent back
            # before the next: the cast reads the masters the step has just left in the cache
            # (a batch of landed chunks stepped in one call, then cast, read them back from
            # memory), and the chunk's slot takes the next copy at once. The analyser sees a
            # segment's masters around all of its chunks.
            for _, chunks in itertools.groupby(copies.landed(), key=lambda c: c.seg.index):
                first = next(chunks)
                with observed(first.seg):
                    for chunk in itertools.chain([first], chunks):
                        step_chunks(bufs, [chunk], self.cfg, lr, self.step_count, coeff)
                        copies.send(chunk)
            return
        if analysed is not None:
            for seg in bufs.layout.segments:  # the same bits as one call (adamw's docstring)
                with observed(seg):
                    step_chunks(bufs, all_chunks(bufs, [seg]), self.cfg, lr,
                                self.step_count, coeff)
        else:
            step_chunks(bufs, all_chunks(bufs, bufs.layout.segments), self.cfg, lr,
                        self.step_count, coeff)
        engine.refresh_compute()

    def discard(self) -> StepResult:
        """The step not taken, as a skip (the loss-spike monitor's veto, after the reductions):
        the norm is reported. Finite gradients leave the loss scale as it is; gradients that
        overflowed too (a spike often does both) count as the overflow they are, as in
        clip_grad_norm, so that the scale backs off rather than grows on the next step. The
        error-feedback residual, which the reductions have just charged with this gradient's
        rounding, goes as an overflow's does: kept, it would carry part of the vetoed gradient
        into the next update."""
        scale = self.loss_scale
        norm = float(self.engine.grad_norm()) / scale
        if self.scaler and not math.isfinite(norm):
            self.scaler.update(True)
        feedback.after_step(self.engine.bufs, True, None, None)
        return StepResult(grad_norm=norm, skipped=True, loss_scale=scale if self.scaler else None)

    def _analyse(self, loss_scale: float | None) -> grad_stats.StepStats:
        if self._analyser is None:
            if self.num_blocks is None:
                raise ValueError("the gradient analyser needs BLOOM modules (a model shape with "
                                 "num_layers)")
            self._analyser = grad_stats.Analyser(self.engine.bufs, self.engine.topo,
                                                 self.num_blocks)
        return self._analyser.begin(loss_scale)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scalars a checkpoint keeps (the moments are the engine's buffers)."""
        return {"step_count": self.step_count,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, scalars: dict | None) -> None:
        """The checkpoint's scalars, after the engine's state (the residual among it)."""
        saved_scale = 1.0  # the saving run's loss scale: 1 unless it ran fp16
        if scalars:
            self.step_count = int(scalars.get("step_count", 0))
            if scalars.get("scaler"):
                saved_scale = float(scalars["scaler"]["scale"])
                if self.scaler:
                    self.scaler.load_state_dict(scalars["scaler"])
        # An fp16 checkpoint resumed in bf16 (or back): its residual was in scaled units.
        feedback.rescale(self.engine.bufs, saved_scale, self.loss_scale)


# ---- the buffers cut into the tensors AdamW steps ----------------------------------------------

def all_chunks(bufs: FlatBuffers, segments: list[Segment]) -> list[Span]:
    return [Span(seg, a, b) for seg in segments for a, b in bufs.chunks(seg)]


def step_chunks(bufs: FlatBuffers, chunks: list, cfg, lr: float, step_count: int,
                coeff: float) -> None:
    """One AdamW update (bloomtrain.optim.adamw_) of `chunks` (Spans, or HostCopies' Chunks)
    of this rank's own ranges, on views of the flat buffers wherever they live (the device;
    the host under offload), each chunk's gradients read where its `slot` says. `coeff`
    unscales and clips the gradients first.

    The tensors torch sees are the same whichever caller: every chunk (the optimizer's unit,
    FlatBuffers.chunks), cut where weight decay starts or stops, so the offloaded step (a call
    per chunk as it lands, to overlap the copies) and the plain one (one call) make the same
    bits. Weight decay on the decayed ranges only (no biases, no LayerNorms): one call for
    those, one with weight_decay 0 for the rest."""
    if not chunks:
        return
    grads, decayed, plain = batch_tensors(bufs, chunks)
    if coeff != 1.0:
        torch._foreach_mul_(grads, coeff)
    hyper = AdamWHyper(lr, cfg.beta1, cfg.beta2, cfg.eps)
    step = None
    for lists, wd in ((decayed, cfg.weight_decay), (plain, 0.0)):
        if lists[0]:
            step = adamw_(*lists, hyper, step_count, wd, step)


def batch_tensors(bufs: FlatBuffers, chunks: list) -> tuple:
    """The lists step_chunks hands torch for `chunks`, consecutive chunks in the order every
    step takes them (HostCopies.order, all_chunks), each in the slot after the one before's:
    ([gradients], then the (masters, gradients, exp_avgs, exp_avg_sqs) of the runs with weight
    decay, then those without).

    The same lists every time the same chunks come together, so made once and kept on `bufs`,
    keyed by the first chunk and the count, with the chunks checked consecutive on every call
    of more than one (the plain step's one call; the offloaded step's calls are of one chunk).
    The offloaded step makes a call per chunk, and what runs between two calls runs cold, after
    the chunk before has streamed megabytes through the caches: measured on the 2-core CI
    machine (2026-12-07), building the lists per call cost ~35-95 us cold, and the step tensor
    (adamw.step_tensor) ~90 us more, against ~300-500 us for the chunk's AdamW itself."""
    if len(chunks) > 1 and not _consecutive(bufs, chunks):
        raise ValueError("step_chunks takes consecutive chunks, in the order of "
                         "FlatBuffers.chunks over the segments")
    first = chunks[0]
    key = (first.seg.index, first.a, first.slot, len(chunks))
    found = bufs.batch_views.get(key)
    if found is None:
        parts = [_chunk_tensors(bufs, c.seg, c.a, c.b, c.slot) for c in chunks]
        found = bufs.batch_views[key] = parts[0] if len(parts) == 1 else (
            [g for part in parts for g in part[0]],
            *(tuple([t for part in parts for t in part[k][i]] for i in range(4))
              for k in (1, 2)))
    return found


def _consecutive(bufs: FlatBuffers, chunks: list) -> bool:
    for prev, c in zip(chunks, chunks[1:]):
        ends = prev.b == bufs.chunks(prev.seg)[-1][1]
        if not ((c.seg is prev.seg and c.a == prev.b)
                or (ends and c.seg.index == prev.seg.index + 1 and c.a == 0)):
            return False
        if (c.slot is None) != (prev.slot is None) or (
                c.slot is not None and c.slot != (prev.slot + 1) % len(bufs.staging)):
            return False
    return True


def _chunk_tensors(bufs: FlatBuffers, seg: Segment, a: int, b: int, slot: int | None) -> tuple:
    """Chunk [a, b) of `seg` in batch_tensors' form, its gradients read from staging slot
    `slot` (None: the gradient buffer)."""
    states = [bufs.state_view(buf, seg) for buf in (bufs.master, bufs.exp_avg, bufs.exp_avg_sq)]
    grad = bufs.grad_view(seg)[a:b] if slot is None else bufs.staging[slot][:b - a]
    lo = bufs.own(seg)[0]
    decayed: tuple[list, list, list, list] = ([], [], [], [])
    plain: tuple[list, list, list, list] = ([], [], [], [])
    for x, y, decay in decay_runs(seg, lo + a, lo + b):
        out = decayed if decay else plain
        out[0].append(states[0][x - lo:y - lo])
        out[1].append(grad if y - x == b - a else grad[x - lo - a:y - lo - a])
        out[2].append(states[1][x - lo:y - lo])
        out[3].append(states[2][x - lo:y - lo])
    return [grad], decayed, plain


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
