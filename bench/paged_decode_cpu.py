"""Decode attention over the paged KV cache on the CPU, kernel against kernel: one layer's
attention of D sequences decoding one token each at a context of L tokens (block tables shuffled
over a pool of D x L tokens plus slack), timed per call (median of --reps), with the step's
metadata built once per step outside the timing (it is shared by every layer):
- gather: the blocks copied out (PagedKVCache.read) and HF's eager math (the engine's CPU path);
- gather_sdpa: the same copy, then F.scaled_dot_product_attention with the float bias
  (not batch invariant on CPU: bloomtrain.model.attention.eager_attention says why);
- flex_eager: bloomtrain.model.paged_flex read in place, FlexAttention's eager reference;
- flex_compiled: the same under torch.compile (inductor's CPU flex template); with
  `flex_compiled_alone_bitwise`, whether the first sequence's result decoded alone is bitwise
  its result in the batch (the engine's batch invariance on CPU).
One torch thread by default (the engine's serving setting). Measures; asserts nothing. Prints
one line per case, then one JSON line.

    python bench/paged_decode_cpu.py
    python bench/paged_decode_cpu.py --seqs 1 8 32 --ctx 128 512 --dtype bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


def timed(fn, reps: int) -> float:
    fn()  # warm-up (and the compilation, for the compiled kernel)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def case(torch, d: int, ctx: int, args, dtype) -> dict:
    import torch.nn.functional as F

    from bloomtrain.model.bloom import alibi_slopes
    from bloomtrain.model.paged_flex import flex_paged_decode
    from bloomtrain.serve.batch import SeqStep, StepBatch
    from bloomtrain.serve.kv_cache import PagedKVCache
    from bloomtrain.serve.runner import plan_step

    bs, nh, hd = args.block_size, args.heads, args.head_dim
    per = -(-ctx // bs)
    pool = d * per + 8
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, pool, bs, nh, hd, dtype, "cpu")
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=g))
    order = torch.randperm(pool, generator=g).tolist()
    seqs = [SeqStep(i, 1, ctx, order[i * per:(i + 1) * per]) for i in range(d)]
    batch = StepBatch([0] * d, seqs, list(range(d)))
    slopes = alibi_slopes(nh)
    q = torch.randn((1, nh, d, hd), generator=g).to(dtype)
    empty = torch.zeros((1, nh, 0, hd), dtype=dtype)

    def attend(meta):
        # No new keys to write: attention alone is timed.
        meta = dataclasses.replace(meta, write_slots=meta.write_slots[:0], num_tokens=0)
        return lambda: meta.attend(0, q, empty, empty)

    _, gather, _ = plan_step(batch, cache, slopes, dtype, "cpu", 1, "gather")
    _, flex, _ = plan_step(batch, cache, slopes, dtype, "cpu", 1, "flex")
    rows, tables, buffer, bias = gather.decodes[0]

    def sdpa():
        keys, values = cache.read(0, tables, buffer)  # [nh, D, Lp, hd]
        qd = q[0].index_select(1, rows).reshape(nh, d, 1, hd)
        return F.scaled_dot_product_attention(qd, keys, values,
                                              attn_mask=bias.view(nh, d, 1, -1))

    q_pos = torch.full((d,), ctx - 1)
    compiled = dataclasses.replace(flex, flex_decodes=[flex_paged_decode(
        rows, tables, q_pos, slopes, bs, cache.plane_blocks, compiled=True)])
    fns = {"gather": attend(gather), "gather_sdpa": sdpa, "flex_eager": attend(flex),
           "flex_compiled": attend(compiled)}
    out = {"seqs": d, "ctx": ctx}
    for name, fn in fns.items():
        if name == "flex_eager" and pool * bs > args.eager_max_slots:
            continue  # the reference materializes D x heads x pool scores: too slow to wait on
        out[name + "_ms"] = round(timed(fn, args.reps) * 1e3, 3)
    ref = fns["gather"]()
    batched = fns["flex_compiled"]()
    out["flex_compiled_max_diff"] = float((batched - ref).abs().max())
    if d > 1:  # batch invariance: the first sequence decoded alone, bitwise?
        alone = dataclasses.replace(flex, flex_decodes=[flex_paged_decode(
            rows[:1], tables[:1], q_pos[:1], slopes, bs, cache.plane_blocks, compiled=True)])
        alone = dataclasses.replace(alone, write_slots=alone.write_slots[:0], num_tokens=0)
        first = alone.attend(0, q[:, :, :1], empty, empty)
        out["flex_compiled_alone_bitwise"] = torch.equal(first[0, :, 0], batched[0, :, 0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--heads", type=int, default=16)   # bloom-560m's heads and head size
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eager-max-slots", type=int, default=4096)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    results = []
    with torch.inference_mode():
        for ctx in args.ctx:
            for d in args.seqs:
                r = case(torch, d, ctx, args, dtype)
                print(r, flush=True)
                results.append(r)
    print(json.dumps({"bench": "paged_decode_cpu", "dtype": args.dtype, "threads": args.threads,
                      "heads": args.heads, "head_dim": args.head_dim,
                      "block_size": args.block_size, "cases": results}))


if __name__ == "__main__":
    main()
