"""`bloomtrain train --config FILE [section.key=value ...] [--nproc N]`."""
from __future__ import annotations

import os

import torch.distributed as dist

from bloomtrain.config import Config
from bloomtrain.layout import validate
from bloomtrain.train.launch import launch_local
from bloomtrain.train.loop import train


def worker_entry(config_path, overrides):
    cfg = Config.load(config_path, overrides)
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cmd_train(args) -> int:
    cfg = Config.load(args.config, args.overrides)
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        validate(cfg, args.nproc)  # fail before starting any worker
        launch_local(args.nproc, worker_entry, args.config, args.overrides)
        return 0
    train(cfg)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a BLOOM model",
                       description="Train a BLOOM model from a YAML config plus overrides.")
    p.add_argument("--config", help="YAML config file (sections model, parallel, data, optim, "
                                    "train, checkpoint, run_dir)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch N local worker processes (not needed under torchrun/srun)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. train.train_iters=100 parallel.tp=2")
    p.set_defaults(func=cmd_train)
