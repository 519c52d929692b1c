"""Pipeline parallelism (bloomtrain.parallel.pipeline) against the single-process model.

One spawn per world size runs every multi-rank case of that size and returns what it saw; the
comparisons with the single-process reference happen here. Parity runs use dropout 0 and fp32.
"""
from __future__ import annotations

import json

import pytest
import torch

from bloomtrain import cli
from bloomtrain.layout import ParallelLayout, partition_layers
from bloomtrain.model import BloomShape, build_model
from bloomtrain.model.params import logical_name
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline import (
    SCHEDULES,
    SPLIT_BACKWARD,
    PipelineCommError,
    Timeline,
    build_pipeline_chunks,
    grid_bubble,
    op_p2p,
    pipeline_eval_step,
    pipeline_train_step,
    schedule_grid,
    theoretical_bubble,
)
from bloomtrain.topology import Topology
from bloomtrain.errors import UserError
from tests import helpers
from tests.dist import run_ranks

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256)
SHAPE8 = SHAPE.replace(num_layers=8)  # pp=4 x v=2 needs 8 virtual stages of >= 1 block
SEED = 1234
MBS, SEQ, NUM_MICRO = 1, 32, 8
NUM_STEPS = 10
LR = 1e-3
TIMEOUT = 120.0

# Tolerances. A pipeline runs the same blocks on the same micro-batches in the same order as one
# process accumulating micro-batch gradients, so every block's math is bit-identical; what
# differs is where sums happen: the tied embedding's grad is the first stage's (embedding) part
# plus the last stage's (LM head) part added once by an all-reduce, instead of per micro-batch,
# and with tp the row-parallel partial sums are added by all-reduces. fp32 addition is not
# associative, so entries differ in the last bits (~1e-7 relative). Measured on these shapes for
# every case below: first-step gradients <= 7.5e-9 absolute (entries up to ~0.04), losses
# <= 1.2e-7 apart over all 10 steps. The bounds leave >= 80x headroom and stay far below what a
# real bug does (a micro-batch missed or counted twice, a wrong stage order, a lost
# tied-embedding reduction move the loss by > 1e-2 and gradients by their own size).
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4
# Ten AdamW steps amplify last-bit differences: Adam divides by sqrt(v), so tiny gradient entries
# get steps of ~lr whatever their size, and their rounding moves the weights, and so the last
# step's gradients, a little more. Measured: last-step gradients <= 7.3e-8 absolute.
TRAIN_LOSS_ATOL = 1e-5
LAST_GRAD_ATOL, LAST_GRAD_RTOL = 2e-6, 1e-4


def _micro_batches(step: int, num_micro: int = NUM_MICRO) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(num_micro):
        ids = torch.randint(0, SHAPE.vocab_size, (MBS, SEQ + 1), generator=g)
        loss_mask = torch.ones(MBS, SEQ)
        if i % 3 == 0:
            loss_mask[0, : 3 + i] = 0.0  # masked prompts of different lengths
        out.append(dict(tokens=ids[:, :-1], labels=ids[:, 1:], loss_mask=loss_mask))
    return out


