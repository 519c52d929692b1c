"""The planner (bloomtrain.planner) against what our engine really allocates, stores and sends, and
against BLOOM-176B's own published figures.

References, each independent of the planner's arithmetic:
- model states: the ZeRO engine's flat buffers (`memory_report`), built through `parallelize` for
  every pipeline rank of each layout (on the meta device: the sizes are the real allocation's);
- activations: the live storages left by a forward (bench/memtrack.py's LiveMemory, a dispatch
  mode that knows nothing of formulas), one process and tp=2 (+ sequence parallelism);
- communication: comm's own counters over a real training step on 4 gloo ranks;
- step time: bench/planner_steptime.py (wall time is a benchmark's, not a test's); here its
  calibration arithmetic at one round;
- BLOOM-176B: the logged 149-150 TFLOP/s and the ~59-60 GB per GPU (bloom_facts.md §2).
"""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import bloomtrain
from bench.memtrack import LiveMemory
from bloomtrain.config import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model import BloomForCausalLM, alibi_slopes
from bloomtrain.model.presets import BloomShape, resolve_model_config
from bloomtrain.parallel import comm
from bloomtrain.planner import plan_for_run
from bloomtrain.planner import fit
from bloomtrain.planner.calibrate import calibrate_efficiency
from bloomtrain.planner.efficiency import A100
from bloomtrain.planner.evaluate import evaluate
from bloomtrain.planner.hardware import GPUS, Cluster
from bloomtrain.planner.memory import (ActivationSpec, chunk_activation_items, in_flight,
                                       stage_memory)
from bloomtrain.planner.traffic import comm_bytes
from bloomtrain.planner.workload import Candidate
from bloomtrain.planner.search import candidate_from_config, search, workload_from_config
from bloomtrain.topology import Topology
from tests import helpers
from tests.dist import run_ranks
from tests.synthetic import write_synthetic_dataset
from tests.helpers import make_cfg

SHAPE8 = BloomShape(vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, ffn_hidden_size=256)
# The activation figures are sums over a few dozen tensors whose sizes the planner derives from
# the shapes; what it leaves out (LayerNorm statistics, labels, masks) is < 2% at these shapes.
# The bound is 10%.
ACTIVATION_RTOL = 0.10
# What selective recompute saves (none - selective) is a difference of such sums: measured
# within 4% of the planned saving (the eager kernel's unplanned LayerNorm statistics and labels
# weigh more in the smaller difference), 0.6% with SDPA.
SAVING_RTOL = 0.05
BLOOM_TFLOPS = 149.5      # logged 149-150 (bloom_facts.md §2)
BLOOM_MEMORY = 59.5e9     # "59 GB/GPU", "60 GB of memory on each GPU"


# ---- model states ----------------------------------------------------------------------------
STATE_LAYOUTS = [
    dict(tp=1, pp=1, dp=1, zero=0),
    dict(tp=2, pp=1, dp=3, zero=1),
    dict(tp=1, pp=2, dp=2, zero=2),
    dict(tp=2, pp=2, dp=3, zero=3),
    dict(tp=1, pp=3, dp=5, zero=1, offload=True),
    dict(tp=2, pp=2, dp=2, zero=3, offload=True),
    dict(tp=1, pp=2, dp=3, zero=2, v=2),
    dict(tp=4, pp=1, dp=7, zero=3),
    dict(tp=2, pp=1, dp=2, zero=0, sp=True),
]


@pytest.mark.parametrize("case", STATE_LAYOUTS, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()))
def test_model_state_bytes_equal_the_engines_buffers(case):
    par = {"tp": case["tp"], "pp": case["pp"], "zero_stage": case["zero"],
           "offload_optimizer": case.get("offload", False), "sequence_parallel":
           case.get("sp", False), "bucket_size_mb": 0.01}  # many segments: padding everywhere
    if case.get("v"):
        par.update(pp_schedule="interleaved", num_virtual_stages=case["v"])
    world = case["tp"] * case["pp"] * case["dp"]
    cfg = helpers.config(SHAPE8, parallel=par, precision="bf16",
                         global_batch_size=4 * case["dp"] * case["pp"], micro_batch_size=1)
    layout = ParallelLayout.from_config(cfg.parallel, world)
    work = workload_from_config(cfg, device="cpu")
    cand = candidate_from_config(cfg, world)
    for pp_rank in range(case["pp"]):
        rank = layout.rank_of(pp_rank, case["dp"] - 1, case["tp"] - 1)
        parts = helpers.build(cfg, Topology.describe_rank(layout, rank), device="meta")
        report = parts.engine.memory_report()["measured"]
        planned = stage_memory(cand, work, pp_rank, 4, 0)
        assert {k: report[k] for k in planned.model_states} == planned.model_states, pp_rank
        host = {k: v for k, v in report["host"].items() if k != "total"}
        assert host == (planned.host or dict.fromkeys(host, 0))


# ---- activations -----------------------------------------------------------------------------
ACT_SHAPE = BloomShape(vocab_size=512, hidden_size=128, num_layers=3, num_heads=4,
                       ffn_hidden_size=512)
SEQ, MBS = 64, 2


def _planned_activations(shape, dtype_bytes, mode, tp=1, sp=False, dropout=False,
                         attention="sdpa"):
    # On CPU torch's dropout keeps its mask in the activation dtype; the planner's GPU default is
    # CUDA's 1-byte mask.
    a = ActivationSpec(seq=SEQ, micro_batch=MBS, tp=tp, sequence_parallel=sp,
                       compute_bytes=dtype_bytes, attention=attention, hidden_dropout=dropout,
                       attention_dropout=dropout and attention == "eager",
                       mask_bytes=dtype_bytes)
    items = chunk_activation_items(shape, a, shape.num_layers, True, True, mode)
    items.pop("stage_output", None)  # one process: no pipeline runtime holding an output
    return sum(items.values())


