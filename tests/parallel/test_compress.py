"""Compressed data-parallel communication (parallel.grad_reduce_dtype, grad_error_feedback,
weight_gather_dtype; bloomtrain/parallel/zero/compress.py): the int8 codec against a plain
quantizer written here, the compressed reduce-scatter against the sum of what that quantizer
makes of every rank's input, error feedback's bookkeeping, fp32 bitwise equal to the engine
without the option, the bytes of a real training step (gloo, dp=4, ZeRO-1 and ZeRO-3), the
error-feedback residual through a checkpoint, and the refused combinations."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.zero import compress
from tests import helpers
from tests.dist import run_ranks

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=256)
SEQ = 16
LR = 1e-3


def plain_int8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The test's own blockwise absmax int8 round trip of a 1-d fp32 tensor."""
    out = torch.empty_like(x)
    for a in range(0, x.numel(), block):
        b = x[a:a + block]
        s = float(b.abs().max()) / 127
        out[a:a + block] = b if s == 0 else torch.round(b / s).clamp(-127, 127) * s
    return out


def test_int8_codec_matches_a_plain_quantizer_and_its_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g) * torch.tensor([[1.0], [1e-3], [0.0]])
    payload = compress.encode(x, "int8")
    # 300 values in 3 blocks (the last one short): 300 int8 + 3 fp32 scales.
    assert payload.dtype == torch.int8 and payload.shape == (3, 300 + 12)
    assert compress.encoded_bytes(300, "int8") == 312
    back = compress.decode(payload, 300, "int8")
    for row in range(3):
        # Division vs the test's own: the same to an fp32 ulp of the value.
        torch.testing.assert_close(back[row], plain_int8(x[row]), rtol=0, atol=1e-6 * x[row].abs().max())
    # A round trip is off by at most half a step (absmax / 254) per block.
    assert float((back[0] - x[0]).abs().max()) <= float(x[0].abs().max()) / 254 * 1.0001
    bf = compress.decode(compress.encode(x, "bf16"), 300, "bf16")
    assert torch.equal(bf, x.to(torch.bfloat16).float())


def _reduce_rank(rank, world, dtype):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * 200, generator=g)
    out = torch.empty(200)
    compress.reduce_scatter(out, x.clone(), comm.world_group(), "dp", dtype)
    residual = torch.zeros_like(x)
    outs = []
    for _ in range(3):  # a constant gradient, three reductions with error feedback
        o = torch.empty(200)
        compress.reduce_scatter(o, x.clone(), comm.world_group(), "dp", dtype, residual)
        outs.append(o)
    full = x.clone()
    compress.all_reduce(full, comm.world_group(), "dp", dtype)
    return x, out, outs, residual, full


def _all_reduce_feedback_rank(rank, world, steps):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * 256, generator=g) * torch.linspace(0.01, 1, world * 256)
    residual, applied = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(steps):  # a constant gradient, reduced `steps` times with error feedback
        full = x.clone()
        compress.all_reduce(full, comm.world_group(), "dp", "int8", residual)
        applied += full
    return x, applied, residual


def test_stage0_error_feedback_covers_the_gathers_encoding_too():
    # Stage 0's all-reduce encodes the sum a second time for its gather. What was applied over
    # N reductions is N times the exact sum less what every rank still owes, exactly: the
    # error stays within one step's rounding however long the run (it grew linearly with N
    # while the gather's rounding was not fed back: 4.6 after 400 steps of 0.036 each).
    for steps in (10, 200):
        res = run_ranks(2, _all_reduce_feedback_rank, steps)
        exact = res[0][0] + res[1][0]
        owed = res[0][2] + res[1][2]
        for _, applied, _ in res:
            torch.testing.assert_close(applied, steps * exact - owed, rtol=0, atol=1e-4 * steps)
            step_size = float(exact.abs().max()) / 127
            assert float((applied - steps * exact).abs().max()) < 2 * step_size, steps


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_compressed_reduce_scatter_is_the_fp32_sum_of_the_decoded_chunks(dtype):
    world = 2
    res = run_ranks(world, _reduce_rank, dtype)
    inputs = [r[0] for r in res]
    rt = plain_int8 if dtype == "int8" else (lambda t: t.to(torch.bfloat16).float())
    for rank, (_, out, outs, residual, full) in enumerate(res):
        chunks = [rt(x[rank * 200:(rank + 1) * 200]) for x in inputs]
        torch.testing.assert_close(out, chunks[0] + chunks[1], rtol=0, atol=1e-6)
        # Error feedback: what was sent over three reductions is 3x the input less what is
        # still owed (the residuals of every rank, for this chunk).
        owed = sum(r[3][rank * 200:(rank + 1) * 200] for r in res)
        exact = sum(x[rank * 200:(rank + 1) * 200] for x in inputs)
        torch.testing.assert_close(sum(outs), 3 * exact - owed, rtol=0, atol=1e-5)
        # The all-reduce: every rank holds the same values, each chunk the (re-encoded) sum.
        assert torch.equal(full, res[0][4])
    sums = torch.cat([r[1] for r in res])
    torch.testing.assert_close(res[0][4], torch.cat([rt(c) for c in sums.split(200)]),
                               rtol=0, atol=1e-6)


