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
from bloomtrain.model import build_model
from bloomtrain.model.params import logical_name
from bloomtrain.parallel.pipeline import (
    SCHEDULES,
    SPLIT_BACKWARD,
    build_pipeline_chunks,
    grid_bubble,
    op_p2p,
    pipeline_train_step,
    schedule_grid,
    theoretical_bubble,
)
from bloomtrain.topology import Topology
from bloomtrain.errors import UserError
from tests.pipeline_cases import (GRAD_ATOL, GRAD_RTOL, LAST_GRAD_ATOL, LAST_GRAD_RTOL,
                                  LOSS_RTOL, MBS, NUM_MICRO, SEED, SEQ, SHAPE,
                                  TRAIN_LOSS_ATOL, case_shape, make_case, merge_grads,
                                  micro_batches, rank_main, reference)
from tests.dist import run_ranks


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(shape, num_steps):
        key = (shape.num_layers, num_steps)
        if key not in cache:
            cache[key] = reference(shape, num_steps)
        return cache[key]
    return get


# ---- what every rank runs ----------------------------------------------------------------------


WORLDS = {
    2: {
        "pp2-gpipe": make_case(2, 1, "gpipe", "type:transformer|embedding", timeline=True),
        "pp2-1f1b": make_case(2, 1, "1f1b", "type:transformer|embedding", recompute="full"),
        "pp2-interleaved": make_case(2, 1, "interleaved"),
    },
    4: {
        "pp4-gpipe": make_case(4, 1, "gpipe", "type:transformer|embedding"),
        "pp4-1f1b": make_case(4, 1, "1f1b", "2,2,2,2"),
        "pp4-interleaved": make_case(4, 1, "interleaved"),
        "pp2tp2-gpipe": make_case(2, 2, "gpipe"),
        "pp2tp2-1f1b": make_case(2, 2, "1f1b", "type:transformer|embedding"),
        "pp2tp2-interleaved": make_case(2, 2, "interleaved"),
        # selective under tp and sp: the replay reruns the block's collectives (model/recompute)
        "pp2tp2sp-1f1b": make_case(2, 2, "1f1b", sp=True, recompute="selective"),
    },
    8: {
        "pp4tp2-gpipe": make_case(4, 2, "gpipe"),
        "pp4tp2-1f1b": make_case(4, 2, "1f1b", "type:transformer|embedding"),
        "pp4tp2-interleaved": make_case(4, 2, "interleaved"),
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
            runs[world] = run_ranks(world, rank_main, WORLDS[world], str(timeline_dir),
                                    world == 2)
        return runs[world]
    return get


# ---- checks ------------------------------------------------------------------------------------


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
        ref = references(case_shape(case), case["steps"])
        for r in ranks:  # the loss is broadcast to every pipeline rank
            assert r[name]["losses"] == pytest.approx(ref["losses"], abs=TRAIN_LOSS_ATOL), name
        assert ranks[0][name]["losses"][0] == pytest.approx(ref["losses"][0], rel=LOSS_RTOL)
        for step, (atol, rtol) in ((0, (GRAD_ATOL, GRAD_RTOL)),
                                   (case["steps"] - 1, (LAST_GRAD_ATOL, LAST_GRAD_RTOL))):
            merged, tied = merge_grads(ranks, name, step)
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
        shape = case_shape(case)
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
    batches = micro_batches(0, 4)
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
    b = micro_batches(0)[0]
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