def _measure_forward(model, ids, params) -> int:
    mem = LiveMemory()
    mem.register(params, "parameters")
    with mem:
        with mem.phase("forward"):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        held = mem.current()["activations"]
    loss.backward()
    return held


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_activation_bytes_match_the_live_storages_of_a_forward(dtype, dropout, attention):
    # dropout: the hidden dropouts, and with the eager kernel (which has one) attention dropout
    drop = 0.1 if dropout else 0.0
    shape = ACT_SHAPE.replace(hidden_dropout=drop,
                             attention_dropout=drop if attention == "eager" else 0.0)
    torch.manual_seed(0)
    model = BloomForCausalLM(shape)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.transformer.alibi_slopes = alibi_slopes(shape.num_heads)
    model.transformer.attention_impl = attention
    model.train()
    ids = torch.randint(0, shape.vocab_size, (MBS, SEQ + 1))
    c = torch.empty(0, dtype=dtype).element_size()
    measured, planned = {}, {}
    for mode in ("none", "selective", "full"):
        model.set_activation_checkpointing(mode)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()  # warm: no first-call allocations
        measured[mode] = _measure_forward(model, ids, list(model.parameters()))
        planned[mode] = _planned_activations(shape, c, mode, dropout=dropout, attention=attention)
        assert planned[mode] == pytest.approx(measured[mode], rel=ACTIVATION_RTOL), mode
    # the planner's recompute modes order as the measurement does: selective saves memory next
    # to the fused SDPA kernel too (issue 38), and what it saves is what the planner says
    assert measured["none"] > measured["selective"] > measured["full"]
    assert planned["none"] > planned["selective"] > planned["full"]
    saved = measured["none"] - measured["selective"]
    assert planned["none"] - planned["selective"] == pytest.approx(saved, rel=SAVING_RTOL)


def _tp_activations(rank, world):
    out, topo = [], None
    for sp in (False, True):
        for mode in ("none", "selective", "full"):
            cfg = helpers.config(ACT_SHAPE, parallel={"tp": world, "sequence_parallel": sp},
                                 precision="bf16", activation_checkpointing=mode,
                                 attention="sdpa")
            topo = helpers.topology(cfg, topo)
            parts = helpers.build(cfg, topo)
            model = parts.chunks[0]
            model.train()
            ids = torch.randint(0, ACT_SHAPE.vocab_size, (MBS, SEQ + 1),
                                generator=torch.Generator().manual_seed(0))
            model(ids[:, :-1], labels=ids[:, 1:]).backward()
            measured = _measure_forward(model, ids, [p for _, p in parts.named_parameters()])
            parts.engine.remove_hooks()
            out.append((sp, mode, measured))
    return out


def test_activation_bytes_under_tensor_and_sequence_parallelism():
    for sp, mode, measured in run_ranks(2, _tp_activations)[0]:
        planned = _planned_activations(ACT_SHAPE, 2, mode, tp=2, sp=sp)
        assert planned == pytest.approx(measured, rel=ACTIVATION_RTOL), (sp, mode)


def test_in_flight_follows_the_schedules():
    # 1F1B: rank r stashes min(pp - r, m); GPipe all m; interleaved more on early ranks
    assert [in_flight("1f1b", 4, r, 8, 1) for r in range(4)] == [(4,), (3,), (2,), (1,)]
    assert in_flight("1f1b", 4, 0, 2, 1) == (2,)
    assert in_flight("gpipe", 4, 3, 8, 1) == (8,)
    first = in_flight("interleaved", 4, 0, 8, 2)
    assert sum(first) > 4 and len(first) == 2


# ---- communication ---------------------------------------------------------------------------
COMM_LAYOUTS = [
    ({"tp": 2, "zero_stage": 1}, {"train__activation_checkpointing": "full"}),
    ({"pp": 2, "zero_stage": 2}, {}),
    ({"tp": 2, "pp": 2, "zero_stage": 0, "sequence_parallel": True,
      "pp_schedule": "interleaved", "num_virtual_stages": 2}, {}),
    ({"zero_stage": 3}, {"train__micro_batch_size": 1}),
    ({"pp": 2, "zero_stage": 3, "pp_schedule": "gpipe"}, {}),
]


def _count_step(rank, world, dataset, tmp):
    from bloomtrain.train import Trainer
    out = []
    for i, (par, train) in enumerate(COMM_LAYOUTS):
        cfg = make_cfg(dataset, Path(tmp) / str(i),
                       model={"preset": None, "hidden_size": 64, "num_layers": 8,
                              "num_heads": 4, "vocab_size": 256},
                       parallel={**par, "bucket_size_mb": 0.01}, train__train_iters=2,
                       train__micro_batch_size=train.get("train__micro_batch_size", 2),
                       **{k: v for k, v in train.items() if k != "train__micro_batch_size"})
        trainer = Trainer(cfg, log=lambda *a: None)
        trainer.train_step(trainer.data.next_batch())  # the first step records stage 3's order
        with comm.stats_scope(True) as stats:
            trainer.train_step(trainer.data.next_batch())
            trainer.control.should_stop()                # the loop's per-step stop flag
            counted = {f"{k}/{g}": v["bytes"] for (k, g), v in stats.snapshot().items()}
        trainer.engine.remove_hooks()
        trainer.data.stream.close()
        trainer.metrics.close()
        out.append((cfg, trainer.topo.pp_rank, counted))
    return out


