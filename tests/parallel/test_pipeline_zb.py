"""The zero-bubble schedule zb-h1 (Qi et al., arXiv 2401.10241 §3.1): its op lists and bubble, the
split backward (bloomtrain.parallel.pipeline.weightgrad) against autograd's, training under
pipeline, tensor and ZeRO 0-2 parallelism against the single-process reference and the plain
reference loop, and the refused combinations.

The multi-rank parity runs reuse tests/parallel/test_pipeline.py's rank function and reference (fp32, no
dropout, 8 micro-batches), and tests/system/test_train_reference.py's plain loop and its tolerances.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomtrain import cli
from bloomtrain.config import Config
from bloomtrain.layout import ParallelLayout
from bloomtrain.validate import validate
from bloomtrain.model import BloomShape, build_model
from bloomtrain.parallel.pipeline import (
    SCHEDULES,
    DeferWeightGrads,
    WeightGradStore,
    backward_input,
    grid_bubble,
    op_costs,
    op_p2p,
    peak_in_flight,
    schedule_grid,
    summarize,
    theoretical_bubble,
)
from bloomtrain.train import Trainer
from bloomtrain.errors import UserError
from tests import pipeline_cases as tp
from tests.dist import run_ranks
from tests.reference import reference_eval, reference_train
from tests.helpers import metrics
from tests.layouts import (LOSS_RTOL, TOLERANCES, WEIGHT_ATOL, case_cfg, checkpoint_states,
                           initial_weights, rel_l2)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the op lists ------------------------------------------------------------------------------

def test_zb_h1_op_list():
    # pp=4, rank 1: 1F1B's two warm-up forwards, then F B and W held back by one micro-batch.
    ops = SCHEDULES["zb-h1"](4, 1, 6)
    assert [f"{op.kind}{op.micro_batch}" for op in ops] == [
        "F0", "F1",
        "F2", "B0", "F3", "B1", "W0", "F4", "B2", "W1", "F5", "B3", "W2",
        "B4", "W3", "B5", "W4", "W5"]
    assert [op.phase for op in ops] == ["warmup"] * 2 + ["steady"] * 11 + ["cooldown"] * 5


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_micro", [1, 2, 3, 4, 8, 13])
def test_zb_h1_lists_are_complete_ordered_and_deadlock_free(pp, num_micro):
    grid = schedule_grid("zb-h1", pp, num_micro)  # raises on deadlock
    sent, received = {}, {}
    for rank, row in enumerate(grid):
        ops = SCHEDULES["zb-h1"](pp, rank, num_micro)
        assert [op for _, op in row] == ops
        assert sorted((op.kind, op.micro_batch) for op in ops) == sorted(
            (k, i) for k in "FBW" for i in range(num_micro))
        done = set()
        for op in ops:  # F before B before W of every micro-batch
            need = {"F": None, "B": "F", "W": "B"}[op.kind]
            assert need is None or (need, op.micro_batch) in done
            done.add((op.kind, op.micro_batch))
        # Activations live from F to W: never more micro-batches than 1F1B's peak, which is its
        # first stage's (ZB-H1's memory bound, arXiv 2401.10241 §3.1).
        one_f_one_b = [peak_in_flight(SCHEDULES["1f1b"](pp, r, num_micro)) for r in range(pp)]
        assert one_f_one_b[rank] == min(pp - rank, num_micro)
        assert peak_in_flight(ops) == max(one_f_one_b) == min(pp, num_micro)
        for op in ops:  # NCCL matches messages by order alone
            recv, send = op_p2p(op, pp, rank, 1)
            if send is not None:
                sent.setdefault((rank, send[0]), []).append((send[1], op.micro_batch))
            if recv is not None:
                received.setdefault((recv[0], rank), []).append((recv[1], op.micro_batch))
    assert sent == received


@pytest.mark.parametrize("costs", [(1, 1, 1), (1.0, 1.3, 0.7), (1.0, 0.8, 1.2), (2, 1, 1)])
@pytest.mark.parametrize("pp,num_micro", [(2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (12, 128)])
def test_zb_h1_bubble_is_the_papers(costs, pp, num_micro):
    """Replayed under F, B, W costs, the bubble is arXiv 2401.10241's (p-1)(T_F+T_B-T_W) over
    m(T_F+T_B+T_W) with m >= p where T_W <= T_F, T_B (the paper's setting), and
    (p-1)·max(T_F, T_B, T_F+T_B-T_W) over the same in general; 1F1B's is (p-1)/m with the same
    total backward."""
    f, b, w = costs
    zb = op_costs("zb-h1", f, b, w)
    measured = grid_bubble(schedule_grid("zb-h1", pp, num_micro, costs=zb), zb)
    assert measured == pytest.approx(theoretical_bubble("zb-h1", pp, num_micro, costs=zb))
    ofob = op_costs("1f1b", f, b, w)
    base = grid_bubble(schedule_grid("1f1b", pp, num_micro, costs=ofob), ofob)
    assert base == pytest.approx((pp - 1) / num_micro)
    if w <= min(f, b):
        assert measured == pytest.approx((pp - 1) * (f + b - w) / (num_micro * (f + b + w)))
    if costs == (1, 1, 1):
        assert measured == pytest.approx(base / 3)  # <= 0.4x 1F1B's at equal pass times


# ---- the split backward ------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_split_backward_equals_autograd(recompute):
    """B for every micro-batch, then W for each: the same gradients as one backward per
    micro-batch, bit for bit (the same matmuls; the tied embedding's two parts added in the
    same order), with the linear layers' weight gradients absent until W."""
    shape = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    ref, model = build_model(shape, 1), build_model(shape, 1)
    batches = [torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    for m in (ref, model):
        m.set_activation_checkpointing(recompute)
    for ids in batches:
        ref(ids[:, :-1], ids[:, 1:]).backward()
    store, params = WeightGradStore(), list(model.parameters())
    with DeferWeightGrads(store):
        for i, ids in enumerate(batches):
            backward_input(model(ids[:, :-1], ids[:, 1:]), None, None, params, store, (0, i))
    assert store.pending() == 3 and all(p.grad is None for p in params)
    for i in range(3):
        store.run((0, i))
    assert store.pending() == 0
    for (n, a), b in zip(ref.named_parameters(), params):
        assert torch.equal(a.grad, b.grad), n


# ---- refused combinations ----------------------------------------------------------------------

def _cfg(parallel: dict) -> Config:
    return Config.from_dict({"model": {"preset": "tiny", "vocab_size": 256},
                             "parallel": parallel,
                             "train": {"micro_batch_size": 1, "global_batch_size": 8,
                                       "train_iters": 1}})


@pytest.mark.parametrize("parallel,world,message", [
    ({"pp": 2, "pp_schedule": "zb-h1", "zero_stage": 3}, 4,
     "zb-h1 does not compose with parallel.zero_stage=3"),
    ({"pp": 1, "pp_schedule": "zb-h1", "zero_stage": 3}, 2,
     "zb-h1 does not compose with parallel.zero_stage=3"),
    ({"pp": 2, "pp_schedule": "zb-h1", "num_virtual_stages": 2}, 2,
     "zb-h1 runs one model chunk per rank"),
])
def test_refused_combinations(parallel, world, message):
    with pytest.raises(UserError, match=message):
        validate(_cfg(parallel), world)


def test_compile_refused():
    cfg = _cfg({"pp": 2, "pp_schedule": "zb-h1"})
    cfg.train.compile = True
    with pytest.raises(UserError, match="zb-h1 with train.compile=true would defer nothing"):
        validate(cfg, 2)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_accepted_combinations(zero):
    run = validate(_cfg({"pp": 2, "tp": 2, "pp_schedule": "zb-h1", "zero_stage": zero,
                         "sequence_parallel": True}), 8)
    assert run.layout == ParallelLayout(tp=2, pp=2, dp=2, zero_stage=zero, schedule="zb-h1",
                                        sequence_parallel=True)


# ---- training against the single-process reference ---------------------------------------------
# Engine-less (torch AdamW on .grad, as tests/parallel/test_pipeline.py): the gradients themselves are
# compared, with test_pipeline's tolerances; zb-h1 and 1F1B run side by side in the same spawn.

STEPS = 3
WORLDS = {
    2: {"pp2-zb": tp.make_case(2, 1, "zb-h1", "type:transformer|embedding", recompute="full",
                           steps=STEPS, timeline=True),
        "pp2-1f1b": tp.make_case(2, 1, "1f1b", "type:transformer|embedding", recompute="full",
                             steps=STEPS)},
    4: {"pp4-zb": tp.make_case(4, 1, "zb-h1", "2,2,2,2", steps=STEPS),
        "pp4-1f1b": tp.make_case(4, 1, "1f1b", "2,2,2,2", steps=STEPS),
        "pp2tp2sp-zb": tp.make_case(2, 2, "zb-h1", sp=True, steps=STEPS),
        "pp2tp2sp-1f1b": tp.make_case(2, 2, "1f1b", sp=True, steps=STEPS)},
    8: {"pp4tp2-zb": tp.make_case(4, 2, "zb-h1", "type:transformer|embedding", steps=STEPS)},
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zb")


@pytest.fixture(scope="module")
def spawn(run_dir):
    runs = {}

    def get(world):
        if world not in runs:
            runs[world] = run_ranks(world, tp.rank_main, WORLDS[world], str(run_dir / str(world)),
                                    False)
        return runs[world]
    return get


def test_zb_h1_timeline_file_and_cli(spawn, run_dir, capsys):
    """The timeline records W as compute, in the op list's order, and the CLI draws it."""
    spawn(2)
    folder = run_dir / "2"
    data = json.loads((folder / "pipeline_timeline" / f"step_{STEPS - 1}_rank_0.json").read_text())
    assert data["schedule"] == "zb-h1"
    kinds = [(e["kind"], e["micro_batch"]) for e in data["events"] if e["kind"] in "FBW"]
    assert kinds == [(op.kind, op.micro_batch) for op in SCHEDULES["zb-h1"](2, 0, 8)]
    summary = summarize(data)
    busy = sum(e["end"] - e["start"] for e in data["events"] if e["kind"] in "FBW")
    assert summary["compute"] == pytest.approx(busy) and summary["theory"] == pytest.approx(1 / 24)
    assert cli.main(["pipeline-timeline", str(folder), "--width", "160"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("stage ") and "|" in line]
    assert len(rows) == 2 and "W0" in rows[0] and "W7" in rows[1]
    assert "W<mb> of the weights" in out and "theory (p-1)/(3m) = 0.042" in out


@pytest.mark.parametrize("world", sorted(WORLDS), ids=lambda w: f"world{w}")
def test_zb_h1_gradients_match_single_process_and_1f1b(spawn, world):
    ranks = spawn(world)
    for name, case in WORLDS[world].items():
        ref = tp.reference(tp.case_shape(case), STEPS)
        for r in ranks:
            assert r[name]["losses"] == pytest.approx(ref["losses"], abs=tp.TRAIN_LOSS_ATOL)
        for step, (atol, rtol) in ((0, (tp.GRAD_ATOL, tp.GRAD_RTOL)),
                                   (STEPS - 1, (tp.LAST_GRAD_ATOL, tp.LAST_GRAD_RTOL))):
            merged, tied = tp.merge_grads(ranks, name, step)
            assert merged.keys() == ref["grads"][step].keys()
            for n, g in ref["grads"][step].items():
                torch.testing.assert_close(merged[n], g, atol=atol, rtol=rtol,
                                           msg=lambda m, n=n: f"{name} step {step} {n}: {m}")
            assert len(tied) == 1 and torch.equal(*tied[0]), name
            twin = name.replace("-zb", "-1f1b")
            if twin != name and twin in WORLDS[world]:
                # Against 1F1B on the same ranks: the same matmuls, the weight gradients only
                # summed later; equal to the reference tolerance, in practice to the last bits.
                other, _ = tp.merge_grads(ranks, twin, step)
                for n, g in other.items():
                    torch.testing.assert_close(merged[n], g, atol=atol, rtol=rtol)
        for r in ranks:
            assert r[name]["eval_loss"] == pytest.approx(ref["eval_loss"],
                                                         abs=tp.TRAIN_LOSS_ATOL)


@pytest.mark.parametrize("world", sorted(WORLDS), ids=lambda w: f"world{w}")
def test_zb_h1_messages_match_by_order_alone(spawn, world):
    ranks = spawn(world)
    for name in WORLDS[world]:
        sent, received = {}, {}
        for r in ranks:
            me = r[name]["rank"]
            for kind, peer, tag, shape in r[name]["p2p"]:
                log = sent if kind == "send" else received
                log.setdefault((me, peer) if kind == "send" else (peer, me), []).append(
                    (tag, shape))
        assert sent and sent == received, name


# ---- the trainer, with ZeRO, against the plain reference loop ------------------------------------
# tests/system/test_train_reference.py's check: bf16 with its tolerances; fp32 with
# tests/system/test_train_parallel.py's (only summation orders differ).

TRAINER_CASES = {
    2: {"pp2-zb-bf16": dict(parallel={"pp": 2, "pp_schedule": "zb-h1",
                                      "pp_partition": "uniform"})},
    4: {"pp2.dp2-z1-zb-bf16": dict(parallel={"pp": 2, "zero_stage": 1, "pp_schedule": "zb-h1",
                                             "pp_partition": "uniform"}),
        "pp2.dp2-z2-zb-fp32": dict(parallel={"pp": 2, "zero_stage": 2, "pp_schedule": "zb-h1",
                                             "pp_partition": "uniform"}, precision="fp32")},
    8: {"tp2.pp2.dp2-z2-zb-bf16": dict(parallel={"tp": 2, "pp": 2, "zero_stage": 2,
                                                 "pp_schedule": "zb-h1",
                                                 "pp_partition": "uniform"})},
}


def _trainer_worker(rank, world, dataset, tmp):
    out = {}
    for name, case in TRAINER_CASES[world].items():
        res = Trainer(case_cfg(dataset, f"{tmp}/{name}", case), log=lambda *a: None).run()
        out[name] = {"losses": res.losses, "eval_loss": res.eval_loss,
                     "checkpoint": res.checkpoint}
    return out


@pytest.fixture(scope="module")
def trainer_runs(dataset, tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"zbtrain{world}")
            cache[world] = (run_ranks(world, _trainer_worker, dataset, str(tmp)), tmp)
        return cache[world]
    return get


@pytest.mark.parametrize("world,name", [(w, n) for w in TRAINER_CASES for n in TRAINER_CASES[w]])
def test_trainer_matches_plain_loop(trainer_runs, dataset, tmp_path, world, name):
    ranks, tmp = trainer_runs(world)
    cfg = case_cfg(dataset, tmp_path, TRAINER_CASES[world][name])
    ref = reference_train(cfg)
    got = ranks[0][name]
    for r in ranks:
        assert r[name]["losses"] == got["losses"]
    state = checkpoint_states(got["checkpoint"])
    assert state["model"].keys() == ref.master.keys()
    records = [r for r in metrics(Path(tmp) / name / "run") if "loss" in r]
    if cfg.train.precision == "fp32":
        np.testing.assert_allclose(got["losses"], ref.losses, rtol=LOSS_RTOL)
        for n, w in ref.master.items():
            torch.testing.assert_close(state["model"][n], w, rtol=0, atol=WEIGHT_ATOL)
        return
    tol = TOLERANCES[cfg.train.precision]
    np.testing.assert_allclose(got["losses"], ref.losses, rtol=tol["loss"])
    np.testing.assert_allclose([r["grad_norm"] for r in records], ref.grad_norms,
                               rtol=tol["norm"])
    init = initial_weights(cfg)
    motion = {n: w - init[n] for n, w in state["model"].items()}
    assert rel_l2(motion, {n: w - init[n] for n, w in ref.master.items()}) < tol["motion"]
    assert rel_l2(state["exp_avg"], ref.exp_avg) < tol["moments"]
    assert got["eval_loss"] == pytest.approx(reference_eval(cfg, state["model"]),
                                             rel=tol["eval"])


def _last_stage(shape, seed=3):
    from bloomtrain.parallel.pipeline import build_pipeline_chunks
    (chunk,) = build_pipeline_chunks(build_model(shape, seed), ParallelLayout(pp=2), 1)
    return chunk


def test_last_stage_lm_head_gradient_in_b_and_the_rest_in_w():
    """On the last stage the LM head's weight gradient is computed in B and handed over right
    after it (its input and vocab-wide output gradient are not held, nor a sum of several B's:
    accumulated in 16 bits, test_zb_h1_accumulates_the_lm_heads_gradient_in_fp32_as_1f1b); the
    other linears' wait for W. Every gradient equals autograd's of one backward per
    micro-batch."""
    shape = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    ref, chunk = _last_stage(shape), _last_stage(shape)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 16, 64, generator=g) for _ in range(3)]
    labels = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(3)]
    for x, y in zip(xs, labels):
        ref(x, y).backward()
    head = chunk.lm_head.weight
    store, params = WeightGradStore([head]), list(chunk.parameters())
    with DeferWeightGrads(store):
        for i, (x, y) in enumerate(zip(xs, labels)):
            inp = x.clone().requires_grad_()
            backward_input(chunk(inp, y), None, inp, params, store, (0, i))
            assert all(w is not head for w, *_ in store.linears[(0, i)])
            assert store.running[id(head)][0] is head
            store.hand_running()  # as the runtime does after each B
            assert not store.running
    # Every B's head gradient is in; no W has run yet.
    torch.testing.assert_close(head.grad, ref.lm_head.weight.grad, rtol=1e-6, atol=1e-7)
    for i in range(3):
        store.run((0, i))
    assert store.pending() == 0
    for (n, a), b in zip(ref.named_parameters(), params):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_w_makes_one_weight_gradient_at_a_time():
    """W runs each deferred matmul as its own autograd node: measured by bench/memtrack, the
    memory other than parameters and their gradients never exceeds what B left plus the
    largest single weight gradient, and what B left is gone after W (handing the stage's
    weight gradients to autograd at once would hold all of them beside the store)."""
    from bench.memtrack import LiveMemory
    shape = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    chunk = _last_stage(shape)
    params = list(chunk.parameters())
    store = WeightGradStore([chunk.lm_head.weight])
    x = torch.randn(2, 16, 64, requires_grad=True)
    with DeferWeightGrads(store):
        backward_input(chunk(x, torch.randint(0, 256, (2, 16))), None, x, params, store, (0, 0))
    held = {id(t.untyped_storage()): t.untyped_storage().nbytes()
            for _, _, *ts in store.linears[(0, 0)] for t in ts}
    running = sum(g.untyped_storage().nbytes() for _, g in store.running.values())
    mem = LiveMemory()
    mem.watch_parameters(chunk)
    mem.close_grad_window(chunk)
    mem.register([t for _, _, *ts in store.linears[(0, 0)] for t in ts], "temporaries")
    mem.register([g for _, g in store.running.values()], "gradients")
    with mem:
        store.run((0, 0))
    def largest(dim):
        return max(p.numel() * p.element_size() for p in params if p.dim() == dim)
    everything = sum(p.numel() * p.element_size() for p in params)
    assert everything > 3 * largest(2)
    # The first node's weight and bias gradients, before it releases its input and output
    # gradient and autograd takes them.
    assert (mem.report()["category_peaks"]["temporaries"]
            <= sum(held.values()) + largest(2) + largest(1))
    assert mem.current()["temporaries"] == 0 and running > 0


def test_deferring_linear_outside_b_is_an_ordinary_backward():
    """Under the mode but outside a B (the first stage's fused B and W), a backward leaves
    nothing in the store and gives autograd's gradients."""
    torch.manual_seed(0)
    ref, lin = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 8)
    ref(x).square().sum().backward()
    store = WeightGradStore()
    with DeferWeightGrads(store):
        lin(x).square().sum().backward()
    assert store.pending() == 0
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


