"""Single-process training-step throughput: bloomtrain vs HF transformers, the same work on both
sides, and how much of this device's matmul rate each side gets.

Both sides: the same BLOOM shape and batch, bf16 compute with fp32 weights for the update, AdamW
(lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only: no decay on biases and
LayerNorms), gradient clipping at 1.0.
- bloomtrain: BloomForCausalLM with bf16 parameters, fp32 master weights and fp32 gradient
  accumulation (the engine's optimizer); `--attention` and `--compile` set `train.attention` and
  `train.compile` (regional torch.compile of each block). Initialized with unseeded random
  values (bench.common.unseeded_init): the seeded ones cost minutes at the bloom-* sizes.
- HF: transformers.BloomForCausalLM with fp32 parameters under bf16 autocast (how BLOOM is
  fine-tuned with plain PyTorch), its fastest attention implementation that loads for Bloom
  (flash_attention_2, sdpa, eager: the ones it rejects are listed in the JSON),
  `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` with `fused=True` or `foreach=True`,
  whichever is faster here (both are timed during warmup).

Timing: after `--warmup` steps per side, `--rounds` rounds alternate the sides (the side that goes
first alternates too), each timing `--steps` steps one by one (with torch.cuda.synchronize on
CUDA); the median step time per side is reported, as tokens/s and Megatron-formula TFLOP/s
(docs/bloom_facts.md §2; the recompute factor 4 only with full recompute). Where the device
cannot hold both sides (`--sides`: by default a CUDA device under 100 GiB, such as an 80 GB
H100), bloomtrain is built, timed and freed before HF is built and timed, and each side's peak
memory is its own; otherwise `peak_memory_gb` is both sides' together.

Speed figures: the bench also measures this device's bf16 matmul peak (1024³ on the CPU, 8192³ on
CUDA: bench.common.PEAK_MATMUL_N; best of 8, before and after the timed rounds; the higher is kept) and reports each side's TFLOP/s as a fraction of
it (`peak_fraction`), and MFU against `--peak-tflops` (default: that measured peak on the CPU, 989
TFLOP/s, H100/H200 SXM dense bf16, on CUDA). `--profile` prints torch.profiler's top ops (self
time) for one step of each side. Prints the figures, then one JSON line. Measures; asserts nothing.

    python bench/step_throughput.py                       # hidden 512, 8 layers, seq 512, mbs 4
    python bench/step_throughput.py --profile
    python bench/step_throughput.py --preset bloom-560m --seq 2048 --micro-batch 4 --device cuda \
        --compile --attention flex
    python bench/step_throughput.py --preset bloom-7b1 --seq 2048 --micro-batch 1 --device cuda \
        --zero-stage 1 --offload-optimizer --activation-checkpointing selective --skip-hf
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

from bench.common import (
    PEAK_MATMUL_N,
    add_shape_args,
    alternate_rounds,
    matmul_peak_tflops,
    shape_from_args,
    unseeded_init,
)
from bloomtrain.config import ModelConfig
from bloomtrain.model import resolve_model_config
from bloomtrain.model.params import base_spec
from bloomtrain.model.presets import megatron_tflops
from tests import helpers

LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
# Dense bf16 peak of an H100/H200 SXM (989.4 TFLOP/s without sparsity): the MFU denominator on CUDA.
CUDA_PEAK_TFLOPS = 989.0
# Devices with less memory than this measure the two sides apart (sides_apart): an H200's 141 GB
# holds bloomtrain and HF at once at the GPU check's shapes, an H100's 80 do not.
SIDES_TOGETHER_GIB = 100


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
    cfg = helpers.config(shape, optim={"lr": LR, "beta1": BETAS[0], "beta2": BETAS[1],
                                       "eps": EPS, "weight_decay": WD, "clip_grad": CLIP},
                         precision="bf16", seed=1,
                         activation_checkpointing=args.activation_checkpointing,
                         compile=args.compile, attention=args.attention,
                         parallel={"zero_stage": args.zero_stage,
                                   "offload_optimizer": args.offload_optimizer})
    with unseeded_init():  # values do not change the speed; seeded ones take a minute at 1b7
        parts = helpers.build(cfg, device=device)
    model = parts.chunks[0]
    model.train()
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step():
        model(inputs, labels=labels).backward()
        helpers.step(parts.optimizer, LR)
    # What train.attention resolved to (auto picks by device), where the model says.
    impl = getattr(model.transformer, "attention_impl", None)
    return step, {"model": "bloomtrain BloomForCausalLM, bf16 parameters",
                  "attention": impl or f"train.attention={args.attention}",
                  "compile": args.compile,
                  "activation_checkpointing": args.activation_checkpointing,
                  "zero_stage": args.zero_stage, "offload_optimizer": args.offload_optimizer,
                  "optimizer": "bloomtrain BF16 optimizer: fp32 master + fp32 grad "
                               "accumulation, AdamW, no decay on biases/LayerNorms"
                               + (", states and step on the host" if args.offload_optimizer
                                  else ""),
                  "clip_grad": CLIP}


def _hf_model(shape, device):
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
            # Built on the device: initializing a billion-parameter preset on the CPU first
            # would take longer than timing it.
            with torch.device(device):
                model = BloomForCausalLM._from_config(cfg, attn_implementation=impl)
            break
        except (ValueError, ImportError) as e:
            rejected.append(f"{impl}: {str(e).splitlines()[0][:120]}")
    return model.to(device), impl, rejected, transformers.__version__


def _hf_optimizer(named, kind):
    groups = [{"params": [p for n, p in named if base_spec(n).weight_decay], "weight_decay": WD},
              {"params": [p for n, p in named if not base_spec(n).weight_decay],
               "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **{kind: True})


def make_hf(shape, ids, device, args):
    model, impl, rejected, version = _hf_model(shape, device)
    # HF has full recompute only; with "selective" it runs without, and says so.
    if args.activation_checkpointing == "full":
        model.gradient_checkpointing_enable()
    model.train()
    named = list(model.named_parameters())
    inputs = ids[:, :-1]  # HF shifts the labels itself

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
    # One optimizer at a time: each one's Adam state is twice the model's fp32 size, and on an
    # 80 GB device two of them beside both models do not fit. The winner is built again.
    best = None
    for kind in ("fused", "foreach"):
        try:
            step = step_with(_hf_optimizer(named, kind))
            step()
        except (RuntimeError, TypeError) as e:
            print(f"HF AdamW {kind}=True unavailable: {e}")
            continue
        t = statistics.median(timed(step, device) for _ in range(max(args.warmup, 2)))
        if best is None or t < best[0]:
            best = (t, kind)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    kind = best[1]
    step = step_with(_hf_optimizer(named, kind))
    return step, {"model": f"transformers {version} BloomForCausalLM, fp32 parameters, bf16 "
                           f"autocast",
                  "attention": impl, "attention_rejected": rejected,
                  "activation_checkpointing": ("full" if args.activation_checkpointing == "full"
                                               else "none"),
                  "optimizer": f"torch.optim.AdamW({kind}=True), no decay on "
                               f"biases/LayerNorms",
                  "clip_grad": CLIP}


def profile_step(name: str, step, device, rows: int) -> list[dict]:
    """One step of `step` under torch.profiler: prints the top ops by self time (device time on
    CUDA, CPU time otherwise) and returns them."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync(device)
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n--- profile: one {name} step, top {rows} ops by {key} ---")
    print(events.table(sort_by=key, row_limit=rows))
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in top]