def test_comm_bytes_per_step_equal_the_comm_counters(tmp_path):
    dataset = write_synthetic_dataset(tmp_path / "data" / "synth_text_document")
    per_rank = run_ranks(4, _count_step, dataset, str(tmp_path))
    for rank_results in per_rank:
        for cfg, pp_rank, counted in rank_results:
            layout = ParallelLayout.from_config(cfg.parallel, 4)
            cand = candidate_from_config(cfg, 4)
            work = workload_from_config(cfg, device="cpu")
            m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.dp)
            assert comm_bytes(cand, work, pp_rank, m) == counted, (cand.label(), pp_rank)


# ---- step time against measured steps ------------------------------------------------------------
# bench/planner_steptime.py times nine layouts in the real trainer on 2 gloo ranks and holds the
# planner's predictions to issue 29's bounds (wall time: measured there, on a quiet machine).
# Here, at one round of a small model, the calibration's own arithmetic: the run that
# `calibrate_efficiency` read is predicted at exactly its recorded step time, and every other
# layout gets a finite positive prediction from the measured collectives.
@pytest.mark.slow
def test_the_step_time_bench_predicts_its_calibration_run_exactly(tmp_path):
    from bench import planner_steptime as bench
    # Three rounds, not one: the memory rate comes from the optimizer's timed traffic, and one
    # noisy round could put the planner's memory floor above the measured step (the run's own
    # loss got faster in place), which no efficiency reproduces.
    out = bench.measure(tmp_path, hidden=64, rounds=3)
    assert set(out["ratios"]) == set(bench.STEP_LAYOUTS)
    assert out["ratios"][bench.CALIBRATION] == pytest.approx(1.0, rel=1e-3)
    assert out["gemm_efficiency"] > 0
    assert all(0 < v < float("inf") for v in out["predicted_ms"].values()), out
    # dp's exposed traffic is priced from the measured collectives: nonzero for dp layouts,
    # nothing for tp=2 (no dp group).
    assert out["dp_exposed_ms"]["dp2-z1-m1"] > 0 and out["dp_exposed_ms"]["tp2-m4"] == 0


# ---- BLOOM-176B ------------------------------------------------------------------------------
BLOOM_LAYOUT = Candidate.of(tp=4, pp=12, dp=8, micro_batch=2, zero_stage=1, recompute="full")


def _bloom(system: str):
    cfg, work, cluster = bloomtrain.planner.make_inputs(
        model="bloom-176b", overrides=["model.hidden_dropout=0.1",
                                       "model.attention_dropout=0.1"],
        gpus=384, gpu_name="a100-80g", inter_node_gbps=400,  # Jean Zay: 4 x 100 Gb/s per node
        global_batch=2048, seq=2048, system=system)
    return work, cluster


def test_bloom_176b_layout_throughput_and_memory():
    work, cluster = _bloom("megatron-deepspeed")
    result = search(work, cluster)
    top3 = [p.label for p in result.plans[:3]]
    assert BLOOM_LAYOUT.label() in top3, top3
    p = evaluate(BLOOM_LAYOUT, work, cluster)
    assert p.fits
    assert abs(p.tflops_per_gpu - BLOOM_TFLOPS) / BLOOM_TFLOPS < 0.10, p.tflops_per_gpu
    assert abs(p.memory_per_gpu - BLOOM_MEMORY) / BLOOM_MEMORY < 0.15, p.memory_per_gpu
    # Our engine on the same layout: no whole-stage 16-bit gradients, no 2 GB all-reduce
    # buffer, a fused attention core, so less memory.
    ours = evaluate(BLOOM_LAYOUT, *_bloom("bloomtrain"))
    assert ours.fits and ours.memory_per_gpu < p.memory_per_gpu


# Every row of BLOOM's public record (docs/planner_data.csv, sources in docs/bloom_facts.md),
# fitted to or held out, predicted with the stored efficiencies: issue 29's bounds.
TFLOPS_TOL, MEMORY_TOL = 0.10, 0.15


def test_every_public_bloom_row_is_predicted_within_bounds():
    report = {r["id"]: r for r in fit.report(fit.load(), A100)}
    table = "\n".join(f"{k:16s} {r['role']:8s} step {r['step_error']:+.3f} tflops "
                       f"{r['tflops_error']:+.3f}" for k, r in report.items())
    # tp4-pp12-24n, not in issue 29's table: two iterations right after a restart (10.5% off)
    for k, r in report.items():
        if k != "tp4-pp12-24n":
            assert abs(r["tflops_error"]) <= TFLOPS_TOL, f"{k}\n{table}"
        if r["memory_gb"]:
            assert abs(r["memory_error"]) <= MEMORY_TOL, f"{k}\n{table}"
    # the global-batch sweep: TFLOPs rise with the batch, as measured
    sweep = [report[f"gbs-{g}"]["predicted_tflops"] for g in (512, 1024, 1536, 2048)]
    assert sweep == sorted(sweep) and sweep[-1] - sweep[0] > 30, sweep
    held = [r for r in report.values() if r["role"] == "holdout"]
    assert len(held) >= 8 and max(abs(r["step_error"]) for r in held) < 0.10


def test_the_stored_efficiencies_are_the_fit_of_the_data():
    # Refit from a start far from the stored figures: the data and the model, not a hand, set
    # them (a changed term or row without a refit fails here). bench/planner_fit.py refits.
    # From two starts the fit lands in two minima (the GEMM and HBM rates trade off); the
    # stored figures are the better one.
    rows = fit.load()
    train = [r for r in rows if r.role == "fit"]
    fits = [fit.fit(rows, replace(A100, gemm=g, nvlink=g, network=g, hbm=g, op_s=op))
            for g, op in ((0.8, 50e-6), (0.6, 10e-6))]
    fitted = min(fits, key=lambda e: sum(x * x for x in fit.residuals(train, e)))
    for name in fit.PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(getattr(A100, name), rel=0.03), name