def _reference(shape: BloomShape, num_steps: int) -> dict:
    """One process, gradient accumulation over the micro-batches: the mean of the micro-batch
    losses, each backpropagated divided by their number."""
    model = build_model(shape, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(num_steps):
        opt.zero_grad(set_to_none=True)
        batches = _micro_batches(step)
        total = 0.0
        for b in batches:
            loss = model(b["tokens"], b["labels"], b["loss_mask"])
            (loss / len(batches)).backward()
            total += loss.item()
        losses.append(total / len(batches))
        if step in (0, num_steps - 1):
            grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    model.eval()
    with torch.no_grad():
        batches = _micro_batches(0)
        eval_loss = sum(model(b["tokens"], b["labels"], b["loss_mask"]).item()
                        for b in batches) / len(batches)
    return dict(losses=losses, grads=grads, eval_loss=eval_loss)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(shape, num_steps):
        key = (shape.num_layers, num_steps)
        if key not in cache:
            cache[key] = _reference(shape, num_steps)
        return cache[key]
    return get


# ---- what every rank runs ----------------------------------------------------------------------

def _case_shape(case) -> BloomShape:
    return SHAPE8 if case["pp"] * case["v"] > 4 or case["pp"] == 4 else SHAPE


def _case_config(case):
    return helpers.config(
        _case_shape(case), precision="fp32", seed=SEED,
        activation_checkpointing=case.get("recompute", "none"),
        parallel={"tp": case["tp"], "pp": case["pp"], "sequence_parallel": case["sp"],
                  "pp_schedule": case["schedule"], "num_virtual_stages": case["v"],
                  "pp_partition": case["partition"]})


def _train_case(case, base, tmp_dir):
    # TP and PP composed by parallelize, without the ZeRO engine: this test drives torch's AdamW
    # on the parameters' .grad, so it sees the pipeline's gradients as they come out of backward.
    cfg = _case_config(case)
    parts = helpers.build(cfg, helpers.topology(cfg, base), engine=False)
    topo, chunks, specs = parts.topo, parts.chunks, parts.specs
    params = parts.named_parameters()
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, weight_decay=0.1)
    recv_shape = topo.layout.recv_shape(MBS, SEQ, cfg.model.hidden_size)
    out = dict(losses=[], grads={}, names=[n for n, _ in params],
               ranges=[c.block_range for c in chunks], rank=topo.rank)
    comm.STATS.trace_p2p()
    for step in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        timeline = Timeline() if case.get("timeline") else None
        loss = pipeline_train_step(case["schedule"], chunks, _micro_batches(step), topo,
                                   recv_shape=recv_shape, timeline=timeline, timeout=TIMEOUT)
        helpers.sum_partial_grads(parts)
        if step in (0, case["steps"] - 1):
            grads = helpers.gather_full_tensors({logical_name(n): p.grad for n, p in params},
                                                topo)
            out["grads"][step] = grads if topo.tp_rank == 0 else None
        opt.step()
        out["losses"].append(loss)
        if timeline is not None:
            timeline.save(tmp_dir, step)
    out["p2p"], _ = comm.STATS.p2p_log, comm.STATS.trace_p2p(False)
    tied = {n: p.detach() for n, p in params if specs[n].tied}
    weights = helpers.gather_full_tensors(tied, topo)
    out["tied_weights"] = weights if topo.tp_rank == 0 else None
    out["attrs"] = {n: (specs[n].tied, specs[n].tied_copy) for n, _ in params
                    if specs[n].tied or specs[n].tied_copy}
    with torch.no_grad():
        parts.train(False)
        out["eval_loss"] = pipeline_eval_step(case["schedule"], chunks, _micro_batches(0), topo,
                                              recv_shape=recv_shape, timeout=TIMEOUT)
    return out


def _freeing_check(topo):
    """Stage 0 of a pp=2 1F1B step: every output it sent has lost its storage, and the first one
    already when the next micro-batch's forward starts, i.e. before its own backward."""
    model = build_model(SHAPE, SEED)
    chunks = build_pipeline_chunks(model, ParallelLayout(pp=2, partition="uniform"), topo.pp_rank)
    chunk = chunks[0]
    blocks = list(chunk.transformer.h.values())
    outputs, seen_at_forward = [], []
    blocks[-1].register_forward_hook(lambda mod, args, out: outputs.append(out))
    blocks[0].register_forward_pre_hook(
        lambda mod, args: seen_at_forward.append([o.untyped_storage().nbytes() for o in outputs]))
    loss = pipeline_train_step("1f1b", chunks, _micro_batches(0, 4), topo,
                               recv_shape=(MBS, SEQ, SHAPE.hidden_size), timeout=TIMEOUT)
    grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    return dict(loss=loss, seen_at_forward=seen_at_forward, grads=grads,
                final=[(tuple(o.shape), o.untyped_storage().nbytes(), o.grad_fn is not None)
                       for o in outputs])


def _mismatch_check(topo):
    """Stage 0 runs two micro-batches and stage 1 three: both must fail fast, naming what they
    waited for, instead of hanging."""
    num_micro = 2 if topo.pp_rank == 0 else 3
    chunks = build_pipeline_chunks(build_model(SHAPE, SEED),
                                   ParallelLayout(pp=2, partition="uniform"), topo.pp_rank)
    try:
        pipeline_train_step("1f1b", chunks, _micro_batches(0, num_micro), topo,
                            recv_shape=(MBS, SEQ, SHAPE.hidden_size), timeout=2.0)
    except PipelineCommError as e:
        return str(e)
    return None


