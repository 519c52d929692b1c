"""The learning rate as a function of *consumed samples*, not of steps, as in Megatron
(`megatron/learning_rates.py`): that keeps the schedule right through batch-size ramp-up and
across resumes that change the batch layout."""
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
