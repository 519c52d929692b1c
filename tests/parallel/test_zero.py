"""ZeRO stages 0-3 against a single process on gloo: losses, grad norms and the final gathered
weights over 10 steps, gradient accumulation, skipped non-finite steps, stage-3 freeing and
prefetch, composition with tensor (+ sequence) and pipeline parallelism, and the layout of the
flat buffers. Every engine is built through `parallelize`. One spawn per world size runs every
check and returns numbers; the tests below assert on them. (The optimizer itself is checked
against torch's in test_optimizer_reference.py.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bloomtrain.layout import ParallelLayout
from bloomtrain.model.params import param_spec
from bloomtrain.parallel.zero.memory import formula
from bloomtrain.parallel.zero.segments import build_layout
from bloomtrain.topology import Topology
from tests import helpers
from tests.dist import run_ranks
from tests.zero_runs import LR, SEQ, SHAPE, global_batches, train

STEPS = 10
MICRO = 2        # micro-batches per dp rank per step
MBS = 2          # samples per micro-batch
STAGES = (0, 1, 2, 3)
BUCKET_MB = 0.05  # several buckets (segments) at this model size

# fp32: the dp runs sum the same per-sample gradients in a different order (reduce-scatter vs
# one accumulator) and a tensor-parallel model splits its matmuls, so results differ by fp32
# rounding, which 10 Adam steps (updates ~lr whatever the gradient size) carry into the weights.
FP32_LOSS_TOL = 1e-5
FP32_WEIGHT_TOL = 1e-5
FP32_NORM_RTOL = 1e-5
# bf16 / fp16: the same, but a master weight that lands near a rounding boundary of the 16-bit
# compute copy can round either way, which moves the next losses by a 16-bit ulp (~4e-3 relative
# for bf16). The bf16 semantics themselves are tested directly in test_optimizer_reference.py and
# through the trainer against a plain bf16 loop in test_train_reference.py.
LOW_LOSS_TOL = {"bf16": 5e-3, "fp16": 2e-3}
LOW_WEIGHT_TOL = {"bf16": 1e-3, "fp16": 1e-3}
# Different micro-batching changes the matmul shapes and so the fp32 summation order only.
ACCUM_TOL = 2e-5


def make(stage=0, precision="fp32", base=None, recompute="none", **parallel):
    """(model chunk, engine) of this rank for the tiny model, seed 1, clip 0.5 (so that clipping,
    and with it the global norm, shapes every update)."""
    cfg = helpers.config(SHAPE, parallel={"zero_stage": stage, "bucket_size_mb": BUCKET_MB,
                                          **parallel},
                         optim={"lr": LR, "clip_grad": 0.5}, precision=precision, seed=1,
                         activation_checkpointing=recompute)
    parts = helpers.build(cfg, helpers.topology(cfg, base))
    return parts


def run(stage, precision, steps, global_batch, mbs, seed=0, base=None, recompute="none",
        **parallel):
    parts = make(stage, precision, base, recompute, **parallel)
    out = train(parts, global_batches(steps, global_batch, seed), mbs)
    return out, parts


def full_master(parts):
    master = helpers.gather_full_tensors(parts.engine.master_state(), parts.topo)
    if "lm_head.weight" in master:  # the last stage's copy of the tied embedding
        master["transformer.word_embeddings.weight"] = master.pop("lm_head.weight")
    return master


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() <= b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compare(out, master, ref_out, ref_master) -> dict:
    (losses, norms, skipped), (rl, rn, _) = out, ref_out
    return {"loss": max(abs(x - y) for x, y in zip(losses, rl)),
            "norm_rel": max(abs(x - y) / y for x, y in zip(norms, rn)),
            "weight": max_diff(master, ref_master), "skipped": any(skipped)}


def run_single(precision, steps, global_batch, mbs, seed=0):
    """One process of the same engine: the reference of the parity checks."""
    cfg = helpers.config(SHAPE, optim={"lr": LR, "clip_grad": 0.5}, precision=precision,
                         seed=1)
    parts = helpers.build(cfg, Topology.describe_rank(ParallelLayout(), 0))
    out = train(parts, global_batches(steps, global_batch, seed), mbs)
    return out, parts.engine.master_state()


# ---- rank functions ------------------------------------------------------------------------

def _dp_checks(rank, world):
    torch.manual_seed(0)
    base = make().topo
    gbs = world * MICRO * MBS
    results = {"parity": {}, "low": {}, "accum": {}, "nonfinite": {}}

    ref_out, ref_master = run_single("fp32", STEPS, gbs, MBS)
    for stage in STAGES:
        out, parts = run(stage, "fp32", STEPS, gbs, MBS, base=base)
        results["parity"][stage] = compare(out, parts.engine.master_state(), ref_out, ref_master)
        if stage == 3:
            results["num_prefetches"] = parts.engine.counters.num_prefetches
    # ZeRO-3 gathers a block's parameters in its pre-hooks and frees them after: selective
    # recompute's replay calls the block as a module, so the gathers run again for it.
    out, parts = run(3, "fp32", STEPS, gbs, MBS, base=base, recompute="selective")
    results["selective_zero3"] = compare(out, parts.engine.master_state(), ref_out, ref_master)

    for precision in ("bf16", "fp16"):
        low_ref_out, low_ref_master = run_single(precision, 3, gbs, MBS)
        for stage in STAGES:
            out, parts = run(stage, precision, 3, gbs, MBS, base=base)
            results["low"][(precision, stage)] = compare(out, parts.engine.master_state(),
                                                         low_ref_out, low_ref_master)

    # Micro-batch 1 x 8 accumulation steps vs micro-batch 8 x 1 step, per rank.
    for stage in STAGES:
        a_out, a = run(stage, "fp32", 2, world * 8, mbs=1, seed=3, base=base)
        b_out, b = run(stage, "fp32", 2, world * 8, mbs=8, seed=3, base=base)
        results["accum"][stage] = compare(a_out, a.engine.master_state(), b_out,
                                          b.engine.master_state())

    for stage in STAGES:
        results["nonfinite"][stage] = _nonfinite(base, stage, gbs)
    results["stage3"] = _stage3_memory(base)
    return results


def _nonfinite(base, stage, gbs):
    parts = make(stage, base=base)
    eng = parts.engine
    batches = global_batches(4, gbs, seed=5)
    train(parts, batches[:2], MBS)
    master, optim = eng.master_state(), eng.optim_state()
    compute = eng.bufs.compute.clone() if eng.bufs.compute is not None else None
    _, norms, skipped = train(parts, batches[2:3], MBS, inject_nonfinite_at=0)
    unchanged = (max_diff(master, eng.master_state()) == 0.0
                 and max_diff(optim, eng.optim_state()) == 0.0
                 and (compute is None or torch.equal(compute, eng.bufs.compute))
                 and parts.optimizer.step_count == 2)
    _, after_norms, after_skipped = train(parts, batches[3:], MBS)
    return {"skipped": skipped[0], "norm_finite": math.isfinite(norms[0]),
            "unchanged": unchanged, "next_ok": not after_skipped[0]
            and math.isfinite(after_norms[0]), "grads_zeroed": eng.bufs.grad.abs().sum().item()}


def _stage3_memory(base):
    """After a forward, a block holds only its shard; during it, the block is gathered."""
    parts = make(3, "bf16", base)
    eng, model = parts.engine, parts.chunks[0]
    block = model.transformer.h["1"]
    seen = {}

    def inside(mod, args):  # registered after the engine's pre-hook, so runs after it
        seen["gathered"] = sum(p.untyped_storage().nbytes() > 0 for p in block.parameters())
    block.register_forward_pre_hook(inside)
    ids = torch.randint(0, SHAPE.vocab_size, (2, SEQ + 1))
    for _ in range(2):  # the second forward follows the recorded order, so it prefetches
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        after_forward = {
            "param_bytes": sum(p.untyped_storage().nbytes() for p in block.parameters()),
            "gathered_bytes": eng.counters.gathered_bytes,
        }
        loss.backward()
    helpers.step(parts.optimizer, LR)
    group = next(g for g in eng.bufs.layout.groups
                 if any(s.param is next(block.parameters()) for s in g.slots))
    return {**after_forward, "gathered_inside": seen["gathered"],
            "num_block_params": len(list(block.parameters())),
            "shards": [(s.shard, s.padded) for s in group.segments], "world": parts.topo.dp_size,
            "after_backward": eng.counters.gathered_bytes,
            "prefetches": eng.counters.num_prefetches,
            "report": eng.memory_report(), "bound": eng.working_set_bound()}


def _tp_pp_checks(rank, world):
    """tp=2 (sequence parallel) x dp=2: replicated LayerNorms and biases count once in the grad
    norm, and every stage matches a single process. Then pp=2 x dp=2 through the pipeline
    runtime: the tied embedding's two copies are summed and counted once."""
    torch.manual_seed(0)
    gbs = 2 * MICRO * MBS
    ref_out, ref_master = run_single("fp32", STEPS, gbs, MBS)
    results = {"tp": {}, "pp": {}}
    base = make(tp=2).topo
    for stage in STAGES:
        out, parts = run(stage, "fp32", STEPS, gbs, MBS, base=base, tp=2, sequence_parallel=True)
        results["tp"][stage] = compare(out, full_master(parts), ref_out, ref_master)
    base = make(pp=2, pp_partition="uniform").topo
    for stage in STAGES:
        out, parts = run(stage, "fp32", STEPS, gbs, MBS, base=base, pp=2, pp_partition="uniform")
        d = compare(out, full_master(parts), ref_out, ref_master)
        results["pp"][stage] = d
    return results