def _rank_main(rank, world_size, cases, tmp_dir, extra_checks):
    topos, results = {}, {}
    for name, case in cases.items():
        key = (case["tp"], case["pp"])
        if key not in topos:  # process groups of these sizes, built once
            topos[key] = Topology.build(tp=case["tp"], pp=case["pp"])
        results[name] = _train_case(case, topos[key], tmp_dir)
    if extra_checks:
        topo = topos[(1, 2)]
        results["freeing"] = _freeing_check(topo)
        results["mismatch"] = _mismatch_check(topo)  # last: it leaves unmatched messages behind
    return results


def _case(pp, tp, schedule, partition="uniform", sp=False, steps=NUM_STEPS, **kw):
    v = 2 if schedule == "interleaved" else 1
    return dict(pp=pp, tp=tp, schedule=schedule, v=v, partition=partition, sp=sp, steps=steps, **kw)


WORLDS = {
    2: {
        "pp2-gpipe": _case(2, 1, "gpipe", "type:transformer|embedding", timeline=True),
        "pp2-1f1b": _case(2, 1, "1f1b", "type:transformer|embedding", recompute="full"),
        "pp2-interleaved": _case(2, 1, "interleaved"),
    },
    4: {
        "pp4-gpipe": _case(4, 1, "gpipe", "type:transformer|embedding"),
        "pp4-1f1b": _case(4, 1, "1f1b", "2,2,2,2"),
        "pp4-interleaved": _case(4, 1, "interleaved"),
        "pp2tp2-gpipe": _case(2, 2, "gpipe"),
        "pp2tp2-1f1b": _case(2, 2, "1f1b", "type:transformer|embedding"),
        "pp2tp2-interleaved": _case(2, 2, "interleaved"),
        # selective under tp and sp: the replay reruns the block's collectives (model/recompute)
        "pp2tp2sp-1f1b": _case(2, 2, "1f1b", sp=True, recompute="selective"),
    },
    8: {
        "pp4tp2-gpipe": _case(4, 2, "gpipe"),
        "pp4tp2-1f1b": _case(4, 2, "1f1b", "type:transformer|embedding"),
        "pp4tp2-interleaved": _case(4, 2, "interleaved"),
    },
}


@pytest.fixture(scope="module")
def timeline_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def spawn(timeline_dir):
    """One spawn per world size, shared by every test that reads it."""
    runs = {}

    def get(world):
        if world not in runs:
            runs[world] = run_ranks(world, _rank_main, WORLDS[world], str(timeline_dir),
                                    world == 2)
        return runs[world]
    return get


# ---- checks ------------------------------------------------------------------------------------

def _merge_grads(ranks, name, step):
    """Full gradients by logical name from every pipeline stage (tp rank 0's gathered copy). The
    tied embedding appears twice, once per stage that holds it; both must agree bit for bit."""
    merged, tied = {}, []
    for r in ranks:
        grads = r[name]["grads"][step]
        if grads is None:
            continue
        for n, g in grads.items():
            if n in merged:
                tied.append((merged[n], g))
            merged[n] = g
    return merged, tied


@pytest.mark.parametrize("world", sorted(WORLDS), ids=lambda w: f"world{w}")
def test_messages_match_by_order_alone(spawn, world):
    """NCCL ignores tags: the n-th message a rank sends to a peer is the n-th that peer posts a
    receive for. gloo matches tags, so the CPU runs would not notice a schedule that posts a
    pair's messages in different orders on the two sides; this checks the order itself, for
    every schedule and layout: each pair's sends, as posted, equal the peer's receives, as
    posted, in tag (what and which micro-batch) and shape."""
    ranks = spawn(world)
    for name in WORLDS[world]:
        sent, received = {}, {}
        for r in ranks:
            me = r[name]["rank"]
            for kind, peer, tag, shape in r[name]["p2p"]:
                log = sent if kind == "send" else received
                log.setdefault((me, peer) if kind == "send" else (peer, me), []).append(
                    (tag, shape))
        assert sent and sent.keys() == received.keys(), name
        for pair, messages in sent.items():
            assert messages == received[pair], (name, pair)