def add_zero_args(ap) -> None:
    """make_bloomtrain's ZeRO options (this bench's and bench/profile_step.py's)."""
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                    help="bloomtrain's parallel.zero_stage (one process: the engine's layout, "
                         "nothing to shard)")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="bloomtrain's parallel.offload_optimizer (ZeRO-Offload: the fp32 "
                         "states and the AdamW step on the host), for ZeRO stages 1-3")


def check_zero_args(ap, args) -> None:
    if args.offload_optimizer and args.zero_stage == 0:
        ap.error("--offload-optimizer needs --zero-stage 1, 2 or 3")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="a model preset instead of the explicit shape")
    add_shape_args(ap, hidden=512, layers=8, heads=8, vocab=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--activation-checkpointing", nargs="?", const="full", default="none",
                    choices=("none", "selective", "full"),
                    help="bloomtrain's train.activation_checkpointing (bare flag: full); HF "
                         "recomputes with full only")
    ap.add_argument("--compile", action="store_true", help="bloomtrain with train.compile=true")
    ap.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex"),
                    help="bloomtrain's train.attention")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the MFU denominator (default: the measured bf16 matmul peak on the "
                         f"CPU, {CUDA_PEAK_TFLOPS:g} on CUDA)")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's top ops for one step of each side")
    ap.add_argument("--profile-rows", type=int, default=15)
    add_zero_args(ap)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sides", choices=("auto", "together", "apart"), default="auto",
                    help="together: both sides resident, their steps alternated; apart: "
                         "bloomtrain timed, freed, then HF (each side's own peak memory); "
                         f"auto: apart on CUDA devices under {SIDES_TOGETHER_GIB} GiB")
    args = ap.parse_args(argv)
    check_zero_args(ap, args)
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                               else ("cpu" if args.device == "auto" else args.device))
    return args


