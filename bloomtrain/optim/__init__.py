"""The optimizer, called by the train step in order: AdamW with clipping and the fp16 loss scale
on the ZeRO engine's fp32 masters (optimizer.py, adamw.py), the gradient analyser that watches
its steps (grad_stats.py), the loss scaler (scaler.py) and the learning-rate schedule
(schedule.py)."""
from bloomtrain.optim.scaler import DynamicLossScaler
from bloomtrain.optim.schedule import LRSchedule
from bloomtrain.utils import lazy_exports

# The optimizer imports torch; the schedule and the scaler do not.
__getattr__ = lazy_exports(__name__, {"StepResult": "optimizer", "ZeroAdamW": "optimizer"})

__all__ = ["DynamicLossScaler", "LRSchedule", "StepResult", "ZeroAdamW"]
