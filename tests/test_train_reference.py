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

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import Trainer
from tests.dist import run_ranks
from tests.reference import reference_eval, reference_train
from tests.helpers import make_cfg, metrics

STEPS = 6

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


def case_cfg(dataset, tmp, case: dict):
    over = {"optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 16, "decay_samples": 400,
                      "clip_grad": 1.0, **case.get("optim", {})}}
    if "rampup" in case:
        over.update(train__train_samples=case["train_samples"], train__train_iters=None,
                    train__rampup_batch_size=case["rampup"])
    else:
        over["train__train_iters"] = STEPS
    return make_cfg(dataset, Path(tmp), parallel=case.get("parallel", {}),
                    train__micro_batch_size=1, train__eval_iters=2,
                    train__global_batch_size=case.get("gbs", 8),
                    train__precision=case.get("precision", "bf16"),
                    checkpoint={"dir": f"{tmp}/ck", "async_save": False}, **over)


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


def _state(path):
    reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    return {k: {n: reader.load(n, k) for n in reader.names()} for k in
            ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS}


def _rel_l2(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of two same-keyed dicts."""
    num = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    den = sum(float(b[n].double().square().sum()) for n in b)
    return (num / den) ** 0.5


# Tolerances. A layout runs the same micro-batches through the same model as the plain loop; what
# differs is where results are rounded. Without tp or pp only fp32 summation orders differ (the
# dp reduction adds per-rank fp32 sums), so the first step, taken from identical weights, has the
# same gradient norm to 1e-6 (measured <= 1.5e-7). Summing the micro-batch gradients in bf16
# instead of fp32 makes it 2.6e-6 with 4 micro-batches per rank and 1.5e-4 with 16.
FIRST_NORM_RTOL = 1e-6
# With tp, each rank rounds its partial matmul output to bf16 before the all-reduce adds them (one
# process rounds the sum once); with pp, the tied embedding's two gradient halves are added in
# fp32 where autograd adds them in bf16. Each is at most half a bf16 ulp, 2^-9 = 0.2%, of one term,
# and after step 1 the compute copies (masters rounded to bf16) flip where the masters differ near
# a rounding midpoint, so the runs drift apart by bf16 noise. Adam's update m/sqrt(v) does not
# depend on the gradient's scale, so that noise moves each step's update by about its own relative
# size. Measured over these layouts (worst case): losses 8.5e-6 relative, gradient norms 8.8e-5,
# the weights' total motion (final - initial master) 0.52% in relative L2, Adam moments 0.73%,
# eval 6e-6. The bounds are 4-10x that: still below the 5.5% motion error and 9e-4 norm error of
# masters kept in bf16 (updates below a bf16 ulp lost: LayerNorm weights near 1 never move), and
# far below a lost or doubled micro-batch or a missing tied-embedding reduction (30%).
# fp16 has three more mantissa bits than bf16, so its bounds are 8x tighter.
TOLERANCES = {
    "bf16": dict(loss=1e-4, norm=3e-4, motion=0.02, moments=0.03, eval=1e-4),
    "fp16": dict(loss=1.2e-5, norm=4e-5, motion=0.0025, moments=0.004, eval=1.2e-5),
}


def _initial_weights(cfg):
    from bloomtrain.model import build_model, resolve_model_config
    model = build_model(resolve_model_config(cfg.model), seed=cfg.train.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


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

    state = _state(got["checkpoint"])
    assert state["model"].keys() == ref.master.keys()
    init = _initial_weights(cfg)
    motion = {n: w - init[n] for n, w in state["model"].items()}
    ref_motion = {n: w - init[n] for n, w in ref.master.items()}
    assert _rel_l2(motion, ref_motion) < tol["motion"]
    assert _rel_l2(state["exp_avg"], ref.exp_avg) < tol["moments"]
    assert _rel_l2(state["exp_avg_sq"], ref.exp_avg_sq) < tol["moments"]

    # Eval: the trainer's (through the pipeline and tp, averaged over dp) against one process
    # evaluating the same weights.
    assert got["eval_loss"] == pytest.approx(reference_eval(cfg, state["model"]),
                                             rel=tol["eval"])