def summarize(sides, times, shape, args, peaks) -> dict:
    """Per side: median step time, tokens/s, TFLOP/s, fraction of the matmul peak and MFU."""
    device, tokens = args.device, args.micro_batch * args.seq
    matmul_peak = max(peaks)
    mfu_peak = args.peak_tflops or (CUDA_PEAK_TFLOPS if device.type == "cuda" else matmul_peak)
    out = {"bench": "step_throughput", "device": str(device), "cpu": platform.processor(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "preset": args.preset, "params": shape.num_parameters(), "seq": args.seq,
           "micro_batch": args.micro_batch, "warmup": args.warmup,
           "steps_per_round": args.steps, "rounds": args.rounds, "compile": args.compile,
           "attention": args.attention, "activation_checkpointing": args.activation_checkpointing,
           "matmul_peak_tflops": matmul_peak, "matmul_peak_samples_tflops": peaks,
           "mfu_peak_tflops": mfu_peak,
           "mfu_peak_source": ("--peak-tflops" if args.peak_tflops else
                               "H100/H200 dense bf16" if device.type == "cuda"
                               else "measured bf16 matmul peak")}
    n = PEAK_MATMUL_N.get(device.type, 1024)
    print(f"bf16 matmul peak ({n}^3, best of 8, before/after): "
          f"{' / '.join(f'{p:.2f}' for p in peaks)} TFLOP/s; MFU against {mfu_peak:.2f} "
          f"({out['mfu_peak_source']})")
    for name, (_, ran) in sides.items():
        dt = statistics.median(times[name])
        full = ran.get("activation_checkpointing") == "full"
        tf = megatron_tflops(args.micro_batch, args.seq, shape.num_layers, shape.hidden_size,
                             shape.vocab_size, dt, 1, full)
        # MFU counts the model's FLOPs: recompute's extra forward is in tflops only.
        model_tf = megatron_tflops(args.micro_batch, args.seq, shape.num_layers,
                                   shape.hidden_size, shape.vocab_size, dt, 1, False)
        out[name] = {**ran, "median_step_s": dt, "tokens_per_s": tokens / dt, "tflops": tf,
                     "peak_fraction": tf / matmul_peak, "mfu": model_tf / mfu_peak,
                     "step_times_s": times[name]}
        print(f"{name:<10}: median {dt:.3f} s/step (min {min(times[name]):.3f}, max "
              f"{max(times[name]):.3f}, n={len(times[name])}), {tokens / dt:,.0f} tokens/s, "
              f"{tf:.3f} TFLOP/s = {tf / matmul_peak:.1%} of the matmul peak, MFU "
              f"{model_tf / mfu_peak:.1%}; {ran['attention']}; {ran['optimizer']}")
    if "hf" in out:
        out["ratio"] = out["bloomtrain"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
        print(f"ratio (bloomtrain / HF tokens/s, medians): {out['ratio']:.2f}")
    return out


def shape_and_batch(args):
    """The bench's BLOOM shape (--preset, else the explicit one) and a seeded batch of token ids
    [micro-batch, seq + 1] on its device."""
    shape = (resolve_model_config(ModelConfig(preset=args.preset)) if args.preset
             else shape_from_args(args))
    torch.manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq + 1),
                        device=args.device)
    return shape, ids


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    shape, ids = shape_and_batch(args)
    print(f"shape: L={shape.num_layers} h={shape.hidden_size} heads={shape.num_heads} "
          f"V={shape.vocab_size} ({shape.num_parameters() / 1e6:.1f}M params), seq {args.seq}, "
          f"micro-batch {args.micro_batch}, device {device}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    peaks = [matmul_peak_tflops(device)]
    makers = {"bloomtrain": make_bloomtrain} | ({} if args.skip_hf else {"hf": make_hf})
    apart = sides_apart(args)
    if apart:
        sides, times, profiles = {}, {}, {}
        for name, make in makers.items():
            s, t, prof = measure_sides({name: make}, shape, ids, device, args)
            sides |= s
            times |= t
            profiles |= prof
            del s
            if device.type == "cuda":  # the next side starts from an empty device
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    else:
        sides, times, profiles = measure_sides(makers, shape, ids, device, args)
    peaks.append(matmul_peak_tflops(device))
    out = summarize(sides, times, shape, args, peaks)
    out["sides"] = "apart" if apart else "together"
    if device.type == "cuda":
        # Together: both sides' models at once; apart: each side's own in out[name].
        out["peak_memory_gb"] = max(ran.get("peak_memory_gb", 0.0) for _, ran in sides.values())
    if args.profile:
        out["profile"] = profiles
    print(json.dumps(out))


def sides_apart(args) -> bool:
    """Whether to measure bloomtrain, free it, then build and measure HF (`--sides apart`),
    rather than alternate the two with both models resident (`together`, which cancels drift
    between them). `auto`: apart on a CUDA device with under SIDES_TOGETHER_GIB of memory (an
    80 GB H100 at bloom-1b7's micro-batch 2 cannot hold both sides and HF's activations)."""
    if args.sides != "auto":
        return args.sides == "apart"
    if args.skip_hf or args.device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(args.device).total_memory
    return total < SIDES_TOGETHER_GIB * 2 ** 30


def measure_sides(makers: dict, shape, ids, device, args):
    """Build the sides, time them (alternating where there are two), record the device's peak
    memory and (with --profile) a profiled step: ({name: (None, info)}, {name: step times},
    {name: profile}). The steps (the models) are released on return."""
    sides = {name: make(shape, ids, device, args) for name, make in makers.items()}
    times = alternate_rounds({name: step for name, (step, _) in sides.items()},
                             lambda step: timed(step, device), args.warmup, args.rounds,
                             args.steps)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
        for _, ran in sides.values():
            ran["peak_memory_gb"] = peak
    profiles = ({name: profile_step(name, step, device, args.profile_rows)
                 for name, (step, _) in sides.items()} if args.profile else {})
    return {name: (None, ran) for name, (_, ran) in sides.items()}, times, profiles


if __name__ == "__main__":
    main()
