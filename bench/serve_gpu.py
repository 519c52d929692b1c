"""The serving engine against HF transformers' `generate` on one device, in process (no HTTP): a
random-init model of bloom-560m's shape (hidden 1024, 24 layers, 16 heads, vocabulary 250,880)
saved as an HF directory, in bf16.

Figures:
- the engine's tokens/s with `--prompts` (64) concurrent prompts of 32 tokens, 128 new tokens
  each, greedy, ignore_eos (every sequence runs to the end), and its decode-step time with all of
  them running;
- HF `generate` on the same prompts as one batch, and one prompt at a time (`--alone` of them);
- the engine with one request alone, against HF's one at a time;
- the same two engine runs with `--enforce-eager` (every decode step eager; by default decode
  steps replay CUDA graphs, captured lazily). Each engine first serves the same load once and one
  prompt alone, so that the timed runs meet no shape for the first time (a decode kernel's
  compile and a graph's capture happen once per batch size and key width); that first run is
  reported too, as `engine_cold` and `engine_eager_cold`;
- every timed run `--rounds` (3) times, their order alternated round by round, HF warmed at
  the timed shapes as the engine is; the median round's figures, with each round's tokens/s;
- fp32 checks on a few prompts: the engine's prompt logprobs against HF fp32's log_softmax, and
  greedy tokens equal to HF fp32 generate's.

`--cpu-smoke` runs the same on the CPU with a tiny shape (bench/gpu.sh --cpu-smoke). Prints the
figures, then one JSON line. Measures; asserts nothing.

    python bench/serve_gpu.py                 # on CUDA, within 90 s on one H200
    python bench/serve_gpu.py --cpu-smoke
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

from bloomtrain.serve.config import EngineConfig  # noqa: E402
from bloomtrain.serve.engine import Engine  # noqa: E402
from bloomtrain.serve.sampling import SamplingParams  # noqa: E402
from bloomtrain.serve.tp import build_runner  # noqa: E402

SHAPES = {"bloom-560m": dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880),
          "tiny": dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512)}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_model(shape: dict, path: Path, device, dtype):
    """A random-init BloomForCausalLM, saved to `path` (the engine loads it from there) and
    returned on `device` in `dtype` with HF's eager attention (what BLOOM supports)."""
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    cfg = BloomConfig(**shape, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    model = BloomForCausalLM(cfg).eval()
    with torch.no_grad():  # wider weights: peaked distributions, greedy not decided by rounding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model.to(device=device, dtype=dtype)


def engine_for(path: Path, device, dtype: str, num_seqs: int, max_len: int,
               enforce_eager: bool = False) -> Engine:
    cfg = EngineConfig(max_model_len=max_len, block_size=16,
                       kv_cache_tokens=16 * num_seqs * (-(-max_len // 16) + 1),
                       max_num_seqs=num_seqs, max_batched_tokens=max(2048, 64 + num_seqs),
                       prefill_chunk=64, max_queue=max(256, num_seqs),
                       enforce_eager=enforce_eager)
    runner = build_runner(path, cfg, device=device, dtype=dtype)
    return Engine(runner.forward, cfg, vocab_size=runner.model.shape.vocab_size,
                  device=runner.device)


def timed_engine(engine: Engine, prompts, new: int, device) -> dict:
    """Serve `prompts` to the end; the wall time, tokens/s, and the median decode-step time
    while every sequence is running."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    done = []
    sync(device)
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(p, params, lambda out, d=done: d.append(out) if out.finish_reason else None)
    steps = []
    while engine.num_live:
        full = engine.num_running == len(prompts) and not engine.scheduler.waiting
        s0 = time.perf_counter()
        engine.step()
        sync(device)
        if full and all(s.num_computed >= s.num_prompt for s in engine.running):
            steps.append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new / wall,
            "decode_step_ms": statistics.median(steps) * 1e3 if steps else None,
            "decode_steps_timed": len(steps)}


def timed_hf(model, prompts, new: int, device) -> dict:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)
    sync(device)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_per_s": len(prompts) * new / wall}


def fp32_checks(path: Path, hf32, prompts, new: int, device) -> dict:
    """Prompt logprobs against HF fp32's, and greedy tokens against HF fp32 generate's."""
    engine = engine_for(path, device, "fp32", len(prompts), len(prompts[0]) + new)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                            prompt_logprobs=True, logprobs=0)
    out = engine.generate(prompts, params)
    worst, equal = 0.0, 0
    for p, r in zip(prompts, out):
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(hf32(ids).logits[0].float(), dim=-1)
            ref = hf32.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
        ours = [e.logprob for e in r["prompt_logprobs"][1:]]
        theirs = [lp[i, p[i + 1]].item() for i in range(len(p) - 1)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, theirs)))
        equal += r["token_ids"] == ref
    return {"prompt_logprob_max_abs_diff": worst, "greedy_equal": equal,
            "greedy_checked": len(prompts)}


def median_rounds(runs: dict, rounds: int) -> dict:
    """Each run `rounds` times, the order alternated (forward, then reversed) so that no side
    always comes first; per run, the figures of its median round by tokens/s, with every
    round's tokens/s beside them."""
    seen: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            seen[name].append(runs[name]())
    out = {}
    for name, results in seen.items():
        ordered = sorted(results, key=lambda res: res["tokens_per_s"])
        out[name] = {**ordered[(len(ordered) - 1) // 2],
                     "rounds_tokens_per_s": [res["tokens_per_s"] for res in results]}
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--prompts", type=int, default=None, help="concurrent prompts (64; smoke 8)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=None, help="new tokens each (128; smoke 16)")
    ap.add_argument("--alone", type=int, default=None,
                    help="prompts HF generates one at a time (4; smoke 2)")
    ap.add_argument("--checks", type=int, default=4, help="prompts of the fp32 checks")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed rounds of every run, alternating their order; the median")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    args.prompts = args.prompts or (8 if smoke else 64)
    args.new = args.new or (16 if smoke else 128)
    args.alone = args.alone or (2 if smoke else 4)
    args.shape = "tiny" if smoke else "bloom-560m"
    args.device = "cpu" if smoke else "cuda"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device, shape = args.device, SHAPES[args.shape]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape["vocab_size"], (args.prompts, args.prompt_len),
                            generator=g).tolist()
    out = {"bench": "serve_gpu", "device": device, "shape": args.shape,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "torch": torch.__version__, "prompts": args.prompts, "prompt_len": args.prompt_len,
           "new_tokens": args.new}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        hf16 = hf_model(shape, path, device, torch.bfloat16)
        engines = {}
        for eager, name in ((False, "engine"), (True, "engine_eager")):
            engine = engines[name] = engine_for(path, device, "bf16", args.prompts,
                                                args.prompt_len + args.new, enforce_eager=eager)
            # Warm-up: the same load once, then one sequence alone. Each (batch size, key
            # width) pair a run meets costs a compile of the decode kernel (FlexAttention, per
            # shape) and a graph capture the first time: the timed runs meet none of them new,
            # as a server past its first minutes. The first run's figures are kept (`_cold`).
            out[name + "_cold"] = timed_engine(engine, prompts, args.new, device)
            timed_engine(engine, prompts[:1], args.new, device)
        # HF warmed at the timed shapes too (its first batch-64 run allocates its cache).
        timed_hf(hf16, prompts, args.new, device)
        timed_hf(hf16, prompts[:1], args.new, device)
        runs = {
            "engine": lambda: timed_engine(engines["engine"], prompts, args.new, device),
            "engine_alone": lambda: timed_engine(engines["engine"], prompts[:1], args.new,
                                                 device),
            "engine_eager": lambda: timed_engine(engines["engine_eager"], prompts, args.new,
                                                 device),
            "engine_eager_alone": lambda: timed_engine(engines["engine_eager"], prompts[:1],
                                                       args.new, device),
            "hf_batched": lambda: timed_hf(hf16, prompts, args.new, device),
            "hf_alone": lambda: {"tokens_per_s": statistics.median(
                timed_hf(hf16, [p], args.new, device)["tokens_per_s"]
                for p in prompts[:args.alone]), "prompts": args.alone}}
        out.update(median_rounds(runs, args.rounds))
        del hf16, engines
        hf32 = hf_model(shape, Path(tmp) / "model32", device, torch.float32)
        out["fp32"] = fp32_checks(Path(tmp) / "model32", hf32, prompts[:args.checks],
                                  min(args.new, 32), device)
    e, hb, ha = out["engine"], out["hf_batched"], out["hf_alone"]
    out["vs_hf_batched"] = e["tokens_per_s"] / hb["tokens_per_s"]
    out["alone_vs_hf_alone"] = out["engine_alone"]["tokens_per_s"] / ha["tokens_per_s"]
    for run in ("", "_alone"):  # graphs (the default) against --enforce-eager
        out["graphs_vs_eager" + run] = (out["engine" + run]["tokens_per_s"]
                                        / out["engine_eager" + run]["tokens_per_s"])
    print(f"{args.shape} on {out['gpu'] or device}, {args.prompts} prompts x {args.prompt_len} "
          f"tokens, {args.new} new (greedy, ignore_eos)")
    print(f"  engine        {e['tokens_per_s']:>10,.0f} tok/s  decode step "
          f"{e['decode_step_ms'] or float('nan'):.1f} ms at {args.prompts} running")
    ee = out["engine_eager"]
    print(f"  eager engine  {ee['tokens_per_s']:>10,.0f} tok/s  decode step "
          f"{ee['decode_step_ms'] or float('nan'):.1f} ms (--enforce-eager) -> graphs "
          f"{out['graphs_vs_eager']:.2f}x, alone {out['graphs_vs_eager_alone']:.2f}x")
    print(f"  HF batched    {hb['tokens_per_s']:>10,.0f} tok/s  -> engine {out['vs_hf_batched']:.2f}x")
    print(f"  first runs    {out['engine_cold']['tokens_per_s']:>10,.0f} tok/s with graphs, "
          f"{out['engine_eager_cold']['tokens_per_s']:,.0f} eager (compiles and captures "
          f"included)")
    print(f"  engine alone  {out['engine_alone']['tokens_per_s']:>10,.0f} tok/s")
    print(f"  HF alone      {ha['tokens_per_s']:>10,.0f} tok/s  -> engine alone "
          f"{out['alone_vs_hf_alone']:.2f}x")
    f = out["fp32"]
    print(f"  fp32: prompt logprobs within {f['prompt_logprob_max_abs_diff']:.2e} of HF's; "
          f"greedy equal {f['greedy_equal']}/{f['greedy_checked']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
