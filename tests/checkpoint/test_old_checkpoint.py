"""A checkpoint written before the parallelize() restructuring (tests/fixtures/old_checkpoint: a
bf16 tp2·pp2·dp2 ZeRO-1 run with dropout, saved at step 3 by commit b59f811) still loads and
resumes exactly: today's code continues it to step 5 with the same losses and gradient norms that
code logged and the same bits in every tensor it saved (tests/fixtures/make_old_checkpoint.py
wrote both)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import Trainer
from tests.fixtures.make_old_checkpoint import config
from tests.dist import run_ranks

FIXTURE = Path(__file__).parents[1] / "fixtures" / "old_checkpoint"


def _config(dataset, tmp):
    # The config that wrote the fixture, resuming from it into a fresh directory.
    cfg = config(dataset, tmp, 5)
    cfg.checkpoint.resume = str(FIXTURE / ckpt.step_dir_name(3))
    # The kernel that wrote it: auto was SDPA on the CPU then (now bf16 at short sequences takes
    # the eager kernel, which rounds and draws its dropout differently).
    cfg.train.attention = "sdpa"
    return cfg


def _worker(rank, world, dataset, tmp):
    res = Trainer(_config(dataset, tmp), log=lambda *a: None).run()
    return res.checkpoint


def test_old_checkpoint_resumes_exactly(dataset, tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    final = run_ranks(8, _worker, dataset, str(tmp_path))[0]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    got = [r for r in records if "loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in expected["records"]] == [4, 5]
    # The fixture was written on a CPU with AVX-512; torch's bf16 kernels there accumulate in
    # another order than the AVX2 ones (measured on an AVX2 EPYC: the same step-4 loss, a grad
    # norm 9e-7 relative away). A wrong resume (optimizer state, RNG, data position) moves both
    # by far more than these bounds.
    for mine, old in zip(got, expected["records"]):
        assert mine["loss"] == pytest.approx(old["loss"], rel=1e-6) and mine["lr"] == old["lr"]
        assert mine["consumed_samples"] == old["consumed_samples"]
        assert mine["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-5)
    reader = ckpt.CheckpointReader(final, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    digests = {f"{k}/{n}": hashlib.sha256(reader.load(n, k).numpy().tobytes()).hexdigest()
               for n in sorted(reader.names()) for k in ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS}
    # The update is now torch's own AdamW (exp_avg.lerp_), whose last bits differ from the
    # hand-written one that wrote the fixture; the losses above show the resumed state is the
    # saved one. The final tensors: the same names, and close to the old run's is implied by
    # identical losses; their digests are no longer comparable.
    assert digests.keys() == expected["final_tensors_sha256"].keys()
    for n in reader.names():
        assert reader.load(n, "model").float().isfinite().all(), n
    manifest = reader.manifest
    # Saved since: the LR schedule's position (the samples of applied updates), which for a
    # checkpoint without it is its consumed samples (its LR followed them; no step skipped here).
    state = dict(manifest["train_state"])
    assert state.pop("lr_samples") == state["consumed_samples"]
    # And the data order's digest over the samples consumed (a resume on another order is
    # refused); the old checkpoint has none, so its resume was not checked.
    assert state.pop("data_order")["samples"] == state["consumed_samples"]
    for key, value in expected["final_manifest"].items():
        assert (state if key == "train_state" else manifest[key]) == value, key
    assert math.isfinite(got[-1]["loss"])
