"""Optimizer pieces that do not depend on parallelism: the learning-rate schedule, the fp16 loss
scaler and Megatron's TFLOPs formula, each with Megatron-DeepSpeed's semantics. (Which
parameters get weight decay is a fact of their spec, bloomtrain.model.params.)

The learning rate is a function of *consumed samples*, not of steps, as in Megatron
(`megatron/learning_rates.py`): that keeps the schedule right through batch-size ramp-up and across
resumes that change the batch layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    """Megatron's AnnealingLR over samples: linear warmup from 0 to `max_lr` over
    `warmup_samples`, then cosine/linear decay to `min_lr` at `decay_samples` (counted from 0,
    warmup included), then constant `min_lr`."""

    max_lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    decay_style: str = "cosine"

    def __call__(self, consumed_samples: int) -> float:
        s = consumed_samples
        if self.warmup_samples > 0 and s <= self.warmup_samples:
            return self.max_lr * s / self.warmup_samples
        if self.decay_style == "constant":
            return self.max_lr
        if s > self.decay_samples:
            return self.min_lr
        ratio = (s - self.warmup_samples) / (self.decay_samples - self.warmup_samples)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


class DynamicLossScaler:
    """fp16 dynamic loss scaling as Megatron's DynamicGradScaler (the settings BLOOM's V100 runs
    used: initial 2^12, window 500, hysteresis 2, min 1). An overflow halves the scale once
    `hysteresis` overflows have been seen since the last growth; `window` clean steps double it."""

    def __init__(self, initial_scale=2.0 ** 12, window=500, hysteresis=2, min_scale=1.0):
        self.scale = float(initial_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.window:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self._growth_tracker = int(d["growth_tracker"])
        self._hysteresis_tracker = int(d["hysteresis_tracker"])


def megatron_tflops(batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                    vocab_size: int, step_time_s: float, num_devices: int,
                    activation_checkpointing: bool) -> float:
    """Hardware TFLOP/s per device by Megatron's formula (docs/bloom_facts.md §2, M1 training.py):
    24·f·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)), f = 4 with full recompute, 3 without."""
    f = 4 if activation_checkpointing else 3
    flops = (24 * f * batch_size * seq_length * num_layers * hidden_size ** 2
             * (1.0 + seq_length / (6.0 * hidden_size)
                + vocab_size / (16.0 * num_layers * hidden_size)))
    return flops / (step_time_s * num_devices * 1e12)
