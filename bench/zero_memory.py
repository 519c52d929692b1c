"""Memory per rank under ZeRO stages 0-3 (arXiv 1910.02054) on 4 gloo ranks (dp=4), a model of
>= 10M parameters, one bf16 training step. Default: Ψ = 14.7M parameters and 2 MB gradient
buckets (524,288 fp32 elements), so Ψ is 28x a bucket, as on real models, where buckets are a
small fraction of the model.

Two independent views of the same step:
- measured live: a tracker of every live tensor storage (bench/memtrack.py) over forward,
  backward and optimizer step, by category (parameters, gradients, optimizer, activations,
  temporaries), with the peak of their sum and the breakdown at that moment. It knows nothing of
  the engine's layout; it sees what is allocated and freed.
- the engine's accounting: the bytes of its flat buffers next to our layout's formula and the
  paper's, and the transient terms of the step: stage 3's peak of gathered units, stages 2-3's
  peak of in-flight fp32 gradient buckets and the bound on compute-dtype gradients autograd
  holds. Their sum is the accounted peak (`peak`), an upper bound of the live one (the terms'
  peaks need not coincide).

Each stage runs again with `parallel.offload_optimizer` (ZeRO-Offload, arXiv 2101.06840; rows
"N+off"): the engine's device bytes drop by the masters and moments (12Ψ/N), which it reports as
host bytes beside the fp32 gradient copy there (4Ψ/N). On a CPU run host and device are the same
memory, so the live tracker sees both (its "optimizer" holds the host states and gradient copy).

Prints a table, then one JSON line. Measures; asserts nothing.

    python bench/zero_memory.py
    python bench/zero_memory.py --hidden 512 --layers 8 --vocab 50304 --dp 4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, shape_from_args  # noqa: E402
from bench.memtrack import CATEGORIES, LiveMemory  # noqa: E402

from tests import helpers  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

STATE_CATEGORIES = ("compute_params", "fp32_master", "fp32_grads", "adam_m", "adam_v")


def one_stage(stage, shape, ids, topo, bucket_mb, offload=False):
    cfg = helpers.config(shape, parallel={"zero_stage": stage, "bucket_size_mb": bucket_mb,
                                          "offload_optimizer": offload},
                         precision="bf16", seed=1)
    parts = helpers.build(cfg, helpers.topology(cfg, topo))
    model, eng = parts.chunks[0], parts.engine
    mem = LiveMemory()
    # The tracker's window hooks must run around the engine's own gradient hooks.
    eng.remove_hooks()
    mem.watch_parameters(model)
    eng.install_hooks()
    mem.close_grad_window(model)
    bufs = eng.bufs
    for t in (bufs.compute, bufs.compute_shard):
        if t is not None:
            mem.register(t, "parameters")
    mem.register([t for t in (bufs.master, bufs.exp_avg, bufs.exp_avg_sq, bufs.host_grad)
                  if t is not None], "optimizer")
    mem.register(bufs.grad, "gradients")

    def step():
        with mem.phase("forward"):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        with mem.phase("backward"):
            loss.backward()
        with mem.phase("step"):
            helpers.step(parts.optimizer, 1e-4)
    step()  # the first step records stage 3's unit order; the second is the measured one
    with mem:
        step()
    rep = eng.memory_report()
    rep["working_bound"] = eng.working_set_bound()
    rep["live"] = mem.report()
    eng.remove_hooks()
    return rep


def measure(rank, world, shape, seq, micro_batch, bucket_mb):
    torch.manual_seed(rank)
    ids = torch.randint(0, shape.vocab_size, (micro_batch, seq + 1))
    topo = helpers.topology(helpers.config(shape))
    out = {str(stage): one_stage(stage, shape, ids, topo, bucket_mb) for stage in range(4)}
    out.update({f"{stage}+off": one_stage(stage, shape, ids, topo, bucket_mb, offload=True)
                for stage in range(4)})
    return out


def mb(n: float) -> str:
    return f"{n / 2 ** 20:9.2f}"


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap, hidden=256, layers=8, heads=8, vocab=32768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    args = ap.parse_args()
    shape = shape_from_args(args)
    psi = shape.num_parameters()
    print(f"model: L={shape.num_layers} h={shape.hidden_size} V={shape.vocab_size}, "
          f"Ψ = {psi:,} parameters; dp = {args.dp} gloo ranks; bf16 compute; micro-batch "
          f"{args.micro_batch} x seq {args.seq}; buckets {args.bucket_mb} MB; rank 0, MiB")
    reports = run_ranks(args.dp, measure, shape, args.seq, args.micro_batch, args.bucket_mb)[0]

    print("\nmeasured live (tensor-storage tracker over one step; breakdown at the peak)")
    print(f"{'stage':>5} " + " ".join(f"{c:>12}" for c in CATEGORIES) + f" {'peak':>10}  phase")
    for stage, rep in reports.items():
        live = rep["live"]
        print(f"{stage:>5} " + " ".join(f"{mb(live['at_peak'][c]):>12}" for c in CATEGORIES)
              + f" {mb(live['peak']):>10}  {live['peak_phase']}")

    print("\nengine accounting (flat buffers) vs formula")
    print(f"{'stage':>5} " + " ".join(f"{c:>14}" for c in STATE_CATEGORIES)
          + f" {'measured':>10} {'formula':>10} {'diff %':>7} {'paper':>10} {'gathered':>9}"
          f" {'staging':>9} {'grads16':>9} {'peak':>9} {'host':>9} {'host f.':>9}")
    rows, worst = [], 0.0
    for stage, rep in reports.items():
        m, f, live = rep["measured"], rep["formula"], rep["live"]
        diff = 100.0 * (m["total"] - f["ours"]) / f["ours"]
        worst = max(worst, abs(diff))
        peak = (m["total"] + m["gathered_peak"] + m["grad_staging_peak"]
                + m["compute_grads_held"])
        print(f"{stage:>5} " + " ".join(f"{mb(m[c]):>14}" for c in STATE_CATEGORIES)
              + f" {mb(m['total']):>10} {mb(f['ours']):>10} {diff:>7.3f} {mb(f['paper']):>10}"
              f" {mb(m['gathered_peak']):>9} {mb(m['grad_staging_peak']):>9}"
              f" {mb(m['compute_grads_held']):>9} {mb(peak):>9}"
              f" {mb(m['host']['total']):>9} {mb(f['host']['total']):>9}")
        rows.append({"stage": int(stage[0]), "offload": rep["offload"],
                     "measured": {c: m[c] for c in STATE_CATEGORIES},
                     "measured_total": m["total"], "formula_total": f["ours"],
                     "diff_pct": diff, "paper_total": f["paper"],
                     "gathered_peak": m["gathered_peak"],
                     "grad_staging_peak": m["grad_staging_peak"],
                     "compute_grads_held": m["compute_grads_held"], "peak": peak,
                     "live_peak": live["peak"], "live_peak_phase": live["peak_phase"],
                     "live_at_peak": live["at_peak"],
                     "live_category_peaks": live["category_peaks"],
                     "host_measured": m["host"], "host_formula_total": f["host"]["total"]})
    s3 = reports["3"]["measured"]
    print("formulas (ours | paper, fp16 grads): 0: 18Ψ | 16Ψ;  1: 2Ψ+4Ψ+12Ψ/N | 4Ψ+12Ψ/N;  "
          "2: 2Ψ+16Ψ/N | 2Ψ+14Ψ/N;  3: 16Ψ/N + W | 16Ψ/N;  offload: less 12Ψ/N (3: plus "
          "2Ψ/N), host 16Ψ/N")
    print(f"stage 3 working set W: gathered peak {s3['gathered_peak']:,} B "
          f"(bound: two blocks + tied embedding = {reports['3']['working_bound']:,} B)")
    print(f"largest |buffers - formula| = {worst:.3f}% (segments are padded to a multiple of dp)")
    peaks = [r["peak"] for r in rows if not r["offload"]]
    live = [r["live_peak"] for r in rows if not r["offload"]]
    moved = {r["stage"]: r["measured_total"] for r in rows if not r["offload"]}
    for r in rows:
        if r["offload"]:
            r["device_drop"] = moved[r["stage"]] - r["measured_total"]
    print("offload: device model states drop by "
          + ", ".join(f"{mb(r['device_drop']).strip()} MiB (stage {r['stage']})"
                      for r in rows if r["offload"]))
    falls = all(a > b for a, b in zip(peaks, peaks[1:]))
    live_falls = all(a > b for a, b in zip(live, live[1:]))
    print(f"peak per stage (accounted): {' > '.join(mb(p).strip() for p in peaks)} MiB; "
          f"live: {' > '.join(mb(p).strip() for p in live)} MiB; falls strictly with every "
          f"stage: accounted {falls}, live {live_falls}")
    print(json.dumps({"bench": "zero_memory", "psi": psi, "dp": args.dp, "seq": args.seq,
                      "peak_falls_strictly": falls, "live_peak_falls_strictly": live_falls,
                      "micro_batch": args.micro_batch, "bucket_size_mb": args.bucket_mb,
                      "stages": rows, "max_abs_diff_pct": worst}))


if __name__ == "__main__":
    main()
