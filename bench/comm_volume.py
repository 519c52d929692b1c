"""Communication volume per training step, measured through bloomtrain.parallel.comm's counters.

Data-parallel section: bytes and elements per step that each ZeRO stage (arXiv 1910.02054) moves
over the dp group, with the dtype of every collective, against the paper's 2Ψ elements (stages
0-2) and 3Ψ (stage 3). Elements follow the paper's accounting: an all-reduce counts twice its
size (reduce-scatter + all-gather), an all-gather its output, a reduce-scatter its input. A
step here has one micro-batch per rank: stages 2-3 reduce-scatter every micro-batch, so with m
micro-batches their gradient traffic is m times larger.

Tensor-parallel section: bytes per step over the tp group on 2 ranks, with sequence
parallelism off and on, against the analytic count for our layout (Megatron-LM arXiv 1909.08053
and arXiv 2205.05198). With A = b·s·h·(bytes per activation element), L blocks:
- SP off: all-reduce (4L + 2)·A: per block g after attention and MLP in forward, f before them in
  backward; g after the vocab-parallel embedding; f before the LM head (backward).
- SP on: all-gather (4L + 2)·A and reduce-scatter (4L + 2)·A (each all-reduce becomes a
  reduce-scatter plus an all-gather of the same buffer), plus one coalesced fp32 all-reduce of
  the sequence-parallel parameters' grads ((6L + 4)·h elements: LayerNorms and row biases).
- Both: the vocab-parallel cross-entropy's three fp32 all-reduces of [b, s] (max, sum-exp,
  target logit); the full logits are never gathered.
Counted as the comm wrappers count: an all-reduce its buffer, an all-gather its output, a
reduce-scatter its input.

Each section is a function that returns its figures; main() prints them and ends with one JSON
line. Measures; asserts nothing.

    python bench/comm_volume.py
    python bench/comm_volume.py --dp 4 --hidden 256 --layers 8 --vocab 32768
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, shape_from_args  # noqa: E402

from bloomtrain.model.presets import BloomShape  # noqa: E402
from bloomtrain.parallel import comm  # noqa: E402
from tests import helpers  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

# Paper elements per byte-counted buffer, by collective.
ELEMENT_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}


class DtypeStats(comm.CommStats):
    """comm's counters, additionally split by dtype (the wrappers read comm.STATS per call)."""

    def __init__(self):
        super().__init__(enabled=True)
        self.by_dtype = defaultdict(lambda: {"calls": 0, "bytes": 0, "elements": 0})

    def reset(self) -> None:
        super().reset()
        self.by_dtype.clear()

    def record(self, kind, name, tensor) -> None:
        super().record(kind, name, tensor)
        e = self.by_dtype[(kind, name, str(tensor.dtype).replace("torch.", ""))]
        e["calls"] += 1
        e["bytes"] += tensor.numel() * tensor.element_size()
        e["elements"] += tensor.numel()


def _dp_rank_fn(rank, world, shape, seq, precision):
    comm.STATS = stats = DtypeStats()
    ids = torch.randint(0, shape.vocab_size, (1, seq + 1),
                        generator=torch.Generator().manual_seed(rank))
    out, topo = {}, None
    for stage in range(4):
        cfg = helpers.config(shape, parallel={"zero_stage": stage}, precision=precision, seed=1)
        topo = helpers.topology(cfg, topo)
        parts = helpers.build(cfg, topo)
        model, eng = parts.chunks[0], parts.engine
        for measured in (False, True):  # the first step records stage 3's prefetch order
            stats.reset()
            model(ids[:, :-1], labels=ids[:, 1:]).backward()
            helpers.step(parts.optimizer, 1e-4)
        out[stage] = {"psi": eng.num_local_parameters(),
                      "ops": {f"{k}/{n}/{d}": v for (k, n, d), v in stats.by_dtype.items()}}
        eng.remove_hooks()
    return out


