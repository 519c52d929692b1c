"""ZeRO-Offload of the optimizer (`parallel.offload_optimizer`, arXiv 2101.06840) against the same
runs without it, on CPU/gloo.

Offload moves the fp32 masters and Adam moments to host memory and runs the step there, with the
same torch AdamW kernel on the same views of the flat buffers
(bloomtrain/parallel/zero/optimizer.py), so the math is identical and every comparison here is
bitwise: losses, gradient norms, skipped steps, the gathered fp32 masters and moments, the
compute copies, and checkpoints, which must not depend on whether the run that wrote or reads
them offloads. The memory accounting must show the
12 bytes per owned parameter leaving the device for the host, and only the staging ring pinned.

One 2-rank spawn runs the dp=2 layouts (ZeRO 0-3, bf16; fp16 with skipped steps; sizes that are
not multiples of a SIMD width) and then the trainer at ZeRO 0-3, with checkpoints saved under
one setting and resumed under the other; one 4-rank spawn runs pp2·dp2 ZeRO-3 (the tied
embedding's two copies, stage 3's device shard). Small buckets cut the segments into several
chunks of the ring, which is reused within a step. The memory accounting is checked on meta,
without processes, and on the test device.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.layout import ParallelLayout
from bloomtrain.model import build_model
from bloomtrain.model.bloom import lm_loss
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.zero.memory import CHUNK_ALIGN, RING_SLOTS, formula, pinned_size
from bloomtrain.topology import Topology
from bloomtrain.train import Trainer
from tests import helpers
from tests.dist import run_ranks
from tests.reference import is_no_decay
from tests.helpers import make_cfg
from tests.zero_runs import global_batches, train

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256)
STEPS = 3
MBS = 2
BUCKET_MB = 0.05  # several segments at this size: the per-segment copies and steps are exercised
STAGES = (0, 1, 2, 3)
# Sizes that are not multiples of a SIMD width (60, 180, 240): torch's CPU kernels run a tensor
# in full vectors from its first element and a scalar tail, whose bits differ, so the step's
# tensors must be cut in the same places with and without offload (at the chunk grid and where
# weight decay starts or stops; bloomtrain/parallel/zero/optimizer.py), which this shape checks.
ODD = BloomShape(vocab_size=256, hidden_size=60, num_layers=2, num_heads=4, ffn_hidden_size=240)


def _parts(stage, offload, precision="bf16", base=None, optim=None, shape=SHAPE, **parallel):
    cfg = helpers.config(shape, parallel={"zero_stage": stage, "bucket_size_mb": BUCKET_MB,
                                          "offload_optimizer": offload, **parallel},
                         optim={"lr": 1e-3, "clip_grad": 0.5, "weight_decay": 0.1,
                                **(optim or {})},
                         precision=precision, seed=1)
    return helpers.build(cfg, helpers.topology(cfg, base))


def _run(stage, offload, precision, base, optim=None, **parallel):
    parts = _parts(stage, offload, precision, base, optim, **parallel)
    assert len(parts.engine.bufs.layout.segments) > 1
    if offload:  # chunks of the ring cut segments, and the ring is reused within a step
        eng = parts.engine
        assert len(eng.host_copies.order) > max(len(eng.bufs.layout.segments),
                                                len(eng.bufs.staging))
    topo = parts.topo
    out = train(parts, global_batches(STEPS, 2 * topo.dp_size * MBS, seed=2), MBS)
    eng = parts.engine
    states = {**eng.master_state(), **eng.optim_state()}
    bufs = eng.bufs
    # What the next forward computes with: the compute copy (stages 0-2), or what stage 3 gathers
    # from (the masters cast, or under offload the device's compute-dtype shard).
    compute = (bufs.compute if bufs.compute is not None else bufs.compute_shard
               if bufs.compute_shard is not None else bufs.master.to(bufs.compute_dtype))
    return out, states, compute.clone()


def _parity(stage, precision, base, optim=None, **parallel) -> dict:
    (l0, n0, s0), states0, compute0 = _run(stage, False, precision, base, optim, **parallel)
    (l1, n1, s1), states1, compute1 = _run(stage, True, precision, base, optim, **parallel)
    assert states0.keys() == states1.keys()
    return {"losses": (l0, l1), "norms": (n0, n1), "skipped": (s0, s1),
            "states_differ": [k for k in states0 if not torch.equal(states0[k], states1[k])],
            "compute_equal": torch.equal(compute0, compute1)}


def _pp_worker(rank, world):
    base = _parts(3, False, pp=2, pp_partition="uniform").topo
    return {"pp2.dp2-z3": _parity(3, "bf16", base, pp=2, pp_partition="uniform")}


@pytest.fixture(scope="module")
def dp2(dataset, tmp_path_factory):
    """Every 2-rank check in one spawn: the parity runs, then the trainer's checkpoints."""
    tmp = tmp_path_factory.mktemp("ckpt")
    return run_ranks(2, _dp2_worker, dataset, str(tmp)), tmp


