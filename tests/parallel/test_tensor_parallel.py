"""Tensor and sequence parallelism (bloomtrain.parallel.tensor) against the single-process model.

One spawn per tp size runs every multi-rank check, for sequence parallelism off and on, and
returns what it saw; the comparisons with the single-process reference happen here. Parity runs
use dropout 0 and fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bloomtrain.layout import ParallelLayout
from bloomtrain.model import BloomShape, build_model, lm_loss
from bloomtrain.model.params import base_spec, param_spec
from bloomtrain.parallel import comm
from bloomtrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    vocab_parallel_lm_loss,
)
from bloomtrain.topology import Topology
from bloomtrain.errors import UserError
from tests.dist import run_ranks
from tests.helpers import gather_full_tensors, shard_full


def sum_sequence_parallel_grads(model, topo, sp: bool) -> None:
    """Under sequence parallelism the replicated parameters' grads are partial sums over tp
    (their specs say so); what the engine does before a step, in one coalesced all-reduce."""
    if sp:
        comm.all_reduce_coalesced([p.grad for n, p in model.named_parameters()
                                   if base_spec(n).tp_dim is None and p.grad is not None],
                                  topo.tp_group, "tp")


def gather_full_state(model, topo) -> dict:
    return gather_full_tensors(model.state_dict(), topo)


def splits_match_specs(model, full_model, tp: int) -> bool:
    """Every sharded parameter is the spec's split of the full one."""
    full = dict(full_model.named_parameters())
    for n, p in model.named_parameters():
        shape = list(full[n].shape)
        dim = base_spec(n).tp_dim
        if dim is not None:
            shape[dim] //= tp
        if list(p.shape) != shape:
            return False
    return True

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256)
SEED = 1234
BATCH, SEQ = 2, 32
NUM_STEPS = 10
LR = 1e-3

# Tolerances. The tensor-parallel model computes the same math as the single-process one, but the
# row-parallel matmuls and the embedding become sums of tp partial products added by an
# all-reduce, and the cross-entropy's exp-sum is split the same way; fp32 addition is not
# associative, so results may differ in the last bits (~1e-7 relative) per reduction. Measured on
# this shape with tp 2 and 4: the loss matched to the last bit, gradients differed by <= 3e-8
# absolute (largest entry ~0.1). The bounds leave >= 30x headroom for other BLAS builds, and
# stay far below what a real bug does (a missing or doubled reduction, a wrong shard or head
# order moves the loss by > 1e-2 and gradients by their own size).
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
# Ten AdamW steps amplify last-bit differences: Adam divides by sqrt(v), so tiny gradient entries
# get steps of ~lr whatever their size, and their rounding can move weights by up to ~lr.
# Measured loss differences after 10 steps: <= 5e-7.
TRAIN_LOSS_ATOL = 1e-5


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, :5] = 0.0  # a masked prompt, so the mask is exercised
    return ids[:, :-1], ids[:, 1:], loss_mask


def _train_losses(model, step_fn=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(NUM_STEPS):
        tokens, labels, mask = _batch(step)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels, mask)
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    model = build_model(SHAPE, SEED)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    tokens, labels, mask = _batch(0)
    loss = model(tokens, labels, mask)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(state=state, loss=loss.item(), grads=grads,
                train_losses=_train_losses(build_model(SHAPE, SEED)))


# ---- what every rank runs ----------------------------------------------------------------------

def _count(snapshot, kind):
    return snapshot.get((kind, "tp"), {"calls": 0, "bytes": 0})


def _comm_counts(model, topo, sequence_parallel):
    """Collectives of one block's forward+backward and of the whole model's training step."""
    tp = topo.tp_size
    comm.STATS.enable()
    comm.STATS.reset()
    seq_local = SEQ // tp if sequence_parallel else SEQ
    x = torch.randn(BATCH, seq_local, SHAPE.hidden_size,
                    generator=torch.Generator().manual_seed(5), requires_grad=True)
    bias = model.transformer.attention_bias(SEQ, SEQ, torch.float32)
    out = model.transformer.h[0](x, bias)
    out.sum().backward()
    block = comm.STATS.snapshot()

    comm.STATS.reset()
    model.zero_grad(set_to_none=True)
    tokens, labels, mask = _batch(0)
    model(tokens, labels, mask).backward()
    sum_sequence_parallel_grads(model, topo, sequence_parallel)
    whole = comm.STATS.snapshot()
    comm.STATS.enable(False)
    model.zero_grad(set_to_none=True)
    return block, whole


