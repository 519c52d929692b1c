"""The planner's step time against our own trainer's measured steps, on 2 gloo ranks of this CPU.

Nine layouts of one model are timed in the real trainer, a rank per core: dp with ZeRO-0, 1
and 3, 1 and 4 micro-batches, full recompute, tp=2, pp=2 with 1F1B at 4 and 8 micro-batches
and interleaved (v=2). The planner then runs on this machine's measured figures: every
collective kind's latency and bandwidth between the two ranks, a point-to-point send, and
torch's fused AdamW (+ the norm's read and the compute copy: the traffic the planner's
optimizer term counts). Its GEMM rate is calibrated by `calibrate_efficiency` from one
layout's records (CALIBRATION, written as `bloomtrain plan --calibrate RUN_DIR` reads them) and
the other eight are predicted. The model is wide enough (h=512) for its matmuls to dominate the
per-op Python cost, and the micro-batch (64 rows) small enough for the data-parallel traffic
to be up to half a step.

Issue 29's bounds: Kendall's tau >= 0.8 between the measured and the predicted order, every
measured/predicted ratio within [1/1.5, 1.5]. They are wall-time figures, so they are measured
here, on a quiet machine, and not in the test suite (a loaded or different CPU moves tp's
half-width matmuls by more than the model's error). tests/planner/test_plan.py runs this at one
round on a small model for the calibration's own arithmetic (its layout's ratio is 1).

    python bench/planner_steptime.py               # 10 rounds, h=512; ends with one JSON line
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bloomtrain.layout import ParallelLayout  # noqa: E402
from bloomtrain.parallel import comm  # noqa: E402
from bloomtrain.planner.calibrate import calibrate_efficiency  # noqa: E402
from bloomtrain.planner.evaluate import evaluate  # noqa: E402
from bloomtrain.planner.hardware import GPUS, Cluster  # noqa: E402
from bloomtrain.planner.search import candidate_from_config, workload_from_config  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.helpers import make_cfg  # noqa: E402
from tests.synthetic import write_synthetic_dataset  # noqa: E402

STEP_SEQ = 64
STEP_LAYOUTS = {  # name -> (parallel, train); micro-batch 1 everywhere
    "dp2-z0-m1": ({"zero_stage": 0}, {"global_batch_size": 2}),
    "dp2-z1-m1": ({"zero_stage": 1}, {"global_batch_size": 2}),
    "dp2-z1-m4": ({"zero_stage": 1}, {"global_batch_size": 8}),
    "dp2-z1-m4-full": ({"zero_stage": 1}, {"global_batch_size": 8,
                                           "activation_checkpointing": "full"}),
    "dp2-z3-m4": ({"zero_stage": 3}, {"global_batch_size": 8}),
    "tp2-m4": ({"tp": 2}, {"global_batch_size": 4}),
    "pp2-m4": ({"pp": 2, "pp_partition": "uniform"}, {"global_batch_size": 4}),
    "pp2-m8": ({"pp": 2, "pp_partition": "uniform"}, {"global_batch_size": 8}),
    "pp2-v2-m4": ({"pp": 2, "pp_partition": "uniform", "pp_schedule": "interleaved",
                   "num_virtual_stages": 2}, {"global_batch_size": 4}),
}
CALIBRATION = "dp2-z1-m4"
# Measured/predicted must lie within [1/TOL, TOL] for every predicted layout. On this 2-core
# machine, loaded by other jobs, the step medians still move ~15% with the load, and the model
# leaves out what a CPU core pays beyond its counted ops (tp's half-width matmuls run below the
# full-width rate). A missing term costs more: without the exposed dp traffic dp2-z1-m1, half
# of whose step it is, came out 1.68-1.89 in 6 runs.
STEP_TOL = 1.5
# Kendall's tau between the measured and the predicted order of the nine layouts (issue 29).
MIN_TAU = 0.8


def model_shape(hidden: int) -> dict:
    return {"preset": None, "hidden_size": hidden, "num_layers": 4, "num_heads": 8,
            "vocab_size": 256}


def kendall_tau(a: dict, b: dict) -> float:
    """Kendall's tau-a of two scorings of the same keys."""
    keys = list(a)
    pairs = [(i, j) for n, i in enumerate(keys) for j in keys[n + 1:]]
    sign = [((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs]
    return sum(sign) / len(pairs)


def step_cfg(dataset, tmp, name, hidden: int):
    par, train = STEP_LAYOUTS[name]
    return make_cfg(dataset, Path(tmp) / name, model=model_shape(hidden),
                    data={"paths": [dataset], "seq_length": STEP_SEQ, "split": "90,10,0"},
                    parallel={**par, "bucket_size_mb": 1000}, train__micro_batch_size=1,
                    train__train_iters=1000, **{f"train__{k}": v for k, v in train.items()})


def _timed(fn, reps: int) -> float:
    comm.barrier(comm.world_group(), "bench")
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    comm.barrier(comm.world_group(), "bench")
    return (time.perf_counter() - start) / reps


def _collectives(out: dict, world, nbytes: int, reps: int) -> None:
    full = torch.ones(nbytes // 4)
    half = torch.empty(nbytes // 8)
    out[("all_reduce", nbytes)] = _timed(lambda: comm.all_reduce(full, world, "bench"), reps)
    out[("reduce_scatter", nbytes)] = _timed(
        lambda: comm.reduce_scatter_tensor(half, full, world, "bench"), reps)
    out[("all_gather", nbytes)] = _timed(
        lambda: comm.all_gather_into_tensor(full, half, world, "bench"), reps)


def _ping_pong(rank: int, nbytes: int) -> float:
    msg = torch.ones(nbytes // 4)

    def once():
        if rank == 0:
            comm.send(msg, 1, "bench")
            comm.recv(msg, 1, "bench")
        else:
            comm.recv(msg, 0, "bench")
            comm.send(msg, 0, "bench")
    return _timed(once, 10) / 2


def _optimizer_step(numel: int) -> float:
    w = torch.nn.Parameter(torch.zeros(numel))
    w.grad = torch.ones(numel)
    copy = torch.empty(numel)
    adamw = torch.optim.AdamW([w], lr=1e-3, fused=True)

    def step():  # the norm's read (fp64 sums of 1M-element chunks), AdamW, the compute copy
        sum(torch.linalg.vector_norm(c, dtype=torch.float64) for c in w.grad.split(1 << 20))
        adamw.step()
        copy.copy_(w)
    step()
    return _timed(step, 3)


def _machine(rank, flat_numel: int, act_bytes: int) -> dict:
    """This machine's figures between the two ranks: seconds per call of each collective kind
    at the sizes a step moves (1 KiB, an activation, the model's flat buffer), a one-way send,
    and the optimizer's traffic."""
    out, world = {}, comm.world_group()
    for nbytes in (1024, act_bytes, 4 * flat_numel):  # control values, tp's [b, s, h], dp's
        _collectives(out, world, nbytes, 2 if nbytes > act_bytes else 10)
    for nbytes in (1024, act_bytes):
        out[("p2p", nbytes)] = _ping_pong(rank, nbytes)
    for numel in (flat_numel // 2, flat_numel):  # a rank's own range sharded over 2, and whole
        out[("optimizer", numel)] = _optimizer_step(numel)
    return out


def _time_layouts(rank, world, dataset, tmp, hidden, rounds):
    """Per round: seconds of one train_step of each layout, and the machine's figures."""
    from bloomtrain.train import Trainer
    trainers = {}
    for name in STEP_LAYOUTS:
        trainer = Trainer(step_cfg(dataset, tmp, name, hidden), log=lambda *a: None)
        trainer.train_step(trainer.data.next_batch())  # warm: first-call allocations
        trainers[name] = trainer
    flat = hidden ** 2 * 12 * 4  # ~ the flat buffer of 4 layers
    steps = {name: [] for name in STEP_LAYOUTS}
    machine = []
    for _ in range(rounds):
        machine.append(_machine(rank, flat, 4 * STEP_SEQ * hidden))
        for name, trainer in trainers.items():
            batch = trainer.data.next_batch()
            comm.barrier(comm.world_group(), "bench")
            start = time.perf_counter()
            trainer.train_step(batch)
            comm.barrier(comm.world_group(), "bench")
            steps[name].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.engine.remove_hooks()
        trainer.data.stream.close()
        trainer.metrics.close()
    return steps, machine


def _alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per call, bytes per second) of the line through two (bytes, seconds) points."""
    (n0, t0), (n1, t1) = points
    bandwidth = (n1 - n0) / max(t1 - t0, 1e-9)
    return max(t0 - n0 / bandwidth, 0.0), bandwidth


def _seconds(machine: dict, kind: str, nbytes: float) -> float:
    """The measured time of one `kind` of `nbytes`: on the line through the two measured sizes
    around it (gloo's cost per byte differs between small and large messages)."""
    points = sorted((n, t) for (k, n), t in machine.items() if k == kind)
    pair = next((points[i:i + 2] for i in range(len(points) - 2) if nbytes <= points[i + 1][0]),
                points[-2:])
    latency, bandwidth = _alpha_beta(pair)
    return latency + nbytes / bandwidth


@contextmanager
def measured_collectives(machine: dict):
    """The planner with its collectives timed as measured here (two ranks)."""
    steptime = importlib.import_module("bloomtrain.planner.steptime")

    def ring_time(kind, nbytes, size, link):
        if size <= 1 or nbytes <= 0:
            return 0.0
        assert size == 2, size
        return _seconds(machine, kind, nbytes)
    with mock.patch.object(steptime, "ring_time", ring_time):
        yield


def measured_cluster(cfg, machine: dict) -> Cluster:
    """Two 'cpu' devices with this machine's send latency and bandwidth and its optimizer
    traffic rate."""
    p2p = _alpha_beta(sorted((n, t) for (k, n), t in machine.items() if k == "p2p"))
    (n0, t0), (n1, t1) = sorted((n, t) for (k, n), t in machine.items() if k == "optimizer")
    seconds_per_element = (t1 - t0) / (n1 - n0)
    work = workload_from_config(cfg, device="cpu")
    hbm = (32 + work.compute_bytes) / seconds_per_element / 1e9  # the term's own bytes
    rates = replace(GPUS["cpu"].efficiency, hbm=1.0)
    cpu = replace(GPUS["cpu"], name="cpu (measured)", hbm_gbs=hbm, nvlink_gbps=p2p[1] * 8e-9,
                  latency_s=p2p[0], efficiency=rates)
    return Cluster(cpu, 2, 2)


def per_round_median(rounds: list[dict]) -> dict:
    """Each key's median over rounds, after dividing out each round's common slowdown (the median
    over keys of round/overall): the machine's load moves every layout of a round alike."""
    keys = list(rounds[0])
    overall = {k: statistics.median(r[k] for r in rounds) for k in keys}
    factor = [statistics.median(r[k] / overall[k] for k in keys) for r in rounds]
    return {k: statistics.median(r[k] / f for r, f in zip(rounds, factor)) for k in keys}


def _calibrate(cfg, measured_s: float, cluster: Cluster, tmp: Path) -> float:
    """The GEMM efficiency `bloomtrain plan --calibrate RUN_DIR` finds in a run of `cfg` whose
    records say `measured_s` per step."""
    run = tmp / "calibration"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    layout = ParallelLayout.from_config(cfg.parallel, 2).label()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": measured_s, "layout": layout}) + "\n"
        for i in range(1, 4)))
    return calibrate_efficiency(str(run), cluster).efficiency


def measure(tmp: Path, hidden: int = 512, rounds: int = 10) -> dict:
    """Time the nine layouts, calibrate on one, predict the rest: the figures as a dict."""
    dataset = write_synthetic_dataset(tmp / "data" / "synth_text_document")
    steps, machine = run_ranks(2, _time_layouts, dataset, str(tmp), hidden, rounds)[0]
    measured = per_round_median([{n: v[i] for n, v in steps.items()} for i in range(rounds)])
    cfgs = {name: step_cfg(dataset, tmp, name, hidden) for name in STEP_LAYOUTS}
    figures = per_round_median(machine)
    cluster = measured_cluster(cfgs[CALIBRATION], figures)
    with measured_collectives(figures):
        eff = _calibrate(cfgs[CALIBRATION], measured[CALIBRATION], cluster, tmp)
        calibrated = cluster.with_efficiency(eff)
        plans = {name: evaluate(candidate_from_config(cfg, 2),
                                workload_from_config(cfg, device="cpu"), calibrated,
                                memory_limit=float("inf")) for name, cfg in cfgs.items()}
    predicted = {n: p.step_time_s for n, p in plans.items()}
    ratios = {n: measured[n] / predicted[n] for n in measured}
    tau = kendall_tau(measured, predicted)
    return {"bench": "planner_steptime", "hidden": hidden, "rounds": rounds,
            "gemm_efficiency": eff, "calibration": CALIBRATION, "tau": tau,
            "measured_ms": {n: v * 1e3 for n, v in measured.items()},
            "predicted_ms": {n: v * 1e3 for n, v in predicted.items()},
            "dp_exposed_ms": {n: p.time["dp_comm_exposed_s"] * 1e3 for n, p in plans.items()},
            "terms_ms": {n: {k: v * 1e3 for k, v in p.time.items() if k.endswith("_s")}
                         for n, p in plans.items()},
            "ratios": ratios, "worst_ratio": max(max(r, 1 / r) for r in ratios.values()),
            "within_bounds": tau >= MIN_TAU and all(1 / STEP_TOL <= r <= STEP_TOL
                                                    for r in ratios.values())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10,
                    help="each round times one step of every layout, so that load drifts hit "
                         "all alike")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(Path(tmp), args.hidden, args.rounds)
    print(f"gemm efficiency {out['gemm_efficiency']:.3f} from {CALIBRATION}; "
          f"tau {out['tau']:.2f} (bound {MIN_TAU})")
    for n in STEP_LAYOUTS:
        print(f"{n:15s} measured {out['measured_ms'][n]:7.1f} ms  predicted "
              f"{out['predicted_ms'][n]:7.1f} ms  ratio {out['ratios'][n]:.2f}  "
              f"dp {out['dp_exposed_ms'][n]:.1f} ms  tp {out['terms_ms'][n]['tp_comm_s']:.1f} ms")
    print(f"worst ratio {out['worst_ratio']:.2f} (bound {STEP_TOL}); within issue 29's bounds: "
          f"{out['within_bounds']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
