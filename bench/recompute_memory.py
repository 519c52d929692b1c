"""Activation memory and step time with activation recomputation none / selective / full: full
recomputes every block, as BLOOM did; selective keeps each block's matmul and fused-attention
outputs and recomputes the rest (bloomtrain.model.recompute). Korthikanti et al.'s selective
("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198) recomputed
only the attention core, which saves nothing next to a fused kernel (issue 38).

For each mode, on one model and one micro-batch:
- activations: the memory held between forward and backward, i.e. allocated in forward and
  still alive after it (CUDA: memory_allocated after forward minus before; CPU: bench/memtrack.py's
  LiveMemory, which sums the live storages made in forward), in total and per transformer layer
  (measured from the entry of the first block to that of ln_f, divided by the layers);
- peak: the most memory above the parameters during forward + backward (activations, gradients
  and temporaries);
- step: forward + backward time, the median over alternating rounds.
Next to them, the paper's per-layer formulas (tp = 1, 16-bit activations, dropout masks
included, attention unfused): none sbh(34 + 5as/h), selective 34sbh, full 2sbh bytes. Fused
attention kernels (SDPA's, FlexAttention) never store the a·s² scores, so there "none" is already
close to 34sbh; the unfused path (attention dropout > 0 on CPU, or --attention eager) shows the
5as/h term. Our selective keeps about 22sbh (input, QKV, attention output, dense, h->4h, 4h->h).

Prints a table, then one JSON line. Measures; asserts nothing.

    python bench/recompute_memory.py                       # h 512, 8 layers, s 512, b 4, bf16, CPU
    python bench/recompute_memory.py --preset bloom-1b7 --seq 2048 --device cuda
    python bench/recompute_memory.py --attention-dropout 0.1   # the unfused attention path
    python bench/recompute_memory.py --attention eager         # HF's math: fp32 softmax stored
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, alternate_rounds, shape_from_args
from bench.memtrack import LiveMemory
from bloomtrain.config import ModelConfig
from bloomtrain.errors import UserError
from bloomtrain.model.attention import resolve_attention
from bloomtrain.model import BloomForCausalLM, alibi_slopes, resolve_model_config
from bloomtrain.devices import DTYPE_NAMES, torch_dtype

MODES = ("none", "selective", "full")
DEFAULT_SHAPE = {"hidden": 512, "layers": 8, "heads": 8, "vocab": 8192}


def korthikanti_per_layer(mode: str, s: int, b: int, h: int, a: int) -> float:
    """Activation bytes per layer, Korthikanti et al. Table 2 (tp = 1, 16-bit activations)."""
    sbh = s * b * h
    return {"none": sbh * (34 + 5 * a * s / h), "selective": 34 * sbh, "full": 2 * sbh}[mode]


def build(shape, device, dtype) -> BloomForCausalLM:
    """Made on the device with torch's default init (values do not matter here, and the seeded
    init of a billion-parameter model on the CPU would take minutes); the ALiBi slopes stay fp32."""
    with torch.device(device):
        model = BloomForCausalLM(shape)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.transformer.alibi_slopes = alibi_slopes(shape.num_heads).to(device)
    return model.train()


class Meter:
    """Memory now, on CUDA from the allocator, on CPU from a LiveMemory over the step."""

    def __init__(self, device, model):
        self.device, self.live = device, None
        if device.type != "cuda":
            self.live = LiveMemory()
            self.live.register(list(model.parameters()), "parameters")
            self.params = sum(p.untyped_storage().nbytes() for p in model.parameters())

    def __enter__(self):
        if self.live is not None:
            self.live.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def activations(self) -> int:
        if self.live is not None:
            return self.live.current()["activations"]
        return torch.cuda.memory_allocated(self.device) - self.base

    def peak(self) -> int:
        if self.live is not None:
            return self.live.peak - self.params
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def phase(self, name):
        if self.live is not None:
            return self.live.phase(name)
        return _NullPhase()


class _NullPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_memory(model, ids, device) -> dict:
    model.zero_grad(set_to_none=True)
    blocks = list(model.transformer.h)
    marks = {}

    def mark(name):
        def hook(*_):  # returns None: a pre-hook's return value would replace the inputs
            marks.setdefault(name, meter.activations())
        return hook

    with Meter(device, model) as meter:
        # From the first block's entry to ln_f's: what the blocks left alive (ln_f, not the last
        # block's exit, where that block's return value is still held).
        hooks = [blocks[0].register_forward_pre_hook(mark("in")),
                 model.transformer.ln_f.register_forward_pre_hook(mark("out"))]
        with meter.phase("forward"):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        activations = meter.activations()
        with meter.phase("backward"):
            loss.backward()
        peak = meter.peak()
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return {"activation_bytes": activations, "peak_bytes": peak,
            "per_layer_bytes": (marks["out"] - marks["in"]) / len(blocks)}


def time_steps(model, ids, device, modes, warmup, rounds) -> dict[str, float]:
    def step_for(mode):
        def step():
            model.set_activation_checkpointing(mode)
            model.zero_grad(set_to_none=True)
            model(ids[:, :-1], labels=ids[:, 1:]).backward()
        return step

    def timer(step):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    times = alternate_rounds({m: step_for(m) for m in modes}, timer, warmup, rounds, 1)
    return {m: statistics.median(t) for m, t in times.items()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", help="a model preset (bloomtrain.model.presets) instead of "
                                     "--hidden/--layers/--heads/--vocab")
    add_shape_args(ap, hidden=None, layers=None, heads=None, vocab=None)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--attention", choices=("auto", "sdpa", "flex", "eager"), default="auto")
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="> 0 runs SDPA's unfused path on CPU, which stores the a·s² scores")
    ap.add_argument("--precision", choices=sorted(DTYPE_NAMES), default="bf16")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes: choose from {','.join(MODES)}")
    explicit = [k for k in DEFAULT_SHAPE if getattr(args, k) is not None]
    if args.preset and explicit:
        ap.error(f"--preset or --{'/--'.join(explicit)}, not both")
    if args.preset:
        try:
            shape = resolve_model_config(ModelConfig(preset=args.preset))
        except UserError as e:
            ap.error(str(e))
    else:
        for k, v in DEFAULT_SHAPE.items():
            setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
        shape = shape_from_args(args)
    return args, shape.replace(attention_dropout=args.attention_dropout)


def main(argv=None) -> int:
    args, shape = parse_args(argv)
    device = torch.device(args.device)
    try:
        impl = resolve_attention(args.attention, shape.attention_dropout, device,
                                 head_dim=shape.head_dim)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build(shape, device, torch_dtype(args.precision))
    model.transformer.attention_impl = impl
    ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq + 1), device=device)
    results = {}
    for mode in args.modes:
        model.set_activation_checkpointing(mode)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()  # warm: kernels, compiles, caches
        results[mode] = measure_memory(model, ids, device)
    times = time_steps(model, ids, device, args.modes, args.warmup, args.rounds)
    report(args, shape, impl, results, times)
    return 0


def report(args, shape, impl, results, times) -> None:
    s, b, h, a = args.seq, args.micro_batch, shape.hidden_size, shape.num_heads
    num_layers = shape.num_layers
    sbh = s * b * h
    mib = 2 ** 20
    print(f"activation recomputation: L={num_layers} h={h} heads={a} vocab={shape.vocab_size} "
          f"s={s} b={b} {args.precision} on {args.device}, attention={impl}, attention dropout "
          f"{shape.attention_dropout}; step median of {args.rounds} rounds")
    print(f"{'mode':<10} {'activations MiB':>15} {'per layer MiB':>13} {'= x sbh':>8} "
          f"{'paper MiB':>10} {'paper x sbh':>11} {'peak MiB':>9} {'step ms':>8}")
    rows = []
    for mode in args.modes:
        r = results[mode]
        paper = korthikanti_per_layer(mode, s, b, h, a)
        print(f"{mode:<10} {r['activation_bytes'] / mib:>15.1f} {r['per_layer_bytes'] / mib:>13.2f} "
              f"{r['per_layer_bytes'] / sbh:>8.1f} {paper / mib:>10.2f} {paper / sbh:>11.1f} "
              f"{r['peak_bytes'] / mib:>9.1f} {times[mode] * 1e3:>8.0f}")
        rows.append({"mode": mode, **r, "paper_per_layer_bytes": paper,
                     "peak_memory_gb": r["peak_bytes"] / 2 ** 30, "step_ms": times[mode] * 1e3})
    print(f"sbh = s*b*h = {sbh:,}; paper: Korthikanti et al. Table 2 at tp=1 (16-bit "
          f"activations, 1-byte dropout masks, unfused attention)")
    print(json.dumps({"bench": "recompute_memory", "device": args.device,
                      "precision": args.precision, "attention": impl, "seq": s, "micro_batch": b,
                      "hidden": h, "layers": num_layers, "heads": a, "vocab": shape.vocab_size,
                      "attention_dropout": shape.attention_dropout, "modes": rows}))


if __name__ == "__main__":
    sys.exit(main())
