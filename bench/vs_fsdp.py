"""bloomtrain ZeRO-3 against PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on the same model
and batch, on 4 gloo ranks: model-state bytes per rank and step time, and their ratios.

bloomtrain: the ZeRO engine at stage 3 with bf16 compute: fp32 master, fp32 gradient and fp32
Adam shards; each unit (a BloomBlock, the embedding, ...) gathered per use, cast from the master
shards, with prefetch.
FSDP2: every BloomBlock and the root wrapped with fully_shard, MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32) (fp32 sharded parameters double as the master, fp32
sharded gradients), `clip_grad_norm_(foreach=True)` and torch.optim.AdamW with `fused=True` or
`foreach=True`, whichever runs faster here on DTensors (as FSDP2's users set it up; the
per-parameter default would handicap it). Both clip at 1.0 and use BLOOM's AdamW settings; weight
decay 0.1 on matrices only.

Timing: after `--warmup` steps per side, `--rounds` rounds alternate the sides, each timing
`--steps` steps one by one between barriers; the median is reported.

Model-state bytes are the distinct storages of the sharded parameters, gradients and optimizer
states on rank 0 after a step (before the gradients are released). Prints the figures, then one
JSON line. Measures; asserts nothing. If FSDP2 cannot run here, the output says why.

    python bench/vs_fsdp.py
    python bench/vs_fsdp.py --hidden 512 --layers 8 --seq 128 --steps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_shape_args, alternate_rounds, shape_from_args,  # noqa: E402
                          timed_on_all_ranks)

from bloomtrain.model import build_model  # noqa: E402
from bloomtrain.model.params import base_spec  # noqa: E402
from bloomtrain.parallel import comm  # noqa: E402
from tests import helpers  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

LR = 1e-4



def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def bloomtrain_side(shape, ids, args):
    cfg = helpers.config(shape, parallel={"zero_stage": 3}, optim={"lr": LR, "clip_grad": 1.0},
                         precision="bf16", seed=1)
    parts = helpers.build(cfg)
    model, eng = parts.chunks[0], parts.engine

    def step():
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        helpers.step(parts.optimizer, LR)

    def memory():
        m = eng.memory_report()["measured"]
        return {"model_state_bytes": m["total"],
                "by_category": {k: m[k] for k in ("compute_params", "fp32_master",
                                                  "fp32_grads", "adam_m", "adam_v")},
                "gathered_peak_bytes": m["gathered_peak"]}
    return step, memory, "bloomtrain ZeRO-3 (bf16 compute, fp32 master and grads)"


def fsdp2_side(shape, ids, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(shape, seed=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    named = list(model.named_parameters())

    def make_opt(kind):
        groups = [{"params": [p for n, p in named if base_spec(n).weight_decay],
                   "weight_decay": 0.1},
                  {"params": [p for n, p in named if not base_spec(n).weight_decay],
                   "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, **{kind: True})

    def step_with(opt, zero=True):
        def step():
            model(ids[:, :-1], labels=ids[:, 1:]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            if zero:
                opt.zero_grad(set_to_none=True)
        return step

    # Every rank must agree on the choice: rank 0's timings decide, broadcast.
    timings, unavailable = {}, {}
    for kind in ("fused", "foreach"):
        try:
            opt = make_opt(kind)
            step_with(opt)()
            timings[kind] = statistics.median(timed_on_all_ranks(step_with(opt)) for _ in range(2))
        except (RuntimeError, TypeError, NotImplementedError) as e:
            # torch has no such implementation for DTensors on this device: say so, use the other
            timings[kind] = float("inf")
            unavailable[kind] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    kind = comm.broadcast_object(min(timings, key=timings.get), 0, comm.world_group(), "bench")
    opt = make_opt(kind)

    def memory():
        step_with(opt, zero=False)()  # leave the sharded gradients in place to measure them

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t
        params = [local(p) for p in model.parameters()]
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        m = [local(st["exp_avg"]) for st in opt.state.values()]
        v = [local(st["exp_avg_sq"]) for st in opt.state.values()]
        cats = {"fp32_params": _storage_bytes(params), "fp32_grads": _storage_bytes(grads),
                "adam_m": _storage_bytes(m), "adam_v": _storage_bytes(v)}
        opt.zero_grad(set_to_none=True)
        return {"model_state_bytes": sum(cats.values()), "by_category": cats,
                "optimizer_timings_s": timings, "optimizer_unavailable": unavailable}
    return step_with(opt), memory, f"FSDP2 + torch.optim.AdamW({kind}=True)"


def run_sides(sides, args) -> dict:
    """Warm up every side, then alternate them over rounds; median step time per side."""
    times = alternate_rounds({name: side[0] for name, side in sides.items()}, timed_on_all_ranks,
                             args.warmup, args.rounds, args.steps)
    return {name: {"ran": ran, "step_time_s": statistics.median(times[name]),
                   "step_times_s": times[name], **memory()}
            for name, (_, memory, ran) in sides.items()}


def rank_fn(rank, world, shape, args):
    import warnings
    # BloomBlock returns its KV (views) next to the hidden state; nothing modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(rank))
    sides = {"bloomtrain": bloomtrain_side(shape, ids, args)}
    out = {}
    try:
        sides["fsdp2"] = fsdp2_side(shape, ids, args)
    except Exception as e:  # report exactly why FSDP2 cannot run on this backend/device
        out["fsdp2_error"] = f"{type(e).__name__}: {e}"
        out["fsdp2_traceback"] = traceback.format_exc(limit=4)
    out.update(run_sides(sides, args))
    return out


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap, hidden=256, layers=8, heads=8, vocab=32768)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shape = shape_from_args(args)
    psi = shape.num_parameters()
    print(f"model: L={shape.num_layers} h={shape.hidden_size} V={shape.vocab_size}, Ψ = {psi:,}; "
          f"{args.world} gloo ranks, micro-batch {args.micro_batch} x seq {args.seq} per rank, "
          f"torch {torch.__version__}")
    r = run_ranks(args.world, rank_fn, shape, args)[0]
    ours = r["bloomtrain"]
    out = {"bench": "vs_fsdp", "psi": psi, "world": args.world, "torch": torch.__version__,
           "bloomtrain": ours}
    print(f"{ours['ran']}: {ours['model_state_bytes']:,} B model state per rank "
          f"({ours['model_state_bytes'] / psi:.2f} B/param; formula 16Ψ/N = "
          f"{16 / args.world:.2f}), {ours['step_time_s']:.3f} s/step; "
          f"gathered working peak {ours['gathered_peak_bytes']:,} B")
    if "fsdp2" in r:
        f = r["fsdp2"]
        print(f"{f['ran']}: {f['model_state_bytes']:,} B model state per rank "
              f"({f['model_state_bytes'] / psi:.2f} B/param; 16Ψ/N = {16 / args.world:.2f}), "
              f"{f['step_time_s']:.3f} s/step")
        ratios = {"model_state_bloomtrain_over_fsdp2":
                  ours["model_state_bytes"] / f["model_state_bytes"],
                  "step_time_bloomtrain_over_fsdp2": ours["step_time_s"] / f["step_time_s"]}
        print(f"ratios (bloomtrain / FSDP2): model state "
              f"{ratios['model_state_bloomtrain_over_fsdp2']:.3f}, step time "
              f"{ratios['step_time_bloomtrain_over_fsdp2']:.3f}")
        out.update(fsdp2=f, **ratios)
    else:
        print(f"FSDP2 did not run: {r['fsdp2_error']}\n{r['fsdp2_traceback']}")
        out["fsdp2_error"] = r["fsdp2_error"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