# ---- the engine --------------------------------------------------------------------------------

def _train(stage, precision, steps, train=None, **parallel):
    cfg = helpers.config(SHAPE, parallel={"zero_stage": stage, "bucket_size_mb": 0.05,
                                          **parallel},
                         optim={"lr": LR, "clip_grad": 1.0}, precision=precision, seed=1,
                         **(train or {}))
    parts = helpers.build(cfg)
    topo, chunk = parts.topo, parts.chunks[0]
    g = torch.Generator().manual_seed(7)
    losses = []
    with comm.stats_scope(True) as stats:
        for step in range(steps):
            batch = torch.randint(0, SHAPE.vocab_size, (topo.dp_size * 4, SEQ + 1), generator=g)
            mine = batch[topo.dp_rank * 4:(topo.dp_rank + 1) * 4]
            loss = 0.0
            for ids in mine.split(2):  # two micro-batches
                part = chunk(ids[:, :-1], labels=ids[:, 1:]) / 2
                part.backward()
                loss += float(part)
            helpers.step(parts.optimizer, LR)
            losses.append(loss)
            if step == 0:
                first = stats.snapshot()
    return parts, losses, first


def _engine_rank(rank, world, stage, precision, parallel):
    parts, losses, counts = _train(stage, precision, 3, **parallel)
    return losses, parts.engine.master_state(), counts


def _without_option_rank(rank, world, stage):
    """The engine exactly as before the option existed: ZeroEngine's defaults."""
    from bloomtrain.parallel import parallelize as par
    real = par.ZeroEngine

    def engine(*args, **kwargs):
        for key in ("grad_reduce_dtype", "error_feedback", "weight_gather_dtype"):
            kwargs.pop(key, None)
        return real(*args, **kwargs)
    par.ZeroEngine = engine
    try:
        parts, losses, _ = _train(stage, "bf16", 3)
    finally:
        par.ZeroEngine = real
    return losses, parts.engine.master_state()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_reduction_is_bitwise_the_engine_without_the_option(stage):
    world = 2
    new = run_ranks(world, _engine_rank, stage, "bf16", {"grad_reduce_dtype": "fp32"})
    old = run_ranks(world, _without_option_rank, stage)
    for (losses, masters, counts), (old_losses, old_masters) in zip(new, old):
        assert losses == old_losses
        assert all(torch.equal(masters[k], old_masters[k]) for k in old_masters)
        assert not any(kind == "all_to_all" for kind, _ in counts)


def _dp_bytes(counts, kinds):
    return sum(v["bytes"] for (kind, name), v in counts.items() if name == "dp" and kind in kinds)


REDUCE_KINDS = ("reduce_scatter", "all_reduce", "all_to_all")


@pytest.mark.parametrize("stage", [1, 3])
def test_int8_reduction_bytes_on_a_training_step(stage):
    world = 4
    fp32 = run_ranks(world, _engine_rank, stage, "bf16", {"grad_reduce_dtype": "fp32"})
    int8 = run_ranks(world, _engine_rank, stage, "bf16", {"grad_reduce_dtype": "int8"})
    ef = run_ranks(world, _engine_rank, stage, "bf16", {"grad_reduce_dtype": "int8",
                                                         "grad_error_feedback": True})
    for a, b, c in zip(fp32, int8, ef):
        ratio = _dp_bytes(b[2], REDUCE_KINDS) / _dp_bytes(a[2], REDUCE_KINDS)
        # 4:1, less the fp32 scale of every 128 values and the padding to whole blocks.
        assert ratio <= 0.27, ratio
        assert _dp_bytes(c[2], REDUCE_KINDS) == _dp_bytes(b[2], REDUCE_KINDS)
        # The other dp traffic (the weights' all-gathers) is untouched.
        assert _dp_bytes(b[2], ("all_gather",)) == _dp_bytes(a[2], ("all_gather",))
        # Still training the same model: int8 sums move the loss by little in 3 steps.
        assert abs(b[0][-1] - a[0][-1]) < 0.05 * a[0][-1]
    print(f"stage {stage}: int8/fp32 dp reduction bytes = {ratio:.4f}")


