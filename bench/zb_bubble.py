"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241) against 1F1B at pp=4
with 8 micro-batches: the bubble under per-op costs measured on this CPU, and the activation
memory each stage holds, measured.

1. Costs: one middle stage's chunk (its transformer blocks) is timed on one thread: F (forward),
   1F1B's backward, and zb-h1's split of it, B (input gradient) and W (weight gradients), the
   median of `--reps` repetitions each. The shape keeps BLOOM's ratio of attention-core to
   linear-layer work (seq / 6h: 2.4% for BLOOM-176B, 2.1% here).
2. Replay: `schedule_grid` runs every rank's op list under those costs with free communication;
   the bubble is idle over compute time (bloomtrain.parallel.pipeline.grid_bubble).
3. Memory: 4 gloo ranks run one step of each schedule on a small model, each inside
   bench/memtrack's LiveMemory: the peak of live bytes other than the parameters and their
   gradients (activations, messages and, under zb-h1, what B leaves for W), per stage, next to
   the op lists' peak count of micro-batches in flight, and the largest stage's against 1F1B's
   largest (ZB-H1's bound).
4. `--picture PATH`: both replays drawn as one Gantt chart (matplotlib).

    python bench/zb_bubble.py [--reps 21] [--picture docs/pipeline_zb_h1.png]

Prints the tables and a JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.memtrack import LiveMemory  # noqa: E402
from bloomtrain.layout import ParallelLayout  # noqa: E402
from bloomtrain.model import BloomShape, build_model  # noqa: E402
from bloomtrain.parallel.pipeline import (  # noqa: E402
    SCHEDULES,
    DeferWeightGrads,
    WeightGradStore,
    backward_input,
    build_pipeline_chunks,
    grid_bubble,
    op_costs,
    peak_in_flight,
    pipeline_train_step,
    schedule_grid,
    theoretical_bubble,
)
from bloomtrain.topology import Topology  # noqa: E402

PP, NUM_MICRO = 4, 8
SCHEDULE_NAMES = ("1f1b", "zb-h1")
# Timed stage: 8 layers over 4 stages, 2 blocks each; seq / 6h = 64 / 3072.
TIME_SHAPE = BloomShape(vocab_size=512, hidden_size=512, num_layers=8, num_heads=8,
                        ffn_hidden_size=2048)
TIME_SEQ, TIME_MBS = 64, 2
# Memory run: small, so that 4 ranks on 2 cores finish in seconds.
MEM_SHAPE = BloomShape(vocab_size=256, hidden_size=128, num_layers=8, num_heads=4,
                       ffn_hidden_size=512)
MEM_SEQ, MEM_MBS = 64, 2


def measure_costs(reps: int, warmup: int = 3) -> dict[str, float]:
    """Seconds of stage 1's chunk: F and the whole backward (BW) as 1F1B runs them, and zb-h1's
    F, B and W, each the median of `reps` rounds that run all of them in turn (so that a
    machine's load shifts every figure alike), after `warmup` rounds."""
    torch.manual_seed(0)
    (chunk,) = build_pipeline_chunks(build_model(TIME_SHAPE, 0),
                                     ParallelLayout(pp=PP, partition="uniform"), 1)
    params = list(chunk.parameters())
    x = torch.randn(TIME_MBS, TIME_SEQ, TIME_SHAPE.hidden_size, requires_grad=True)
    dy = torch.randn(TIME_MBS, TIME_SEQ, TIME_SHAPE.hidden_size)
    store = WeightGradStore()
    times: dict[str, list[float]] = {k: [] for k in ("F", "BW", "zb_F", "zb_B", "zb_W")}
    for i in range(warmup + reps):
        t = [time.perf_counter()]
        out = chunk(x)
        t.append(time.perf_counter())
        out.backward(dy)
        t.append(time.perf_counter())
        with DeferWeightGrads(store):
            out = chunk(x)
            t.append(time.perf_counter())
            backward_input(out, dy, x, params, store, (0, i))
            t.append(time.perf_counter())
            store.run((0, i))
            t.append(time.perf_counter())
        if i >= warmup:
            for k, (t0, t1) in zip(times, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]):
                times[k].append(t[t1] - t[t0])
    return {k: statistics.median(v) for k, v in times.items()}


