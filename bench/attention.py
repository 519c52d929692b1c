"""The attention core alone (softmax(q kᵀ / sqrt(d) + ALiBi + causal) v), forward and forward +
backward, by kernel: which one `train.attention` should pick on this device
(bloomtrain/model/attention.py).

Kernels:
- sdpa-bias-<dtype>: F.scaled_dot_product_attention with the ALiBi+causal float bias
  [1, heads, s, s] (bloomtrain's sdpa path; its bias is in the compute dtype), and the same with
  an fp32 bias;
- hf-eager: HF transformers' BLOOM attention: baddbmm(alibi, q, kᵀ) with ALiBi from *absolute*
  key positions, masked_fill, softmax in fp32, cast back, bmm;
- flex: FlexAttention (arXiv 2412.05496) compiled, ALiBi as a score_mod and a causal BlockMask
  (bloomtrain's flex path). It has no backward on CPU in torch 2.13: forward only there.

Each kernel's error is the max abs difference of its output from fp64 math on the same (rounded)
inputs; "correct" means within max(4 x the best kernel's error, one unit of the compute dtype at
the output's largest value): summation orders differ by a few units, a wrong bias by far more. Times are medians over alternating rounds. Prints a table,
then one JSON line. Measures; asserts nothing.

    python bench/attention.py                                  # hidden 512, 8 heads, s 512, b 4, bf16, CPU
    python bench/attention.py --device cuda --seq 2048
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import alternate_rounds
from bloomtrain.model.attention import (
    attention_core,
    flex_alibi,
    flex_attention_available,
)
from bloomtrain.model.bloom import alibi_causal_bias, alibi_slopes
from bloomtrain.devices import DTYPE_NAMES, torch_dtype



def hf_eager(q, k, v, slopes):
    """HF transformers' BloomAttention core (modeling_bloom.py), on [b, nh, s, hd] inputs."""
    b, nh, s, hd = q.shape
    alibi = (slopes[:, None] * torch.arange(s, device=q.device)[None, :]).to(q.dtype)  # [nh, k]
    alibi = alibi.repeat(b, 1)[:, None, :]  # [b*nh, 1, k]
    scores = torch.baddbmm(alibi, q.reshape(b * nh, s, hd), k.reshape(b * nh, s, hd).mT,
                           beta=1.0, alpha=1.0 / math.sqrt(hd)).view(b, nh, s, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, torch.finfo(q.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def kernels(slopes, s, dtype):
    """name -> fn(q, k, v); each bias is built once, as the model builds it once per forward."""
    def core(bias):
        return lambda q, k, v: attention_core(q, k, v, bias)

    out = {"sdpa-bias-compute": core(alibi_causal_bias(slopes, s, s, dtype))}
    if dtype != torch.float32:
        out["sdpa-bias-fp32"] = core(alibi_causal_bias(slopes, s, s, torch.float32))
    out["hf-eager"] = lambda q, k, v: hf_eager(q, k, v, slopes)
    if flex_attention_available():
        out["flex"] = core(flex_alibi(slopes, s, s))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args) -> dict:
    device, dtype = torch.device(args.device), torch_dtype(args.dtype)
    b, nh, s, hd = args.micro_batch, args.heads, args.seq, args.hidden // args.heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, nh, s, hd, generator=g).to(device=device, dtype=dtype)
               for _ in range(3))
    grad_out = torch.randn(b, nh, s, hd, generator=g).to(device=device, dtype=dtype)
    slopes = alibi_slopes(nh).to(device)
    ref = F.scaled_dot_product_attention(  # fp64 math on the same rounded inputs
        q.double(), k.double(), v.double(),
        attn_mask=alibi_causal_bias(slopes, s, s, torch.float64, device))
    fns = kernels(slopes, s, dtype)
    has_backward = {name: not (name == "flex" and device.type in ("cpu", "mps")) for name in fns}
    results = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(q, k, v)
        _sync(device)
        results[name] = {"first_call_s": time.perf_counter() - t0,
                         "max_err": (out.double() - ref).abs().max().item(),
                         "backward": has_backward[name]}

    def forward(fn):
        def step():
            with torch.no_grad():
                fn(q, k, v)
        return step

    def forward_backward(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def step():
            torch.autograd.grad(fn(*leaves), leaves, grad_out)
        return step

    def timer(step):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        return time.perf_counter() - t0

    fwd = alternate_rounds({n: forward(f) for n, f in fns.items()}, timer, args.warmup,
                           args.rounds, 1)
    fwd_bwd = alternate_rounds({n: forward_backward(f) for n, f in fns.items()
                                if has_backward[n]}, timer, args.warmup, args.rounds, 1)
    for name, r in results.items():
        r["fwd_ms"] = statistics.median(fwd[name]) * 1e3
        r["fwd_bwd_ms"] = statistics.median(fwd_bwd[name]) * 1e3 if name in fwd_bwd else None
    ulp = torch.finfo(dtype).eps * ref.abs().max().item()
    bound = max(4 * min(r["max_err"] for r in results.values()), ulp)
    for r in results.values():
        r["correct"] = r["max_err"] <= bound
    return {"results": results, "error_bound": bound}


def pick(results: dict, key: str) -> str | None:
    timed = {n: r[key] for n, r in results.items() if r["correct"] and r[key] is not None}
    return min(timed, key=timed.get) if timed else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    m = measure(args)
    res = m["results"]
    print(f"attention core: b={args.micro_batch} heads={args.heads} s={args.seq} "
          f"head_dim={args.hidden // args.heads} {args.dtype} on {args.device} "
          f"({torch.get_num_threads()} threads), median of {args.rounds} rounds")
    print(f"{'kernel':<18} {'fwd ms':>9} {'fwd+bwd ms':>11} {'max err':>9} {'correct':>8} "
          f"{'1st call s':>10}")
    for name, r in res.items():
        fb = f"{r['fwd_bwd_ms']:.1f}" if r["fwd_bwd_ms"] is not None else "no bwd"
        print(f"{name:<18} {r['fwd_ms']:>9.1f} {fb:>11} {r['max_err']:>9.2e} "
              f"{'yes' if r['correct'] else 'NO':>8} {r['first_call_s']:>10.2f}")
    train, infer = pick(res, "fwd_bwd_ms"), pick(res, "fwd_ms")
    print(f"error bound {m['error_bound']:.2e}; fastest correct: training {train}, "
          f"forward only {infer}")
    print(json.dumps({"bench": "attention", "device": args.device, "dtype": args.dtype,
                      "batch": args.micro_batch, "heads": args.heads, "seq": args.seq,
                      "head_dim": args.hidden // args.heads, "threads": torch.get_num_threads(),
                      "results": res, "error_bound": m["error_bound"],
                      "fastest_correct_train": train, "fastest_correct_forward": infer}))


if __name__ == "__main__":
    main()