@pytest.fixture(scope="module")
def parity(dp2):
    per_rank = [r["parity"] for r in dp2[0]], run_ranks(4, _pp_worker)
    return {f"{name}@rank{rank}": d for ranks in per_rank for rank, out in enumerate(ranks)
            for name, d in out.items()}


def test_offload_is_bitwise_equal_to_no_offload(parity):
    assert len(parity) == 8 * 2 + 1 * 4  # every case from every rank
    for name, d in parity.items():
        assert d["losses"][0] == d["losses"][1], name
        # repr: a skipped step's norm is nan, which equals nothing, but its repr does.
        assert list(map(repr, d["norms"][0])) == list(map(repr, d["norms"][1])), name
        assert d["skipped"][0] == d["skipped"][1], name
        assert d["states_differ"] == [], name
        assert d["compute_equal"], name
        if "z2-fp16" in name:  # the case whose loss scale overflows at first
            assert any(d["skipped"][0]) and not all(d["skipped"][0]), d["skipped"]
        else:
            assert not any(d["skipped"][0]), name


# ---- memory ------------------------------------------------------------------------------------

def _described(stage, offload, pin=False, dp=2):
    """dp rank 1 of a dp=2 layout's engine on meta: no memory, no process group."""
    cfg = helpers.config(SHAPE, parallel={"zero_stage": stage, "bucket_size_mb": BUCKET_MB,
                                          "offload_optimizer": offload,
                                          "offload_pin_memory": pin})
    layout = ParallelLayout.from_config(cfg.parallel, dp)
    return helpers.build(cfg, Topology.describe_rank(layout, dp - 1), device="meta").engine


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_buffers_are_the_memory_model(stage, offload, dp):
    """What the engine allocates (FlatBuffers.nbytes, host_nbytes: the tensors' own sizes) is
    the one torch-free memory model (zero/memory.py's state_bytes, which the planner and
    formula() read too), byte for byte by category, on and off the host, at every stage, with
    dp sizes that pad every segment."""
    report = _described(stage, offload, dp=dp).memory_report()
    measured, model = report["measured"], report["model"]
    assert {k: measured[k] for k in model["device"]} == model["device"]
    assert sum(model["device"].values()) == measured["total"]  # nothing else on the device
    host = {k: v for k, v in measured["host"].items() if k != "total"}
    assert host == (model["host"] or dict.fromkeys(host, 0))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_moves_the_optimizer_to_the_host(stage):
    """dp=2, bf16, described on meta (no memory, no process group): the device's model states
    drop by the masters and moments, 12 bytes per owned element (over dp where sharded); the
    host holds them and the staging ring, RING_SLOTS chunks of fp32, and no copy of the
    gradients; stage 3 keeps its own shard in bf16 on the device instead."""
    reports = {offload: _described(stage, offload).memory_report() for offload in (False, True)}
    eng = _described(stage, True)
    layout_ = eng.bufs.layout
    owned = layout_.shard_numel if stage else layout_.full_numel
    plain, off = reports[False]["measured"], reports[True]["measured"]
    drop = plain["total"] - off["total"]
    assert drop == 12 * owned - (2 * owned if stage == 3 else 0)
    assert off["fp32_master"] == off["adam_m"] == off["adam_v"] == 0
    ring = 4 * RING_SLOTS * eng.bufs.chunk
    assert off["host"] == {"fp32_master": 4 * owned, "adam_m": 4 * owned, "adam_v": 4 * owned,
                           "staging_ring": ring, "total": 12 * owned + ring}
    # The ring is about one bucket (BUCKET_MB: 13,107 elements, cut in RING_SLOTS chunks
    # rounded up to CHUNK_ALIGN), not a copy of the gradients.
    assert eng.bufs.chunk == CHUNK_ALIGN
    assert plain["host"]["total"] == 0
    for key in ("compute_params", "fp32_grads"):
        assert off[key] == plain[key] + (2 * owned if stage == 3 and key == "compute_params"
                                         else 0), key
    # The formula says the same in Ψ: the masters and moments, 12Ψ/N, move to the host.
    psi, n = reports[True]["psi"], 2 if stage else 1
    f0, f1 = formula(stage, psi, 2), formula(stage, psi, 2, offload=True)
    assert f0["ours"] - f1["ours"] == pytest.approx(12 * psi / n - (2 * psi / n if stage == 3
                                                                    else 0))
    assert f1["host"]["total"] == pytest.approx(12 * psi / n)
    assert f0["paper"] - f1["paper"] == pytest.approx(12 * psi / n)
    assert reports[True]["formula"]["host"]["total"] == pytest.approx(
        off["host"]["total"] - ring, rel=0.02)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_only_the_staging_ring_is_pinned(stage):
    """What the engine page-locks (on CUDA; the CPU pins nothing, torch refuses pin_memory
    without an accelerator, but the engine counts what it asks for): the staging ring alone, a
    fixed size whatever the model, not the 12 bytes per owned parameter of the states, unless
    parallel.offload_pin_memory asks for them too (then each of the three state buffers as
    torch's pinned allocator takes it: rounded up to a power of two); nothing without
    offload."""
    for pin in (False, True):
        eng = _described(stage, True, pin=pin)
        bufs = eng.bufs
        owned = bufs.layout.shard_numel if stage else bufs.layout.full_numel
        ring = 4 * RING_SLOTS * bufs.chunk
        pinned = eng.memory_report()["measured"]["host_pinned"]
        states = 3 * 2 ** math.ceil(math.log2(4 * owned))
        assert pinned == ring + (states if pin else 0), pin
        assert ring < 4 * owned  # smaller than even one state buffer here
    assert _described(stage, False).memory_report()["measured"]["host_pinned"] == 0


