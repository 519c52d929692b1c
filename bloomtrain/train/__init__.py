"""Training: `loop` (the Trainer: build, then the loop), `metrics` (metrics.jsonl and the
progress line), `control` (signals, kill switch, exit duration, save timing), `checkpointing`
(what a training checkpoint holds and how a run resumes), `launch` (device, process group,
SLURM, the local launcher) and `cli` (`bloomtrain train`)."""
from bloomtrain.train.checkpointing import TrainState
from bloomtrain.train.cli import cmd_train, register
from bloomtrain.train.launch import env_from_slurm, launch_local, resolve_device
from bloomtrain.train.loop import Trainer, TrainResult, train

__all__ = ["TrainResult", "TrainState", "Trainer", "cmd_train", "env_from_slurm",
           "launch_local", "register", "resolve_device", "train"]