def test_int8_weight_gather_bytes_zero3():
    world = 4
    bf16 = run_ranks(world, _engine_rank, 3, "bf16", {"weight_gather_dtype": "auto"})
    int8 = run_ranks(world, _engine_rank, 3, "bf16", {"weight_gather_dtype": "int8"})
    for a, b in zip(bf16, int8):
        ratio = _dp_bytes(b[2], ("all_gather",)) / _dp_bytes(a[2], ("all_gather",))
        assert ratio <= 0.52, ratio
        assert _dp_bytes(b[2], REDUCE_KINDS) == _dp_bytes(a[2], REDUCE_KINDS)
        assert abs(b[0][-1] - a[0][-1]) < 0.05 * a[0][-1]
    print(f"int8/bf16 stage-3 gather bytes = {ratio:.4f}")


# ---- refused combinations ----------------------------------------------------------------------

@pytest.mark.parametrize("parallel, message", [
    ({"grad_error_feedback": True}, "grad_error_feedback needs a compressed reduction"),
    ({"weight_gather_dtype": "int8", "zero_stage": 2}, "needs parallel.zero_stage=3"),
    ({"grad_reduce_dtype": "int4"}, "grad_reduce_dtype must be fp32, bf16 or int8"),
    ({"weight_gather_dtype": "fp8"}, "weight_gather_dtype must be auto, bf16 or int8"),
])
def test_refused_combinations(parallel, message):
    cfg = Config.from_dict({"parallel": parallel, "train": {"train_iters": 1}})
    with pytest.raises(UserError, match=message):
        cfg.check()


@pytest.mark.parametrize("parallel", [{"grad_reduce_dtype": "int8"},
                                      {"grad_reduce_dtype": "bf16", "grad_error_feedback": True},
                                      {"zero_stage": 3, "weight_gather_dtype": "int8"}])
def test_compression_at_dp_1_is_refused_not_silently_off(parallel):
    from bloomtrain.validate import validate
    cfg = Config.from_dict({"parallel": parallel, "train": {"train_iters": 1},
                            "model": {"preset": "tiny"}})
    with pytest.raises(UserError, match="at dp 1 there is none"):
        validate(cfg, 1)
    validate(cfg, 2)  # dp 2: accepted


# ---- the error-feedback residual through a checkpoint --------------------------------------------

EF = {"zero_stage": 1, "grad_reduce_dtype": "int8", "grad_error_feedback": True}


def _ef_cfg(dataset, tmp, resume="auto", train__precision="bf16", train__train_iters=6,
            **parallel):
    from tests.helpers import make_cfg
    return make_cfg(dataset, Path(tmp), parallel={**EF, **parallel},
                    train__precision=train__precision, train__micro_batch_size=1,
                    train__train_iters=train__train_iters,
                    checkpoint={"dir": f"{tmp}/ck", "save_interval": 3, "async_save": False,
                                "keep_last": None, "resume": resume})


def _ef_resume_rank(rank, world, dataset, tmp, zero_stage):
    from bloomtrain.train import Trainer
    out = {}
    full = Trainer(_ef_cfg(dataset, f"{tmp}/full", zero_stage=zero_stage), log=lambda *a: None)
    out["full"] = full.run().losses
    bufs = full.engine.bufs
    out["full_state"] = {k: getattr(bufs, k).clone() for k in ("master", "exp_avg",
                                                                "grad_residual")}
    at3 = ckpt.list_checkpoints(Path(tmp) / "full" / "ck")[0][1]
    resumed = Trainer(_ef_cfg(dataset, f"{tmp}/resumed", resume=str(at3), zero_stage=zero_stage),
                      log=lambda *a: None)
    out["start"] = resumed.state.step
    out["resumed"] = resumed.run().losses
    bufs = resumed.engine.bufs
    out["resumed_state"] = {k: getattr(bufs, k).clone() for k in out["full_state"]}
    return out