def test_states_are_pageable_and_the_ring_pinned_on_device(device):
    """A real engine on the test device. On CUDA the tensors say it: the ring's slots are
    page-locked, the masters and moments are not unless parallel.offload_pin_memory; the
    engine's count of pinned bytes matches. On the CPU nothing is pinned at all (no copy engine
    to serve) and the count is what a CUDA run would pin."""
    for pin in (False, True):
        cfg = helpers.config(SHAPE, parallel={"zero_stage": 1, "offload_optimizer": True,
                                              "offload_pin_memory": pin}, precision="fp32")
        bufs = helpers.build(cfg, device=device).engine.bufs
        states = (bufs.master, bufs.exp_avg, bufs.exp_avg_sq)
        assert all(t.device.type == "cpu" for t in states + tuple(bufs.staging))
        on_cuda = device.type == "cuda"
        assert [t.is_pinned() for t in bufs.staging] == [on_cuda] * RING_SLOTS
        assert [t.is_pinned() for t in states] == [on_cuda and pin] * 3
        assert bufs.pinned == (4 * RING_SLOTS * bufs.chunk
                               + (sum(pinned_size(t.numel() * 4) for t in states) if pin
                                  else 0))


# ---- the optimizer against torch's ---------------------------------------------------------------

@pytest.mark.parametrize("offload", [False, True])
def test_step_is_torch_fused_adamw_bitwise(offload):
    """Without clipping (whose global norm we sum in fp64 where clip_grad_norm_ uses fp32, see
    test_optimizer_reference.py), the engine's update is torch.optim.AdamW(fused=True) to the
    bit, weight decay on the 2-D weights only, with or without offload: it is the same kernel."""
    cfg = helpers.config(SHAPE, optim={"lr": 1e-3, "clip_grad": 0.0, "weight_decay": 0.1,
                                       "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
                         parallel={"offload_optimizer": offload}, precision="fp32", seed=1)
    parts = helpers.build(cfg)
    ours, eng = parts.chunks[0], parts.engine
    # The same loss on both sides, so that the gradients are too: what is compared is the
    # update (the engine's own, in-place cross-entropy is checked against F.cross_entropy in
    # tests/parallel/test_tensor_parallel.py).
    ours.loss_fn = lm_loss
    ref = build_model(SHAPE, seed=1)
    named = list(ref.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if not is_no_decay(n, p)], "weight_decay": 0.1},
         {"params": [p for n, p in named if is_no_decay(n, p)], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    params = dict(named)
    for ids in global_batches(4, 4, seed=3):
        ours(ids[:, :-1], labels=ids[:, 1:]).backward()
        ref(ids[:, :-1], labels=ids[:, 1:]).backward()
        helpers.step(parts.optimizer, 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
    moments = eng.optim_state()
    for name, w in eng.master_state().items():
        assert torch.equal(w, params[name].detach()), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[f"{kind}.{name}"], opt.state[params[name]][kind]), name


def test_offload_on_device_matches_no_offload(device):
    """The same 4 fp32 steps with and without offload on the test device. On the CPU it is the
    same kernel on the same values: bitwise. On CUDA the offloaded step runs torch's CPU AdamW
    kernel while the plain one runs the CUDA kernel; they round differently by at most an ulp of
    each update (~lr·2^-24), and forward/backward on the weights that differ by that much move
    the next gradients by as little, so 4 steps stay well inside 1e-6 absolute on weights of
    size ~0.02-1. A copy raced (a gradient read before it landed, a compute copy not refreshed)
    moves weights by ~lr = 1e-3."""
    runs = []
    for offload in (False, True):
        cfg = helpers.config(SHAPE, optim={"lr": 1e-3, "clip_grad": 0.5, "weight_decay": 0.1},
                             parallel={"zero_stage": 1, "offload_optimizer": offload},
                             precision="fp32", seed=1)
        parts = helpers.build(cfg, device=device)
        model, eng = parts.chunks[0], parts.engine
        losses = []
        for ids in global_batches(4, 4, seed=4):
            ids = ids.to(device)
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
            losses.append(float(loss.detach()))
            helpers.step(parts.optimizer, 1e-3)
        runs.append((losses, {k: v.cpu() for k, v in eng.master_state().items()},
                     {k: v.cpu() for k, v in eng.optim_state().items()},
                     {n: p.detach().cpu() for n, p in model.named_parameters()}))
    (l0, m0, o0, c0), (l1, m1, o1, c1) = runs
    exact = device.type == "cpu"
    for a, b in ((m0, m1), (o0, o1), (c0, c1)):
        assert a.keys() == b.keys()
        for k in a:
            if exact:
                assert torch.equal(a[k], b[k]), k
            else:
                assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    assert l0 == l1 if exact else l0 == pytest.approx(l1, rel=1e-6)


# ---- checkpoints -------------------------------------------------------------------------------

def _trainer_cfg(prefix, tmp, offload, stage, resume="auto"):
    return make_cfg(prefix, Path(tmp), parallel={"zero_stage": stage, "bucket_size_mb": BUCKET_MB,
                                                  "offload_optimizer": offload},
                    model={"preset": "tiny", "vocab_size": 256, "num_layers": 2},
                    train__precision="bf16", train__micro_batch_size=2, train__train_iters=4,
                    train__eval_iters=1,
                    checkpoint={"dir": f"{tmp}/ck", "save_interval": 2, "keep_last": None,
                                "async_save": False, "resume": resume})


def _dp2_worker(rank, world, prefix, tmp):
    base = _parts(0, False).topo
    parity = {f"dp2-z{stage}": _parity(stage, "bf16", base) for stage in (0, 1, 2, 3)}
    # fp16 from a loss scale that overflows: the first two steps are skipped (the host copies in
    # flight are waited for before the gradients are zeroed), then the scale fits.
    parity["dp2-z2-fp16"] = _parity(2, "fp16", base, optim={"initial_loss_scale": 2.0 ** 21,
                                                            "hysteresis": 1})
    parity["dp2-z1-odd"] = _parity(1, "bf16", base, shape=ODD)
    # Compressed ZeRO-3 gathers: an offloaded run encodes the device's compute-dtype copy of the
    # masters; without offload the gather encoded the fp32 masters, and the first loss differed.
    parity["dp2-z3-int8-gather"] = _parity(3, "bf16", base, weight_gather_dtype="int8")
    parity["dp2-z3-fp16-bf16-gather"] = _parity(3, "fp16", base, weight_gather_dtype="bf16",
                                                optim={"initial_loss_scale": 2.0 ** 10})
    return {"parity": parity,
            "checkpoint": {stage: _checkpoint_runs(prefix, f"{tmp}/z{stage}", stage)
                           for stage in STAGES}}


def _checkpoint_runs(prefix, tmp, stage):
    """Straight runs with and without offload, saving at steps 2 and 4; then each direction of
    resuming the other's step-2 checkpoint."""
    out = {}
    for name, offload in (("plain", False), ("offload", True)):
        res = Trainer(_trainer_cfg(prefix, f"{tmp}/{name}", offload, stage),
                      log=lambda *a: None).run()
        out[name] = {"losses": res.losses, "checkpoint": res.checkpoint}
    for name, offload, source in (("offload->plain", False, "offload"),
                                  ("plain->offload", True, "plain")):
        step2 = str(dict(ckpt.list_checkpoints(f"{tmp}/{source}/ck"))[2])
        trainer = Trainer(_trainer_cfg(prefix, f"{tmp}/{name}", offload, stage, resume=step2),
                          log=lambda *a: None)
        start = trainer.state.step
        res = trainer.run()
        eng = trainer.engine
        out[name] = {"start": start, "losses": res.losses, "checkpoint": res.checkpoint,
                     "state": {**eng.master_state(), **eng.optim_state()}}
    return out


def _checkpoint_tensors(path):
    reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    return {(k, n): reader.load(n, k) for n in reader.names()
            for k in ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS}


def _assert_same_checkpoint(a, b):
    ta, tb = _checkpoint_tensors(a), _checkpoint_tensors(b)
    assert ta.keys() == tb.keys()
    for key in tb:
        assert torch.equal(ta[key], tb[key]), key


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoints_do_not_depend_on_offload(dp2, stage):
    """Saved with offload, resumed without, and the reverse, at every ZeRO stage (the trainer,
    in segments the ring cuts into chunks): the same checkpoints and the same bits as a run that
    never offloaded."""
    ranks, tmp = dp2
    tmp = tmp / f"z{stage}"
    out = ranks[0]["checkpoint"][stage]
    plain, offload = out["plain"], out["offload"]
    assert plain["losses"] == offload["losses"]  # the trainer too: offload changes no bit
    for step in (2, 4):
        a, b = (dict(ckpt.list_checkpoints(tmp / n / "ck"))[step] for n in ("plain", "offload"))
        _assert_same_checkpoint(a, b)
    for name in ("offload->plain", "plain->offload"):
        resumed = out[name]
        assert resumed["start"] == 2, name
        assert resumed["losses"] == plain["losses"][2:], name
        _assert_same_checkpoint(resumed["checkpoint"], plain["checkpoint"])
    for r in ranks:  # each rank's engine ends where the other direction's does
        a, b = (r["checkpoint"][stage][n]["state"] for n in ("offload->plain", "plain->offload"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_stage3_compute_shard_is_refreshed_chunk_by_chunk(monkeypatch):
    """Stage 3 under offload refreshes its device shard from the host masters (first values, a
    checkpoint) in chunks, not in one copy whose dtype conversion would allocate a host
    temporary as large as the shard: the result is the one-copy cast, bit for bit."""
    from bloomtrain.parallel.zero import buffers
    cfg = helpers.config(parallel={"zero_stage": 3, "offload_optimizer": True},
                         precision="bf16", seed=5)
    bufs = helpers.build(cfg, device="cpu").engine.bufs
    assert bufs.compute_shard is not None and bufs.master.numel() > 3 * 1000
    bufs.master.normal_()
    monkeypatch.setattr(buffers, "REFRESH_CHUNK", 1000)
    bufs.refresh_compute_shard()
    assert torch.equal(bufs.compute_shard, bufs.master.to(bufs.compute_shard.dtype))


def test_each_chunk_lands_in_its_slot_with_its_own_gradients():
    """The ring (RING_SLOTS slots) carries every chunk of a step in order, chunk k in slot
    k % RING_SLOTS, each slot refilled as the chunk before in it is sent: whenever a chunk is
    handed to the step, its slot holds exactly its own gradients, although every slot has
    carried others in the same step."""
    cfg = helpers.config(SHAPE, parallel={"zero_stage": 1, "bucket_size_mb": BUCKET_MB,
                                          "offload_optimizer": True}, precision="bf16", seed=1)
    eng = helpers.build(cfg, device="cpu").engine
    bufs, host = eng.bufs, eng.host_copies
    assert len(bufs.staging) == RING_SLOTS and len(host.order) > 2 * RING_SLOTS
    bufs.grad.copy_(torch.arange(bufs.grad.numel(), dtype=torch.float32))
    host.grads_to_host()
    seen = []
    for chunk in host.landed():
        assert chunk.slot == len(seen) % RING_SLOTS
        assert chunk.grad.data_ptr() == bufs.staging[chunk.slot].data_ptr()
        assert torch.equal(chunk.grad, bufs.grad_view(chunk.seg)[chunk.a:chunk.b])
        seen.append((chunk.seg.index, chunk.a, chunk.b))
        host.send(chunk)
    assert seen == [(c.seg.index, c.a, c.b) for c in host.order]


def test_a_step_takes_consecutive_chunks_only():
    """The optimizer keeps the tensors of each run of chunks it steps in one call, keyed by the
    first chunk and the count; chunks that are not consecutive are refused, not stepped as
    whatever was kept under that key, before and after the consecutive run is kept."""
    from bloomtrain.parallel.zero.optimizer import all_chunks, step_chunks
    parts = _parts(1, False)
    bufs = parts.engine.bufs
    spans = all_chunks(bufs, bufs.layout.segments)
    assert len(spans) >= 3
    with pytest.raises(ValueError, match="consecutive"):
        step_chunks(bufs, [spans[0], spans[2]], parts.optimizer.cfg, 1e-3, 1, 1.0)
    step_chunks(bufs, spans[:2], parts.optimizer.cfg, 1e-3, 1, 1.0)
    with pytest.raises(ValueError, match="consecutive"):
        step_chunks(bufs, [spans[0], spans[2]], parts.optimizer.cfg, 1e-3, 2, 1.0)