# ---- memory --------------------------------------------------------------------------------------

def _memory_worker(rank, world):
    from bench.zb_bubble import MEM_MBS, MEM_SEQ, MEM_SHAPE, NUM_MICRO, stage_peaks
    from bloomtrain.topology import Topology
    return stage_peaks(Topology.build(tp=1, pp=world), MEM_SHAPE, MEM_SEQ, MEM_MBS, NUM_MICRO)


def _pending_sends_worker(rank, world):
    from bloomtrain.parallel.pipeline import build_pipeline_chunks, runtime
    from bloomtrain.topology import Topology
    topo = Topology.build(tp=1, pp=world)
    chunks = build_pipeline_chunks(build_model(tp.SHAPE, 0), ParallelLayout(pp=world),
                                   topo.pp_rank)
    g = torch.Generator().manual_seed(0)
    batches = [dict(tokens=ids[:, :-1], labels=ids[:, 1:])
               for ids in (torch.randint(0, 256, (1, 17), generator=g) for _ in range(8))]
    seen = {}
    finish = runtime._P2P.finish

    def counting_finish(self):
        seen[name] = len(self.pending_sends)
        finish(self)
    runtime._P2P.finish = counting_finish
    try:
        for name in ("1f1b", "zb-h1"):
            runtime.pipeline_train_step(name, chunks, batches, topo,
                                        recv_shape=(1, 16, tp.SHAPE.hidden_size), timeout=60.0)
    finally:
        runtime._P2P.finish = finish
    return seen