def _ef_precision_rank(rank, world, dataset, tmp):
    from bloomtrain.train import Trainer
    quiet = lambda *a: None  # noqa: E731
    saved = Trainer(_ef_cfg(dataset, f"{tmp}/fp16", train__precision="fp16",
                            train__train_iters=3), log=quiet)
    saved.run()
    residual, scale = saved.engine.bufs.grad_residual.clone(), saved.optimizer.loss_scale
    at3 = str(ckpt.list_checkpoints(Path(tmp) / "fp16" / "ck")[0][1])
    resumed = Trainer(_ef_cfg(dataset, f"{tmp}/bf16", resume=at3), log=quiet)
    return residual, scale, resumed.engine.bufs.grad_residual.clone()


def test_an_fp16_residual_resumed_in_bf16_is_unscaled(dataset, tmp_path):
    # Under fp16 the residual is owed in loss-scaled gradients; a bf16 run's carry no scale.
    # Loaded as saved, the first bf16 reduction sent 4096x what was owed (grad norm 27 for 1).
    for residual, scale, resumed in run_ranks(2, _ef_precision_rank, dataset, str(tmp_path)):
        assert scale > 1 and residual.abs().max() > 0
        assert torch.equal(resumed, residual / scale)  # a power of two: exact


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_resume_with_error_feedback_is_bitwise(dataset, tmp_path, zero_stage):
    outs = run_ranks(2, _ef_resume_rank, dataset, str(tmp_path), zero_stage)
    for rank, out in enumerate(outs):
        assert out["start"] == 3
        assert out["resumed"] == out["full"][3:], rank
        assert out["full_state"]["grad_residual"].abs().max() > 0  # it is in use
        for key, t in out["full_state"].items():
            assert torch.equal(out["resumed_state"][key], t), (rank, key)


def _ef_reshard_rank(rank, world, dataset, tmp, saved):
    from bloomtrain.train import Trainer
    cfg = _ef_cfg(dataset, f"{tmp}/dp{world}", resume=saved)
    cfg.train.train_iters = 3  # nothing left to train: run() only finishes the trainer
    t = Trainer(cfg, log=lambda *a: None)
    bufs = t.engine.bufs
    # Back to full tensors by name, the padding left out.
    out = ({s.name: bufs.grad_residual[s.full_off:s.full_off + s.numel].clone()
            for s in bufs.layout.slots}, t.state.step)
    t.run()
    return out


def _ef_save_rank(rank, world, dataset, tmp):
    from bloomtrain.train import Trainer
    cfg = _ef_cfg(dataset, f"{tmp}/dp2")
    cfg.train.train_iters = 3
    Trainer(cfg, log=lambda *a: None).run()