@pytest.fixture(scope="module")
def dp2():
    return run_ranks(2, _dp_checks)


@pytest.fixture(scope="module")
def dp4():
    return run_ranks(4, _dp_checks)


@pytest.fixture(params=["dp2", "dp4"])
def dp_results(request):
    return request.getfixturevalue(request.param)


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_parity_fp32(dp_results, stage):
    for r in dp_results:
        d = r["parity"][stage]
        assert not d["skipped"]
        assert d["loss"] < FP32_LOSS_TOL, d
        assert d["norm_rel"] < FP32_NORM_RTOL, d
        assert d["weight"] < FP32_WEIGHT_TOL, d


def test_parity_zero3_with_selective_recompute(dp_results):
    for r in dp_results:
        d = r["selective_zero3"]
        assert not d["skipped"]
        assert d["loss"] < FP32_LOSS_TOL, d
        assert d["norm_rel"] < FP32_NORM_RTOL, d
        assert d["weight"] < FP32_WEIGHT_TOL, d


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_parity_low_precision(dp_results, precision, stage):
    for r in dp_results:
        d = r["low"][(precision, stage)]
        assert not d["skipped"]
        assert d["loss"] < LOW_LOSS_TOL[precision], d
        assert d["weight"] < LOW_WEIGHT_TOL[precision], d


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation(dp_results, stage):
    for r in dp_results:
        d = r["accum"][stage]
        assert d["loss"] < ACCUM_TOL and d["weight"] < ACCUM_TOL, d


