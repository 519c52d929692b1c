"""Single-process training-step throughput: bloomtrain vs HF transformers, the same work on both
sides.

Both sides: the same BLOOM shape and batch, bf16 compute with fp32 weights for the update, AdamW
(lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only: no decay on biases and
LayerNorms), gradient clipping at 1.0.
- bloomtrain: BloomForCausalLM with bf16 parameters, fp32 master weights and fp32 gradient
  accumulation (the engine's optimizer), attention through SDPA with the ALiBi bias.
- HF: transformers.BloomForCausalLM with fp32 parameters under bf16 autocast (how BLOOM is
  fine-tuned with plain PyTorch), its fastest attention implementation that loads for Bloom,
  `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` with `fused=True` or `foreach=True`,
  whichever is faster here (both are timed during warmup).

Timing: after `--warmup` steps per side, `--rounds` rounds alternate the sides (the side that goes
first alternates too), each timing `--steps` steps one by one; the median step time per side is
reported. Prints both tokens/s, the ratio and Megatron-formula TFLOP/s, then one JSON line that
also says what each side ran. Measures; asserts nothing.

    python bench/step_throughput.py                       # hidden 512, 8 layers, seq 512, mbs 4
    python bench/step_throughput.py --preset bloom-560m --seq 2048 --micro-batch 4 --device cuda
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, alternate_rounds, shape_from_args  # noqa: E402
from bloomtrain.config import ModelConfig  # noqa: E402
from bloomtrain.model import resolve_model_config  # noqa: E402
from bloomtrain.model.params import base_spec  # noqa: E402
from bloomtrain.optim import megatron_tflops  # noqa: E402
from tests import helpers  # noqa: E402

LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def make_bloomtrain(shape, ids, device, args):
    cfg = helpers.config(shape, optim=dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                           weight_decay=WD, clip_grad=CLIP),
                         precision="bf16", seed=1,
                         activation_checkpointing="full" if args.activation_checkpointing
                         else "none")
    parts = helpers.build(cfg, device=device)
    model, opt = parts.chunks[0], parts.engine
    model.train()
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step():
        model(inputs, labels=labels).backward()
        opt.step(LR)
    return step, {"model": "bloomtrain BloomForCausalLM, bf16 parameters",
                  "attention": "torch SDPA with the ALiBi+causal bias as a float mask",
                  "optimizer": "bloomtrain BF16 optimizer: fp32 master + fp32 grad "
                               "accumulation, AdamW, no decay on biases/LayerNorms",
                  "clip_grad": CLIP}


def _hf_model(shape, device, args):
    import transformers
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      n_layer=shape.num_layers, n_head=shape.num_heads, hidden_dropout=0.0,
                      attention_dropout=0.0)
    # The fastest implementation transformers will load for Bloom (it rejects the ones the
    # architecture does not support, and says why).
    rejected = []
    for impl in ("flash_attention_2", "sdpa", "eager"):
        try:
            model = BloomForCausalLM._from_config(cfg, attn_implementation=impl)
            break
        except (ValueError, ImportError) as e:
            rejected.append(f"{impl}: {str(e).splitlines()[0][:120]}")
    return model.to(device), impl, rejected, transformers.__version__


def make_hf(shape, ids, device, args):
    model, impl, rejected, version = _hf_model(shape, device, args)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    named = list(model.named_parameters())
    inputs = ids[:, :-1]  # HF shifts the labels itself

    def make_opt(kind):
        groups = [{"params": [p for n, p in named if base_spec(n).weight_decay],
                   "weight_decay": WD},
                  {"params": [p for n, p in named if not base_spec(n).weight_decay],
                   "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **{kind: True})

    def step_with(opt):
        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=inputs, labels=inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    # fused vs foreach: time both (after one step each to allocate the state) and keep the faster.
    best = None
    for kind in ("fused", "foreach"):
        try:
            opt = make_opt(kind)
            step = step_with(opt)
            step()
        except (RuntimeError, TypeError) as e:
            print(f"HF AdamW {kind}=True unavailable: {e}")
            continue
        t = statistics.median(timed(step, device) for _ in range(max(args.warmup, 2)))
        if best is None or t < best[0]:
            best = (t, kind, step)
    _, kind, step = best
    return step, {"model": f"transformers {version} BloomForCausalLM, fp32 parameters, bf16 "
                           f"autocast",
                  "attention": impl, "attention_rejected": rejected,
                  "optimizer": f"torch.optim.AdamW({kind}=True), no decay on "
                               f"biases/LayerNorms",
                  "clip_grad": CLIP}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="a model preset instead of the explicit shape")
    add_shape_args(ap, hidden=512, layers=8, heads=8, vocab=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device bf16 peak for MFU (e.g. 989 for H100/H200 SXM dense)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if args.preset:
        shape = resolve_model_config(ModelConfig(preset=args.preset))
    else:
        shape = shape_from_args(args)
    torch.manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq + 1), device=device)
    tokens = args.micro_batch * args.seq
    print(f"shape: L={shape.num_layers} h={shape.hidden_size} heads={shape.num_heads} "
          f"V={shape.vocab_size} ({shape.num_parameters() / 1e6:.1f}M params), seq {args.seq}, "
          f"micro-batch {args.micro_batch}, device {device}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    sides = {"bloomtrain": make_bloomtrain(shape, ids, device, args)}
    if not args.skip_hf:
        sides["hf"] = make_hf(shape, ids, device, args)
    times = alternate_rounds({name: step for name, (step, _) in sides.items()},
                             lambda step: timed(step, device), args.warmup, args.rounds,
                             args.steps)

    out = {"bench": "step_throughput", "device": str(device), "cpu": platform.processor(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "params": shape.num_parameters(), "seq": args.seq, "micro_batch": args.micro_batch,
           "warmup": args.warmup, "steps_per_round": args.steps, "rounds": args.rounds}
    for name, (_, ran) in sides.items():
        dt = statistics.median(times[name])
        tf = megatron_tflops(args.micro_batch, args.seq, shape.num_layers, shape.hidden_size,
                             shape.vocab_size, dt, 1, args.activation_checkpointing)
        print(f"{name:<10}: median {dt:.3f} s/step (min {min(times[name]):.3f}, max "
              f"{max(times[name]):.3f}, n={len(times[name])}), {tokens / dt:,.0f} tokens/s, "
              f"{tf:.2f} TFLOP/s; {ran['attention']}; {ran['optimizer']}")
        out[name] = {**ran, "median_step_s": dt, "tokens_per_s": tokens / dt, "tflops": tf,
                     "step_times_s": times[name]}
        if args.peak_tflops:
            out[name]["mfu"] = tf / args.peak_tflops
    if "hf" in out:
        out["ratio"] = out["bloomtrain"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
        print(f"ratio (bloomtrain / HF tokens/s, medians): {out['ratio']:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