def test_reshard_with_error_feedback_follows_the_rule(dataset, tmp_path):
    """dp 2 -> 4: every new rank holds the saved residuals' sum / 4 (the total owed is kept);
    dp 2 -> 2 on the other stage layout: each rank its own."""
    run_ranks(2, _ef_save_rank, dataset, str(tmp_path))
    saved = ckpt.list_checkpoints(tmp_path / "dp2" / "ck")[-1][1]
    reader = ckpt.CheckpointReader(saved, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    assert ckpt.residual_kinds(reader.manifest) == ["grad_residual_dp0", "grad_residual_dp1"]
    e = [{n: reader.load(n, f"grad_residual_dp{s}").reshape(-1) for n in reader.names()}
         for s in range(2)]
    outs = run_ranks(4, _ef_reshard_rank, dataset, str(tmp_path), str(saved))
    for residual, step in outs:
        assert step == 3
        for name, t in residual.items():
            torch.testing.assert_close(t, (e[0][name] + e[1][name]) / 4, rtol=0, atol=0)
    assert any(float(t.abs().max()) > 0 for t in outs[0][0].values())


# ---- composition: tp, pp, offload ---------------------------------------------------------------

def _compose_rank(rank, world, dataset, tmp, parallel):
    from bloomtrain.train import Trainer
    from tests.helpers import make_cfg
    out = {}
    for name, extra in (("fp32", {}), ("int8", {"grad_reduce_dtype": "int8",
                                                "grad_error_feedback": True})):
        cfg = make_cfg(dataset, Path(tmp) / name, parallel={**parallel, **extra},
                       train__precision="bf16", train__micro_batch_size=1,
                       train__train_iters=6)
        t = Trainer(cfg, log=lambda *a: None)
        out[name] = t.run().losses
        residual = t.engine.bufs.grad_residual
        out[f"{name}_residual"] = None if residual is None else float(residual.abs().max())
    return out


COMPOSE = {
    "tp2-sp.dp2-z1": (4, {"tp": 2, "sequence_parallel": True, "zero_stage": 1}),
    "pp2.dp2-z2": (4, {"pp": 2, "pp_partition": "uniform", "zero_stage": 2}),
    "dp2-z3-offload-qwz": (2, {"zero_stage": 3, "offload_optimizer": True,
                               "weight_gather_dtype": "int8"}),
}


@pytest.mark.parametrize("layout", sorted(COMPOSE))
def test_int8_reduction_composes(dataset, tmp_path, layout):
    """int8 with error feedback under tp (with sequence parallelism's partial gradients), pp and
    ZeRO-3 offload with int8 gathers: it trains, and 6 steps stay within 2% of the fp32
    reduction's losses (quantization noise on tiny gradients, not a bias)."""
    world, parallel = COMPOSE[layout]
    outs = run_ranks(world, _compose_rank, dataset, str(tmp_path), parallel)
    for out in outs:
        assert out["int8_residual"] > 0 and out["fp32_residual"] is None
        if out["fp32"]:  # the ranks that log losses
            for a, b in zip(out["fp32"], out["int8"]):
                assert abs(a - b) <= 0.02 * a, (out["fp32"], out["int8"])


# ---- hpZ: the secondary shard -------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [{}, {"activation_checkpointing": "full"},
                                      {"weight_gather_dtype": "int8"}])
def test_secondary_shard_is_bitwise_and_keeps_backward_gathers_in_the_node(parallel):
    """dp=4 on two "nodes" of 2 processes (LOCAL_WORLD_SIZE=2): the same bits as without hpZ;
    backward's gathers run on the node's 2 ranks, so the dp group's all-gather bytes drop."""
    parallel = dict(parallel)
    recompute = parallel.pop("activation_checkpointing", None)
    extra = {"activation_checkpointing": recompute} if recompute else {}
    base = run_ranks(4, _engine_rank_with, 3, {**parallel}, extra)
    hpz = run_ranks(4, _engine_rank_with, 3, {**parallel, "zero_secondary_shard": True}, extra)
    for (losses, masters, counts), (hl, hm, hc) in zip(base, hpz):
        assert hl == losses
        assert all(torch.equal(hm[k], masters[k]) for k in masters)
        assert ("all_gather", "dp_node") not in counts and ("all_gather", "dp_node") in hc
        node, dp = hc[("all_gather", "dp_node")]["bytes"], hc[("all_gather", "dp")]["bytes"]
        assert dp < counts[("all_gather", "dp")]["bytes"]
        if not parallel:
            # Every unit is gathered once in forward and once in backward, the same bytes each
            # time; backward's now in the node. (int8 gathers: the node keeps the decoded bf16.)
            assert dp + node == counts[("all_gather", "dp")]["bytes"]
            assert node >= 0.4 * counts[("all_gather", "dp")]["bytes"]


def test_secondary_shard_with_tensor_parallelism():
    """tp=2 dp=4 on two "nodes" of 4 processes (each a tp pair of each of 2 dp ranks): hpZ's
    node groups are the dp ranks of one tp rank inside a node; the same bits as without it,
    and backward's gathers in the node."""
    parallel = {"tp": 2}
    base = run_ranks(8, _engine_rank_with, 3, parallel, {}, 4)
    hpz = run_ranks(8, _engine_rank_with, 3, {**parallel, "zero_secondary_shard": True}, {}, 4)
    for (losses, masters, counts), (hl, hm, hc) in zip(base, hpz):
        assert hl == losses
        assert all(torch.equal(hm[k], masters[k]) for k in masters)
        assert ("all_gather", "dp_node") in hc
        assert hc[("all_gather", "dp")]["bytes"] < counts[("all_gather", "dp")]["bytes"]