@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_gradient_skips_step_everywhere(dp_results, stage):
    for r in dp_results:
        d = r["nonfinite"][stage]
        assert d["skipped"] and not d["norm_finite"], d
        assert d["unchanged"], d
        assert d["next_ok"] and d["grads_zeroed"] == 0.0, d


def test_stage3_frees_gathered_params_and_prefetches(dp_results):
    for r in dp_results:
        s = r["stage3"]
        assert s["gathered_inside"] == s["num_block_params"]
        assert s["param_bytes"] == 0 and s["gathered_bytes"] == 0, s
        assert s["after_backward"] == 0, s
        assert all(shard * s["world"] == padded for shard, padded in s["shards"])
        assert s["prefetches"] > 0 and r["num_prefetches"] > 0
        # Peak of gathered copies: two units (current + prefetched) plus the tied embedding,
        # which its LM head uses again.
        assert 0 < s["report"]["measured"]["gathered_peak"] <= s["bound"], s


def test_memory_report_matches_formula(dp_results):
    # The tiny model pads each segment to a multiple of dp; bench/zero_memory.py checks the
    # formula on a 10M+ parameter model, where padding is negligible.
    for r in dp_results:
        rep = r["stage3"]["report"]
        f = rep["formula"]
        assert rep["measured"]["compute_params"] == f["compute_params"] == 0  # cast when gathered
        for key in ("fp32_master", "fp32_grads", "adam_m", "adam_v"):
            assert rep["measured"][key] == pytest.approx(f[key], rel=0.01), key


