"""The serving engine's own cost, as CPU time per generated token: 16 greedy sequences
(`--seqs`; prompts of 32 tokens, 96 new tokens each) served to the end by `Engine.generate` in
this process, one torch thread (OMP_NUM_THREADS=1, as bench/serve_load.py runs the server), no
HTTP. `--load serve` serves bench/serve_load.py's 64 requests instead, `--seqs` at a time: the
mixed prompt and output lengths its 16-client load gives the server's engine. CPU time (time.process_time) rather than wall time, because on a machine shared with other
jobs the wall time says more about them than about the engine.

`--padding` times what batch invariance costs one request alone: one greedy request (32 prompt
tokens, 128 new) through `generate` (the engine unpadded, sized for one sequence: the
bench/serve_load.py baseline) and through the engine sized as bench/serve_load.py's server
(16 sequences, 256-token steps) unpadded, padded to the rows the probe finds batch-invariant,
and padded through the packed GEMM (as the server runs); alternated `--rounds` times in this
process, the medians of each one's paired ratio to `generate`'s CPU time.

`--root DIR` imports bloomtrain from another source tree (e.g. `git archive COMMIT | tar -x -C
DIR`), to compare two versions of the engine in alternation on the same machine. The checkpoint
is bench/serve_load.py's trained demo model (run that first, or give --checkpoint).
Measures; asserts nothing. Prints one line per round, then one JSON line.

    python bench/serve_engine_cpu.py
    python bench/serve_engine_cpu.py --root /tmp/old --rounds 5
    python bench/serve_engine_cpu.py --load serve
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                    help="the source tree to import bloomtrain from (default: this one)")
    ap.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir())
                                                / "bloomtrain_serve_load" / "checkpoints"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=16,
                    help="sequences served together (default 16; 1: a lone request's steps)")
    ap.add_argument("--load", choices=("uniform", "serve"), default="uniform",
                    help="uniform: --seqs prompts of 32 random tokens, 96 new tokens each; "
                         "serve: bench/serve_load.py's 64 requests (its demo model's "
                         "validation text, prompts of 8-96 and outputs of 16-128 tokens), "
                         "--seqs of them running at once, as its clients keep them")
    ap.add_argument("--padding", action="store_true",
                    help="one request alone: generate against the server's engine unpadded, "
                         "padded, padded and packed (see above)")
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool
    import torch

    import bloomtrain
    from bloomtrain.serve.config import EngineConfig
    from bloomtrain.serve.engine import Engine
    from bloomtrain.serve.tp import build_runner
    try:
        from bloomtrain.serve.sampling import SamplingParams
    except ImportError:  # trees from before the serve split
        from bloomtrain.serve.engine import SamplingParams

    torch.set_num_threads(1)
    if args.padding:
        return padding_cost(args, SamplingParams)
    cfg = EngineConfig(max_model_len=512, kv_cache_tokens=16384,
                       max_num_seqs=args.seqs if args.load == "serve" else 32)
    runner = build_runner(args.checkpoint, cfg)
    engine = Engine(runner.forward, cfg, vocab_size=runner.model.shape.vocab_size)
    if args.load == "serve":
        prompts, params = serve_load_requests(args.checkpoint)
    else:
        g = torch.Generator().manual_seed(0)
        vocab = runner.model.shape.vocab_size
        prompts = [torch.randint(0, vocab, (32,), generator=g).tolist()
                   for _ in range(args.seqs)]
        params = SamplingParams(max_tokens=96, temperature=0)
    engine.generate(prompts[:2], params)  # untimed warm-up: allocator, first-call paths
    per_token = []
    for r in range(args.rounds):
        start = time.process_time()
        out = engine.generate(prompts, params)
        tokens = sum(len(o["token_ids"]) for o in out)
        per_token.append((time.process_time() - start) / tokens)
        print(f"round {r + 1}: {tokens} tokens, {per_token[-1] * 1e3:.4f} ms CPU per token",
              flush=True)
    print(json.dumps({"bench": "serve_engine_cpu", "bloomtrain": str(Path(
        bloomtrain.__file__).parent), "rounds": args.rounds, "seqs": args.seqs,
        "load": args.load,
        "cpu_ms_per_token_median": statistics.median(per_token) * 1e3,
        "cpu_ms_per_token_rounds": [t * 1e3 for t in per_token]}))


def padding_cost(args, SamplingParams) -> None:
    """--padding: see the module doc."""
    import torch

    from bloomtrain.generate import generate
    from bloomtrain.serve.config import EngineConfig
    from bloomtrain.serve.engine import Engine
    from bloomtrain.serve.kv_cache import PagedKVCache
    from bloomtrain.serve.packed import pack_linears
    from bloomtrain.serve.runner import MIN_ROWS, ModelRunner, batch_invariant_rows
    from bloomtrain.serve.tp import load_serving_model

    cfg = EngineConfig(max_model_len=512, max_num_seqs=16, max_batched_tokens=256)

    def engine(padded: bool, packed: bool):
        model = load_serving_model(args.checkpoint)
        shape, dtype = model.shape, torch.float32
        # As the server pads (serve.tp's build_runner): the probed rows, MIN_ROWS if none hold.
        rows = (batch_invariant_rows(model, cfg.max_batched_tokens, dtype) or MIN_ROWS
                if padded else 1)
        if packed:
            pack_linears(model, rows, cfg.max_batched_tokens)
        cache = PagedKVCache(shape.num_layers, cfg.num_blocks, cfg.block_size, shape.num_heads,
                             shape.head_dim, dtype, "cpu")
        runner = ModelRunner(model, cache, min_rows=rows)
        return Engine(runner.forward, cfg, vocab_size=shape.vocab_size), model, rows

    unpadded, model, _ = engine(False, False)
    padded, _, rows = engine(True, False)
    packed, _, _ = engine(True, True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.shape.vocab_size, (32,), generator=g).tolist()
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    ways = {"generate": lambda: generate(model, torch.tensor([prompt]), 128)[0, 32:].tolist()}
    for name, e in (("unpadded", unpadded), (f"padded to {rows}", padded),
                    (f"padded to {rows}, packed", packed)):
        ways[name] = (lambda e: lambda: e.generate([prompt], params)[0]["token_ids"])(e)
    tokens = {name: way() for name, way in ways.items()}  # warm-up, and the same tokens
    assert all(t == tokens["generate"] for t in tokens.values()), "the ways' tokens differ"
    cpu = {name: [] for name in ways}
    for r in range(args.rounds):
        for name, way in ways.items():
            start = time.process_time()
            way()
            cpu[name].append((time.process_time() - start) / 128)
        print(f"round {r + 1}: " + ", ".join(f"{name} {v[-1] * 1e3:.3f}" for name, v in
                                             cpu.items()) + " ms CPU per token", flush=True)
    ratios = {name: statistics.median(a / b for a, b in zip(v, cpu["generate"]))
              for name, v in cpu.items()}
    for name, ratio in ratios.items():
        print(f"{name:>24}: {ratio:.3f}x generate's CPU per token")
    print(json.dumps({"bench": "serve_engine_cpu", "mode": "padding", "rounds": args.rounds,
                      "min_rows": rows, "vs_generate": ratios,
                      "cpu_ms_per_token": {k: [t * 1e3 for t in v] for k, v in cpu.items()}}))


def serve_load_requests(checkpoint: str):
    """bench/serve_load.py's requests (its workload, seed 0) as prompts and greedy
    SamplingParams, from the demo run the checkpoint belongs to. Imported from the tree being
    measured, as bloomtrain is."""
    from bench.serve_load import validation_samples, workload
    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer
    from bloomtrain.data.tokenizer import load_tokenizer
    try:
        from bloomtrain.serve.sampling import SamplingParams
    except ImportError:  # trees from before the serve split
        from bloomtrain.serve.engine import SamplingParams
    run_dir = Path(checkpoint).parent
    tokenizer = load_tokenizer(checkpoint_tokenizer(checkpoint, None))
    requests = workload(validation_samples(run_dir, tokenizer, 64), 64, 0)
    return ([p for p, _ in requests],
            [SamplingParams(max_tokens=n, temperature=0) for _, n in requests])


if __name__ == "__main__":
    main()