def test_sends_are_freed_once_the_peer_shows_it_received_them():
    """Gloo reports a send complete only when it is waited for, so without more every sent
    activation and gradient would live to the end of the step. A message from the peer's op k
    shows that the peer received what its ops up to k consumed; those sends are waited for and
    dropped. pp=2, 8 micro-batches, both schedules: the first stage's last message comes from
    the last stage's B7, after it consumed every activation, so none of its 8 sends is left at
    the end of the step; the last stage's comes from the first stage's F7, which precedes only
    its B6 and B7, so at most those two gradients are (without this, all 8 would be)."""
    first, last = run_ranks(2, _pending_sends_worker)
    assert first == {"1f1b": 0, "zb-h1": 0}
    assert last.keys() == first.keys() and all(n <= 2 for n in last.values())


def test_first_stage_holds_exactly_1f1b_memory():
    """Measured by bench/memtrack on bench/zb_bubble.py's memory run (live bytes other than
    parameters and their gradients, pp=4, 8 micro-batches, fp32 without dropout, where a held
    W store is nearly a micro-batch's activations): the first stage, whose op list is 1F1B's
    with each W right after its B and which runs both as one backward, peaks at exactly 1F1B's
    bytes; the others hold their W back, so each holds more than under 1F1B, but none more than
    1F1B's largest stage, its first (ZB-H1's bound, arXiv 2401.10241 §3.1)."""
    peaks = run_ranks(4, _memory_worker)
    assert peaks[0]["zb-h1"] == peaks[0]["1f1b"]
    largest = max(p["1f1b"] for p in peaks)
    assert largest == peaks[0]["1f1b"]
    for p in peaks[1:]:
        assert p["1f1b"] < p["zb-h1"] <= largest