def _hpz_pipeline_rank(rank, world, dataset, tmp):
    import os

    from bloomtrain.parallel.zero.gather import Stage3Gatherer
    from bloomtrain.train import Trainer
    from tests.helpers import make_cfg
    # Nodes of 2 processes: each holds 2 dp ranks of one pipeline stage.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    in_node = []  # the gathers served from the node's secondary copies
    original = Stage3Gatherer._gather_secondary

    def counted(self, g, async_op):
        in_node.append(g)
        return original(self, g, async_op)
    Stage3Gatherer._gather_secondary = counted
    out = {}
    try:
        for hpz in (False, True):
            in_node.clear()
            cfg = make_cfg(dataset, Path(tmp) / str(hpz), train__precision="bf16",
                           train__micro_batch_size=1, train__train_iters=3,
                           parallel={"pp": 2, "pp_partition": "uniform", "zero_stage": 3,
                                     "zero_secondary_shard": hpz})
            t = Trainer(cfg, log=lambda *a: None)
            out[hpz] = (t.run().losses, t.engine.bufs.master.clone(), len(in_node))
    finally:
        Stage3Gatherer._gather_secondary = original
    return out


def test_secondary_shard_with_pipeline_parallelism(dataset, tmp_path):
    """pp=2 dp=4 ZeRO-3 through the trainer (1F1B) on four nodes of 2 processes: the same bits
    as without hpZ (losses and masters on every rank), and backward's gathers served from the
    node's copies."""
    for out in run_ranks(8, _hpz_pipeline_rank, dataset, str(tmp_path)):
        (losses, masters, in_node), (hl, hm, hpz_in_node) = out[False], out[True]
        assert hl == losses and torch.equal(hm, masters)
        assert in_node == 0 and hpz_in_node > 0


def _engine_rank_with(rank, world, stage, parallel, train, per_node=2):
    import os
    # "Nodes" of `per_node` processes (the rank pool's own environment says one node of
    # `world`; the pool restores the environment after the call).
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    parts, losses, counts = _train(stage, "bf16", 2, train=train, **parallel)
    return losses, parts.engine.master_state(), counts


def test_secondary_shard_refusals():
    cfg = Config.from_dict({"parallel": {"zero_secondary_shard": True, "zero_stage": 2},
                            "train": {"train_iters": 1}})
    with pytest.raises(UserError, match="zero_secondary_shard needs parallel.zero_stage=3"):
        cfg.check()
    outs = run_ranks(2, _hpz_one_per_node)
    assert all("at least 2 ranks of every dp group on each node" in o for o in outs)
    # One process (dp 1: no dp group at all): refused too, not a setting that does nothing.
    with pytest.raises(UserError, match="at least 2 ranks of every dp group on each node"):
        _train(3, "bf16", 1, zero_secondary_shard=True)


def _hpz_one_per_node(rank, world):
    import os
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one process per node: no dp peer inside a node
    try:
        _train(3, "bf16", 1, zero_secondary_shard=True)
    except UserError as e:
        return str(e)
    return "not refused"


def _int8_feedback(stage, precision, seed, **optim):
    """An engine reducing in int8 with error feedback, its chunk, and a generator of batches."""
    cfg = helpers.config(SHAPE, parallel={"zero_stage": stage, "grad_reduce_dtype": "int8",
                                          "grad_error_feedback": True},
                         optim={"lr": LR, "clip_grad": 1.0, **optim}, precision=precision,
                         seed=1)
    parts = helpers.build(cfg)
    return parts, parts.chunks[0], parts.engine, torch.Generator().manual_seed(seed)


def _stage0_rank(rank, world, precision, overflow_at):
    parts, chunk, eng, g = _int8_feedback(0, precision, 3 + rank)
    skipped = []
    for step in range(3):
        ids = torch.randint(0, SHAPE.vocab_size, (2, SEQ + 1), generator=g)
        loss = chunk(ids[:, :-1], labels=ids[:, 1:])
        parts.optimizer.scale_loss(loss).backward()
        if step == overflow_at and rank == 0:
            eng.bufs.grad[0] = float("inf")  # an fp16 overflow on one rank
        skipped.append(helpers.step(parts.optimizer, LR).skipped)
        assert torch.isfinite(eng.bufs.grad_residual).all()
    return eng.bufs.master.clone(), skipped