def test_formula_against_paper():
    # ZeRO Fig. 1: Ψ = 7.5B, N = 64: 120 GB / 31.4 GB / 16.6 GB / 1.9 GB.
    psi, n = 7.5e9, 64
    papers = [formula(s, psi, n)["paper"] / 1e9 for s in STAGES]
    assert papers == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.06)
    assert formula(1, psi, n)["ours"] == pytest.approx(2 * psi + 4 * psi + 12 * psi / n)
    # Stage 3 keeps no compute copy: FSDP2's 16Ψ/N.
    assert formula(3, psi, n)["ours"] == pytest.approx(16 * psi / n)


def test_tensor_and_pipeline_composition_and_norm_counting():
    results = run_ranks(4, _tp_pp_checks)
    for r in results:
        for layout in ("tp", "pp"):
            for stage, d in r[layout].items():
                assert d["norm_rel"] < FP32_NORM_RTOL, (layout, stage, d)
                assert d["loss"] < FP32_LOSS_TOL, (layout, stage, d)
                assert d["weight"] < FP32_WEIGHT_TOL, (layout, stage, d)


# ---- the layout of the flat buffers, without a process group ------------------------------------

def _fake_params(sizes):
    names = [f"transformer.h.0.mlp.dense_h_to_4h.weight.{i}" for i in range(len(sizes))]
    spec = param_spec("transformer.h.0.mlp.dense_h_to_4h.weight")
    return [[(n, nn.Parameter(torch.empty(s, device="meta")), spec)
             for n, s in zip(names, sizes)]]


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket", [5, 16, 1000])
def test_segments_cover_every_parameter_once(dp, bucket):
    """Segments hold at most a bucket (a multiple of dp), are padded only where a run ends, and
    every parameter is one contiguous range of the full flat space."""
    groups = _fake_params([7, 30, 1, 12])
    layout = build_layout(groups, dp, 0, bucket, per_group=False)
    cap = max(dp, bucket // dp * dp)
    covered = {s.name: [] for s in layout.slots}
    for i, seg in enumerate(layout.segments):
        assert seg.padded % dp == 0 and seg.shard * dp == seg.padded
        assert seg.numel <= cap
        if i < len(layout.segments) - 1:
            assert seg.padded == seg.numel  # padding only at the end of the run
        for p in seg.pieces:
            assert seg.full_off + p.seg_start == p.slot.full_off + p.param_start
            covered[p.slot.name].append((p.param_start, p.param_start + p.numel))
    for slot in layout.slots:
        ranges = sorted(covered[slot.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # Backward order: the last parameter of the forward comes first.
    assert layout.segments[0].pieces[0].slot.name.endswith(".3")


class _Counting(dict):
    def __init__(self, *a):
        super().__init__(*a)
        self.reads = {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().__getitem__(key)


@pytest.mark.parametrize("stage", STAGES)
def test_load_state_reads_each_tensor_once(stage):
    """A resume hands the engine lazy tensors read from disk on access: however the parameters
    are cut into segments (here: thousands of tiny ones), each is asked for once."""
    cfg = helpers.config(SHAPE, parallel={"zero_stage": stage, "bucket_size_mb": 0.001}, seed=1)
    parts = helpers.build(cfg, Topology.describe_rank(ParallelLayout.from_config(cfg.parallel, 1),
                                                      0))
    eng = parts.engine
    assert len(eng.bufs.layout.segments) > 100
    master, optim = _Counting(eng.master_state()), _Counting(eng.optim_state())
    eng.load_state(master, optim)
    assert set(master.reads.values()) == {1} and len(master.reads) == len(master)
    assert set(optim.reads.values()) == {1} and len(optim.reads) == len(optim)


def test_frozen_parameters_are_refused():
    from bloomtrain.config import UserError
    from bloomtrain.model.params import ParamSpec
    from bloomtrain.parallel.zero.engine import ZeroEngine
    m = nn.Linear(4, 4)
    m.bias.requires_grad_(False)
    spec = ParamSpec(name="x", tp_dim=None, weight_decay=False, init="zeros")
    with pytest.raises(UserError, match=r"\['bias'\] do not require grad"):
        ZeroEngine([m], {"weight": spec, "bias": spec}, Topology.single(), "fp32")
