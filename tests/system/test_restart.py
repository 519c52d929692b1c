"""Restarts by themselves: `bloomtrain train --nproc 2 --max-restarts 2` with
checkpoint.resume=auto, in which one rank SIGKILLs itself mid-step twice (rank 1 in step 3 of the
first attempt, rank 0 in step 5 of the second; BLOOMTRAIN_TEST_KILL keys each kill on the
launcher's restart count, so each fires once). The launcher restarts every worker after each
kill, each restart resumes from the last whole checkpoint, and the final checkpoint equals an
uninterrupted run's bit for bit: fp32 master weights, both Adam moments, the train state, the
optimizer scalars and every logged loss. dp=2 with ZeRO-1, so each rank's shard of the
optimizer state must come back too.
"""
from __future__ import annotations

import re


from bloomtrain import checkpoint as ckpt
from tests import faults
from tests.chaos import Job, compare, group_left_after

KILLS = [(1, 3), (0, 5)]  # (rank, step) of restart 0 and of restart 1
STEPS = 7


def _config(tmp_path, dataset):
    cfg = tmp_path / "restart.yaml"
    # decay_samples spans the run so that the lr changes every step: a restart that resumed
    # at the wrong schedule position would show. timeout_minutes bounds a survivor that waits
    # on the killed rank in an op no error reaches.
    cfg.write_text(
        f"model: {{preset: tiny, vocab_size: 256}}\n"
        f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
        f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: {STEPS * 8}}}\n"
        f"train: {{micro_batch_size: 4, global_batch_size: 8, train_iters: {STEPS},"
        f" precision: fp32, log_interval: 1, device: cpu, eval_iters: 1}}\n"
        f"parallel: {{zero_stage: 1, timeout_minutes: 0.5}}\n"
        f"checkpoint: {{save_interval: 1, keep_last: 3, resume: auto}}\n")
    return cfg


def _run(cfg, tmp_path, name, *extra, env=None) -> tuple[int, str]:
    job = Job(["train", "--config", str(cfg), "--nproc", "2", *extra,
               f"checkpoint.dir={tmp_path / name / 'ck'}", f"run_dir={tmp_path / name / 'run'}"],
              env=env)
    try:
        rc = job.wait(900)
        assert group_left_after(job.pgid) == []  # every restart's workers are gone too
    finally:
        job.kill()
        (tmp_path / f"{name}.log").write_text(job.output())
    return rc, job.output()


def test_killed_ranks_restart_by_themselves_and_end_bitwise_equal(dataset, tmp_path):
    cfg = _config(tmp_path, dataset)
    rc, out = _run(cfg, tmp_path, "ref")
    assert rc == 0, out[-6000:]
    spec = ",".join(f"{rank}:{step}" for rank, step in KILLS)
    rc, out = _run(cfg, tmp_path, "got", "--max-restarts", "2", env=faults.env(kill=spec))
    assert rc == 0, out[-6000:]

    # Both kills fired, each once, inside a step; each restart resumed from a checkpoint that
    # precedes its kill, and the second from beyond the first kill's.
    for rank, step in KILLS:
        assert len(re.findall(rf"rank {rank} SIGKILLs itself in step {step}, in ", out)) == 1, \
            out[-6000:]
    assert "[launch] restart 1 of 2" in out and "[launch] restart 2 of 2" in out, out[-6000:]
    resumed = [int(s) for s in re.findall(r"\[checkpoint\] resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 2, out[-6000:]
    assert 1 <= resumed[0] < KILLS[0][1] and KILLS[0][1] <= resumed[1] < KILLS[1][1], resumed

    ref_final, got_final = ckpt.resolve(tmp_path / "ref" / "ck"), ckpt.resolve(tmp_path / "got"
                                                                              / "ck")
    assert ref_final.name == got_final.name == ckpt.step_dir_name(STEPS)
    problems, n_tensors = compare(ref_final, got_final, tmp_path / "ref" / "run",
                                  tmp_path / "got" / "run")
    assert not problems, problems
    assert n_tensors > 0
