"""One rank lost: a real tp2·dp2 job on 4 ranks, launched as users launch it (`bloomtrain train
--nproc 4`), in which rank 2 SIGKILLs itself inside a collective of step 3 (the fault injection
BLOOMTRAIN_TEST_KILL, tests/faults.py). The survivors must leave their collectives and exit, the
launcher must exit non-zero within parallel.timeout_minutes + 60 s with a last line that names
the lost rank and its signal, no process of the job may be left, and the checkpoint directory
must hold only whole checkpoints: the kill lands while the saves of every step (async,
save_interval 1) are under way."""
from __future__ import annotations

import re

import pytest

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import watchdog
from tests import faults
from tests.chaos import Job, alive, full_state, group_left_after
from tests.synthetic import tiny_job_yaml

TIMEOUT_MINUTES = 0.25  # 15 s: far above a step of the tiny model on a loaded 2-core machine
LOST, KILL_STEP = 2, 3


def test_a_rank_killed_mid_step_ends_the_job_cleanly_and_names_it(dataset, tmp_path):
    cfg = tmp_path / "lost.yaml"
    cfg.write_text(tiny_job_yaml(
        dataset, tmp_path / "run",
        f"parallel: {{tp: 2, timeout_minutes: {TIMEOUT_MINUTES}}}\n"
        f"checkpoint: {{dir: {tmp_path / 'ck'}, save_interval: 1, keep_last: 2}}\n"))
    kill_line = f"{faults.KILL_ENV}: rank {LOST} SIGKILLs itself"
    job = Job(["train", "--config", str(cfg), "--nproc", "4"],
              env=faults.env(kill=f"{LOST}:{KILL_STEP}"))
    try:
        # Start-up is slow (four ranks import torch on two cores); the bound that matters runs
        # from the kill.
        rc = job.wait(600, after=kill_line, limit=TIMEOUT_MINUTES * 60 + 60)
        out = job.output()
        killed_at = job.first(kill_line)
        assert killed_at is not None, out[-6000:]
        # Inside an op of step 3, as a GPU or node lost mid-step.
        assert re.search(rf"in step {KILL_STEP}, in \w+/\w+ ", out), out[-6000:]
        assert rc != 0, out[-6000:]
        assert job.exited_at - killed_at <= TIMEOUT_MINUTES * 60 + 60
        assert re.fullmatch(rf"bloomtrain train: error: rank {LOST} \(local rank {LOST}, pid \d+\)"
                            rf" was killed by SIGKILL \(signal 9\)", job.last_line()), out[-6000:]

        # Every survivor left its collective: an op with the lost rank (or with a survivor that
        # had already gone) raised, or timed out, and its watchdog wrote where it was.
        hang = tmp_path / "run" / "hang"
        for rank in (0, 1, 3):
            report = watchdog.read_report(hang / f"{rank}.txt")
            assert report["state"] in ("failed", "waiting"), report
            assert not alive(int(report["pid"])), report
        assert not (hang / f"{LOST}.txt").exists()
        assert f"rank {LOST} was lost; 3 rank(s) of this node reported" in out
        assert f"rank(s) [{LOST}] did not report" in out
        # Nothing left hanging: no process of the session survives the launcher.
        assert group_left_after(job.pgid) == []
    finally:
        job.kill()

    # No checkpoint is half-committed: every checkpoint in the directory verifies (sizes and
    # checksums), `latest` names the newest, it precedes the lost step, and it loads in full.
    root = tmp_path / "ck"
    found = ckpt.list_checkpoints(root)
    assert found, out[-6000:]
    for _, path in found:
        ckpt.verify(path)
    latest = ckpt.find_latest_valid(root, log=lambda *a: None)
    assert latest == found[-1][1] == ckpt.resolve(root)
    step = ckpt.read_manifest(latest)["train_state"]["step"]
    assert 1 <= step < KILL_STEP
    state = full_state(latest)
    assert state and all(t.numel() > 0 for t in state.values())


def test_the_kill_injection_fires_once_per_restart():
    # Entry i is for restart i (TORCHELASTIC_RESTART_COUNT): a restarted job meets the next kill.
    assert faults.parse_kill("2:3,1:6", 0) == (2, 3)
    assert faults.parse_kill("2:3,1:6", 1) == (1, 6)
    assert faults.parse_kill("2:3,1:6", 2) is None
    assert faults.parse_kill(None, 0) is None
    for bad in ("2:3:4", "2", "a:b", "2:3,"):
        with pytest.raises(ValueError, match="RANK:STEP"):
            faults.parse_kill(bad, 0)


def test_the_launchers_last_line_says_how_the_first_rank_ended(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from bloomtrain.train.launch import failure_text
    none = str(tmp_path / "no-error-file")
    assert failure_text(2, ProcessFailure(0, 77, -9, none)) == \
        "rank 2 (local rank 0, pid 77) was killed by SIGKILL (signal 9)"
    assert failure_text(5, ProcessFailure(1, 78, watchdog.HANG_EXIT_CODE, none)) == \
        "rank 5 (local rank 1, pid 78) was ended by its hang watchdog (exit code 124)"
    assert failure_text(0, ProcessFailure(0, 79, 1, none)) == \
        "rank 0 (local rank 0, pid 79) exited with code 1"
    # The error file torch's @record writes for a worker that raised: its first line.
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": {"message": "RuntimeError: Connection closed by peer\\n'
                          'more detail", "extraInfo": {"py_callstack": "", "timestamp": "0"}}}')
    assert failure_text(3, ProcessFailure(1, 80, 1, str(error_file))) == \
        "rank 3 (local rank 1, pid 80) exited with code 1: RuntimeError: Connection closed by peer"