def test_int8_stage0_keeps_the_replicas_equal_and_survives_an_overflow():
    """Stage 0's int8 all-reduce: every rank holds the same (re-encoded) sums, so the replicated
    masters stay bitwise equal; under fp16 an overflowing step is skipped and clears the error
    feedback, which would otherwise carry the inf into every later reduction."""
    outs = run_ranks(2, _stage0_rank, "bf16", None)
    assert torch.equal(outs[0][0], outs[1][0])
    outs = run_ranks(2, _stage0_rank, "fp16", 1)
    assert torch.equal(outs[0][0], outs[1][0])
    assert [o[1] for o in outs] == [[False, True, False]] * 2


def _scale_growth_rank(rank, world, initial_scale, window):
    """ZeRO-1 int8 with error feedback under fp16, 5 steps: this rank's residual after each step
    and the loss scale the next step's gradients carry."""
    parts, chunk, eng, g = _int8_feedback(1, "fp16", 5 + rank, lr=0.0,
                                          initial_loss_scale=initial_scale,
                                          loss_scale_window=window)
    out = []
    for step in range(5):
        ids = torch.randint(0, SHAPE.vocab_size, (2, SEQ + 1), generator=g)
        parts.optimizer.scale_loss(chunk(ids[:, :-1], labels=ids[:, 1:])).backward()
        # lr 0: the weights stay, so the two runs' gradients differ only by fp16's rounding
        # of their scale, not by trajectories that part.
        assert not helpers.step(parts.optimizer, 0.0).skipped
        out.append((eng.bufs.grad_residual.clone(), parts.optimizer.loss_scale))
    return out


def test_error_feedback_follows_a_growing_loss_scale():
    """The residual is in the units of the gradients it came from, which carry the loss scale:
    when the scale doubles, so must what is owed. Against the same run at the final scale
    throughout (int8's absmax blocks and fp16 are scale-equivariant for powers of two, up to
    fp16's rounding near its smallest numbers): the growing run's residual times the scale
    ratio is the constant run's, before and after the growth. Not rescaled it would be half of
    it from the growth on."""
    constant = run_ranks(2, _scale_growth_rank, 2.0 ** 10, 1000)
    growing = run_ranks(2, _scale_growth_rank, 2.0 ** 9, 3)
    assert [s for _, s in growing[0]] == [2.0 ** 9] * 2 + [2.0 ** 10] * 3
    for want, got in zip(constant, growing):
        for (r_want, s_want), (r_got, s_got) in zip(want, got):
            assert s_want == 2.0 ** 10 and r_want.abs().max() > 0
            scaled = r_got * (s_want / s_got)
            # Measured here: at most 1.1e-3 (fp16's rounding); 0.5 from the growth on if the
            # residual kept the old scale.
            assert (scaled - r_want).norm() <= 1e-2 * r_want.norm(), (s_got, scaled, r_want)


def _fp32_sum_rank(rank, world):
    """Stage 0, fp32 reduction: this rank's reduced gradient by name, and its local one from an
    engine of its own without dp peers, on the same micro-batches."""
    from bloomtrain.layout import ParallelLayout
    from bloomtrain.topology import Topology
    g = torch.Generator().manual_seed(11 + rank)
    batches = [torch.randint(0, SHAPE.vocab_size, (2, SEQ + 1), generator=g) for _ in range(2)]
    out = []
    for single in (False, True):
        cfg = helpers.config(SHAPE, parallel={"zero_stage": 0, "grad_reduce_dtype": "fp32",
                                              "bucket_size_mb": 0.05},
                             optim={"lr": LR}, precision="bf16", seed=1)
        topo = (Topology.describe_rank(ParallelLayout.from_config(cfg.parallel, 1), 0)
                if single else None)
        parts = helpers.build(cfg, topo)
        for ids in batches:
            parts.chunks[0](ids[:, :-1], labels=ids[:, 1:]).backward()
        parts.engine.reduce_gradients()
        bufs = parts.engine.bufs
        out.append({s.name: bufs.grad[s.full_off:s.full_off + s.numel].clone()
                    for s in bufs.layout.slots})
    return out


