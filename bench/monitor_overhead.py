"""What the trainer's monitors (bloomtrain/train/monitors.py) cost: the gradient analyser, the
per-record memory read and gather, TensorBoard.

Whole runs of `--steps` steps of a small model (hidden 256, 4 layers, seq 128, fp32 on the CPU,
one process; the synthetic dataset of the tests), timed from `Trainer.run()` start to end and
divided by the steps, so that what happens between steps (records, their gather) counts too.
The final evaluation is one batch (eval_iters 1), the same in every side. Sides:
- defaults:        train.grad_stats_interval 100, run.tensorboard unset (on when installed)
- all_off:         grad_stats_interval 0, run.tensorboard false
- grad_stats_1:    every step analysed, TensorBoard off
- grad_stats_100:  one step in 100 analysed, TensorBoard off
The straggler/memory gather of each record cannot be switched off; it is timed on its own
below. `--rounds` rounds alternate the sides (the first side alternates too, bench.common); the
median per side is reported, of the wall time and of this process's CPU time (the latter is
what to read on a machine that other work shares). Log interval 10 in every side.

Also, on one trainer: the extra time of one analysed optimizer step (engine.step with and without
grad_stats, alternating, median), the host cost of one record's monitor fields on one process
(memory read, the gather as a local copy, the straggler rule), and the gather itself over 2 gloo
ranks (all-gather of 4 float64 per rank). Prints the figures, then one JSON line. Measures;
asserts nothing.

    python bench/monitor_overhead.py
    python bench/monitor_overhead.py --steps 200 --rounds 5 --device cuda
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import alternate_rounds  # noqa: E402
from tests import helpers  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.synthetic import write_synthetic_dataset  # noqa: E402

SIDES = {
    "defaults": {"train": {"grad_stats_interval": 100}, "run": {}},
    "all_off": {"train": {"grad_stats_interval": 0}, "run": {"tensorboard": False}},
    "grad_stats_1": {"train": {"grad_stats_interval": 1}, "run": {"tensorboard": False}},
    "grad_stats_100": {"train": {"grad_stats_interval": 100}, "run": {"tensorboard": False}},
}


def make_cfg(args, dataset: str, run_dir: str, side: dict):
    from bloomtrain.config import Config
    return Config.from_dict({
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": args.heads, "vocab_size": 256},
        "data": {"paths": [dataset], "seq_length": args.seq, "split": "90,10,0"},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_samples": 0},
        "train": {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch,
                  "train_iters": args.steps, "precision": "fp32", "log_interval": 10,
                  "eval_iters": 1, "device": args.device, **side["train"]},
        "run": side["run"],
        "run_dir": run_dir})


def time_run(args, dataset: str, tmp: Path, side: dict) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per step of one whole run (construction
    excluded). The CPU time, user + system of every thread, is the work itself: other load on a
    shared machine stretches the wall time of whichever side it lands on, not the CPU time."""
    from bloomtrain.train import Trainer
    trainer = Trainer(make_cfg(args, dataset, tempfile.mkdtemp(dir=tmp), side),
                      log=lambda *a: None)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.run()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return ((time.perf_counter() - start) / args.steps,
            (time.process_time() - cpu) / args.steps)


def analysed_step_extra(args, dataset: str, tmp: Path) -> tuple[float, float]:
    """(median seconds of an optimizer step with the analyser, without), alternating, on one
    trainer after a forward and backward each."""
    from bloomtrain.parallel.pipeline import pipeline_train_step
    from bloomtrain.train import Trainer
    trainer = Trainer(make_cfg(args, dataset, tempfile.mkdtemp(dir=tmp), SIDES["all_off"]),
                      log=lambda *a: None)
    batch = trainer.data.next_batch()
    times = {True: [], False: []}
    for i in range(2 * args.step_samples + 4):
        analyse = i % 2 == 0
        pipeline_train_step(trainer.cfg.parallel.pp_schedule, trainer.parts.chunks, batch,
                            trainer.topo, scale_loss=trainer.optimizer.scale_loss,
                            **trainer._schedule_kwargs(batch))
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        helpers.step(trainer.optimizer, 1e-5, grad_stats=analyse)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 4:  # two of each warm up
            times[analyse].append(time.perf_counter() - start)
    return statistics.median(times[True]), statistics.median(times[False])