@pytest.mark.parametrize("world", sorted(WORLDS), ids=lambda w: f"world{w}")
def test_parity_with_single_process(spawn, references, world):
    ranks = spawn(world)
    for name, case in WORLDS[world].items():
        ref = references(_case_shape(case), case["steps"])
        for r in ranks:  # the loss is broadcast to every pipeline rank
            assert r[name]["losses"] == pytest.approx(ref["losses"], abs=TRAIN_LOSS_ATOL), name
        assert ranks[0][name]["losses"][0] == pytest.approx(ref["losses"][0], rel=LOSS_RTOL)
        for step, (atol, rtol) in ((0, (GRAD_ATOL, GRAD_RTOL)),
                                   (case["steps"] - 1, (LAST_GRAD_ATOL, LAST_GRAD_RTOL))):
            merged, tied = _merge_grads(ranks, name, step)
            assert merged.keys() == ref["grads"][step].keys(), name
            for n, g in ref["grads"][step].items():
                torch.testing.assert_close(merged[n], g, atol=atol, rtol=rtol,
                                           msg=lambda m, n=n: f"{name} step {step} {n}: {m}")
            assert len(tied) == 1 and torch.equal(*tied[0]), name
        # The two copies of the tied embedding took identical steps.
        copies = [w for r in ranks if r[name]["tied_weights"]
                  for w in r[name]["tied_weights"].values()]
        assert len(copies) == 2 and torch.equal(copies[0], copies[1]), name
        # Eval through the pipeline (forwards only) against one process evaluating its own
        # weights, which match the pipeline's to the training tolerance.
        for r in ranks:
            assert r[name]["eval_loss"] == pytest.approx(ref["eval_loss"], abs=TRAIN_LOSS_ATOL)


@pytest.mark.parametrize("world", sorted(WORLDS), ids=lambda w: f"world{w}")
def test_stage_contents_and_names(spawn, world):
    ranks = spawn(world)
    for name, case in WORLDS[world].items():
        pp, tp, v = case["pp"], case["tp"], case["v"]
        shape = _case_shape(case)
        expected = partition_layers(shape.num_layers, pp * v, case["partition"], v > 1)
        for rank, r in enumerate(ranks):
            pp_rank = rank // tp  # dp = 1
            res = r[name]
            assert res["ranges"] == [expected[c * pp + pp_rank] for c in range(v)]
            blocks = {int(n.split(".")[2]) for n in res["names"] if n.startswith("transformer.h.")}
            assert blocks == {i for c in range(v) for i in range(*expected[c * pp + pp_rank])}
            has_embedding = "transformer.word_embeddings.weight" in res["names"]
            has_head = "lm_head.weight" in res["names"]
            assert has_embedding == (pp_rank == 0) and has_head == (pp_rank == pp - 1)
            assert ("transformer.ln_f.weight" in res["names"]) == (pp_rank == pp - 1)
            expected_attrs = {}
            if pp_rank == 0:
                expected_attrs["transformer.word_embeddings.weight"] = (True, False)
            if pp_rank == pp - 1:
                expected_attrs["lm_head.weight"] = (True, True)
            assert res["attrs"] == expected_attrs


