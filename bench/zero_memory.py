"""Model-state memory per rank under ZeRO stages 0-3 (arXiv 1910.02054): measured buffer bytes
against our layout's formula and the paper's, on 4 gloo ranks (dp=4) and a model of >= 10M
parameters.

Measured = the storage bytes of the optimizer's flat buffers on rank 0 (compute parameters, fp32
master, fp32 gradients, Adam m and v) after one bf16 training step, plus stage 3's peak of gathered
working copies (reported next to its bound, not part of the Ψ formula). Prints a table, then one
JSON line. Measures; asserts nothing.

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

from bloomtrain.config import OptimConfig  # noqa: E402
from bloomtrain.model import build_model  # noqa: E402
from bloomtrain.parallel.zero import MixedPrecisionOptimizer  # noqa: E402
from bloomtrain.topology import Topology  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

CATEGORIES = ("compute_params", "fp32_master", "fp32_grads", "adam_m", "adam_v")


def measure(rank, world, shape, seq):
    topo = Topology.build(1, 1)
    reports = {}
    ids = torch.randint(0, shape.vocab_size, (1, seq + 1),
                        generator=torch.Generator().manual_seed(rank))
    for stage in range(4):
        model = build_model(shape, seed=1)
        opt = MixedPrecisionOptimizer(model, OptimConfig(), "bf16", topo, zero_stage=stage)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        opt.step(1e-4)
        rep = opt.memory_report()
        rep["working_bound"] = opt.working_set_bound()
        reports[stage] = rep
        opt.remove_hooks()
        del model, opt
    return reports


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap, hidden=256, layers=8, heads=8, vocab=32768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dp", type=int, default=4)
    args = ap.parse_args()
    shape = shape_from_args(args)
    psi = shape.num_parameters()
    print(f"model: L={shape.num_layers} h={shape.hidden_size} V={shape.vocab_size}, "
          f"Ψ = {psi:,} parameters; dp = {args.dp} gloo ranks; bf16 compute; bytes per rank")
    reports = run_ranks(args.dp, measure, shape, args.seq)[0]
    rows, worst = [], 0.0
    header = f"{'stage':>5} " + " ".join(f"{c:>14}" for c in CATEGORIES) + \
        f" {'measured':>12} {'formula':>12} {'diff %':>7} {'paper':>12}"
    print(header)
    for stage, rep in reports.items():
        m, f = rep["measured"], rep["formula"]
        diff = 100.0 * (m["total"] - f["ours"]) / f["ours"]
        worst = max(worst, abs(diff))
        print(f"{stage:>5} " + " ".join(f"{m[c]:>14,}" for c in CATEGORIES)
              + f" {m['total']:>12,} {f['ours']:>12,.0f} {diff:>7.3f} {f['paper']:>12,.0f}")
        rows.append({"stage": stage, "measured": {c: m[c] for c in CATEGORIES},
                     "measured_total": m["total"], "formula_total": f["ours"],
                     "diff_pct": diff, "paper_total": f["paper"],
                     "gathered_peak": m["gathered_peak"],
                     "grad_staging_peak": m["grad_staging_peak"]})
    s3 = reports[3]["measured"]
    print("formulas (ours | paper, fp16 grads): 0: 18Ψ | 16Ψ;  1: 2Ψ+4Ψ+12Ψ/N | 4Ψ+12Ψ/N;  "
          "2: 2Ψ+16Ψ/N | 2Ψ+14Ψ/N;  3: 18Ψ/N + W | 16Ψ/N")
    print(f"stage 3 working set W: gathered peak {s3['gathered_peak']:,} B "
          f"(bound: two blocks + tied embedding = {reports[3]['working_bound']:,} B); "
          f"stage 2-3 in-flight fp32 gradient buckets peak {s3['grad_staging_peak']:,} B")
    print(f"largest |measured - formula| = {worst:.3f}% (segments are padded to a multiple of dp)")
    print(json.dumps({"bench": "zero_memory", "psi": psi, "dp": args.dp, "stages": rows,
                      "max_abs_diff_pct": worst}))


if __name__ == "__main__":
    main()
