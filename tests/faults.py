"""Fault injection for the multi-process tests: a rank that stops inside a step, outside any
collective (the hang watchdog's test), or SIGKILLs itself inside a collective or p2p op of a step
(a GPU or node lost mid-step: the lost-rank and restart tests). The ranks are interpreters that
`bloomtrain train --nproc N` starts, so a test hands the job `env(...)`: the fault's variable,
and a PYTHONPATH whose sitecustomize.py (tests/fault_site/) calls `install()` as each interpreter
starts, which wraps the Trainer's step. The package itself knows nothing of it.

BLOOMTRAIN_TEST_SLEEP="RANK:STEP:SECONDS": global rank RANK sleeps SECONDS as step STEP begins.
BLOOMTRAIN_TEST_KILL="RANK:STEP[,RANK:STEP...]": global rank RANK SIGKILLs itself in step STEP,
as soon as its training thread is inside an op (or at the step's end, should every op of it pass
between two polls); entry i applies to restart i of the elastic launcher
(TORCHELASTIC_RESTART_COUNT, which torch counts per node), so each kill fires once and a
restarted job runs into the next.
BLOOMTRAIN_TEST_RAISE="RANK:STEP": global rank RANK raises a ValueError as step STEP begins (a
bug or bad input on one rank, while its peers go on into the step's communication).
BLOOMTRAIN_TEST_SAVE_SLEEP="RANK:STEP:SECONDS": global rank RANK sleeps SECONDS in its first save
of a step >= STEP, once it has written its files into the save's temporary directory: a save
still in progress when a test cuts it short (a kill, a second Ctrl-C).
BLOOMTRAIN_TEST_BUILD_SLEEP="SECONDS": every rank sleeps SECONDS as the Trainer's build begins
(after the process group and the run lock, before the model): a start still in progress.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

SLEEP_ENV = "BLOOMTRAIN_TEST_SLEEP"
KILL_ENV = "BLOOMTRAIN_TEST_KILL"
SAVE_SLEEP_ENV = "BLOOMTRAIN_TEST_SAVE_SLEEP"
RAISE_ENV = "BLOOMTRAIN_TEST_RAISE"
BUILD_SLEEP_ENV = "BLOOMTRAIN_TEST_BUILD_SLEEP"
SITE = Path(__file__).resolve().parent / "fault_site"
REPO = Path(__file__).resolve().parents[1]


def parse_sleep(value: str | None, name: str = SLEEP_ENV) -> tuple[int, int, float] | None:
    if not value:
        return None
    try:
        rank, step, seconds = value.split(":")
        return int(rank), int(step), float(seconds)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected RANK:STEP:SECONDS, e.g. 1:2:600") \
            from None


def parse_kill(value: str | None, restart: int) -> tuple[int, int] | None:
    """The (rank, step) KILL_ENV names for restart `restart` of the job, if any."""
    if not value:
        return None
    try:
        kills = [tuple(int(x) for x in item.split(":")) for item in value.split(",")]
    except ValueError:
        kills = [()]
    if any(len(k) != 2 for k in kills):
        raise ValueError(f"{KILL_ENV}={value!r}: expected RANK:STEP[,RANK:STEP...], one per "
                         f"restart, e.g. 2:3,1:6")
    return kills[restart] if restart < len(kills) else None


def env(sleep: str | None = None, kill: str | None = None,
        save_sleep: str | None = None, raise_at: str | None = None,
        build_sleep: float | None = None) -> dict[str, str]:
    """The variables that make a job's interpreters inject these faults."""
    path = [str(SITE), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                     else [])
    out = {"PYTHONPATH": os.pathsep.join(path)}
    if sleep is not None:
        out[SLEEP_ENV] = sleep
    if kill is not None:
        out[KILL_ENV] = kill
    if save_sleep is not None:
        out[SAVE_SLEEP_ENV] = save_sleep
    if raise_at is not None:
        out[RAISE_ENV] = raise_at
    if build_sleep is not None:
        out[BUILD_SLEEP_ENV] = str(build_sleep)
    return out


