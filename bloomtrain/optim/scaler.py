"""fp16 dynamic loss scaling, as Megatron's DynamicGradScaler."""
from __future__ import annotations


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
            # >=, not Megatron's ==: a resume with a smaller window than the checkpoint's
            # tracker would otherwise never grow the scale again.
            if self._growth_tracker >= self.window:
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
