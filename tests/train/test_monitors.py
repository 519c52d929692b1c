"""The trainer's monitors (bloomtrain/train/monitors.py): the gradient analyser against plain
torch gradients and weights, and across layouts; per-rank peak memory; the straggler check with
one rank slowed down. One spawn per layout runs every multi-rank check; the asserts are here."""
from __future__ import annotations

import itertools
import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from bloomtrain.parallel.zero.grad_stats import GradStats
from bloomtrain.parallel.zero.waits import WaitClock
from bloomtrain.train import Trainer
from bloomtrain.train.monitors import find_straggler, flag_entries, flags_line
from tests.dist import run_ranks
from tests.reference import _batch, datasets, megatron_lr
from tests.helpers import make_cfg, metrics

# The reference loop and the one-process runs are tiny-tensor work: one intra-op thread.
pytestmark = pytest.mark.usefixtures("one_thread")

# fp32, same data and seed. The analyser sums the engine's flat fp32 gradients and weights in fp64
# per block; the reference sums torch's per-parameter tensors. They differ by the summation order
# of the matmuls, of the loss over micro-batches and (AdamW) of the fused vs single-tensor
# kernel: measured at most 1e-8 relative on the gradient norms and 2e-8 on the update ratios,
# whatever the layout (one process, tp2 x pp2, dp4 under ZeRO-3). 1e-6 leaves 50x for another
# BLAS. On CUDA the trainer's kernels (cuBLAS) differ from the CPU reference's by more.
RTOL = {"cpu": 1e-6, "cuda": 1e-5}

ENTRY = re.compile(r"^transformer\.h\.(\d+)\.")


def records(run_dir) -> list[dict]:
    return [r for r in metrics(run_dir) if "loss" in r]


# ---- an independent reference: plain torch -------------------------------------------------------

def _entry(name: str, num_layers: int) -> int:
    m = ENTRY.match(name)
    if m:
        return 1 + int(m.group(1))
    return num_layers + 1 if name.startswith("transformer.ln_f") else 0


