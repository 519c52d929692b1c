"""Run control: the operator's and the scheduler's ways to stop a run cleanly, and when to save.

SIGTERM (preemption) and SIGUSR1 (`scancel --signal=USR1`), BLOOM's kill-switch file and
`train.exit_duration_minutes` all make every rank finish its step, save and exit 0. Ranks must
agree, or one would wait forever in the save's collectives: the decision is reduced over the
world (max) every step, and the time-based save interval is decided by rank 0, whose clock the
others follow. The signal handlers are installed for the run only and the previous ones
restored after it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import torch

from bloomtrain.parallel import comm

STOP_REASONS = {0: None, 1: "signal", 2: "kill switch", 3: "exit_duration_minutes"}


class RunControl:
    def __init__(self, train_cfg, checkpoint_cfg, device):
        self.t, self.c = train_cfg, checkpoint_cfg
        # The flags travel on the training device, which every backend of the job serves (NCCL
        # has no CPU tensors).
        self.device = device
        self.signal: int | None = None
        self.started = self.last_save = time.time()

    @contextlib.contextmanager
    def active(self):
        """Catch the stop signals while the block runs; restore the previous handlers after."""
        def handler(signum, _frame):
            self.signal = signum
        saved = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                saved[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass
        self.started = self.last_save = time.time()
        try:
            yield self
        finally:
            for sig, old in saved.items():
                # None: the previous handler was not installed from Python; the default is the
                # closest Python can put back.
                signal.signal(sig, signal.SIG_DFL if old is None else old)

    def should_stop(self) -> str | None:
        """Operator and scheduler controls, agreed across ranks so every rank saves together."""
        t = self.t
        reason = 0
        if self.signal is not None:
            reason = 1
        elif t.kill_switch_path and os.path.exists(t.kill_switch_path):
            reason = 2
        elif t.exit_duration_minutes and (time.time() - self.started) / 60 >= \
                t.exit_duration_minutes:
            reason = 3
        flag = torch.tensor([reason], dtype=torch.int32, device=self.device)
        comm.all_reduce(flag, comm.world_group(), "control", op=comm.ReduceOp.MAX)
        return STOP_REASONS[int(flag)]

    def time_to_save(self, step: int) -> bool:
        c = self.c
        due = bool(c.save_interval and step % c.save_interval == 0)
        if c.save_interval_minutes and not due:
            due_here = time.time() - self.last_save >= 60 * c.save_interval_minutes
            flag = torch.tensor([int(due_here)], dtype=torch.int32, device=self.device)
            comm.broadcast(flag, 0, comm.world_group(), "control")  # rank clocks differ
            due = bool(flag)
        return due

    def saved(self) -> None:
        self.last_save = time.time()
