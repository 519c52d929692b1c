"""The trainer in bf16 (and fp16) under tensor, pipeline and ZeRO data parallelism against the
plain reference loop of tests/reference.py: bf16 compute, fp32 gradient accumulation and fp32
masters, torch AdamW + clip_grad_norm_. And the trainer's eval against a single-process eval of
the same weights.

One spawn per world size runs every layout of that size; the comparisons happen here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bloomtrain.train import Trainer
from tests.dist import run_ranks
from tests.reference import reference_eval, reference_train
from tests.helpers import metrics
from tests.layouts import TOLERANCES, case_cfg, checkpoint_states, initial_weights, rel_l2


# Layouts by world size. Every case: tiny model, 8 samples per global batch of micro-batches of
# 1 (8 micro-batches per step on one process), lr 1e-3 warmed up over 2 steps, clip 1.0.
CASES = {
    2: {
        "dp2-z1": dict(parallel={"zero_stage": 1}),
        "dp2-z3-gbs32": dict(parallel={"zero_stage": 3}, gbs=32),
        "tp2": dict(parallel={"tp": 2}),
        "pp2-1f1b": dict(parallel={"pp": 2, "pp_schedule": "1f1b", "pp_partition": "uniform"}),
        "pp2-interleaved": dict(parallel={"pp": 2, "pp_schedule": "interleaved",
                                          "num_virtual_stages": 2, "pp_partition": "uniform"}),
    },
    4: {
        "tp2.dp2-sp-z2": dict(parallel={"tp": 2, "sequence_parallel": True, "zero_stage": 2}),
        # fp16: a loss scale of 2^24 overflows the fp16 gradients, so the first steps are skipped
        # and the scale halves (hysteresis 1) until they fit; the reference does the same.
        "pp2.dp2-z1-fp16": dict(parallel={"pp": 2, "zero_stage": 1, "pp_partition": "uniform"},
                                precision="fp16",
                                optim={"initial_loss_scale": 2.0 ** 24, "hysteresis": 1}),
    },
    8: {
        "tp2.pp2.dp2-z1": dict(parallel={"tp": 2, "pp": 2, "zero_stage": 1,
                                         "pp_partition": "uniform"}),
        "tp2.pp2.dp2-z3": dict(parallel={"tp": 2, "pp": 2, "zero_stage": 3,
                                         "pp_partition": "uniform"}),
        # Ramp-up 4 -> 8 samples over the first 16: global batches 4, 4, 4, 4, 8, 8, 8 (one and
        # then two micro-batches per dp rank), with pipeline and dp = 4.
        "pp2.dp4-z2-rampup": dict(parallel={"pp": 2, "zero_stage": 2,
                                            "pp_partition": "uniform"},
                                  train_samples=40, rampup=[4, 4, 16]),
    },
}


def _worker(rank, world, dataset, tmp):
    out = {}
    for name, case in CASES[world].items():
        cfg = case_cfg(dataset, f"{tmp}/{name}", case)
        res = Trainer(cfg, log=lambda *a: None).run()
        out[name] = {"losses": res.losses, "eval_loss": res.eval_loss,
                     "checkpoint": res.checkpoint}
    return out


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"world{world}")
            cache[world] = (run_ranks(world, _worker, dataset, str(tmp)), tmp)
        return cache[world]
    return get


# Tolerances. A layout runs the same micro-batches through the same model as the plain loop; what
# differs is where results are rounded. Without tp or pp only fp32 summation orders differ (the
# dp reduction adds per-rank fp32 sums), so the first step, taken from identical weights, has the
# same gradient norm to 1e-6 (measured <= 1.5e-7). Summing the micro-batch gradients in bf16
# instead of fp32 makes it 2.6e-6 with 4 micro-batches per rank and 1.5e-4 with 16.
FIRST_NORM_RTOL = 1e-6


@pytest.mark.parametrize("world,name", [(w, n) for w in CASES for n in CASES[w]])
def test_layout_matches_plain_loop(runs, dataset, tmp_path, world, name):
    ranks, tmp = runs(world)
    case = CASES[world][name]
    cfg = case_cfg(dataset, tmp_path, case)
    tol = TOLERANCES[cfg.train.precision]
    ref = reference_train(cfg)
    got = ranks[0][name]
    for r in ranks:
        assert r[name]["losses"] == got["losses"]  # every rank reports the same step loss
    records = [r for r in metrics(Path(tmp) / name / "run") if "loss" in r]
    assert [bool(r.get("skipped")) for r in records] == ref.skipped
    if cfg.train.precision == "fp16":
        assert any(ref.skipped) and not all(ref.skipped)  # the scale came down, then steps ran
        assert [r["loss_scale"] for r in records[:-1]] == ref.loss_scales[1:]
    np.testing.assert_allclose(got["losses"], ref.losses, rtol=tol["loss"])
    applied = [(r["grad_norm"], n) for r, n, s in zip(records, ref.grad_norms, ref.skipped)
               if not s]
    np.testing.assert_allclose([a for a, _ in applied], [b for _, b in applied],
                               rtol=tol["norm"])
    p = cfg.parallel
    if p.tp == 1 and p.pp == 1:
        assert records[0]["grad_norm"] == pytest.approx(ref.grad_norms[0], rel=FIRST_NORM_RTOL)

    state = checkpoint_states(got["checkpoint"])
    assert state["model"].keys() == ref.master.keys()
    init = initial_weights(cfg)
    motion = {n: w - init[n] for n, w in state["model"].items()}
    ref_motion = {n: w - init[n] for n, w in ref.master.items()}
    assert rel_l2(motion, ref_motion) < tol["motion"]
    assert rel_l2(state["exp_avg"], ref.exp_avg) < tol["moments"]
    assert rel_l2(state["exp_avg_sq"], ref.exp_avg_sq) < tol["moments"]

    # Eval: the trainer's (through the pipeline and tp, averaged over dp) against one process
    # evaluating the same weights.
    assert got["eval_loss"] == pytest.approx(reference_eval(cfg, state["model"]),
                                             rel=tol["eval"])