class Faults:
    def __init__(self, sleep: tuple[int, int, float] | None, kill: tuple[int, int] | None,
                 raise_at: tuple[int, int] | None = None):
        self.sleep, self.kill, self.raise_at = sleep, kill, raise_at
        self.step: int | None = None  # the step the training thread is in

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(parse_sleep(os.environ.get(SLEEP_ENV)),
                   parse_kill(os.environ.get(KILL_ENV),
                              int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))),
                   parse_kill(os.environ.get(RAISE_ENV), 0))

    @contextlib.contextmanager
    def fault_in_step(self, rank: int, step: int):
        """Around global rank `rank`'s step `step`, on its training thread."""
        self.step = step
        if self.sleep is not None and self.sleep[:2] == (rank, step):
            print(f"[bloomtrain] {SLEEP_ENV}: rank {rank} sleeps {self.sleep[2]:g} s in step "
                  f"{step} (fault injection for tests)", file=sys.stderr, flush=True)
            time.sleep(self.sleep[2])
        if self.raise_at == (rank, step):
            raise ValueError(f"{RAISE_ENV}: rank {rank} raises in step {step} (fault injection "
                             f"for tests)")
        if self.kill == (rank, step):
            threading.Thread(target=self._kill_in_step, args=(threading.get_ident(), rank, step),
                             name="bloomtrain-test-kill", daemon=True).start()
        yield

    def _kill_in_step(self, thread_id: int, rank: int, step: int) -> None:
        from bloomtrain.parallel import comm

        entry = None
        while entry is None and self.step == step:
            entry = comm.INFLIGHT.busy.get(thread_id)
            time.sleep(0.0002)
        where = f"in {entry[0]}/{entry[1]}" if entry is not None else "at its end"
        print(f"[bloomtrain] {KILL_ENV}: rank {rank} SIGKILLs itself in step {step}, {where} "
              f"(fault injection for tests)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Wrap Trainer.train_step with the faults this interpreter's environment names. They are
    read at the first step: a launched worker gets its restart count from the elastic agent
    after its interpreter started."""
    save_sleep = parse_sleep(os.environ.get(SAVE_SLEEP_ENV), SAVE_SLEEP_ENV)
    if save_sleep is not None:
        _sleep_in_save(*save_sleep)
    if os.environ.get(BUILD_SLEEP_ENV):
        _sleep_in_build(float(os.environ[BUILD_SLEEP_ENV]))
    if not (os.environ.get(SLEEP_ENV) or os.environ.get(KILL_ENV) or os.environ.get(RAISE_ENV)):
        return
    from bloomtrain.train.loop import Trainer

    train_step = Trainer.train_step

    @functools.wraps(train_step)
    def step_with_faults(self, micro_batches):
        faults = _faults()
        with faults.fault_in_step(self.topo.rank, self.state.step + 1):
            return train_step(self, micro_batches)
    Trainer.train_step = step_with_faults


@functools.cache
def _faults() -> Faults:
    return Faults.from_env()


def _sleep_in_save(rank: int, first_step: int, seconds: float) -> None:
    """Wrap the checkpoint writer's shard writing (called on the thread that writes the save,
    the async one too) with SAVE_SLEEP_ENV's sleep."""
    import re

    from bloomtrain.checkpoint import writer

    write_shard, fired = writer._write_shard, []

    @functools.wraps(write_shard)
    def write_shard_then_sleep(tmp, shard_rank, fragments):
        out = write_shard(tmp, shard_rank, fragments)
        step = int(re.fullmatch(r"\.step_(\d+)\.tmp", Path(tmp).name).group(1))
        if shard_rank == rank and step >= first_step and not fired:
            fired.append(step)
            print(f"[bloomtrain] {SAVE_SLEEP_ENV}: rank {rank} sleeps {seconds:g} s in its save "
                  f"of step {step}, its files written to {tmp} (fault injection for tests)",
                  file=sys.stderr, flush=True)
            time.sleep(seconds)
        return out
    writer._write_shard = write_shard_then_sleep


def _sleep_in_build(seconds: float) -> None:
    from bloomtrain.train.loop import Trainer

    build = Trainer._build

    @functools.wraps(build)
    def sleep_then_build(self, *args, **kwargs):
        print(f"[bloomtrain] {BUILD_SLEEP_ENV}: rank {self.topo.rank} sleeps {seconds:g} s as "
              f"its build begins (fault injection for tests)", file=sys.stderr, flush=True)
        time.sleep(seconds)
        return build(self, *args, **kwargs)
    Trainer._build = sleep_then_build