def record_cost(args, dataset: str, tmp: Path, calls: int = 200) -> float:
    """Median seconds of one record's monitor fields on one process."""
    from bloomtrain.train import Trainer
    trainer = Trainer(make_cfg(args, dataset, tempfile.mkdtemp(dir=tmp), SIDES["all_off"]),
                      log=lambda *a: None)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        trainer.monitors.record(0.1, 10)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gather_rank(rank, world, calls):
    from bloomtrain.parallel import comm
    torch.set_num_threads(1)
    mine = torch.zeros(4, dtype=torch.float64)
    rows = torch.empty(4 * world, dtype=torch.float64)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        comm.all_gather_into_tensor(rows, mine, comm.world_group(), "monitor")
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-samples", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        dataset = write_synthetic_dataset(tmp / "data" / "synth_text_document")
        runs = alternate_rounds({name: (lambda s=side: time_run(args, dataset, tmp, s))
                                 for name, side in SIDES.items()},
                                timer=lambda step: step(), warmup=0, rounds=args.rounds,
                                steps_per_round=1)
        with_stats, without = analysed_step_extra(args, dataset, tmp)
        record_s = record_cost(args, dataset, tmp)
        gather_s = run_ranks(2, _gather_rank, 200)[0]
    step_ms = {name: 1e3 * statistics.median(w for w, _ in t) for name, t in runs.items()}
    cpu_ms = {name: 1e3 * statistics.median(c for _, c in t) for name, t in runs.items()}
    out = {
        "bench": "monitor_overhead", "device": args.device, "threads": args.threads,
        "shape": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq,
                  "micro_batch": args.micro_batch},
        "steps_per_run": args.steps, "rounds": args.rounds,
        "step_ms": step_ms,
        "step_ms_rounds": {name: [1e3 * w for w, _ in t] for name, t in runs.items()},
        "cpu_ms": cpu_ms,
        "defaults_vs_all_off_pct": 100 * (step_ms["defaults"] / step_ms["all_off"] - 1),
        "defaults_vs_all_off_cpu_pct": 100 * (cpu_ms["defaults"] / cpu_ms["all_off"] - 1),
        "grad_stats_1_vs_100_pct": 100 * (step_ms["grad_stats_1"] / step_ms["grad_stats_100"]
                                          - 1),
        "optimizer_step_ms": {"analysed": 1e3 * with_stats, "plain": 1e3 * without},
        "analysed_step_extra_ms": 1e3 * (with_stats - without),
        "record_fields_ms_one_process": 1e3 * record_s,
        "gather_ms_2_gloo_ranks": 1e3 * gather_s,
    }
    print(f"step time per side (median of {args.rounds} runs of {args.steps} steps, ms; wall, "
          f"then this process's CPU time):")
    for name, ms in step_ms.items():
        print(f"  {name:15s} {ms:8.2f}   cpu {cpu_ms[name]:8.2f}   rounds: "
              + " ".join(f"{x:.2f}" for x in out["step_ms_rounds"][name]))
    print(f"defaults vs all off: {out['defaults_vs_all_off_pct']:+.1f}% wall, "
          f"{out['defaults_vs_all_off_cpu_pct']:+.1f}% CPU; grad stats every step "
          f"vs every 100: {out['grad_stats_1_vs_100_pct']:+.1f}%")
    print(f"optimizer step: {1e3 * with_stats:.2f} ms analysed, {1e3 * without:.2f} ms plain "
          f"({out['analysed_step_extra_ms']:+.2f} ms; over 100 steps "
          f"{out['analysed_step_extra_ms'] / 100:+.3f} ms/step)")
    print(f"one record's monitor fields, one process: {out['record_fields_ms_one_process']:.3f} "
          f"ms; the gather over 2 gloo ranks: {out['gather_ms_2_gloo_ranks']:.3f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
