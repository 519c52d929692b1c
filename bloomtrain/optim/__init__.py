"""The optimizer's maths, on tensor lists and numbers: AdamW and the clip coefficient
(adamw.py), the fp16 loss scaler (scaler.py) and the learning-rate schedule (schedule.py). It
imports nothing from bloomtrain.parallel: the optimizer that steps a ZeroEngine's buffers with
it, and the gradient analyser, sit beside those buffers (bloomtrain.parallel.zero.optimizer,
grad_stats)."""
from bloomtrain.optim.scaler import DynamicLossScaler
from bloomtrain.optim.schedule import LRSchedule
from bloomtrain.utils import lazy_exports

# AdamW imports torch; the schedule and the scaler do not.
__getattr__ = lazy_exports(__name__, {"AdamWHyper": "adamw", "adamw_": "adamw",
                                      "clip_coefficient": "adamw"})

__all__ = ["AdamWHyper", "DynamicLossScaler", "LRSchedule", "adamw_", "clip_coefficient"]