def reference_grad_stats(cfg) -> list[dict]:
    """Per step, the gradient norm of every entry (embedding, each block, final LN) from the
    .grad of torch's own parameters after a plain loss.backward() per micro-batch (before
    clipping), and ||w_after - w_before|| / ||w_before|| around torch's AdamW step. fp32."""
    from bloomtrain.model import build_model, resolve_model_config
    t, o = cfg.train, cfg.optim
    assert t.precision == "fp32" and t.rampup_batch_size is None
    shape = resolve_model_config(cfg.model)
    model = build_model(shape, seed=t.seed)
    named = dict(model.named_parameters())  # the tied LM head appears once
    entries = {n: _entry(n, shape.num_layers) for n in named}
    num = shape.num_layers + 2
    opt = torch.optim.AdamW(
        [{"params": [p for p in named.values() if p.ndim >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    train_ds, _ = datasets(cfg)
    out, consumed = [], 0
    for _ in range(t.train_iters):
        num_micro = t.global_batch_size // t.micro_batch_size
        for k in range(num_micro):
            tokens, labels = _batch(train_ds, consumed + k * t.micro_batch_size,
                                    t.micro_batch_size)
            (model(tokens, labels=labels) / num_micro).backward()
        grad_sq = [0.0] * num
        for n, p in named.items():
            grad_sq[entries[n]] += p.grad.double().square().sum().item()
        torch.nn.utils.clip_grad_norm_(list(named.values()), o.clip_grad)
        before = {n: p.detach().clone() for n, p in named.items()}
        for group in opt.param_groups:
            group["lr"] = megatron_lr(consumed, o.lr, o.min_lr, o.warmup_samples,
                                      o.decay_samples, o.decay_style)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_sq, weight_sq = [0.0] * num, [0.0] * num
        for n, p in named.items():
            update_sq[entries[n]] += (p.detach() - before[n]).double().square().sum().item()
            weight_sq[entries[n]] += before[n].double().square().sum().item()
        out.append({"grad": [math.sqrt(g) for g in grad_sq],
                    "ratio": [math.sqrt(u / w) for u, w in zip(update_sq, weight_sq)]})
        consumed += t.global_batch_size
    return out


def assert_stats_close(got: dict, want: dict, rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got["block_grad_norm"]), torch.tensor(want["grad"]),
                               rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(got["block_update_ratio"]),
                               torch.tensor(want["ratio"]), rtol=rtol, atol=0)


def as_reference(grad_stats: dict) -> dict:
    return {"grad": grad_stats["block_grad_norm"], "ratio": grad_stats["block_update_ratio"]}


# ---- one process ---------------------------------------------------------------------------------

# Clip 0.05 clips every step: an analyser that took the norm after clipping would be off by the
# clip coefficient. A small bucket makes several segments per rank (an analysed step runs AdamW
# per segment, see below).
ONE = {"train__train_iters": 3, "optim__clip_grad": 0.05,
       "parallel": {"bucket_size_mb": 0.05}}


def _final_state(trainer) -> dict:
    return {k: v.cpu() for k, v in {**trainer.engine.master_state(),
                                    **trainer.engine.optim_state()}.items()}


@pytest.fixture(scope="module")
def one_process(dataset, tmp_path_factory, device):
    """Three runs of the same 3 steps: analyser off, every step, every step with the optimizer
    offloaded; (losses, final state, records, the model-state bytes) each."""
    runs = {}
    for name, interval, offload in (("off", 0, False), ("every", 1, False),
                                    ("offload", 1, True)):
        cfg = make_cfg(dataset, tmp_path_factory.mktemp(name), train__device=device.type,
                       train__grad_stats_interval=interval,
                       **{**ONE, "parallel": {**ONE["parallel"], "offload_optimizer": offload}})
        trainer = Trainer(cfg, log=lambda *a: None)
        assert len(trainer.engine.bufs.layout.segments) > 4
        losses = trainer.run().losses
        runs[name] = (losses, _final_state(trainer), records(cfg.run_dir),
                      trainer.engine.memory_report()["measured"]["total"])
    return runs


def test_grad_stats_match_plain_torch(one_process, dataset, tmp_path, device):
    _, _, recs, states = one_process["every"]
    want = reference_grad_stats(make_cfg(dataset, tmp_path, **ONE))
    assert [r["grad_stats"]["step"] for r in recs] == [1, 2, 3]
    for rec, ref in zip(recs, want):
        gs = rec["grad_stats"]
        assert gs["names"] == ["embedding", "block 0", "block 1", "block 2", "block 3",
                               "final_ln"]
        assert_stats_close(gs, ref, RTOL[device.type])
        # The entries partition the parameters the global norm counts (fp64 sums of the same
        # fp32 gradients in two orders).
        total = math.sqrt(sum(g * g for g in gs["block_grad_norm"]))
        assert total == pytest.approx(rec["grad_norm"], rel=1e-12)  # measured 2e-16
        assert gs["flagged"] == []
    for rec in recs:
        # Memory: the peak covers at least the model states the process holds.
        assert rec["mem_peak_rank"] == 0 and rec["mem_peak_bytes"] >= states
        if device.type == "cuda":
            assert rec["mem_kind"] == "cuda" and rec["mem_reserved_bytes"] >= rec["mem_peak_bytes"]
        else:
            assert rec["mem_kind"].startswith("rss") and "mem_reserved_bytes" not in rec
        # One rank: its own step time is the max and the median, and never a straggler.
        assert rec["step_time_max_s"] == rec["step_time_median_s"] == rec["step_time_s"]
        assert "straggler_rank" not in rec


def test_grad_stats_leave_training_unchanged(one_process, device):
    # An analysed step runs AdamW segment by segment, to copy only one segment's weights first;
    # torch's kernels treat each tensor on its own, so the bits are those of the one call.
    off, every, offload = (one_process[k] for k in ("off", "every", "offload"))
    if device.type == "cpu":
        assert every[0] == off[0]
        for k, v in off[1].items():
            assert torch.equal(every[1][k], v), k
    else:
        # CUDA's embedding backward adds with atomics: two identical runs already differ in the
        # last bits, which three steps leave far below the device tolerance.
        torch.testing.assert_close(torch.tensor(every[0]), torch.tensor(off[0]),
                                   rtol=RTOL["cuda"], atol=0)
        for k, v in off[1].items():
            torch.testing.assert_close(every[1][k], v, rtol=RTOL["cuda"], atol=1e-7)
    assert all("grad_stats" not in r for r in off[2])
    # Offloaded, the update runs on the host (segment by segment anyway) and is analysed there:
    # the same bits on a CPU; on CUDA the host's AdamW kernel against the device's.
    for a, b in zip(every[2], offload[2]):
        assert_stats_close(b["grad_stats"], as_reference(a["grad_stats"]),
                           0 if device.type == "cpu" else RTOL["cuda"])


def test_overflow_is_flagged_exploding(dataset, tmp_path):
    # fp16 with a loss scale of 2^40: every gradient overflows and the step is skipped; the
    # analyser still runs (before the skip zeroes the gradients) and says where.
    cfg = make_cfg(dataset, tmp_path, train__precision="fp16", train__train_iters=1,
                   train__grad_stats_interval=1, optim__initial_loss_scale=2.0 ** 40)
    lines = []
    Trainer(cfg, log=lambda *a: lines.append(" ".join(map(str, a)))).run()
    rec = records(cfg.run_dir)[0]
    assert rec["skipped"] is True
    gs = rec["grad_stats"]
    flagged = {f["entry"] for f in gs["flagged"] if f["kind"] == "exploding"}
    non_finite = {n for n, g in zip(gs["names"], gs["block_grad_norm"]) if not math.isfinite(g)}
    assert non_finite and flagged >= non_finite
    assert gs["block_update_ratio"] == [0.0] * len(gs["names"])  # nothing was applied
    assert any(line.startswith("[train] grad stats: step 1: ") and "exploding" in line
               for line in lines)
    assert any(a.startswith("grad stats: step 1: ") for a in rec["alerts"])


def test_flags_and_straggler_rules():
    stats = GradStats(["embedding", "block 0", "block 1", "block 2", "final_ln"],
                      [0.5, 0.4, 52.1, 3e-9, 0.3], [1e-3] * 5)
    flags = flag_entries(stats)
    assert [(f["entry"], f["kind"]) for f in flags] == [("block 1", "exploding"),
                                                       ("block 2", "vanishing")]
    assert flags[0]["median"] == 0.4
    assert flags_line(7, flags[:1]) == ("[train] grad stats: step 7: block 1 exploding (norm "
                                        "52.1 vs median 0.4)")
    nan = GradStats(["embedding", "block 0"], [float("nan"), 1.0], [0.0, 0.0])
    assert [f["entry"] for f in flag_entries(nan)] == ["embedding"]
    assert find_straggler([1.0, 1.1, 0.9, 1.45], 1.2) == (3, pytest.approx(1.45 / 1.05))
    assert find_straggler([1.0, 1.1, 0.9, 1.1], 1.2) is None
    assert find_straggler([0.0, 0.0], 1.2) is None


def test_wait_clock_counts_only_inside(device):
    clock = WaitClock(device)
    x = torch.randn(256, 256, device=device)
    with clock.waiting():
        for _ in range(20):
            x = x @ x.T / 256
    inside = clock.take()
    assert inside > 0 and clock.take() == 0.0
    x = x @ x.T  # outside: not counted
    assert clock.take() == 0.0


# ---- several ranks -------------------------------------------------------------------------------

SLOW_RANK = 3
HOG_RANK = 2
HOG_BYTES = 512 * 2 ** 20
# Slow rank: each step of the last interval it first sleeps this many times its own step
# period measured before (so the slowdown dominates whatever the machine's load makes of the
# steps), before its first collective, as a slow disk or data loader would.
SLOWDOWN = 4.0
# The slowed interval's ratio is about 1 + SLOWDOWN; the balanced intervals stay far below
# this factor however unevenly a loaded machine shares its cores among the ranks.
FACTOR = 2.5


def _worker(rank, world, dataset, tmp):
    """Two runs on 4 ranks: tp2 x pp2 (3 steps, every step analysed), then dp4 under ZeRO-3
    (6 steps, records at 2, 4 and 6) with one rank holding extra memory through step 3 and
    another slowed down in steps 5 and 6. Rank 0 returns the records and the log."""
    tmp = Path(tmp)
    cfg = make_cfg(dataset, tmp / "tp2pp2", train__train_iters=3, train__grad_stats_interval=1,
                   parallel={"tp": 2, "pp": 2, "pp_partition": "uniform"})
    Trainer(cfg, log=lambda *a: None).run()
    out = {"tp2pp2": records(cfg.run_dir) if rank == 0 else None}

    cfg = make_cfg(dataset, tmp / "dp4", train__train_iters=6, train__log_interval=2,
                   train__micro_batch_size=2, train__grad_stats_interval=2,
                   train__straggler_factor=FACTOR, parallel={"zero_stage": 3})
    lines = []
    trainer = Trainer(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    fetch, calls = trainer.data.next_batch, []

    def next_batch():
        # Called inside the timed step, before any collective of it.
        calls.append(time.perf_counter())
        if rank == SLOW_RANK and trainer.state.step + 1 >= 5:
            # The periods of steps 2-4 (step 1 warms up).
            period = statistics.median(b - a for a, b in itertools.pairwise(calls[1:5]))
            time.sleep(SLOWDOWN * period)
        return fetch()
    trainer.data.next_batch = next_batch
    should_stop, held = trainer.control.should_stop, []

    def hog_then_should_stop():
        # Between steps, after the step's record: the memory is held through step 3 only, and
        # its allocation is outside any rank's timed step (the others wait for it in the stop
        # flag's all-reduce), so it makes no straggler.
        if rank == HOG_RANK and trainer.state.step == 2:
            held.append(torch.ones(HOG_BYTES // 4))  # touched, so resident
        elif held:
            held.clear()
        return should_stop()
    trainer.control.should_stop = hog_then_should_stop
    trainer.run()
    out["dp4"] = (records(cfg.run_dir), lines) if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def four_ranks(dataset, tmp_path_factory):
    # fresh: the memory test compares per-rank peak RSS, so every rank must start from the same
    # resident size, not one a pool worker's earlier tests left.
    return run_ranks(4, _worker, dataset, str(tmp_path_factory.mktemp("four")), fresh=True)[0]


@pytest.fixture(scope="module")
def dp_run(four_ranks):
    return four_ranks["dp4"]


def test_straggler_named_only_when_slowed(dp_run):
    recs, lines = dp_run
    assert [r["step"] for r in recs] == [2, 4, 6]
    for rec in recs[:2]:  # balanced
        assert "straggler_rank" not in rec
        assert rec["step_time_max_s"] >= rec["step_time_median_s"] > 0
    slowed = recs[2]
    assert slowed["straggler_rank"] == SLOW_RANK and slowed["straggler_ratio"] > FACTOR
    # dp = 4, tp = pp = 1: rank 3 is dp rank 3.
    named = [l for l in lines if l.startswith("[train] straggler: ")]
    assert len(named) == 1
    assert named[0].startswith(f"[train] straggler: rank {SLOW_RANK} (pp 0, dp 3, tp 0) ")
    assert any(a.startswith(f"straggler: rank {SLOW_RANK} ") for a in slowed["alerts"])


def test_memory_peak_per_interval_and_rank(dp_run):
    recs, _ = dp_run
    _, hog, after = recs
    # Steps 3-4: rank 2 held 512 MiB more than any other rank; steps 5-6 it did not, and the
    # peak was reset in between.
    assert hog["mem_peak_rank"] == HOG_RANK
    assert hog["mem_peak_bytes"] - after["mem_peak_bytes"] > 0.9 * HOG_BYTES
    assert all(r["mem_kind"].startswith("rss") for r in recs)


def test_grad_stats_dp4_zero3_match_one_process(dp_run, dataset, tmp_path):
    # dp = 4 under ZeRO-3: every rank holds a quarter of each segment's gradients and weights.
    recs, _ = dp_run
    want = reference_grad_stats(make_cfg(dataset, tmp_path, train__train_iters=6,
                                         train__micro_batch_size=2))
    assert [r["grad_stats"]["step"] for r in recs] == [2, 4, 6]
    for rec in recs:
        assert_stats_close(rec["grad_stats"], want[rec["step"] - 1], RTOL["cpu"])


def test_grad_stats_tp2_pp2_match_one_process(four_ranks, dataset, tmp_path):
    # tp = 2 x pp = 2: tp-replicated parameters (LayerNorms, row-parallel biases) counted once,
    # the last stage's copy of the tied embedding not at all.
    recs = four_ranks["tp2pp2"]
    want = reference_grad_stats(make_cfg(dataset, tmp_path, train__train_iters=3))
    assert [r["grad_stats"]["step"] for r in recs] == [1, 2, 3]
    for rec, ref in zip(recs, want):
        assert_stats_close(rec["grad_stats"], ref, RTOL["cpu"])