def test_a_missing_term_breaks_the_fit(monkeypatch):
    # Without the exposed dp reduction the fit rows can no longer all be matched: the ramp's
    # start (one micro-batch per pipeline) is a third dp reduction.
    steptime = importlib.import_module("bloomtrain.planner.steptime")
    monkeypatch.setattr(steptime, "dp_exposed", lambda *a: 0.0)
    monkeypatch.setattr(steptime, "tied_exposed", lambda *a: 0.0)
    rows = fit.load()
    errors = [abs(r["tflops_error"]) for r in fit.report(rows, fit.fit(rows, A100))]
    assert max(errors) > TFLOPS_TOL, errors


def test_a_compressed_dp_reduction_is_priced_by_its_wire_bytes():
    # The hook a compressed (int8) reduction sets: the exposed dp time of a bandwidth-bound
    # ZeRO-0 all-reduce scales with the bytes on the wire; gathers keep their own ratio. (pp=1:
    # no tied-embedding sum between stages in the term; memory does not matter here.)
    work, cluster = _bloom("bloomtrain")
    work = replace(work, global_batch=1920)   # 10 micro-batches of 2 per replica
    cand = Candidate.of(tp=4, pp=1, dp=96, micro_batch=2, zero_stage=0, recompute="full")
    full = evaluate(cand, work, cluster).time["dp_comm_exposed_s"]
    quarter = evaluate(cand, replace(work, dp_reduce_bytes_ratio=0.25), cluster).time
    assert quarter["dp_comm_exposed_s"] == pytest.approx(full / 4, rel=0.01)
    z1 = Candidate.of(tp=4, pp=1, dp=96, micro_batch=2, zero_stage=1, recompute="full")
    gathers = evaluate(z1, replace(work, dp_gather_bytes_ratio=0.5), cluster).time
    assert gathers["dp_comm_exposed_s"] < evaluate(z1, work, cluster).time["dp_comm_exposed_s"]


# ---- errors, API, CLI ------------------------------------------------------------------------
def test_no_fitting_layout_names_the_smallest_change():
    with pytest.raises(UserError) as e:
        bloomtrain.plan("bloom-7b1", gpus=1, gpu="a100-40g", global_batch=512, seq=2048)
    msg = str(e.value)
    assert "no layout of 1 x a100-40g fits" in msg and "GiB over" in msg
    assert "the smallest change that fits: --gpus 2" in msg
    # and that change does fit
    assert bloomtrain.plan("bloom-7b1", gpus=2, gpu="a100-40g", global_batch=512, seq=2048)


def test_gpu_counts_that_factor_badly_are_explained():
    with pytest.raises(UserError, match=r"not a whole number of nodes .* use 8 or 16"):
        bloomtrain.plan("tiny", gpus=10, global_batch=8, seq=32)
    with pytest.raises(UserError, match=r"divisible by train.micro_batch_size \* dp .*"
                                         r"smallest change that fits: --gpus 2"):
        bloomtrain.plan("tiny", gpus=3, global_batch=4, seq=32,
                        overrides=["model.num_layers=2", "model.vocab_size=256"])


def test_api_returns_the_records_of_one_layout_and_of_a_search():
    [one] = bloomtrain.plan("bloom-560m", gpus=8, gpu="h100", global_batch=256, seq=2048,
                            layout="tp=1,pp=1,mbs=4,zero=1,recompute=none", tokens=1e9)
    assert one.layout["dp"] == 8 and one.fits and one.days > 0
    assert set(one.time) >= {"compute_s", "tp_comm_s", "pp_p2p_s", "bubble_s",
                             "dp_comm_exposed_s", "optimizer_s", "step_s"}
    best = bloomtrain.plan("bloom-560m", gpus=8, gpu="h100", global_batch=256, seq=2048, top=3)
    assert len(best) == 3 and best[0].step_time_s <= best[1].step_time_s <= best[2].step_time_s
    assert all(p.fits for p in best)
    [tight] = bloomtrain.plan("bloom-7b1", gpus=1, gpu="a100-40g", global_batch=512, seq=2048,
                              layout="recompute=none")
    assert not tight.fits and "out of memory on pipeline stage 0" in tight.reason


