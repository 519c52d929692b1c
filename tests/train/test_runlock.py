"""One job per run directory and checkpoint.dir (bloomtrain/train/runlock.py): a second job is
refused before it writes anything, naming the holder, and a killed job leaves no stale lock."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bloomtrain.errors import UserError
from bloomtrain.train import runlock
from tests import faults, helpers


class _Rank0:
    rank = 0


def _snapshot(*dirs: Path) -> dict:
    """Every file under `dirs` (the lock file left out) with its bytes."""
    return {str(p): p.read_bytes() for d in dirs for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != runlock.LOCK_NAME}


def _train(config: Path, *over: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bloomtrain", "train", "--config", str(config),
                           *over], env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)


@pytest.mark.slow
def test_a_second_job_in_a_running_jobs_directories_is_refused(dataset, tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cfg = helpers.run_dict(dataset, run, train__train_iters=4, checkpoint__dir=str(ckpt),
                           checkpoint__save_interval=1, checkpoint__async_save=False)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # The first job saves step 1 and then sleeps in step 2: it holds both directories.
    first = subprocess.Popen([sys.executable, "-m", "bloomtrain", "train", "--config",
                              str(config)], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(env, **faults.env(sleep="0:2:600")))
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "latest").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
        time.sleep(0.5)
        before = _snapshot(run, ckpt)
        # Another job in the same run directory, and one whose own run directory is elsewhere
        # but whose checkpoints would go to the first job's.
        for over, named in (((), run), ((f"run_dir={tmp_path / 'other'}",), ckpt)):
            out = _train(config, *over, env=env)
            assert out.returncode == 2, out.stdout[-3000:]
            m = re.search(r"(\S+) is in use by another run \(pid (\d+) on (\S+), since ", out.stdout)
            assert m, out.stdout[-3000:]
            assert Path(m.group(1)) == named.resolve() and int(m.group(2)) == first.pid
            assert "Traceback" not in out.stdout
            assert _snapshot(run, ckpt) == before  # nothing of the first job's was touched
        assert not (tmp_path / "other" / "metrics.jsonl").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    # A killed job holds nothing: the next one resumes from its checkpoint and ends.
    out = _train(config, env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "resumed" in out.stdout.lower() and helpers.metrics(run)[-1]["step"] == 4


def test_the_lock_is_reentrant_in_one_process_and_released_by_its_last_holder(tmp_path):
    a = runlock.lock_run(str(tmp_path / "run"), str(tmp_path / "ckpt"), _Rank0(), print)
    b = runlock.lock_run(str(tmp_path / "run"), None, _Rank0(), print)  # a Trainer built again
    run = os.path.realpath(tmp_path / "run")
    assert runlock._HELD[run][1] == 2
    b.release()
    assert run in runlock._HELD  # `a` still holds it
    # Another process is refused while `a` holds it.
    probe = subprocess.run([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('took')\n"
        "except BlockingIOError: print('held')"), str(tmp_path / "run" / runlock.LOCK_NAME)],
        capture_output=True, text=True)
    assert probe.stdout.strip() == "held"
    a.release()
    a.release()  # twice is harmless (train()'s end, then the Trainer's finalizer)
    assert run not in runlock._HELD
    c = runlock.lock_run(str(tmp_path / "run"), None, _Rank0(), print)
    c.release()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)
    said = []
    locks = runlock.lock_run(str(tmp_path / "run"), None, _Rank0(), said.append)
    assert locks.dirs == [] and len(said) == 1
    assert "cannot lock" in said[0] and "would not be refused" in said[0]


def test_a_held_directory_is_a_user_error_on_every_rank(tmp_path, monkeypatch):
    def held(fd, op):
        raise BlockingIOError(errno.EWOULDBLOCK, "held")
    monkeypatch.setattr(runlock.fcntl, "flock", held)
    with pytest.raises(UserError, match="is in use by another run"):
        runlock.lock_run(str(tmp_path / "run"), str(tmp_path / "ckpt"), _Rank0(), print)
    # Nothing of this run's is held (other tests' Trainers in this process may hold theirs).
    assert not {os.path.realpath(tmp_path / d) for d in ("run", "ckpt")} & set(runlock._HELD)


def test_a_trainer_that_fails_to_build_holds_nothing(dataset, tmp_path, monkeypatch):
    # A notebook keeps the traceback (sys.last_traceback), and the half-built Trainer with it:
    # the lock must not live as long, or the user's next job in that directory is refused.
    from bloomtrain.train import Trainer, loop
    taken = []

    def lock_run(*args, **kwargs):
        taken.append(runlock.lock_run(*args, **kwargs))
        return taken[-1]
    monkeypatch.setattr(loop, "lock_run", lock_run)

    def data_that_fails(*args, **kwargs):  # a build that fails after the lock
        raise RuntimeError("the data is nowhere")
    monkeypatch.setattr(loop, "TrainData", data_that_fails)
    cfg = helpers.make_cfg(dataset, tmp_path)
    with pytest.raises(Exception, match="nowhere") as kept:
        Trainer(cfg, log=lambda *a: None)
    assert taken, "the build failed before the lock: this test tests nothing"
    assert kept.value.__traceback__ is not None  # the frames (and the Trainer) still alive
    assert os.path.realpath(tmp_path / "run") not in runlock._HELD