def _dropout_checks(topo, sequence_parallel):
    shape = SHAPE.replace(hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels, mask = _batch(0)
    group = topo.tp_group

    def run(activation_checkpointing, capture=None):
        torch.manual_seed(7)
        model = build_model(shape, SEED)
        apply_tensor_parallel(model, topo, sequence_parallel=sequence_parallel, seed=SEED)
        model.train()
        model.set_activation_checkpointing(activation_checkpointing)
        if capture is not None:
            model.transformer.ln_f.register_forward_hook(
                lambda mod, args, out: capture.append(out.detach().clone()))
        loss = model(tokens, labels, mask)
        loss.backward()
        sum_sequence_parallel_grads(model, topo, sequence_parallel)
        grads = gather_full_tensors({n: p.grad for n, p in model.named_parameters()}, topo)
        return loss.item(), grads, model

    hidden = []
    loss_a, grads_a, model = run("none", capture=hidden)
    loss_b, grads_b, _ = run("none")
    loss_c, grads_c, _ = run("full")
    loss_d, grads_d, _ = run("selective")

    # Without sequence parallelism the hidden states are replicated: the hidden dropout must
    # have dropped the same elements on every tp rank.
    gathered_hidden = torch.empty((topo.tp_size,) + tuple(hidden[0].shape))
    comm.all_gather_into_tensor(gathered_hidden, hidden[0].unsqueeze(0).contiguous(), group, "tp")

    torch.manual_seed(3)
    with model.tp_rng.fork():
        forked = torch.rand(16)
    default = torch.rand(16)
    streams = torch.empty(topo.tp_size, 2, 16)
    comm.all_gather_into_tensor(streams, torch.stack([forked, default])[None], group, "tp")
    return dict(losses=(loss_a, loss_b, loss_c, loss_d),
                grads_equal_rerun=all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a),
                grads_equal_recompute=all(torch.equal(grads_a[n], grads_c[n]) for n in grads_a),
                grads_equal_selective=all(torch.equal(grads_a[n], grads_d[n]) for n in grads_a),
                hidden_replicated=all(torch.equal(gathered_hidden[0], h) for h in gathered_hidden),
                streams=streams)


def _cross_entropy_check(topo):
    g = torch.Generator().manual_seed(11)
    full = (3 * torch.randn(BATCH, SEQ, SHAPE.vocab_size, generator=g)).requires_grad_()
    labels = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=g)
    labels[1, 3] = -100  # F.cross_entropy's ignore_index, which lm_loss inherits
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()
    shard = full.detach().chunk(topo.tp_size, -1)[topo.tp_rank].clone().requires_grad_()
    out = {}
    for key, loss_mask in (("masked", mask), ("unmasked", None)):
        full.grad, shard.grad = None, None
        expected = lm_loss(full, labels, loss_mask)
        expected.backward()
        got = vocab_parallel_lm_loss(shard, labels, loss_mask, topo.tp_group)
        got.backward()
        out[key] = dict(loss=(got.item(), expected.item()),
                        grad_err=(shard.grad - full.grad.chunk(topo.tp_size, -1)[topo.tp_rank])
                        .abs().max().item())
    return out