def replay(costs: dict[str, float]) -> dict:
    per = {"1f1b": op_costs("1f1b", costs["F"], costs["BW"], 0.0),
           "zb-h1": op_costs("zb-h1", costs["zb_F"], costs["zb_B"], costs["zb_W"])}
    out = {}
    for name in SCHEDULE_NAMES:
        grid = schedule_grid(name, PP, NUM_MICRO, costs=per[name])
        out[name] = dict(bubble=grid_bubble(grid, per[name]), costs=per[name], grid=grid,
                         theory=theoretical_bubble(name, PP, NUM_MICRO, costs=per[name]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_peaks(topo, shape: BloomShape, seq: int, micro_batch: int,
                num_micro: int) -> dict[str, int]:
    """Per schedule, this pipeline rank's peak of live bytes other than parameters and their
    gradients during a training step (the second: the first allocates the gradients), measured
    by LiveMemory."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(num_micro):
        ids = torch.randint(0, shape.vocab_size, (micro_batch, seq + 1), generator=g)
        batches.append(dict(tokens=ids[:, :-1], labels=ids[:, 1:]))
    result = {}
    for name in SCHEDULE_NAMES:
        chunks = build_pipeline_chunks(build_model(shape, 0),
                                       ParallelLayout(pp=topo.pp_size, partition="uniform"),
                                       topo.pp_rank)
        for _ in range(2):
            mem = LiveMemory()
            mem.watch_parameters(chunks[0])
            mem.close_grad_window(chunks[0])
            # The first step's gradients, which this one accumulates into in place: without this
            # the accumulation (an in-place add on memory made before the region) would count
            # them as temporaries.
            mem.register([p.grad for p in chunks[0].parameters() if p.grad is not None],
                         "gradients")
            with mem:
                pipeline_train_step(name, chunks, batches, topo,
                                    recv_shape=(micro_batch, seq, shape.hidden_size),
                                    timeout=120.0)
        # Parameters count as such (close_grad_window); their gradients are marked as such by
        # watch_parameters and the registration above; the rest is "temporaries".
        result[name] = mem.report()["category_peaks"]["temporaries"]
    return result


def _memory_rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=timedelta(seconds=300))
    try:
        peaks = stage_peaks(Topology.build(tp=1, pp=PP), MEM_SHAPE, MEM_SEQ, MEM_MBS, NUM_MICRO)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(peaks, f)
    finally:
        dist.destroy_process_group()


def measure_memory() -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_memory_rank, args=(_free_port(), out_dir), nprocs=PP,
                           start_method="spawn")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(PP)]


def draw(replays: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.8), sharex=True)
    for ax, name in zip(axes, SCHEDULE_NAMES):
        r = replays[name]
        for stage, row in enumerate(r["grid"]):
            for start, op in row:
                width = r["costs"][op.kind]
                ax.barh(stage, width * 1e3, left=start * 1e3, color=colors[op.kind],
                        edgecolor="white", linewidth=0.5)
                ax.text((start + width / 2) * 1e3, stage, f"{op.kind}{op.micro_batch}",
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(PP), [f"stage {s}" for s in range(PP)])
        ax.invert_yaxis()
        ax.set_title(f"{name}: bubble {r['bubble']:.3f} (idle / compute)", fontsize=9)
    axes[-1].set_xlabel(f"ms (replay with F, B, W timed on this CPU; pp={PP}, "
                        f"m={NUM_MICRO}; 1F1B's B is the whole backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--picture", default=None, help="write the Gantt chart here (PNG)")
    parser.add_argument("--no-memory", action="store_true", help="skip the 4-rank memory run")
    args = parser.parse_args()
    torch.set_num_threads(1)

    costs = measure_costs(args.reps)
    print(f"per-op costs of one middle stage (hidden {TIME_SHAPE.hidden_size}, 2 blocks, seq "
          f"{TIME_SEQ}, micro-batch {TIME_MBS}), median of {args.reps}, ms:")
    print(f"  1F1B   F {costs['F'] * 1e3:.2f}  backward {costs['BW'] * 1e3:.2f}")
    print(f"  zb-h1  F {costs['zb_F'] * 1e3:.2f}  B {costs['zb_B'] * 1e3:.2f}  "
          f"W {costs['zb_W'] * 1e3:.2f}  (B + W = {(costs['zb_B'] + costs['zb_W']) * 1e3:.2f})")
    replays = replay(costs)
    ratio = replays["zb-h1"]["bubble"] / replays["1f1b"]["bubble"]
    print(f"\nreplay, pp={PP}, m={NUM_MICRO}: bubble = idle / compute of the busiest stage")
    for name in SCHEDULE_NAMES:
        r = replays[name]
        print(f"  {name:<6} {r['bubble']:.4f}   (formula {r['theory']:.4f})")
    print(f"  zb-h1 / 1f1b = {ratio:.3f}")

    memory = None
    if not args.no_memory:
        memory = measure_memory()
        print(f"\nmemory, 4 gloo ranks, hidden {MEM_SHAPE.hidden_size}, 2 blocks per stage, seq "
              f"{MEM_SEQ}, micro-batch {MEM_MBS}, m={NUM_MICRO}: peak live KiB other than "
              f"parameters and their gradients (micro-batches in flight, from the op lists)")
        print(f"{'stage':>5}" + "".join(f"{n:>22}" for n in SCHEDULE_NAMES) + f"{'ratio':>8}")
        for r, peaks in enumerate(memory):
            cells = []
            for n in SCHEDULE_NAMES:
                count = peak_in_flight(SCHEDULES[n](PP, r, NUM_MICRO))
                cells.append(f"{peaks[n] / 1024:>14.0f} ({count})")
            ratio_mem = memory[r]["zb-h1"] / memory[r]["1f1b"]
            print(f"{r:>5}" + "".join(f"{c:>22}" for c in cells) + f"{ratio_mem:>8.3f}")
        largest = {n: max(m[n] for m in memory) for n in SCHEDULE_NAMES}
        print(f"{'max':>5}" + "".join(f"{largest[n] / 1024:>22.0f}" for n in SCHEDULE_NAMES)
              + f"{largest['zb-h1'] / largest['1f1b']:>8.3f}   (ZB-H1's bound: the largest "
              f"stage's peak <= 1F1B's largest)")
    if args.picture:
        draw(replays, args.picture)
        print(f"\nwrote {args.picture}")
    print(json.dumps(dict(
        bench="zb_bubble", pp=PP, micro_batches=NUM_MICRO,
        costs_ms={k: round(v * 1e3, 4) for k, v in costs.items()},
        bubble={n: round(replays[n]["bubble"], 4) for n in SCHEDULE_NAMES},
        zb_h1_over_1f1b=round(ratio, 4),
        peak_bytes_per_stage=None if memory is None else {
            n: [m[n] for m in memory] for n in SCHEDULE_NAMES},
        largest_stage_zb_h1_over_1f1b=None if memory is None else round(
            max(m["zb-h1"] for m in memory) / max(m["1f1b"] for m in memory), 4),
        in_flight_per_stage={n: [peak_in_flight(SCHEDULES[n](PP, r, NUM_MICRO))
                                 for r in range(PP)] for n in SCHEDULE_NAMES})))


if __name__ == "__main__":
    main()