def test_sent_activations_are_freed(spawn):
    ranks = spawn(2)
    stage0, stage1 = ranks[0]["freeing"], ranks[1]["freeing"]
    # Forward of micro-batch i sees the outputs of 0..i-1 already released; in 1F1B stage 0 runs
    # F0 F1 B0 ..., so micro-batch 0's output was gone before its backward.
    assert stage0["seen_at_forward"] == [[0] * i for i in range(4)]
    assert all(shape == (0,) and nbytes == 0 and has_grad_fn
               for shape, nbytes, has_grad_fn in stage0["final"])
    assert len(stage0["final"]) == 4
    # The backward through the released outputs still gives the single-process gradients.
    model = build_model(SHAPE, SEED)
    batches = _micro_batches(0, 4)
    total = 0.0
    for b in batches:
        loss = model(b["tokens"], b["labels"], b["loss_mask"])
        (loss / len(batches)).backward()
        total += loss.item()
    assert stage0["loss"] == pytest.approx(total / 4, rel=LOSS_RTOL)
    ref = {n: p.grad for n, p in model.named_parameters()}
    for grads in (stage0["grads"], stage1["grads"]):
        for n, g in grads.items():
            if n in ("lm_head.weight", "transformer.word_embeddings.weight"):
                continue  # a part of the tied gradient; the all-reduced sum is checked above
            torch.testing.assert_close(g, ref[n], atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_mismatch_fails_with_a_named_error(spawn):
    ranks = spawn(2)
    assert ranks[1]["mismatch"] == ("pipeline stage 1/2: recv activation for micro-batch 2 "
                                    "from rank 0 timed out after 2s")
    assert ranks[0]["mismatch"] == ("pipeline stage 0/2: broadcast of the step loss from rank 1 "
                                    "timed out after 2s")


def test_timeline_file_and_cli(spawn, timeline_dir, capsys):
    spawn(2)
    files = sorted((timeline_dir / "pipeline_timeline").glob("*.json"))
    assert [f.name for f in files][:2] == ["step_0_rank_0.json", "step_0_rank_1.json"]
    data = json.loads((timeline_dir / "pipeline_timeline" / "step_9_rank_1.json").read_text())
    assert data["schedule"] == "gpipe" and data["pp_rank"] == 1 and data["step"] == 9
    kinds = [(e["kind"], e["micro_batch"]) for e in data["events"] if e["kind"] in ("F", "B")]
    assert kinds == [("F", i) for i in range(NUM_MICRO)] + [("B", i) for i in range(NUM_MICRO)]
    assert all(e["kind"] != "recv" or e["end"] >= e["start"] for e in data["events"])

    assert cli.main(["pipeline-timeline", str(timeline_dir), "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "step 9" in out and "gpipe" in out
    rows = [line for line in out.splitlines() if line.startswith("stage ") and "|" in line]
    assert len(rows) == 2 and "F0" in rows[0] and "B7" in rows[1]
    assert "theory (p-1)/m = 0.125" in out
    assert cli.main(["pipeline-timeline", str(timeline_dir), "--step", "77"]) == 2


# ---- single process ----------------------------------------------------------------------------

def test_tp1_pp1_chunk_is_the_model():
    model = build_model(SHAPE, SEED)
    names = [n for n, _ in model.named_parameters()]
    b = _micro_batches(0)[0]
    expected = model(b["tokens"], b["labels"], b["loss_mask"]).item()
    (chunk,) = build_pipeline_chunks(model, ParallelLayout(), 0)
    assert [n for n, _ in chunk.named_parameters()] == names
    assert chunk.lm_head.weight is chunk.transformer.word_embeddings.weight
    loss = pipeline_train_step("1f1b", [chunk], [b], Topology.single(),
                               recv_shape=(MBS, SEQ, SHAPE.hidden_size))
    assert loss == expected
    assert logical_name("lm_head.weight") == "transformer.word_embeddings.weight"
    assert logical_name("transformer.h.3.mlp.dense_4h_to_h.weight").endswith("4h_to_h.weight")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("num_micro", [4, 8, 12])
def test_schedule_grid_bubble_and_message_order(schedule, pp, num_micro):
    v = 2 if schedule == "interleaved" else 1
    if schedule == "interleaved" and num_micro % pp:
        with pytest.raises(UserError, match="divisible by parallel.pp"):
            schedule_grid(schedule, pp, num_micro, v)
        return
    grid = schedule_grid(schedule, pp, num_micro, v)
    # Counted from the slots, the bubble is the paper's formula.
    assert grid_bubble(grid) == pytest.approx(theoretical_bubble(schedule, pp, num_micro, v))
    for rank, row in enumerate(grid):
        ops = SCHEDULES[schedule](pp, rank, num_micro, v)
        kinds = "FBW" if schedule in SPLIT_BACKWARD else "FB"
        assert sorted((op.kind, op.chunk, op.micro_batch) for op in ops) == sorted(
            (k, c, i) for k in kinds for c in range(v) for i in range(num_micro))
        assert [op for _, op in row] == ops
        phases = [op.phase for op in ops]
        assert phases == sorted(phases, key=["warmup", "steady", "cooldown"].index)
    # Between every pair of ranks, messages are received in the order they are sent: NCCL, which
    # ignores tags, matches them by order alone.
    sent, received = {}, {}
    for rank in range(pp):
        for op in SCHEDULES[schedule](pp, rank, num_micro, v):
            recv, send = op_p2p(op, pp, rank, v)
            if send is not None:
                sent.setdefault((rank, send[0]), []).append((send[1], send[2], op.micro_batch))
            if recv is not None:
                received.setdefault((recv[0], rank), []).append((recv[1], recv[2],
                                                                 op.micro_batch))
    assert sent == received


def test_one_f_one_b_phases():
    ops = SCHEDULES["1f1b"](4, 1, 6)
    assert [(op.kind, op.micro_batch, op.phase) for op in ops] == [
        ("F", 0, "warmup"), ("F", 1, "warmup"),
        ("F", 2, "steady"), ("B", 0, "steady"), ("F", 3, "steady"), ("B", 1, "steady"),
        ("F", 4, "steady"), ("B", 2, "steady"), ("F", 5, "steady"), ("B", 3, "steady"),
        ("B", 4, "cooldown"), ("B", 5, "cooldown")]