# ---- 16-bit training: every gradient accumulated in fp32, micro-batch by micro-batch --------
def _accumulators_rank(rank, world, precision, num_micro):
    """Each schedule's fp32 gradient accumulators after one step's backward (before any
    reduction), and the masters after the step."""
    from bloomtrain.parallel.pipeline import pipeline_train_step
    from bloomtrain.topology import Topology
    from tests import helpers
    base = Topology.build(tp=1, pp=world)
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        cfg = helpers.config(tp.SHAPE, precision=precision, seed=tp.SEED,
                             parallel={"pp": world, "pp_schedule": schedule,
                                       "pp_partition": "uniform"},
                             micro_batch_size=1, global_batch_size=num_micro)
        topo = helpers.topology(cfg, base)
        parts = helpers.build(cfg, topo)
        parts.optimizer.zero_grad()
        pipeline_train_step(schedule, parts.chunks, tp.micro_batches(0, num_micro), topo,
                            scale_loss=parts.optimizer.scale_loss,
                            recv_shape=(1, tp.SEQ, tp.SHAPE.hidden_size),
                            dtype=parts.engine.compute_dtype, timeout=60)
        grads = parts.engine.bufs.grad.clone()
        parts.engine.reduce_gradients()
        parts.optimizer.clip_grad_norm()
        parts.optimizer.step(1e-3)
        out[schedule] = (grads, parts.engine.bufs.master.clone())
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zb_h1_accumulates_the_lm_heads_gradient_in_fp32_as_1f1b(precision):
    # The last stage's LM head computes its weight gradient in B. Kept as one running sum until
    # the next W, the first pp micro-batches' gradients were added in bf16/fp16 (its fp16 sum
    # could overflow where 1F1B's did not); handed over after each B, the fp32 accumulator
    # gets each micro-batch's as 1F1B gives it: the same bits. (In fp32 the running sum was
    # exact too, which is why the fp32 parity tests did not see it.)
    for ranks in run_ranks(2, _accumulators_rank, precision, 8):
        for kept, name in ((0, "accumulated gradients"), (1, "masters after the step")):
            assert torch.equal(ranks["zb-h1"][kept], ranks["1f1b"][kept]), name


@pytest.mark.parametrize("pp,num_micro", [(4, 2), (8, 2), (8, 4), (4, 1)])
def test_zb_h1_bubble_with_fewer_micro_batches_than_stages_is_the_replays(pp, num_micro):
    """With m < p the closed form under-counts the bubble (0.50 against 0.83 at p=4, m=2), and
    the planner, which uses theoretical_bubble, ranked such zb-h1 layouts above better ones."""
    zb = op_costs("zb-h1")
    measured = grid_bubble(schedule_grid("zb-h1", pp, num_micro, costs=zb), zb)
    assert theoretical_bubble("zb-h1", pp, num_micro) == pytest.approx(measured)
    assert measured > (pp - 1) / (3 * num_micro)
