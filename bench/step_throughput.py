"""Single-process training-step throughput: bloomtrain vs HF transformers.

bloomtrain: BloomForCausalLM with bf16 parameters, fp32 master weights and fp32 gradient
accumulation (MixedPrecisionOptimizer). HF: transformers.BloomForCausalLM (fp32 parameters) under
bf16 autocast with torch.optim.AdamW, the usual way people fine-tune BLOOM with plain PyTorch.
Same shape, batch and optimizer settings. Prints both tokens/s, the ratio and Megatron-formula
TFLOP/s, then one JSON line.

    python bench/step_throughput.py                       # hidden 512, 8 layers, seq 512, mbs 4
    python bench/step_throughput.py --preset bloom-560m --seq 2048 --micro-batch 4 --device cuda
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, shape_from_args  # noqa: E402
from bloomtrain.config import ModelConfig, OptimConfig  # noqa: E402
from bloomtrain.model import build_model, resolve_model_config  # noqa: E402
from bloomtrain.optim import megatron_tflops  # noqa: E402
from bloomtrain.parallel.zero import MixedPrecisionOptimizer  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step_fn, device, warmup, steps):
    for _ in range(warmup):
        step_fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def bench_bloomtrain(shape, ids, device, args):
    model = build_model(shape, seed=1, device=device)
    model.set_activation_checkpointing(args.activation_checkpointing)
    opt = MixedPrecisionOptimizer(model, OptimConfig(), "bf16")
    model.train()
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step():
        loss = model(inputs, labels=labels)
        loss.backward()
        opt.step(1e-4)
    dt = time_steps(step, device, args.warmup, args.steps)
    del model, opt
    return dt


def bench_hf(shape, ids, device, args):
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      n_layer=shape.num_layers, n_head=shape.num_heads, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = BloomForCausalLM(cfg).to(device)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    inputs, labels = ids[:, :-1], ids[:, :-1]  # HF shifts labels internally

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = time_steps(step, device, args.warmup, args.steps)
    del model, opt
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="a model preset instead of the explicit shape")
    add_shape_args(ap, hidden=512, layers=8, heads=8, vocab=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
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
    dt_ours = bench_bloomtrain(shape, ids, device, args)
    tf = megatron_tflops(args.micro_batch, args.seq, shape.num_layers, shape.hidden_size,
                         shape.vocab_size, dt_ours, 1, args.activation_checkpointing)
    print(f"bloomtrain : {dt_ours:.3f} s/step, {tokens / dt_ours:,.0f} tokens/s, {tf:.2f} TFLOP/s")
    out = {"bench": "step_throughput", "device": str(device), "cpu": platform.processor(),
           "params": shape.num_parameters(), "seq": args.seq, "micro_batch": args.micro_batch,
           "bloomtrain_tokens_per_s": tokens / dt_ours, "bloomtrain_tflops": tf}
    if args.peak_tflops:
        out["bloomtrain_mfu"] = tf / args.peak_tflops
    if not args.skip_hf:
        dt_hf = bench_hf(shape, ids, device, args)
        tf_hf = megatron_tflops(args.micro_batch, args.seq, shape.num_layers, shape.hidden_size,
                                shape.vocab_size, dt_hf, 1, args.activation_checkpointing)
        print(f"HF + AdamW : {dt_hf:.3f} s/step, {tokens / dt_hf:,.0f} tokens/s, "
              f"{tf_hf:.2f} TFLOP/s")
        print(f"ratio (bloomtrain / HF tokens/s): {dt_hf / dt_ours:.2f}")
        out.update(hf_tokens_per_s=tokens / dt_hf, hf_tflops=tf_hf, ratio=dt_hf / dt_ours)
        if args.peak_tflops:
            out["hf_mfu"] = tf_hf / args.peak_tflops
    print(json.dumps(out))


if __name__ == "__main__":
    main()
