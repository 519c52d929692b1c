"""The planner (bloomtrain.planner) against what our engine really allocates, stores and sends, and
against BLOOM-176B's own published figures.

References, each independent of the planner's arithmetic:
- model states: the ZeRO engine's flat buffers (`memory_report`), built through `parallelize` for
  every pipeline rank of each layout (on the meta device: the sizes are the real allocation's);
- activations: the live storages left by a forward (bench/memtrack.py's LiveMemory, a dispatch
  mode that knows nothing of formulas), one process and tp=2 (+ sequence parallelism);
- communication: comm's own counters over a real training step on 4 gloo ranks;
- BLOOM-176B: the logged 149-150 TFLOP/s and the ~59-60 GB per GPU (bloom_facts.md §2).
"""
from __future__ import annotations

import json
import subprocess
import sys
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
from bloomtrain.planner.calibrate import calibrate_efficiency
from bloomtrain.planner.evaluate import Candidate, comm_bytes, evaluate, stage_memory
from bloomtrain.planner.hardware import GPUS, Cluster
from bloomtrain.planner.memory import ActivationSpec, chunk_activation_items, in_flight
from bloomtrain.planner.search import candidate_from_config, search, workload_from_config
from bloomtrain.topology import Topology
from tests import helpers
from tests.dist import run_ranks
from tests.synthetic import write_synthetic_dataset
from tests.test_train import make_cfg

SHAPE8 = BloomShape(vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, ffn_hidden_size=256)
# The activation figures are sums over a few dozen tensors whose sizes the planner derives from
# the shapes; what it leaves out (LayerNorm statistics, labels, masks) is < 2% at these shapes.
# The bound is 10%.
ACTIVATION_RTOL = 0.10
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
        planned = stage_memory(cand, work, layout, pp_rank, 4)
        assert {k: report[k] for k in planned.model_states} == planned.model_states, pp_rank
        host = {k: v for k, v in report["host"].items() if k != "total"}
        assert host == (planned.host or dict.fromkeys(host, 0))


# ---- activations -----------------------------------------------------------------------------
ACT_SHAPE = BloomShape(vocab_size=512, hidden_size=128, num_layers=3, num_heads=4,
                       ffn_hidden_size=512)
SEQ, MBS = 64, 2


def _planned_activations(shape, dtype_bytes, mode, tp=1, sp=False, dropout=False):
    # On CPU torch's dropout keeps its mask in the activation dtype; the planner's GPU default is
    # CUDA's 1-byte mask.
    a = ActivationSpec(seq=SEQ, micro_batch=MBS, tp=tp, sequence_parallel=sp,
                       compute_bytes=dtype_bytes, attention="sdpa", hidden_dropout=dropout,
                       attention_dropout=False, mask_bytes=dtype_bytes)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "hidden-dropout"])
def test_activation_bytes_match_the_live_storages_of_a_forward(dtype, dropout):
    shape = ACT_SHAPE.replace(hidden_dropout=0.1 if dropout else 0.0)
    torch.manual_seed(0)
    model = BloomForCausalLM(shape)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.transformer.alibi_slopes = alibi_slopes(shape.num_heads)
    model.transformer.attention_impl = "sdpa"
    model.train()
    ids = torch.randint(0, shape.vocab_size, (MBS, SEQ + 1))
    c = torch.empty(0, dtype=dtype).element_size()
    for mode in ("none", "selective", "full"):
        model.set_activation_checkpointing(mode)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()  # warm: no first-call allocations
        measured = _measure_forward(model, ids, list(model.parameters()))
        planned = _planned_activations(shape, c, mode, dropout=dropout)
        assert planned == pytest.approx(measured, rel=ACTIVATION_RTOL), mode
    # the planner's recompute modes order as the measurement does
    assert _planned_activations(shape, c, "full") < _planned_activations(shape, c, "selective")


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
            assert comm_bytes(cand, work, layout, pp_rank, m) == counted, (cand.label(), pp_rank)


# ---- BLOOM-176B ------------------------------------------------------------------------------
BLOOM_LAYOUT = Candidate(tp=4, pp=12, dp=8, micro_batch=2, zero_stage=1, recompute="full")


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


# ---- calibration -----------------------------------------------------------------------------
def test_calibrate_recovers_the_efficiency_of_a_run(tmp_path):
    # A run dir written as a real run writes it, with the step time the planner predicts at a
    # known efficiency: calibration must find that efficiency again.
    cfg = helpers.config(SHAPE8, parallel={"tp": 2}, precision="bf16", global_batch_size=16,
                         micro_batch_size=2)
    cfg.data.seq_length = 256
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
    assert any("plan:" in line and "GiB per device predicted" in line and "cpu" in line
               for line in lines), lines

    class Props:
        total_memory = 2 ** 20  # a 1 MiB "GPU"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    shape = resolve_model_config(cfg.model)
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
