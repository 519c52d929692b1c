"""Run control: the operator's and the scheduler's ways to stop a run cleanly, and when to save.

SIGTERM (preemption) and SIGUSR1 (`scancel --signal=USR1`), BLOOM's kill-switch file and
`train.exit_duration_minutes` all make every rank finish its step, save and exit 0. Under
bloomtrain's launcher (`--nproc`) a stop signal sent to the launcher alone reaches the workers
through the file `bloomtrain.launch.SIGNAL_FILE_ENV` names; the launcher waits for them. Ranks must
agree, or one would wait forever in the save's collectives: the decision is reduced over the
world (max) every step, and the time-based save interval is decided by rank 0, whose clock the
others follow. The signal handlers are installed for the run only and the previous ones
restored after it.

Ctrl-C (SIGINT) does the same, and the process then exits 130; a second Ctrl-C quits at once
without saving (a save cut short leaves only its hidden `.step_N.tmp`, which no reader takes up).
Who counts the Ctrl-Cs: a process started by bloomtrain's launcher leaves SIGINT to the launcher,
which creates the file named by `bloomtrain.launch.STOP_FILE_ENV` at the first and ends the
workers at the second (bloomtrain.launch.SigintStop); a process started by another elastic agent
(torchrun) gets each Ctrl-C twice, from the terminal and from the agent, so any SIGINT only asks
for the stop; any other process (a plain `bloomtrain train`, an srun task) counts its own. A process
started with SIGINT ignored (nohup, a background job) leaves it ignored.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.parallel import comm
from bloomtrain.launch import JOB_START_ENV, say_in_handler, SIGNAL_FILE_ENV, STOP_FILE_ENV

STOP_REASONS = {0: None, 1: "signal", 2: "kill switch", 3: "exit_duration_minutes", 4: "SIGINT"}
SIGINT_EXIT_CODE = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C


class RunControl:
    def __init__(self, train_cfg, checkpoint_cfg, device):
        self.t, self.c = train_cfg, checkpoint_cfg
        # The flags travel on the training device, which every backend of the job serves (NCCL
        # has no CPU tensors).
        self.device = device
        self.signal: int | None = None  # SIGTERM or SIGUSR1
        self.interrupted = False  # a SIGINT reached this process
        self.stop_file = os.environ.get(STOP_FILE_ENV)  # set by bloomtrain's launcher
        # Where that launcher leaves a SIGTERM or SIGUSR1 sent to it alone.
        self.signal_file = os.environ.get(SIGNAL_FILE_ENV)
        self.last_save = time.time()
        # train.exit_duration_minutes counts from the job's start, as a scheduler's time limit
        # does (Megatron: from its process start, the earliest over the ranks), not from the
        # first step: loading, hashing the checkpoint and building the data indices count.
        self.started = job_start()

    @contextlib.contextmanager
    def active(self):
        """Catch the stop signals while the block runs; restore the previous handlers after."""
        def handler(signum, _frame):
            self.signal = signum
        handlers = {signal.SIGTERM: handler, signal.SIGUSR1: handler}
        if self.stop_file or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            handlers[signal.SIGINT] = self._sigint
        saved = {}
        for sig, new in handlers.items():
            try:
                saved[sig] = signal.signal(sig, new)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass
        self.last_save = time.time()
        t = torch.tensor([self.started], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, comm.world_group(), "control", op=comm.ReduceOp.MIN)
        self.started = float(t)
        try:
            yield self
        finally:
            for sig, old in saved.items():
                # None: the previous handler was not installed from Python; the default is the
                # closest Python can put back.
                signal.signal(sig, signal.SIG_DFL if old is None else old)

    def kill_switch_at_start(self, log) -> bool:
        """Whether BLOOM's kill-switch file is there before the first step (agreed across
        ranks; `log` says so): then the run must not start. Else a job the scheduler requeues
        would train a step, save and prune an older checkpoint at every start."""
        path = self.t.kill_switch_path
        flag = torch.tensor([int(bool(path) and os.path.exists(path))], dtype=torch.int32,
                            device=self.device)
        comm.all_reduce(flag, comm.world_group(), "control", op=comm.ReduceOp.MAX)
        if flag:
            log(f"[train] the kill switch {path} is there: not training and not saving "
                f"(remove it to train)")
        return bool(flag)

    def _sigint(self, _signum, _frame) -> None:
        # Under an elastic agent (bloomtrain's launcher, torchrun) every SIGINT only asks for
        # the stop: the agent, not this process, decides when to end it.
        counts = "TORCHELASTIC_RUN_ID" not in os.environ
        if self.interrupted and counts:
            say_in_handler(f"bloomtrain: SIGINT again: quit at once without saving; "
                           f"{newest_checkpoint_text(self.c.dir)}; exit code "
                           f"{SIGINT_EXIT_CODE}")
            for stream in (sys.stdout, sys.stderr):  # what is buffered (a reentrant flush
                with contextlib.suppress(Exception):  # refuses: its lines are lost)
                    stream.flush()
            os._exit(SIGINT_EXIT_CODE)
        if not self.interrupted and counts and os.environ.get("RANK", "0") == "0":
            say_in_handler("bloomtrain: SIGINT: stopping at the end of this step to save a "
                           "checkpoint; Ctrl-C again quits at once without saving")
        self.interrupted = True

    def should_stop(self) -> str | None:
        """Operator and scheduler controls, agreed across ranks so every rank saves together."""
        t = self.t
        reason = 0
        if self.interrupted or (self.stop_file and os.path.exists(self.stop_file)):
            reason = 4
        elif self.signal is not None or self._launcher_signal():
            reason = 1
        elif t.kill_switch_path and os.path.exists(t.kill_switch_path):
            reason = 2
        elif t.exit_duration_minutes and (time.time() - self.started) / 60 >= \
                t.exit_duration_minutes:
            reason = 3
        flag = torch.tensor([reason], dtype=torch.int32, device=self.device)
        comm.all_reduce(flag, comm.world_group(), "control", op=comm.ReduceOp.MAX)
        return STOP_REASONS[int(flag)]

    def _launcher_signal(self) -> bool:
        """Whether the launcher took a stop signal (its file), which is then this process's."""
        if not self.signal_file or not os.path.exists(self.signal_file):
            return False
        with open(self.signal_file) as f:
            self.signal = int(f.read().strip() or signal.SIGTERM)
        return True

    def stop_line(self, step: int, reason: str) -> str:
        """What a stop says: it saves, or, without checkpoint.dir, that there is nowhere to."""
        return (f"[train] stopping at step {step}: {reason}; "
                + ("saving" if self.c.dir else "nothing to save to (no checkpoint.dir)"))

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