def test_fp32_reduction_is_the_exact_fp32_sum():
    """Independent of the engine's own reduction: at dp=2 the fp32 reduction of stage 0 is, bit
    for bit, (g0 + g1) / 2 of the two ranks' local fp32-accumulated gradients (two addends: no
    order to differ in)."""
    outs = run_ranks(2, _fp32_sum_rank)
    (r0, g0), (r1, g1) = outs
    for name in g0:
        want = (g0[name] + g1[name]) / 2
        assert torch.equal(r0[name], want) and torch.equal(r1[name], want), name


def _vetoed_rank(rank, world, dataset, tmp):
    """dp2, int8 with error feedback, the loss x50 at step 10 (a spike the monitor skips): the
    residual before and after that step, and whether it was skipped."""
    from bloomtrain.train import Trainer
    from tests.helpers import make_cfg
    cfg = make_cfg(dataset, Path(tmp), parallel={"zero_stage": 1, "grad_reduce_dtype": "int8",
                                                 "grad_error_feedback": True},
                   train__precision="bf16", train__micro_batch_size=1, train__train_iters=11,
                   train__on_loss_spike="skip", train__loss_spike_window=5,
                   train__loss_spike_zscore=6.0)
    t = Trainer(cfg, log=lambda *a: None)
    chunk = t.parts.chunks[-1]
    chunk.register_forward_hook(
        lambda m, a, out: out * 50 if m.training and t.state.step + 1 == 10 else None)
    seen, step = {}, t.train_step

    def train_step(mbs):
        before = t.engine.bufs.grad_residual.clone()
        out = step(mbs)
        if t.state.step + 1 == 10:
            seen.update(skipped=out[1].skipped, before=float(before.abs().max()),
                        after=float(t.engine.bufs.grad_residual.abs().max()))
        return out
    t.train_step = train_step
    t.run()
    return seen


def test_a_vetoed_step_leaves_nothing_in_the_residual(dataset, tmp_path):
    """The reductions charge the residual with the step's rounding before the loss-spike
    monitor vetoes it: kept, that (here 35-60x a normal residual) went out with the next step's
    reduction, part of the vetoed gradient applied after all. It goes, as an overflow's."""
    for seen in run_ranks(2, _vetoed_rank, dataset, str(tmp_path)):
        assert seen["skipped"] and seen["before"] > 0
        assert seen["after"] == 0.0


def _ef_copies_rank(rank, world, dataset, tmp):
    """pp2.dp2 with error feedback, saved at step 3: per piece of this rank, whether it is the
    counted copy, and its residual at the save and right after a resume from it."""
    from bloomtrain.train import Trainer
    cfg = _ef_cfg(dataset, f"{tmp}/full", pp=2, pp_partition="uniform", zero_stage=1)
    full = Trainer(cfg, log=lambda *a: None)
    at_save, save = {}, full.checkpoints.save

    def saving(state):
        at_save[state.step] = full.engine.bufs.grad_residual.clone()
        return save(state)
    full.checkpoints.save = saving
    full.run()
    at3 = ckpt.list_checkpoints(Path(tmp) / "full" / "ck")[0][1]
    resumed = Trainer(_ef_cfg(dataset, f"{tmp}/resumed", resume=str(at3), pp=2,
                              pp_partition="uniform", zero_stage=1), log=lambda *a: None)
    bufs, out = resumed.engine.bufs, []
    for seg in bufs.layout.segments:
        for piece in seg.pieces:
            lo = seg.full_off + piece.seg_start
            out.append((piece.slot.name, piece.counted, at_save[3][lo:lo + piece.numel],
                        bufs.grad_residual[lo:lo + piece.numel].clone()))
    return out


def test_a_resumed_residual_on_an_uncounted_copy_starts_at_zero(dataset, tmp_path):
    """Only a parameter's counted copy writes its residual, and the last stage's tied embedding
    took the first stage's on resume: that copy's own is another (its reduction is another dp
    group's), so the amount was owed twice. Now it starts at zero; every counted piece is
    restored bitwise."""
    outs = run_ranks(4, _ef_copies_rank, dataset, str(tmp_path))
    uncounted = [(name, saved, loaded) for out in outs for name, counted, saved, loaded in out
                 if not counted]
    assert uncounted and all(n == "lm_head.weight" for n, _, _ in uncounted)
    for name, saved, loaded in uncounted:
        assert saved.abs().max() > 0 and not loaded.any(), name
    for out in outs:
        for name, counted, saved, loaded in out:
            if counted:
                assert torch.equal(loaded, saved), name
