"""Training: `loop` (the Trainer: build, then the loop), `metrics` (metrics.jsonl and the
progress line), `control` (signals, kill switch, exit duration, save timing), `checkpointing`
(what a training checkpoint holds and how a run resumes), `launch` (device, process group,
SLURM, the local launcher) and `cli` (`bloomtrain train`)."""
from bloomtrain.utils import lazy_exports

# Imported when used: `bloomtrain train`'s parser and config checks (bloomtrain.train.cli) run
# before torch is imported.
__getattr__ = lazy_exports(__name__, {
    "TrainState": "checkpointing", "cmd_train": "cli", "register": "cli",
    **dict.fromkeys(["env_from_slurm", "launch_local", "resolve_device"], "launch"),
    **dict.fromkeys(["Trainer", "TrainResult", "train"], "loop")})

__all__ = ["TrainResult", "TrainState", "Trainer", "cmd_train", "env_from_slurm",
           "launch_local", "register", "resolve_device", "train"]