def job_start() -> float:
    """When this job started: the launcher's time (JOB_START_ENV) when it set one, else this
    process's start (from /proc; the import of this module where there is none)."""
    found = [_IMPORTED]
    with contextlib.suppress(ValueError, TypeError):
        found.append(float(os.environ.get(JOB_START_ENV)))
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:  # field 22: start, in clock ticks after boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        found.append(boot + ticks / os.sysconf("SC_CLK_TCK"))
    return min(found)


_IMPORTED = time.time()


def newest_checkpoint_text(directory) -> str:
    """The newest complete checkpoint under `directory`, as the end of a sentence: what a
    resume with checkpoint.resume=auto takes up (sizes checked, not checksums: a quick look)."""
    if not directory:
        return "nothing is saved (checkpoint.dir is not set)"
    found = ckpt.find_latest_valid(directory, log=lambda *_: None, check_sums=False)
    if found is None:
        return f"there is no checkpoint in {directory}"
    return f"the newest checkpoint is {found}"


def summary(result) -> dict:
    """What a worker hands back to the launcher about its run (bloomtrain.train.cli)."""
    return {"exit_reason": result.exit_reason, "step": result.state.step,
            "checkpoint": result.checkpoint}


def stopped_text(run: dict | None, directory) -> str:
    """After a Ctrl-C: the step the run stopped at and the checkpoint it saved there, from its
    summary(); or, without one (the process did not end on its own), what is on disk."""
    if run is None:
        return newest_checkpoint_text(directory)
    if run["exit_reason"] == "SIGINT":
        ended = f"stopped at the end of step {run['step']}"
    else:  # it reached its end (or another stop) before it looked for the SIGINT
        ended = f"the run ended at step {run['step']} ({run['exit_reason']})"
    if run["checkpoint"]:
        return f"{ended} and saved {run['checkpoint']}"
    return f"{ended}; {newest_checkpoint_text(directory)}"


def exit_after_sigint(stopped: str) -> int:
    """The last line of a run a Ctrl-C stopped (stopped_text, or what launch_local returned;
    rank 0's, in a job of several), and its exit code."""
    if os.environ.get("RANK", "0") == "0":
        print(f"bloomtrain: SIGINT: {stopped}; exit code {SIGINT_EXIT_CODE}", file=sys.stderr,
              flush=True)
    return SIGINT_EXIT_CODE
