"""Where one training step's time goes: one bloomtrain step (bench/step_throughput.py's, after
warm-up steps) under torch.profiler, its kernel time summed into categories, with the largest
kernels and their shares. On CUDA the device's kernel time (and the time the GPU sat idle waiting
on the host: the step's wall time less the union of its kernels' intervals); on the CPU the ops'
self CPU time, and as "idle" the step's time outside any op (Python and dispatch).

Categories, by kernel or op name (CATEGORIES, first match wins): GEMM, attention (forward and
backward), LayerNorm, the loss (log-softmax and NLL over the vocabulary), optimizer, copies (H2D,
D2H, D2D), communication, and elementwise and other memory-bound kernels (GeLU, dropout, adds,
casts): everything else.

    python bench/profile_step.py                                  # a small shape on the CPU
    python bench/profile_step.py --preset bloom-1b7 --seq 2048 --micro-batch 2 --device cuda

Prints the table, then one JSON line. Measures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args  # noqa: E402
from bench.step_throughput import (  # noqa: E402
    add_zero_args,
    check_zero_args,
    make_bloomtrain,
    shape_and_batch,
    sync,
)

# (category, pattern over a kernel's or an op's name, lower case): the first that matches.
CATEGORIES = (
    ("communication", r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast|c10d"),
    ("copies", r"memcpy|memset|aten::copy_|aten::_to_copy|aten::to$|aten::contiguous|"
               r"aten::clone|direct_copy"),
    ("optimizer", r"adam|foreach|multi_tensor|fused_sgd|optim"),
    # Before attention, whose softmax pattern would take the loss's log-softmax (on CUDA
    # cunn_SoftMaxForward<...LogSoftMaxForwardEpilogue>: at BLOOM's 250,880-token vocabulary a
    # large share of the step, and nothing to do with attention).
    ("loss", r"log_?softmax|nll_loss|cross_entropy"),
    ("attention", r"flash|fmha|attention|flex|sdpa|softmax|_efficient_attention|cudnn_mha|"
                  r"triton_tem_fused|baddbmm"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|aten::mm$|aten::addmm|aten::bmm|"
             r"aten::linear|aten::_addmm_activation|sm\d\d_.*(h|s)\d*gemm"),
    ("LayerNorm", r"layer_?norm|gammabeta"),  # GammaBetaBackward: its weight gradients
)
ORDER = ("GEMM", "attention", "LayerNorm", "loss", "elementwise/other", "optimizer", "copies",
         "communication", "idle")


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "elementwise/other"


def _device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every device kernel and copy of the profile."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            start = e.time_range.start
            out.append((e.name, float(start), float(e.device_time_total)))
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, d in sorted(intervals):
        if s + d > end:
            total += s + d - max(s, end)
            end = s + d
    return total


def breakdown(prof, wall_s: float, device: torch.device, top: int) -> dict:
    """{categories: {name: {ms, share}}, top: [{name, ms, share, calls, category}]} of a
    profiled step of `wall_s` seconds."""
    per_name: dict[str, list[float]] = {}
    if device.type == "cuda":
        kernels = _device_kernels(prof)
        for name, _, dur in kernels:
            per_name.setdefault(name, []).append(dur / 1e3)
        busy_ms = _union([(s, d) for _, s, d in kernels]) / 1e3
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0 and e.key.startswith("aten::"):
                per_name.setdefault(e.key, []).extend([e.self_cpu_time_total / 1e3 / e.count]
                                                      * e.count)
        busy_ms = sum(sum(v) for v in per_name.values())
    wall_ms = wall_s * 1e3
    cats = {c: 0.0 for c in ORDER}
    for name, times in per_name.items():
        cats[category(name)] += sum(times)
    cats["idle"] = max(0.0, wall_ms - busy_ms)
    total = sum(cats.values()) or 1.0
    largest = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_ms": wall_ms, "busy_ms": busy_ms,
            "categories": {c: {"ms": ms, "share": ms / total} for c, ms in cats.items()},
            "top": [{"name": n, "ms": sum(t), "share": sum(t) / total, "calls": len(t),
                     "category": category(n)} for n, t in largest]}


def profile_one_step(step, device: torch.device):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t0
    return prof, wall


def print_table(result: dict, label: str) -> None:
    print(f"\n{label}: step {result['wall_ms']:.1f} ms")
    print("| category | ms | share |\n|---|---|---|")
    for c, v in result["categories"].items():
        print(f"| {c} | {v['ms']:.2f} | {v['share']:.1%} |")
    print("\n| largest kernels | category | calls | ms | share |\n|---|---|---|---|---|")
    for k in result["top"]:
        print(f"| {k['name'][:70]} | {k['category']} | {k['calls']} | {k['ms']:.2f} | "
              f"{k['share']:.1%} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None)
    add_shape_args(ap, hidden=256, layers=4, heads=8, vocab=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--activation-checkpointing", default="none",
                    choices=("none", "selective", "full"))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex", "eager"))
    add_zero_args(ap)
    args = ap.parse_args(argv)
    check_zero_args(ap, args)
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                               else ("cpu" if args.device == "auto" else args.device))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = args.device
    shape, ids = shape_and_batch(args)
    step, ran = make_bloomtrain(shape, ids, device, args)
    for _ in range(args.warmup):
        step()
    prof, wall = profile_one_step(step, device)
    result = breakdown(prof, wall, device, args.top)
    label = (f"{args.preset or 'shape'} (L={shape.num_layers} h={shape.hidden_size}), seq "
             f"{args.seq}, micro-batch {args.micro_batch}, {device}, attention "
             f"{ran['attention']}, compile {args.compile}, recompute "
             f"{args.activation_checkpointing}")
    print_table(result, label)
    out = {"bench": "profile_step", "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "preset": args.preset, "seq": args.seq,
           "micro_batch": args.micro_batch, "attention": ran["attention"],
           "compile": args.compile, "activation_checkpointing": args.activation_checkpointing,
           **result}
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    print(json.dumps(out))


if __name__ == "__main__":
    main()