def _tp_rank_checks(rank, world_size):
    topo = Topology.build(tp=world_size, pp=1)
    tokens, labels, mask = _batch(0)
    results = {"cross_entropy": _cross_entropy_check(topo)}
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(SHAPE, SEED), topo, sequence_parallel=sp,
                                      seed=SEED)
        r = {}
        r["attrs_ok"] = splits_match_specs(model, build_model(SHAPE, SEED), topo.tp_size)
        r["sp_params"] = [n for n, _ in model.named_parameters()
                          if param_spec(n, tp=topo.tp_size, sequence_parallel=sp).tp_partial_grad]
        r["module_types"] = (
            type(model.transformer.word_embeddings) is VocabParallelEmbedding
            and type(model.transformer.h[0].self_attention.query_key_value) is ColumnParallelLinear
            and type(model.transformer.h[0].mlp.dense_4h_to_h) is RowParallelLinear
            and model.lm_head.weight is model.transformer.word_embeddings.weight)
        state = gather_full_state(model, topo)
        local = model.state_dict()
        r["reshard_exact"] = all(torch.equal(shard_full(n, t, topo.tp_rank, topo.tp_size),
                                             local[n]) for n, t in state.items())
        r["logits_shape"] = tuple(model(tokens).shape)
        loss = model(tokens, labels, mask)
        loss.backward()
        sum_sequence_parallel_grads(model, topo, sp)
        grads = gather_full_tensors({n: p.grad for n, p in model.named_parameters()}, topo)
        r["loss"] = loss.item()
        r["block_comm"], r["model_comm"] = _comm_counts(model, topo, sp)
        r["train_losses"] = _train_losses(
            apply_tensor_parallel(build_model(SHAPE, SEED), topo, sequence_parallel=sp, seed=SEED),
            step_fn=lambda m: sum_sequence_parallel_grads(m, topo, sp))
        r["dropout"] = _dropout_checks(topo, sp)
        if rank == 0:  # identical on every rank after the gathers; ship one copy
            r["state"], r["grads"] = state, grads
        results[sp] = r

    # A sequence that does not split over tp fails on every rank before any collective.
    model = apply_tensor_parallel(build_model(SHAPE, SEED), topo, sequence_parallel=True)
    try:
        model(tokens[:, :SEQ - 1])
        results["bad_seq_error"] = None
    except UserError as e:
        results["bad_seq_error"] = str(e)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_run(request):
    tp = request.param
    return tp, run_ranks(tp, _tp_rank_checks)


