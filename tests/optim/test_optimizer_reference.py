"""The optimizer against references that share none of its code: `torch.optim.AdamW` with
`torch.nn.utils.clip_grad_norm_` for the update, and hand-made cases for the BF16Optimizer
semantics (fp32 gradient accumulation, fp32 masters, compute copy = master rounded).

Nothing here compares the engine with itself: a bug shared by every layout of our optimizer (a
wrong bias correction, weight decay on LayerNorms, a clip coefficient off by the loss scale) shows
up as a difference from torch.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bloomtrain.config import OptimConfig
from bloomtrain.model import build_model
from bloomtrain.model.params import ParamSpec
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.zero.optimizer import ZeroAdamW
from bloomtrain.parallel.zero.engine import ZeroEngine
from bloomtrain.topology import Topology
from tests import helpers
from tests.reference import is_no_decay, megatron_lr

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256)
SEQ = 32
STEPS = 24
CLIP = 1.0
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 4 * 8, 20 * 8  # samples; 8 per step
# The loss is scaled per step so that the gradient norm (about 0.7 at scale 1) crosses the clip
# threshold on some steps and not on others: both branches of the clip coefficient are taken.
MOMENT_RTOL = 1e-5
LOSS_SCALES = [0.5, 3.0, 1.0, 2.0]


def torch_reference(model: nn.Module, **adamw_kw):
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not is_no_decay(n, p)], "weight_decay": 0.1},
              {"params": [p for n, p in named if is_no_decay(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, **adamw_kw)


def test_adamw_clipping_and_norm_match_torch(device):
    """24 fp32 steps of a tiny BLOOM: our single-process optimizer vs torch AdamW +
    clip_grad_norm_ on an fp32 copy of the model, each side with its own forward and backward.

    Tolerances. Both sides run the same fp32 forward and backward; the updates differ only in
    rounding: torch forms exp_avg with lerp and clips with an fp32 coefficient, we multiply-add
    and sum the norm's squares in fp64. That is <= 1 fp32 ulp per step: measured, parameters
    <= 1.2e-7 apart (one ulp of the LayerNorm weights near 1) and norms <= 4e-7 relative. The
    moments follow the gradients, which the one-ulp parameter differences move by up to ~1e-6
    relative where a gradient entry is a cancelling sum; v is a square, so twice that. Measured:
    <= 1.1e-6 (exp_avg) and 1.6e-6 (exp_avg_sq) of each tensor's largest entry, so the bound is
    1e-5 of it, and 1e-6 absolute. A real bug moves parameters by ~lr = 1e-3 and moments by
    their own size."""
    cfg = helpers.config(SHAPE, optim=dict(lr=LR, min_lr=MIN_LR, clip_grad=CLIP,
                                           weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8),
                         precision="fp32", seed=1)
    parts = helpers.build(cfg, device=device)
    ours, eng, opt = parts.chunks[0], parts.engine, parts.optimizer
    ref = build_model(SHAPE, seed=1, device=device)
    topt = torch_reference(ref, foreach=False)
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(0)
    clipped = []
    for step in range(STEPS):
        lr = megatron_lr(step * 8, LR, MIN_LR, WARMUP, DECAY, "cosine")
        batch = torch.randint(0, SHAPE.vocab_size, (8, SEQ + 1), generator=g).to(device)
        scale = LOSS_SCALES[step % len(LOSS_SCALES)]
        for mb in batch.split(4):  # two micro-batches: the accumulation path too
            (ours(mb[:, :-1], labels=mb[:, 1:]) * scale / 2).backward()
            (ref(mb[:, :-1], labels=mb[:, 1:]) * scale / 2).backward()
        res = helpers.step(opt, lr)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        topt.zero_grad(set_to_none=True)
        clipped.append(ref_norm > CLIP)

        assert not res.skipped
        assert res.grad_norm == pytest.approx(ref_norm, rel=1e-6), step
        master = eng.master_state()
        moments = eng.optim_state()
        assert master.keys() == {n for n in ref_params if n != "lm_head.weight"}
        for name, w in master.items():
            p = ref_params[name]
            assert (w.to(device) - p.detach()).abs().max().item() <= 1e-6, (step, name)
            st = topt.state[p]
            for kind in ("exp_avg", "exp_avg_sq"):
                mine, theirs = moments[f"{kind}.{name}"].to(device), st[kind]
                err = (mine - theirs).abs().max().item()
                assert err <= 1e-6, (step, name, kind)
                assert err <= MOMENT_RTOL * theirs.abs().max().item(), (step, name, kind)
        assert opt.step_count == int(topt.state[ref_params["transformer.ln_f.weight"]]["step"])
    assert 0 < sum(clipped) < STEPS, clipped  # clipping was active on some steps only


# ---- BF16Optimizer semantics ---------------------------------------------------------------------

class Scalar(nn.Module):
    """One parameter and a loss whose gradient is exactly the coefficient given: d(c·w)/dw = c."""

    def __init__(self, value: float):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), value))

    def forward(self, c: float):
        return (self.w * c).sum()


def _optimizer(module, stage, **kw):
    """The engine and its optimizer alone on a module that is not BLOOM: its one parameter gets
    a spec by hand."""
    cfg = OptimConfig(lr=1.0, clip_grad=0.0, weight_decay=0.0, **kw)
    spec = ParamSpec(name="w", tp_dim=None, weight_decay=False, init="zeros")
    eng = ZeroEngine([module], {"w": spec}, Topology.single(), "bf16", zero_stage=stage,
                     unit_types=(Scalar,))
    return eng, ZeroAdamW(eng, cfg, "bf16")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_accumulator_is_fp32(stage, device):
    """One micro-batch of gradient 1 and 200 of 2^-10: the step's gradient is 1 + 200·2^-10 =
    1.1953125 in fp32. Summed in bf16, whose ulp at 1 is 2^-7, every 2^-10 rounds away and the sum
    stays 1. The first Adam moment after one step is (1 - beta1)·g, so it shows which sum the
    optimizer took."""
    m = Scalar(0.5).to(device)
    eng, opt = _optimizer(m, stage, beta1=0.9)
    coeffs = [1.0] + [2.0 ** -10] * 200
    assert torch.tensor(1.0, dtype=torch.bfloat16) + 2.0 ** -10 == 1.0  # the premise
    for c in coeffs:
        m(c).backward()
    helpers.step(opt, 1e-3)
    exp_avg = eng.optim_state()["exp_avg.w"].cpu()
    torch.testing.assert_close(exp_avg, torch.full((4,), 0.1 * 1.1953125), rtol=1e-6, atol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_masters_accumulate_updates_below_a_bf16_ulp(stage, device):
    """A weight at 1.0 and Adam steps of lr = 1e-4 (Adam's update is ~lr whatever the gradient):
    each step is 1/39 of the bf16 spacing below 1 (2^-8), so a bf16 weight updated in place
    would never move. The fp32 master must follow torch AdamW on an fp32 weight step for step,
    and the compute copy must be that master rounded to bf16 after every step: 1.0 until the
    master has fallen past the midpoint 1 - 2^-9, then 1 - 2^-8."""
    m = Scalar(1.0).to(device)
    eng, opt = _optimizer(m, stage)
    ref_w = nn.Parameter(torch.full((4,), 1.0))  # torch's update on the CPU: the reference
    ref = torch.optim.AdamW([ref_w], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            foreach=False)
    seen = set()
    for _ in range(40):
        m(1.0).backward()
        helpers.step(opt, 1e-4)
        ref_w.grad = torch.ones(4)
        ref.step()
        master = eng.master_state()["w"].cpu()
        torch.testing.assert_close(master, ref_w.detach(), rtol=0, atol=1e-7)
        compute = _compute_copy(m, eng)["w"].cpu()
        assert compute.dtype == torch.bfloat16
        assert torch.equal(compute, master.to(torch.bfloat16))
        seen.add(float(compute[0]))
    assert master[0].item() == pytest.approx(1.0 - 40e-4, abs=1e-6)
    assert seen == {1.0, 1.0 - 2.0 ** -8}  # it moved once, and only through the master


def _compute_copy(module: nn.Module, eng) -> dict[str, torch.Tensor]:
    """The compute-dtype parameters as the next forward sees them (stage 3 gathers them in a
    forward pre-hook, so they are read from inside the forward)."""
    if eng.stage < 3:
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    # Stage 3 keeps no compute copy: it is cast from the masters as a unit is gathered.
    seen = {}
    hooks = [mod.register_forward_pre_hook(
        lambda mod, args, prefix=prefix: seen.update(
            {prefix + n: p.detach().clone() for n, p in mod.named_parameters(recurse=False)}))
        for prefix, mod in ((f"{name}." if name else "", mod)
                            for name, mod in module.named_modules())]
    with torch.no_grad():
        if isinstance(module, Scalar):
            module(1.0)
        else:
            module(torch.zeros(1, 4, dtype=torch.long,
                               device=module.transformer.alibi_slopes.device))
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compute_copy_is_the_rounded_master_after_every_step(stage, device):
    parts = helpers.build(helpers.config(SHAPE, parallel={"zero_stage": stage},
                                         optim={"lr": 1e-3, "clip_grad": 1.0}, seed=1),
                          device=device)
    model, eng, opt = parts.chunks[0], parts.engine, parts.optimizer
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, SHAPE.vocab_size, (2, SEQ + 1), generator=g).to(device)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        helpers.step(opt, 1e-3)
        master = eng.master_state()
        compute = _compute_copy(model, eng)
        compute.pop("lm_head.weight", None)  # the tied embedding, seen under its own name too
        assert compute.keys() == master.keys()
        for name, w in master.items():
            assert compute[name].dtype == torch.bfloat16
            assert torch.equal(compute[name].cpu(), w.cpu().to(torch.bfloat16)), name
        assert all(math.isfinite(float(v.abs().max())) for v in master.values())
