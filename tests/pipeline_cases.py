"""What every rank of the pipeline tests runs (tests/parallel/test_pipeline.py, tests/parallel/test_pipeline_zb.py):
the tiny model, its micro-batches, a case (pp, tp, schedule, partition...) trained for some steps
with torch's AdamW on the pipeline's gradients, the single-process reference it is compared
with, the tolerances of that comparison and why, and the gradient merge across stages."""
from __future__ import annotations

import torch

from bloomtrain.layout import ParallelLayout
from bloomtrain.model import BloomShape, build_model
from bloomtrain.model.params import logical_name
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline import (PipelineCommError, Timeline, build_pipeline_chunks,
                                          pipeline_eval_step, pipeline_train_step)
from bloomtrain.topology import Topology
from tests import helpers


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


def micro_batches(step: int, num_micro: int = NUM_MICRO) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(num_micro):
        ids = torch.randint(0, SHAPE.vocab_size, (MBS, SEQ + 1), generator=g)
        loss_mask = torch.ones(MBS, SEQ)
        if i % 3 == 0:
            loss_mask[0, : 3 + i] = 0.0  # masked prompts of different lengths
        out.append(dict(tokens=ids[:, :-1], labels=ids[:, 1:], loss_mask=loss_mask))
    return out


def reference(shape: BloomShape, num_steps: int) -> dict:
    """One process, gradient accumulation over the micro-batches: the mean of the micro-batch
    losses, each backpropagated divided by their number."""
    model = build_model(shape, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], {}
    for step in range(num_steps):
        opt.zero_grad(set_to_none=True)
        batches = micro_batches(step)
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
        batches = micro_batches(0)
        eval_loss = sum(model(b["tokens"], b["labels"], b["loss_mask"]).item()
                        for b in batches) / len(batches)
    return dict(losses=losses, grads=grads, eval_loss=eval_loss)


def case_shape(case) -> BloomShape:
    return SHAPE8 if case["pp"] * case["v"] > 4 or case["pp"] == 4 else SHAPE


def case_config(case):
    return helpers.config(
        case_shape(case), precision="fp32", seed=SEED,
        activation_checkpointing=case.get("recompute", "none"),
        parallel={"tp": case["tp"], "pp": case["pp"], "sequence_parallel": case["sp"],
                  "pp_schedule": case["schedule"], "num_virtual_stages": case["v"],
                  "pp_partition": case["partition"]})


def train_case(case, base, tmp_dir):
    # TP and PP composed by parallelize, without the ZeRO engine: this test drives torch's AdamW
    # on the parameters' .grad, so it sees the pipeline's gradients as they come out of backward.
    cfg = case_config(case)
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
        loss = pipeline_train_step(case["schedule"], chunks, micro_batches(step), topo,
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
        out["eval_loss"] = pipeline_eval_step(case["schedule"], chunks, micro_batches(0), topo,
                                              recv_shape=recv_shape, timeout=TIMEOUT)
    return out


def freeing_check(topo):
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
    loss = pipeline_train_step("1f1b", chunks, micro_batches(0, 4), topo,
                               recv_shape=(MBS, SEQ, SHAPE.hidden_size), timeout=TIMEOUT)
    grads = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    return dict(loss=loss, seen_at_forward=seen_at_forward, grads=grads,
                final=[(tuple(o.shape), o.untyped_storage().nbytes(), o.grad_fn is not None)
                       for o in outputs])


def mismatch_check(topo):
    """Stage 0 runs two micro-batches and stage 1 three: both must fail fast, naming what they
    waited for, instead of hanging."""
    num_micro = 2 if topo.pp_rank == 0 else 3
    chunks = build_pipeline_chunks(build_model(SHAPE, SEED),
                                   ParallelLayout(pp=2, partition="uniform"), topo.pp_rank)
    try:
        pipeline_train_step("1f1b", chunks, micro_batches(0, num_micro), topo,
                            recv_shape=(MBS, SEQ, SHAPE.hidden_size), timeout=2.0)
    except PipelineCommError as e:
        return str(e)
    return None


def rank_main(rank, world_size, cases, tmp_dir, extra_checks):
    topos, results = {}, {}
    for name, case in cases.items():
        key = (case["tp"], case["pp"])
        if key not in topos:  # process groups of these sizes, built once
            topos[key] = Topology.build(tp=case["tp"], pp=case["pp"])
        results[name] = train_case(case, topos[key], tmp_dir)
    if extra_checks:
        topo = topos[(1, 2)]
        results["freeing"] = freeing_check(topo)
        results["mismatch"] = mismatch_check(topo)  # last: it leaves unmatched messages behind
    return results


def make_case(pp, tp, schedule, partition="uniform", sp=False, steps=NUM_STEPS, **kw):
    v = 2 if schedule == "interleaved" else 1
    return dict(pp=pp, tp=tp, schedule=schedule, v=v, partition=partition, sp=sp, steps=steps, **kw)


def merge_grads(ranks, name, step):
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
