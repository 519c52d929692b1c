"""The trainer under a parallel layout against the plain loop of tests/reference.py
(tests/system/test_train_reference.py, tests/system/test_train_parallel.py, tests/parallel/test_pipeline_zb.py): the
tolerances of each comparison and why, a case's config, the states a checkpoint holds, and the
relative L2 distance they are compared by."""
from __future__ import annotations

from pathlib import Path

from bloomtrain import checkpoint as ckpt
from tests.helpers import make_cfg


STEPS = 6  # steps of a non-ramp-up case


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


def checkpoint_states(path):
    reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    return {k: {n: reader.load(n, k) for n in reader.names()} for k in
            ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS}


def rel_l2(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every tensor of two same-keyed dicts."""
    num = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    den = sum(float(b[n].double().square().sum()) for n in b)
    return (num / den) ** 0.5


# bf16 and fp16 layouts against the plain loop (tests/system/test_train_reference.py: the first step's
# gradient norm, where only fp32 summation orders differ, is held to 1e-6 there). With tp, each
# rank rounds its partial matmul output to bf16 before the all-reduce adds them (one
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


def initial_weights(cfg):
    from bloomtrain.model import build_model, resolve_model_config
    model = build_model(resolve_model_config(cfg.model), seed=cfg.train.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


# fp32, dropout 0: tensor-parallel runs differ from one process only in the summation order of
# the all-reduced partial matmuls (~1e-7 relative per step). Over 10 AdamW steps that stays
# below 1e-5 relative on the loss; weights move by lr-sized steps, so 1e-5 absolute.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