# ---- checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parity_with_single_process(tp_run, reference, sp):
    tp, ranks = tp_run
    r0 = ranks[0][sp]
    assert all(r[sp]["attrs_ok"] and r[sp]["module_types"] and r[sp]["reshard_exact"]
               for r in ranks)
    assert r0["logits_shape"] == (BATCH, SEQ, SHAPE.vocab_size // tp)
    # Same seed, same full model: the shards are cut from the same full tensors, bit for bit.
    assert r0["state"].keys() == reference["state"].keys()
    for n, t in reference["state"].items():
        assert torch.equal(r0["state"][n], t), n
    for r in ranks:  # the loss is all-reduced, so every rank sees it
        assert r[sp]["loss"] == pytest.approx(reference["loss"], rel=LOSS_RTOL)
    assert r0["grads"].keys() == reference["grads"].keys()
    for n, grad in reference["grads"].items():
        torch.testing.assert_close(r0["grads"][n], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    for r in ranks:
        assert r[sp]["train_losses"] == pytest.approx(reference["train_losses"],
                                                      abs=TRAIN_LOSS_ATOL)
    # The LayerNorms and row-parallel biases see only their sequence shard under SP.
    replicated = [n for n in reference["grads"] if base_spec(n).tp_dim is None]
    assert r0["sp_params"] == (replicated if sp else [])
    assert len(replicated) == 6 * SHAPE.num_layers + 4


def test_vocab_parallel_cross_entropy(tp_run):
    _, ranks = tp_run
    for r in ranks:
        for key, check in r["cross_entropy"].items():
            got, expected = check["loss"]
            # fp32 log-sum-exp over split exp-sums; the values are O(5).
            assert got == pytest.approx(expected, rel=1e-6), key
            assert check["grad_err"] < 1e-7, key


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_rng(tp_run, reference, sp):
    tp, ranks = tp_run
    for r in ranks:
        d = r[sp]["dropout"]
        loss_a, loss_b, loss_c, loss_d = d["losses"]
        assert loss_a == loss_b, "same seed must give the same dropout masks"
        assert d["grads_equal_rerun"]
        # Recomputation (full: every block; selective: every op of the block but its matmuls,
        # the attention core's dropout inside the forked per-rank RNG, whose draw from the
        # default generator the replay repeats) replays the same masks, so the gradients are
        # bitwise those of the run that kept its activations.
        assert loss_c == loss_a and d["grads_equal_recompute"]
        assert loss_d == loss_a and d["grads_equal_selective"]
        assert abs(loss_a - reference["loss"]) > 1e-4, "dropout had no effect"
        if not sp:
            assert d["hidden_replicated"]
        streams = d["streams"]  # [tp, (forked, default), 16]
        for other in range(1, tp):
            assert not torch.equal(streams[0, 0], streams[other, 0]), "forked streams collide"
            assert torch.equal(streams[0, 1], streams[other, 1]), "default streams diverged"
    # Every rank gathered the same picture.
    assert all(torch.equal(r[sp]["dropout"]["streams"], ranks[0][sp]["dropout"]["streams"])
               for r in ranks)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_comm_counts(tp_run, sp):
    tp, ranks = tp_run
    b, s, h, num_layers = BATCH, SEQ, SHAPE.hidden_size, SHAPE.num_layers
    act = b * s * h * 4  # one full fp32 activation [b, s, h]
    token = b * s * 4  # one fp32 value per token (the cross-entropy's three all-reduces)
    num_replicated = num_layers * 6 * h + 4 * h
    if not sp:
        # Per block: g after attention.dense and after dense_4h_to_h in forward, f before
        # query_key_value and dense_h_to_4h in backward. Model: + g after the embedding,
        # f before the LM head (backward), and the cross-entropy's max, target and exp-sum.
        expected_block = {("all_reduce", "tp"): {"calls": 4, "bytes": 4 * act}}
        expected_model = {("all_reduce", "tp"): {"calls": 4 * num_layers + 5,
                                                 "bytes": (4 * num_layers + 2) * act + 3 * token}}
    else:
        # Per block, every all-reduce becomes a pair: the two column inputs are all-gathered in
        # forward and reduce-scattered in backward, the two row outputs the other way round.
        # Model: + the embedding's reduce-scatter (all-gather in backward), the LM head's gather
        # (reduce-scatter in backward), the cross-entropy, and one coalesced all-reduce of the
        # sequence-parallel LayerNorm and bias grads.
        expected_block = {("all_gather", "tp"): {"calls": 4, "bytes": 4 * act},
                          ("reduce_scatter", "tp"): {"calls": 4, "bytes": 4 * act}}
        per = {"calls": 4 * num_layers + 2, "bytes": (4 * num_layers + 2) * act}
        expected_model = {("all_gather", "tp"): per, ("reduce_scatter", "tp"): per,
                          ("all_reduce", "tp"): {"calls": 4,
                                                 "bytes": 3 * token + 4 * num_replicated}}
    for r in ranks:
        assert r[sp]["block_comm"] == expected_block
        assert r[sp]["model_comm"] == expected_model


def test_sequence_length_not_divisible(tp_run):
    tp, ranks = tp_run
    for r in ranks:
        assert r["bad_seq_error"] == (
            f"the sequence length ({SEQ - 1}) must be divisible by parallel.tp ({tp}) with "
            f"parallel.sequence_parallel=true; change data.seq_length or turn sequence "
            f"parallelism off")


# ---- single process ----------------------------------------------------------------------------

def test_validation_messages():
    def check(shape, tp, seq):
        ParallelLayout(tp=tp, sequence_parallel=True).check_tensor_parallel(shape, seq, 384)
    check(SHAPE, 4, SEQ)
    cases = [
        (SHAPE.replace(ffn_hidden_size=252, vocab_size=255), 3, 33,
         "model.num_heads (4) must be divisible by parallel.tp (3)"),
        # Every broken rule in one message.
        (SHAPE, 3, SEQ, "4 problems; change each of these:\n"
         "  - model.num_heads (4) must be divisible by parallel.tp (3)\n"
         "  - model.ffn_hidden_size (256) must be divisible by parallel.tp (3)\n"
         "  - the padded vocabulary (256) must be divisible by parallel.tp (3); set "
         "model.make_vocab_size_divisible_by to a multiple of 3\n"
         "  - data.seq_length (32) must be divisible by parallel.tp (3) with "
         "parallel.sequence_parallel=true"),
        (SHAPE.replace(ffn_hidden_size=250), 4, SEQ,
         "model.ffn_hidden_size (250) must be divisible by parallel.tp (4)"),
        (SHAPE.replace(vocab_size=250), 4, SEQ,
         "the padded vocabulary (250) must be divisible by parallel.tp (4); set "
         "model.make_vocab_size_divisible_by to a multiple of 4"),
        (SHAPE, 4, 30, "data.seq_length (30) must be divisible by parallel.tp (4) with "
                       "parallel.sequence_parallel=true"),
    ]
    for shape, tp, seq, message in cases:
        with pytest.raises(UserError) as e:
            check(shape, tp, seq)
        assert str(e.value) == message


def test_tp1_is_a_no_op():
    model = build_model(SHAPE, SEED)
    types = [type(m) for m in model.modules()]
    tokens, labels, mask = _batch(0)
    expected = model(tokens, labels, mask)
    apply_tensor_parallel(model, Topology.single(), sequence_parallel=True)
    assert [type(m) for m in model.modules()] == types
    assert torch.equal(model(tokens, labels, mask), expected)
    assert not any(param_spec(n, tp=1, sequence_parallel=True).tp_partial_grad
                   for n, _ in model.named_parameters())


def test_split_dims_and_sharding_without_a_process_group():
    def dim(name):
        return base_spec(name).tp_dim
    assert dim("transformer.word_embeddings.weight") == 0
    assert dim("lm_head.weight") == 0
    assert dim("transformer.h.3.self_attention.query_key_value.bias") == 0
    assert dim("transformer.h.3.mlp.dense_4h_to_h.weight") == 1
    assert dim("transformer.h.3.mlp.dense_4h_to_h.bias") is None
    assert dim("transformer.word_embeddings_layernorm.weight") is None
    # The fused QKV is per-head interleaved, so rank r's row block holds heads of rank r whole:
    # rows [r * 3h/tp, (r+1) * 3h/tp) are heads [r * nh/tp, (r+1) * nh/tp) with their q, k, v.
    h, nh, hd = SHAPE.hidden_size, SHAPE.num_heads, SHAPE.head_dim
    qkv = torch.arange(3 * h * h, dtype=torch.float32).view(3 * h, h)
    heads = qkv.view(nh, 3, hd, h)
    shard = shard_full("transformer.h.0.self_attention.query_key_value.weight", qkv, 1, 2)
    assert torch.equal(shard.view(nh // 2, 3, hd, h), heads[nh // 2:])


def test_cross_entropy_matches_without_a_group():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(BATCH, SEQ, SHAPE.vocab_size, generator=g, requires_grad=True)
    labels = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=g)
    got = vocab_parallel_lm_loss(logits, labels, None, None)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert torch.allclose(got, expected, rtol=1e-6)
    (grad,) = torch.autograd.grad(got, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad, expected_grad, atol=1e-8)


def test_one_rank_trains_with_the_in_place_cross_entropy():
    """At tp = 1 the plan installs the same loss over the whole vocabulary (no group): its
    backward works in place on the saved softmax, where F.cross_entropy's held three fp32
    [b, s, V] tensors at once. F.cross_entropy is the reference: bf16 logits, ignored labels
    and a loss mask."""
    from bloomtrain.model import BloomForCausalLM
    from bloomtrain.parallel.tensor.loss import VocabParallelLMLoss
    from bloomtrain.parallel.tensor.plan import apply_tensor_parallel

    model = apply_tensor_parallel(BloomForCausalLM(SHAPE), Topology.single())
    assert isinstance(model.loss_fn, VocabParallelLMLoss) and model.loss_fn.group is None
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(BATCH, SEQ, SHAPE.vocab_size, generator=g).to(dtype)
        logits.requires_grad_(True)
        labels = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=g)
        labels[0, :3] = -100
        mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).float()
        got = model.loss_fn(logits, labels, mask)
        want = lm_loss(logits, labels, mask)
        assert got.dtype == want.dtype == torch.float32
        assert torch.allclose(got, want, rtol=1e-6), dtype
        (grad,) = torch.autograd.grad(got, logits)
        (want_grad,) = torch.autograd.grad(want, logits)
        assert grad.dtype == dtype
        tol = 1e-8 if dtype == torch.float32 else 2 ** -8 * want_grad.abs().max().item()
        assert (grad.float() - want_grad.float()).abs().max() <= tol, dtype