def dp_section(args) -> dict:
    """dp traffic per step for each ZeRO stage, on args.dp gloo ranks."""
    shape = shape_from_args(args)
    per_stage = run_ranks(args.dp, _dp_rank_fn, shape, args.seq, args.precision)[0]
    n = args.dp
    print(f"== data parallel: dp={n}, Ψ={shape.num_parameters():,}, {args.precision} compute, "
          f"1 micro-batch per rank per step ==")
    rows = []
    for stage, r in per_stage.items():
        psi = r["psi"]
        dp_ops = {k: v for k, v in r["ops"].items() if k.split("/")[1] == "dp"}
        elements = sum(v["elements"] * ELEMENT_FACTOR[k.split("/")[0]] for k, v in dp_ops.items())
        nbytes = sum(v["bytes"] * ELEMENT_FACTOR[k.split("/")[0]] for k, v in dp_ops.items())
        expected = (3 if stage == 3 else 2) * psi
        # Stage 3 gathers per use: the head tied to the embedding (pp=1) is a second forward
        # use of the embedding, so ours is 3Ψ + Ψ_emb (the embedding's own backward needs no
        # weights and finds them gathered by the head's backward).
        ours = expected + (shape.vocab_size * shape.hidden_size if stage == 3 else 0)
        print(f"stage {stage}: {elements / psi:.3f} Ψ elements (paper {expected // psi}Ψ, "
              f"ours {ours / psi:.3f}Ψ), {nbytes / 2 ** 20:,.1f} MiB per rank-buffer, "
              f"~{nbytes * (n - 1) / n / 2 ** 20:,.1f} MiB sent per rank (ring)")
        for k, v in sorted(dp_ops.items()):
            kind, _, dtype = k.split("/")
            share = v["elements"] * ELEMENT_FACTOR[kind] / psi
            print(f"    {kind:<15} {dtype:<9} {v['calls']:>4} calls  {share:6.3f} Ψ  "
                  f"{v['bytes'] / 2 ** 20:9.1f} MiB")
        rows.append({"stage": stage, "psi": psi, "elements": elements,
                     "elements_over_psi": elements / psi, "expected_over_psi": expected // psi,
                     "ours_over_psi": ours / psi,
                     "bytes": nbytes, "ops": dp_ops})
    return {"dp": n, "precision": args.precision, "stages": rows}


def _tp_rank_fn(rank, world, shape, batch, seq, precision, sequence_parallel):
    comm.STATS = stats = DtypeStats()
    ids = torch.randint(0, shape.vocab_size, (batch, seq + 1),
                        generator=torch.Generator().manual_seed(0))
    cfg = helpers.config(shape, parallel={"tp": world, "sequence_parallel": sequence_parallel},
                         precision=precision, seed=1)
    parts = helpers.build(cfg)
    model = parts.chunks[0]
    for _ in range(2):  # the second step is measured
        stats.reset()
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        helpers.step(parts.optimizer, 1e-4)
    return {f"{k}/{n}/{d}": v for (k, n, d), v in stats.by_dtype.items() if n == "tp"}


def tp_expected(shape: BloomShape, batch: int, seq: int, act_bytes: int, sp: bool) -> dict:
    a = batch * seq * shape.hidden_size * act_bytes
    n_big = 4 * shape.num_layers + 2
    ce = 3 * batch * seq * 4
    if not sp:
        return {"all_reduce": n_big * a + ce}
    sp_grads = (6 * shape.num_layers + 4) * shape.hidden_size * 4
    return {"all_gather": n_big * a, "reduce_scatter": n_big * a, "all_reduce": ce + sp_grads}


def tp_section(args) -> dict:
    """tp traffic per step on args.tp gloo ranks, sequence parallelism off and on."""
    shape = shape_from_args(args)
    act_bytes = 4 if args.precision == "fp32" else 2
    print(f"== tensor parallel: tp={args.tp}, L={shape.num_layers}, h={shape.hidden_size}, "
          f"batch {args.batch} x seq {args.seq}, {args.precision} activations ==")
    rows = []
    for sp in (False, True):
        ops = run_ranks(args.tp, _tp_rank_fn, shape, args.batch, args.seq, args.precision, sp)[0]
        measured = defaultdict(int)
        for k, v in ops.items():
            measured[k.split("/")[0]] += v["bytes"]
        expected = tp_expected(shape, args.batch, args.seq, act_bytes, sp)
        total_m, total_e = sum(measured.values()), sum(expected.values())
        print(f"sequence_parallel={sp}: measured {total_m / 2 ** 20:.3f} MiB, analytic "
              f"{total_e / 2 ** 20:.3f} MiB, ratio {total_m / total_e:.4f}")
        for kind in sorted(set(measured) | set(expected)):
            print(f"    {kind:<15} measured {measured.get(kind, 0):>12,} B   analytic "
                  f"{expected.get(kind, 0):>12,} B")
        for k, v in sorted(ops.items()):
            print(f"      {k:<30} {v['calls']:>4} calls {v['bytes']:>12,} B")
        rows.append({"sequence_parallel": sp, "measured_bytes": total_m,
                     "analytic_bytes": total_e, "ratio": total_m / total_e,
                     "by_kind": {"measured": dict(measured), "analytic": expected}})
    return {"tp": args.tp, "precision": args.precision, "cases": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch for the tp section")
    ap.add_argument("--section", choices=["all", "tp", "dp"], default="all")
    add_shape_args(ap, hidden=256, layers=8, heads=8, vocab=32768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()
    result = {"bench": "comm_volume"}
    if args.section in ("all", "tp"):
        result["tensor_parallel"] = tp_section(args)
    if args.section in ("all", "dp"):
        result["data_parallel"] = dp_section(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
