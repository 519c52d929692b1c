"""`train.compile`: every transformer block's forward compiled (bloomtrain.parallel.compile), through
the trainer, against the same trainer eager: bf16 as the trainer trains, under tp (with comm
counts), pp and ZeRO stages 0-3, with full and selective activation checkpointing; and the blocks
really are compiled, once, with no recompilation after the first step.

One spawn runs every two-rank layout (each eager, then compiled, in the same processes, so later
layouts with the same block shapes reuse the compiled code); one process covers ZeRO-0 and
checkpointing. Compiling dominates the time: keep the model at 2 blocks and 4 steps.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from bloomtrain.model import build_model
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.compile import compile_blocks, is_compiled
from bloomtrain.train import Trainer
from tests.dist import run_ranks
from tests.helpers import make_cfg, metrics

STEPS = 4
MODEL = {"preset": None, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256}

# bf16 keeps 8 mantissa bits (relative rounding up to 2^-9 = 2e-3 per element). Inductor fuses
# LayerNorm, bias-GeLU, bias-dropout-add and the attention softmax and rounds their fp32
# intermediates to bf16 once, where eager rounds after every op, so activations differ by a few
# bf16 ulps; the loss averages them over 8 x 32 tokens. Measured: compiled and eager losses
# within 1.1e-5 relative over 4 steps in every layout, grad norms within 2.4e-4; both bounds are
# about 10x that. The loss moves 1% over the 4 steps, so a wrong gradient direction (a lost tp
# all-reduce, a stale ZeRO-3 gather) bends it by far more than 1e-4; AdamW hides a wrong
# gradient scale from the loss, not from the grad norm.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 3e-3

LAYOUTS = {
    "tp2-z1": {"tp": 2, "zero_stage": 1},
    "pp2-z2": {"pp": 2, "zero_stage": 2, "pp_schedule": "1f1b", "pp_partition": "uniform"},
    "dp2-z3": {"zero_stage": 3},
}


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _run(dataset, tmp: Path, name: str, compiled: bool, parallel: dict, **over) -> dict:
    """One trainer run. `graphs`: Dynamo graphs compiled in this process by the end of each step
    (a recompilation adds one)."""
    over = {"model": MODEL, "train__train_iters": STEPS, **over}
    cfg = make_cfg(dataset, tmp / name, parallel=parallel, train__precision="bf16",
                   train__compile=compiled, **over)
    trainer = Trainer(cfg, log=lambda *a: None)
    blocks = [b for c in trainer.parts.chunks for b in c.transformer.h.values()]
    graphs, step = [], trainer.train_step

    def counted(micro_batches):
        out = step(micro_batches)
        graphs.append(_graphs())
        return out
    trainer.train_step = counted
    before = _graphs()
    res = trainer.run()
    recs = [r for r in metrics(cfg.run_dir) if "loss" in r] if trainer.is_logger else []
    return {"losses": res.losses, "eval_loss": res.eval_loss, "before": before,
            "graphs": graphs, "after": _graphs(), "compiled": [is_compiled(b) for b in blocks],
            "grad_norms": [r["grad_norm"] for r in recs], "comm": [r.get("comm") for r in recs]}


def _two_rank_worker(rank, world, dataset, tmp):
    out, tmp = {}, Path(tmp)
    for name, parallel in LAYOUTS.items():
        for compiled in (False, True):
            # tp2 also saves at step 2: the checkpoint writer's group, first used there, must
            # not recompile the blocks for steps 3 and 4.
            save = {"checkpoint": {"dir": str(tmp / f"ck-{compiled}"), "save_interval": 2,
                                   "async_save": False}} if name == "tp2-z1" else {}
            out[name, compiled] = _run(dataset, tmp, f"{name}-{compiled}", compiled, parallel,
                                       **save)
    # Communication counts under compile: with comm_stats on, the tp ops fall back to eager at
    # the (untraced) count, so every collective is still counted once.
    for compiled in (False, True):
        out["tp2-stats", compiled] = _run(dataset, tmp, f"stats-{compiled}", compiled,
                                          {"tp": 2, "comm_stats": True}, train__train_iters=1,
                                          data__split="100,0,0")
    return out


@pytest.fixture(scope="module")
def two_rank_runs(dataset, tmp_path_factory):
    return run_ranks(2, _two_rank_worker, dataset, str(tmp_path_factory.mktemp("compile2")))


def _check_parity(eager: dict, compiled: dict) -> None:
    assert len(compiled["losses"]) == len(eager["losses"]) == STEPS
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(compiled["grad_norms"], eager["grad_norms"], rtol=GRAD_NORM_RTOL)
    if eager["eval_loss"] is not None:
        np.testing.assert_allclose(compiled["eval_loss"], eager["eval_loss"], rtol=LOSS_RTOL)


def _check_compiled_once(run: dict, new_graphs: bool = True) -> None:
    assert run["compiled"] and all(run["compiled"])
    first, rest = run["graphs"][0], run["graphs"][1:]
    assert rest == [first] * len(rest)  # nothing recompiles after the first step
    assert (first > run["before"]) == new_graphs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_matches_eager_through_the_trainer(two_rank_runs, layout):
    for rank_runs in two_rank_runs:
        eager, compiled = rank_runs[layout, False], rank_runs[layout, True]
        assert eager["graphs"] == [eager["before"]] * STEPS and not any(eager["compiled"])
        # dp2-z3 runs blocks of pp2-z2's shapes (whole, not tp-split): it reuses their code.
        _check_compiled_once(compiled, new_graphs=layout != "dp2-z3")
        if rank_runs is two_rank_runs[0]:
            _check_parity(eager, compiled)


def test_comm_counts_under_compile_equal_eager(two_rank_runs):
    for rank_runs in two_rank_runs:
        eager, compiled = rank_runs["tp2-stats", False], rank_runs["tp2-stats", True]
        np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=LOSS_RTOL)
    counts = two_rank_runs[0]["tp2-stats", True]["comm"][0]
    assert counts == two_rank_runs[0]["tp2-stats", False]["comm"][0]
    assert counts["all_reduce/tp"]["calls"] > 0


def test_one_process_zero0_with_activation_checkpointing(dataset, tmp_path, one_thread):
    eager = _run(dataset, tmp_path, "eager", False, {"zero_stage": 0})
    runs = {mode: _run(dataset, tmp_path, mode, True, {"zero_stage": 0},
                       train__activation_checkpointing=mode)
            for mode in ("none", "full", "selective")}
    for mode, run in runs.items():
        _check_parity(eager, run)
        # full and selective wrap the same compiled block in a checkpoint (selective with its
        # op policy, model/recompute.py): no new graphs after none's.
        _check_compiled_once(run, new_graphs=mode == "none")
    # The recomputation replays the same compiled code: bitwise the same training.
    assert runs["full"]["losses"] == runs["none"]["losses"]
    assert runs["full"]["grad_norms"] == runs["none"]["grad_norms"]


# ---- one block, element by element -----------------------------------------------------------------

BLOCK_SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4,
                         ffn_hidden_size=256)


def _block_outputs(model, x, grad):
    """The block's output and the gradients of its input and of every parameter, in float64."""
    x = x.detach().clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    out = model.transformer.run_blocks(x, model.transformer.h)
    out.backward(grad)
    named = {"output": out, "input.grad": x.grad}
    named |= {f"{n}.grad": p.grad for n, p in model.transformer.h.named_parameters()}
    return {n: t.detach().double() for n, t in named.items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_compiled_block_is_as_accurate_as_eager_forward_and_backward(one_thread, dtype):
    """The fused path (train.compile: Inductor's LayerNorm, bias-GeLU and bias-dropout-add
    kernels) against the unfused one, element by element, forward and backward: the output, the
    input's gradient and each of the block's 12 parameter gradients. The reference is the same
    block in float64. In fp32 compiled and eager agree to a few ulps (1e-5 of each tensor's
    largest entry: the fused reductions sum in another order). In bf16 they round at different
    places (eager after every op, Inductor once per fused kernel), so neither is the other's
    reference: each tensor of the compiled block must be as close to float64 as eager's is, up
    to 1.5x, plus one bf16 ulp of the tensor's largest entry. Checked to fail: the compiled
    MLP's output scaled by 1.01 (both dtypes), and exact GeLU for the tanh approximation (fp32;
    in bf16 the two differ by less than an ulp)."""
    torch.manual_seed(0)
    base = build_model(BLOCK_SHAPE, seed=3)
    with torch.no_grad():  # biases and LayerNorms away from their init, so that each one counts
        for p in base.transformer.h.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    x = torch.randn(2, 24, BLOCK_SHAPE.hidden_size)
    grad = torch.randn(2, 24, BLOCK_SHAPE.hidden_size)
    ref = _block_outputs(copy.deepcopy(base).double(), x.double(), grad.double())
    low = torch.float32 if dtype == "fp32" else torch.bfloat16
    eager_model = copy.deepcopy(base).to(low)
    eager = _block_outputs(eager_model, x.to(low), grad.to(low))
    compiled_model = copy.deepcopy(base).to(low)
    assert compile_blocks([compiled_model]) == 1
    compiled = _block_outputs(compiled_model, x.to(low), grad.to(low))
    assert is_compiled(compiled_model.transformer.h[0])
    assert ref.keys() == eager.keys() == compiled.keys() and len(ref) == 14
    for name, r in ref.items():
        scale = r.abs().max().item()
        if dtype == "fp32":
            assert (compiled[name] - eager[name]).abs().max().item() <= 1e-5 * scale, name
        else:
            err_eager = (eager[name] - r).abs().max().item()
            err_compiled = (compiled[name] - r).abs().max().item()
            assert err_compiled <= 1.5 * err_eager + scale * 2 ** -8, (name, err_compiled,
                                                                        err_eager)


def test_inference_steps_through_compiled_blocks_compile_nothing(one_thread):
    """The harness scores packed rows (and generates) through the live model's blocks, whose
    packed length changes from call to call: each new length compiled the block again (up to
    Dynamo's limit of 8, after which the validation forward ran uncompiled). Inference steps
    run the blocks eagerly; the training-shaped validation forward still compiles once."""
    from bloomtrain.model.bloom import packed_attention

    model = build_model(BLOCK_SHAPE, seed=3)
    compile_blocks([model])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, BLOCK_SHAPE.vocab_size, (2, 17), generator=g)
    model.train()
    model(ids[:, :-1], labels=ids[:, 1:]).backward()
    before = _graphs()
    model.eval()
    eager = copy.deepcopy(model)
    for block in eager.transformer.h:
        del block.forward  # the class's forward again
    slopes = model.transformer.alibi_slopes
    with torch.no_grad():
        for lengths in ([5, 9, 1], [3, 3], [7, 2, 4], [1], [6, 6, 6], [2, 8], [4], [9, 9], [3]):
            seqs = torch.randint(0, BLOCK_SHAPE.vocab_size, (1, sum(lengths)), generator=g)
            meta = packed_attention(lengths, slopes, torch.float32)
            got = model.transformer(seqs, paged=meta)
            assert torch.equal(got, eager.transformer(seqs, paged=meta))
        assert _graphs() == before
        model(ids[:, :-1], labels=ids[:, 1:])  # validation: grad off, the training shape
    assert _graphs() == before + 1
