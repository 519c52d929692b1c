"""The optimizer of a ZeroEngine's fp32 master weights, with BLOOM's BF16Optimizer semantics
(DeepSpeed's `runtime/bf16_optimizer.py`; fp16 adds Megatron's dynamic loss scale): global
gradient norm, clipping, AdamW on this rank's own range of the masters, then the compute copy
refreshed from them. The train step calls it in torchtitan's order:

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

import torch

from bloomtrain.optim import grad_stats
from bloomtrain.optim.adamw import adamw, all_chunks, clip_coefficient
from bloomtrain.optim.grad_stats import GradStats
from bloomtrain.optim.scaler import DynamicLossScaler


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

    # ---- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self) -> float:
        """The global norm of the reduced gradients, unscaled; the clip that step() applies.
        Under fp16 a non-finite norm (every rank agrees: the norm is global) updates the loss
        scale and makes the step a skip. A collective."""
        host = self.engine.host
        if host:
            host.grads_to_host()  # in flight while the norm is computed
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
            if self.engine.host:
                self.engine.host.wait()  # the copies still read the gradients
            residual = self.engine.bufs.grad_residual
            if residual is not None:
                # Error feedback carried a non-finite gradient (an fp16 overflow): what it owes
                # is lost with the step, or it would poison every later reduction.
                residual.zero_()
        else:
            self.step_count += 1
            self._update(lr, clip_coefficient(clipped.norm, self.cfg.clip_grad, clipped.scale),
                         analysed)
            residual = self.engine.bufs.grad_residual
            if residual is not None and self.scaler and self.scaler.scale != clipped.scale:
                # What error feedback owes is in the units of the gradients it came from,
                # which carried this step's loss scale; the next step's carry the grown one.
                # (A power of two: exact.)
                residual.mul_(self.scaler.scale / clipped.scale)
        return StepResult(grad_norm=clipped.norm, skipped=clipped.found_inf,
                          loss_scale=clipped.scale,
                          grad_stats=analysed.finish() if analysed is not None else None)

    def _update(self, lr: float, coeff: float, analysed) -> None:
        engine, bufs = self.engine, self.engine.bufs

        def observed(seg):
            return analysed.update(seg) if analysed is not None else contextlib.nullcontext()
        if engine.host:
            # Chunk by chunk as they land in the staging ring (a batch of a segment's landed
            # chunks per call), each batch sent back before the next is stepped; the analyser
            # sees a segment's masters around all of its chunks.
            for _, batches in itertools.groupby(engine.host.landed(),
                                                key=lambda batch: batch[0].seg.index):
                first = next(batches)
                with observed(first[0].seg):
                    for batch in itertools.chain([first], batches):
                        adamw(bufs, [(c.seg, c.a, c.b) for c in batch],
                              [c.grad for c in batch], self.cfg, lr, self.step_count, coeff)
                        engine.host.send(batch)
            return
        if analysed is not None:
            for seg in bufs.layout.segments:  # the same bits as one call (adamw's docstring)
                with observed(seg):
                    adamw(bufs, all_chunks(bufs, [seg]), None, self.cfg, lr, self.step_count,
                          coeff)
        else:
            adamw(bufs, all_chunks(bufs, bufs.layout.segments), None, self.cfg, lr,
                  self.step_count, coeff)
        engine.refresh_compute()

    def discard(self) -> StepResult:
        """The step not taken, as a skip (the loss-spike monitor's veto, after the reductions):
        the norm is reported, and unlike an overflow the loss scale stays as it is, since these
        gradients are finite."""
        return StepResult(grad_norm=float(self.engine.grad_norm()) / self.loss_scale,
                          skipped=True, loss_scale=self.scaler.scale if self.scaler else None)

    def _analyse(self, loss_scale: float | None) -> grad_stats.StepStats:
        if self._analyser is None:
            if self.num_blocks is None:
                raise ValueError("the gradient analyser needs BLOOM modules (a model shape with "
                                 "num_layers)")
            self._analyser = grad_stats.Analyser(self.engine.bufs, self.engine.topo,
                                                 self.num_blocks)
        return self._analyser.begin(loss_scale)

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scalars a checkpoint keeps (the moments are the engine's buffers)."""
        return {"step_count": self.step_count,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, scalars: dict | None) -> None:
        if scalars:
            self.step_count = int(scalars.get("step_count", 0))
            if self.scaler and scalars.get("scaler"):
                self.scaler.load_state_dict(scalars["scaler"])