def test_cli_json_and_table(tmp_path):
    cmd = [sys.executable, "-m", "bloomtrain", "plan", "--model", "bloom-560m", "--gpus", "8",
           "--global-batch", "256", "--seq", "2048", "--top", "2"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert len(data["plans"]) == 2 and data["fitting"] >= 2
    table = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert data["plans"][0]["label"] in table and "model states" in table


def test_plan_config_reads_the_tokenizers_vocabulary_in_readable_units(tmp_path,
                                                                       tiny_tokenizer_dir):
    # issue 31: `plan --config` planned vocab 256 where training used the tokenizer's, printed
    # "0.00B parameters" and a step of 0.0001907 in the step column.
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    padded = -(-n // 128) * 128               # model.make_vocab_size_divisible_by's default
    assert padded != 256
    cfg = tmp_path / "my.yaml"
    cfg.write_text(f"model: {{preset: tiny}}\ndata: {{tokenizer: {tiny_tokenizer_dir}, "
                   f"seq_length: 64}}\ntrain: {{global_batch_size: 8, micro_batch_size: 1}}\n")
    out = subprocess.run([sys.executable, "-m", "bloomtrain", "plan", "--config", str(cfg),
                          "--gpus", "2", "--gpu", "cpu", "--top", "3"],
                         capture_output=True, text=True, check=True).stdout
    shape = BloomShape(vocab_size=padded, hidden_size=64, num_layers=4, num_heads=4,
                       ffn_hidden_size=256)
    params = shape.num_parameters()
    assert f"{params / 1e3:.2f}K parameters (L=4, h=64, heads=4, vocab={padded})" in out, out
    rows = [line for line in out.splitlines() if re.match(r" ?\d+  tp=", line)]
    assert len(rows) == 3 and all(re.search(r" \d+(\.\d+)? (ms|us) ", r) for r in rows), rows
    assert "CUDA, cuBLAS, NCCL" not in out    # a CPU process has no CUDA context
    assert " 0.0 TFLOP/s" not in out


def test_a_search_where_nothing_fits_sizes_no_variant(monkeypatch):
    # issue 31: the no-fit search took minutes. A layout whose model states alone are over is
    # rejected with all its micro-batch and recompute variants before any is sized.
    memory = importlib.import_module("bloomtrain.planner.memory")
    sized = []
    real = memory.stage_memory
    monkeypatch.setattr(memory, "stage_memory", lambda *a: sized.append(a) or real(*a))
    evaluate_module = importlib.import_module("bloomtrain.planner.evaluate")
    monkeypatch.setattr(evaluate_module.mem, "stage_memory", memory.stage_memory)
    _, work, cluster = bloomtrain.planner.make_inputs(
        model="bloom-176b", gpus=8, gpu_name="a100-40g", global_batch=64, seq=2048)
    result = search(work, cluster)
    assert not result.plans and result.evaluated > 100 and not sized
    assert result.reasons["out of memory"] > 0


# ---- calibration -----------------------------------------------------------------------------
def test_calibrate_recovers_the_efficiency_of_a_run(tmp_path):
    # A run dir written as a real run writes it, with the step time the planner predicts at a
    # known efficiency: calibration must find that efficiency again.
    # GEMM-bound on an H100 (a model of SHAPE8's size is bound by its kernel launches there,
    # and then no GEMM rate can be read from its step: checked below).
    wide = BloomShape(vocab_size=1024, hidden_size=4096, num_layers=2, num_heads=32,
                      ffn_hidden_size=16384)
    cfg = helpers.config(wide, parallel={"tp": 2}, precision="bf16", global_batch_size=16,
                         micro_batch_size=2)
    cfg.data.seq_length = 2048
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    cluster = Cluster(GPUS["h100"], 4, 4)
    truth = evaluate(candidate_from_config(cfg, 4), workload_from_config(cfg),
                     cluster.with_efficiency(0.37), memory_limit=float("inf")).step_time_s
    _write_records(tmp_path, [3 * truth, truth, truth, truth])  # the first is warm-up
    fitted = calibrate_efficiency(str(tmp_path), cluster)
    assert fitted.efficiency == pytest.approx(0.37, rel=1e-4)
    assert fitted.world_size == 4 and fitted.records == 3
    _write_records(tmp_path, [truth / 100] * 2)  # faster than any efficiency allows
    with pytest.raises(UserError, match="faster than"):
        calibrate_efficiency(str(tmp_path), cluster)
    with pytest.raises(UserError, match="config.yaml is missing"):
        calibrate_efficiency(str(tmp_path / "nowhere"), cluster)
    # A corrupt metrics.jsonl: one line each, where a traceback came (or, for NaN, a fit down
    # to an efficiency of 1e-6 and "0 tokens/s").
    metrics = tmp_path / "metrics.jsonl"
    for line, said in (('"step_time_s"', "metrics.jsonl:1 is not a record"),
                       ('{"step": 1, "step_time_s": "fast", "layout": "tp=2 pp=1 dp=2"}',
                        "step_time_s 'fast' is not a positive number"),
                       ('{"step": 1, "step_time_s": NaN, "layout": "tp=2 pp=1 dp=2"}',
                        "step_time_s nan is not a positive number"),
                       ('{"step": 1, "step_time_s": 1.0, "layout": null}',
                        "carry no layout")):
        metrics.write_text(line + "\n")
        with pytest.raises(UserError, match=said):
            calibrate_efficiency(str(tmp_path), cluster)
    small = helpers.config(SHAPE8, parallel={"tp": 2}, precision="bf16", global_batch_size=16,
                           micro_batch_size=2)
    (tmp_path / "config.yaml").write_text(small.to_yaml())
    host_bound = evaluate(candidate_from_config(small, 4), workload_from_config(small),
                          cluster, memory_limit=float("inf")).step_time_s
    _write_records(tmp_path, [host_bound] * 3)
    with pytest.raises(UserError, match="bound by its host"):
        calibrate_efficiency(str(tmp_path), cluster)


def test_calibrate_reads_a_runs_vocabulary_from_its_tokenizer(tmp_path, tiny_tokenizer_dir):
    # A run dir's config.yaml leaves model.vocab_size to data.tokenizer (the demo's does):
    # --calibrate planned it as training resolved it, not "vocabulary size is unknown".
    from bloomtrain.config import Config
    cfg = Config.from_dict({"model": {"preset": "tiny"},
                            "data": {"tokenizer": str(tiny_tokenizer_dir), "seq_length": 64},
                            "parallel": {"tp": 2},
                            "train": {"global_batch_size": 16, "micro_batch_size": 2,
                                      "precision": "fp32", "device": "cpu"}})
    assert cfg.model.vocab_size is None
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    cluster = Cluster(GPUS["cpu"], 4, 4)
    work = workload_from_config(cfg)
    assert work.shape.vocab_size != 256 and work.shape.vocab_size % 128 == 0
    truth = evaluate(candidate_from_config(cfg, 4), work, cluster.with_efficiency(2.0),
                     memory_limit=float("inf")).step_time_s
    _write_records(tmp_path, [3 * truth, truth, truth])
    assert calibrate_efficiency(str(tmp_path), cluster).efficiency == pytest.approx(2.0, rel=1e-4)


def _write_records(run_dir: Path, step_times: list[float]) -> None:
    recs = [{"step": i, "step_time_s": t, "layout": "tp=2 pp=1 dp=2 zero=1 precision=bf16"}
            for i, t in enumerate(step_times, 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


# ---- the trainer -----------------------------------------------------------------------------
def test_trainer_logs_the_prediction_and_cuda_refuses_a_layout_that_does_not_fit(
        tmp_path, monkeypatch):
    dataset = write_synthetic_dataset(tmp_path / "d" / "synth_text_document")
    cfg = make_cfg(dataset, tmp_path, train__train_iters=1)
    lines = []
    from bloomtrain.train import train
    train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert any("plan:" in line and "GiB per device predicted" in line and
               "gives each of this node's processes" in line for line in lines), lines

    class Props:
        total_memory = 2 ** 20  # a 1 MiB "GPU"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    shape = resolve_model_config(cfg.model)
    on_cpu, _ = plan_for_run(cfg, shape, 1, "cpu")   # issue 31: no CUDA context on a CPU
    assert on_cpu.stages and all(s["context"] == 0 for s in on_cpu.stages)
    with pytest.raises(UserError, match=r"more than the 0.00 GiB this GPU has.*"
                                        r"train.ignore_plan=true"):
        plan_for_run(cfg, shape, 1, "cuda")
    cfg.train.ignore_plan = True
    plan, text = plan_for_run(cfg, shape, 1, "cuda")
    assert not plan.fits and "starting anyway" in text
    Props.total_memory = 2 ** 40
    cfg.train.ignore_plan = False
    plan, text = plan_for_run(cfg, shape, 1, "cuda")
    assert plan.fits and "the device has 1024.00 GiB" in text
    assert all(s["context"] == 2 ** 30 for s in plan.stages)
    # On the CPU the host is the device: its available memory over the node's processes (a
    # sequence of 100,000 ended in an allocator traceback, the 176 GiB plan logged and unheeded).
    monkeypatch.setenv("BLOOMTRAIN_HOST_MEMORY", "4MiB")
    with pytest.raises(UserError, match=r"GiB per process on pipeline stage 0, more than the "
                                        r"0.00 GiB this host has for each of its processes "
                                        r"\(BLOOMTRAIN_HOST_MEMORY\).*train.ignore_plan=true"):
        plan_for_run(cfg, shape, 1, "cpu")
    monkeypatch.setenv("BLOOMTRAIN_HOST_MEMORY", "64GiB")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan, text = plan_for_run(cfg, shape, 2, "cpu")
    assert plan.fits and "BLOOMTRAIN_HOST_MEMORY gives each of this node's processes 32.00 GiB" \
        in text


def test_ties_are_every_plan_within_the_error_band():
    """mark_ties against the definition, every pair compared (a plain loop here): the ranks of
    the other plans whose step time is within the band of this one's, on random times with
    repeats, in order and not, and for bands that are and are not zero."""
    import math
    import random
    from types import SimpleNamespace

    from bloomtrain.planner.search import mark_ties

    rng = random.Random(0)
    for _ in range(300):
        times = [rng.choice([1.0, 1.05, 2.0]) * rng.choice([1.0, rng.uniform(0.9, 1.1)])
                 for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:
            times.sort()
        band = rng.choice([0.0, 0.05, math.log(1.05)])
        plans = [SimpleNamespace(step_time_s=t) for t in times]
        mark_ties(plans, band)
        for i, plan in enumerate(plans):
            assert plan.ties == [j + 1 for j, t in enumerate(times)
                                 if j != i and abs(math.log(t / times[i])) <= band]


def test_a_runs_own_plan_knows_its_nodes(monkeypatch):
    """plan_for_run (the prediction `bloomtrain train` logs and, on CUDA, enforces) took the
    whole job for one node, so ZeRO-3's hpZ secondary copy, sharded within a node, came out
    1/dp instead of 1/(ranks per node): half of what 2 nodes of 8 hold. The launcher's
    LOCAL_WORLD_SIZE (srun's tasks per node through env_from_slurm) says how many a node has."""
    from dataclasses import replace as dc_replace

    from bloomtrain.config import Config

    cfg = Config.load(None, ["train.train_iters=1", "model.preset=bloom-560m",
                             "model.vocab_size=250880", "parallel.zero_stage=3",
                             "parallel.zero_secondary_shard=true",
                             "train.global_batch_size=16", "data.seq_length=512",
                             "train.ignore_plan=true"])  # more than this host has: a plan only
    shape = resolve_model_config(cfg.model, 250880)
    spec = dc_replace(GPUS["cpu"], memory_bytes=1 << 62)
    work = workload_from_config(cfg, device="cpu", shape=shape)
    want = evaluate(candidate_from_config(cfg, 16), work, Cluster(spec, 16, 8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    got, _ = plan_for_run(cfg, shape, 16, "cpu")

    def secondary(p):
        return p.stages[0]["model_states"]["hpz_secondary"]
    assert secondary(got) == secondary(want) > 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    alone, _ = plan_for_run(cfg, shape, 16, "cpu")
    assert secondary(alone) == secondary(want) / 2  # one node of 16
    # Nodes of different sizes (srun's "2,1" for 3 tasks): plan's refusal of uneven nodes
    # ("--gpus (3) is not a whole number of nodes of --gpus-per-node (2)") failed the run; the
    # prediction takes equal nodes that divide the job.
    cfg3 = Config.load(None, ["train.train_iters=1", "model.preset=tiny", "train.ignore_plan=true",
                              "train.global_batch_size=12", "train.micro_batch_size=4"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    uneven, _ = plan_for_run(cfg3, resolve_model_config(cfg3.model, 256), 3, "cpu")
    assert uneven.stages


def test_a_layout_with_sizes_below_one_is_refused_by_name():
    """`--layout mbs=0` divided by zero (a traceback); `dp=-4,tp=-1` multiplied to the GPUs'
    4 and was taken, the error then about micro-batches."""
    from bloomtrain.planner.workload import parse_layout

    for spec, key in (("mbs=0", "mbs"), ("dp=-4,tp=-1", "dp"), ("v=0", "v")):
        with pytest.raises(UserError, match=f"--layout {key}: must be at least 1"):
            parse_layout(spec, 4, "uniform")
    assert parse_layout("zero=0", 4, "uniform").zero_stage == 0


def test_the_communication_report_prices_what_the_step_time_does():
    """Megatron-DeepSpeed's BF16_Optimizer sums the tied embedding's gradient whole between the
    first and last stages (bloom_facts §6), as steptime's tied_exposed prices it; the report
    divided it by dp (428.8 MiB for 3.4 GiB at BLOOM-176B). Under DeepSpeed's fp16 ZeRO the
    gradients go in 16 bits, as dp_exposed prices them, not fp32's 4 bytes."""
    from dataclasses import replace as dc_replace

    from bloomtrain.planner import memory as mem

    work, _ = _bloom("megatron-deepspeed")
    groups, _ = mem.rank_states(work.shape, BLOOM_LAYOUT.layout, 0, work.system,
                                work.precision, BLOOM_LAYOUT.offload)
    tied = sum(mem.flat_numel([g], BLOOM_LAYOUT.dp, True) for g in groups if g.tied)
    assert comm_bytes(BLOOM_LAYOUT, work, 0, 128)["all_reduce/emb"] == 4 * tied
    ours, _ = _bloom("bloomtrain")
    assert comm_bytes(BLOOM_LAYOUT, ours, 0, 128)["all_reduce/emb"] == 4 * tied // 8
    fp16 = dc_replace(work, precision="fp16")
    states = mem.rank_states(fp16.shape, BLOOM_LAYOUT.layout, 0, fp16.system, "fp16",
                             False)[1]
    sent = comm_bytes(BLOOM_LAYOUT, fp16, 0, 128)
    assert sent["reduce_scatter/dp"] == 2 * states["flat_numel"]


def test_plan_refuses_a_top_below_one_and_only_with_a_layout(capsys):
    """--top 0 had no best layout to show (an IndexError), -2 listed all but the last two;
    --only with --layout was ignored."""
    from bloomtrain.cli import main

    base = ["plan", "--model", "tiny", "--gpus", "4", "--global-batch", "8", "--seq", "32"]
    assert main(base + ["--top", "0"]) == 2
    assert "top (--top) must be >= 1, got 0" in capsys.readouterr().err
    assert main(base + ["--layout", "tp=2", "--only", "recompute=full"]) == 2
    assert "give the values in the layout" in capsys.readouterr().err
    # bloomtrain.plan() refuses them alike (it returned all but the last two, and ignored
    # `only`).
    kw = dict(model="tiny", gpus=4, global_batch=8, seq=32)
    for bad in ({"top": -2}, {"top": 0}, {"layout": "tp=2", "only": "recompute=full"}):
        with pytest.raises(UserError, match="top .* must be >= 1|give the values in the layout"):
            bloomtrain.plan(**kw, **bad)
    # Zero is no size either (it was taken for "not given" and replaced by the config's); a
    # negative token count printed "-0.0 days", a negative host memory its bytes.
    for extra, said in ((["--global-batch", "0"], "must be positive"),
                        (["--seq", "0"], "must be positive"),
                        (["--tokens", "-1"], "tokens (--tokens) must be a positive finite "
                                             "number, got -1"),
                        (["--tokens", "inf"], "got inf"),
                        (["--host-memory-gib", "-5"], "--host-memory-gib must be a positive "
                                                      "finite number, got -5\n"),
                        # NaN compares false: planned as "fits: yes" of nan GiB, and NaN
                        # step times ranked.
                        (["--host-memory-gib", "nan"], "--host-memory-gib must be a positive "
                                                       "finite number, got nan\n"),
                        (["--inter-node-gbps", "nan"], "--inter-node-gbps must be a positive "
                                                       "finite number, got nan\n")):
        assert main(base[:-4] + ["--global-batch", "8", "--seq", "32"] + extra) == 2
        assert said in capsys.readouterr().err


def test_plan_takes_a_model_given_as_overrides_alone(capsys):
    """A shape of one's own (model.preset=null plus hidden/layers/heads), or a preset, given as
    overrides is a model: plan refused it with "give a model". The plan is the same as the one
    for the same model given as --model; overrides that name no model are still refused rather
    than planning the default config's toy model."""
    from bloomtrain.cli import main

    kw = dict(gpus=8, global_batch=16, seq=512, top=None)
    shape = ["model.preset=null", "model.hidden_size=1024", "model.num_layers=24",
             "model.num_heads=16", "model.vocab_size=250880"]
    by_name = bloomtrain.plan("bloom-560m", **kw)
    for overrides in (shape, ["model.preset=bloom-560m"]):
        got = bloomtrain.plan(overrides=overrides, **kw)
        assert [p.label for p in got] == [p.label for p in by_name]
        assert [p.step_time_s for p in got] == [p.step_time_s for p in by_name]
        assert [p.memory_per_gpu for p in got] == [p.memory_per_gpu for p in by_name]
    base = ["plan", "--gpus", "8", "--global-batch", "16", "--seq", "512", "--top", "1"]
    assert main(base + shape) == 0
    assert "L=24, h=1024, heads=16, vocab=250880" in capsys.readouterr().out
    assert main(base + ["model.hidden_dropout=0.1"]) == 2
    assert "give a model" in capsys.readouterr().err


def test_every_layout_the_search_recommends_is_one_train_accepts():
    """The search applies `bloomtrain train`'s rules between the layout and the rest of the
    config: the ramp-up's batch sizes split over dp (BLOOM's own ramp refused the search's best
    layout), zb-h1 is refused with compile, dp compression at dp 1, and the vocabulary padding
    rule is the config's make_vocab_size_divisible_by (the padded vocabulary was passed)."""
    from bloomtrain.config import Config
    from bloomtrain.validate import validate

    overrides = ["train.compile=true", "parallel.grad_reduce_dtype=bf16",
                 "train.rampup_batch_size=[24,8,100000]", "train.train_samples=1000000",
                 "model.make_vocab_size_divisible_by=1", "model.vocab_size=1001"]
    plans = bloomtrain.plan("bloom-560m", gpus=8, global_batch=64, seq=512,
                            overrides=overrides, top=None)
    assert len(plans) > 50
    kinds = set()
    for p in plans:
        lay = p.layout
        kinds.add((lay["tp"], lay["dp"], lay["schedule"]))
        cfg = Config.load(None, [
            "model.preset=bloom-560m", *overrides, f"parallel.tp={lay['tp']}",
            f"parallel.pp={lay['pp']}", f"parallel.zero_stage={lay['zero_stage']}",
            f"parallel.pp_schedule={lay['schedule']}",
            f"parallel.num_virtual_stages={lay['num_virtual_stages']}",
            f"parallel.sequence_parallel={str(lay['sequence_parallel']).lower()}",
            f"parallel.offload_optimizer={str(lay['offload']).lower()}",
            f"train.micro_batch_size={lay['micro_batch']}",
            f"train.activation_checkpointing={lay['recompute']}",
            "train.global_batch_size=64", "data.seq_length=512"])
        validate(cfg, 8)  # raises what `bloomtrain train` would refuse
    # vocabulary 1001 splits over no tp > 1, and compression needs dp > 1
    assert {tp for tp, _, _ in kinds} == {1} and all(dp > 1 for _, dp, _ in kinds)
    assert "zb-h1" not in {schedule for _, _, schedule in kinds}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_training_steps_peak_is_the_planned_one_where_the_logits_dominate(tmp_path,
                                                                          precision):
    """One whole training step (the Trainer, tp=1) at a vocabulary whose logits outweigh the
    rest, measured by LiveMemory: what the step allocates at its peak against the planner's
    activations and transients. F.cross_entropy's backward held three fp32 [b, s, V] tensors
    at once, 12 bytes a logit where the plan counts 10: 104.9 MiB measured for 88.3 planned in
    bf16. In fp32 the logits need no float32 cast, and the plan counted one."""
    from bloomtrain.train import Trainer

    dataset = write_synthetic_dataset(tmp_path / "d" / "synth_text_document")
    cfg = make_cfg(dataset, tmp_path, model={"preset": None, "hidden_size": 64, "num_layers": 2,
                                             "num_heads": 4, "vocab_size": 16384},
                   train={"micro_batch_size": 4, "global_batch_size": 8, "train_iters": 3,
                          "precision": precision, "device": "cpu", "attention": "sdpa"},
                   data={"paths": [str(dataset)], "seq_length": 128, "split": "90,10,0"})
    trainer = Trainer(cfg, log=lambda *a: None)
    try:
        trainer.train_step(trainer.data.next_batch())  # warm: no first-call allocations
        batch = trainer.data.next_batch()
        mem = LiveMemory()
        with mem:
            with mem.phase("backward"):
                trainer.train_step(batch)
        measured = mem.report()["peak"]
        stage = trainer.plan.stages[0]
        planned = sum(stage["activations"].values()) + sum(stage["transients"].values())
    finally:
        trainer.engine.remove_hooks()
        trainer.data.stream.close()
        trainer.metrics.close()
    assert 0.9 < measured / planned < 1.05, (measured / 2 ** 20, planned / 2 ** 20)


def test_live_memory_files_a_fresh_parameter_gradient_under_gradients():
    """bench/memtrack.py, the measure the activation and zb-h1 figures rest on: a backward
    matmul's output that autograd hands to a parameter counts as gradients at the peak, not as
    temporaries (its hook runs a few ops after it is made: it was counted as temporaries,
    328,708 bytes at the peak where 65,540 were)."""
    lin = torch.nn.Linear(256, 256)
    mem = LiveMemory()
    mem.watch_parameters(lin)
    mem.close_grad_window(lin)
    x = torch.randn(64, 256)
    with mem:
        with mem.phase("forward"):
            loss = lin(x).relu().sum()
        with mem.phase("backward"):
            loss.backward()
    report = mem.report()
    grads = (256 * 256 + 256) * 4
    assert report["peak_phase"] == "backward"
    assert report["at_peak"]["gradients"] == report["category_peaks"]["gradients"] == grads
    # The relu's and sum's gradients: [64, 256] fp32 and a scalar.
    assert report["category_peaks"]["temporaries"] == 64 * 256 * 4 + 4
