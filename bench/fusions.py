"""The seeds' fused kernels one at a time: LayerNorm, bias-GeLU and bias-dropout-add, and a whole
transformer block, each eager against compiled (Inductor, as `train.compile` compiles a block),
forward and backward together. Megatron-DeepSpeed built these as CUDA extensions; bloomtrain gets
them from torch.compile (bloomtrain/parallel/compile.py). This says what each one buys.

For each region: the kernels one call launches (forward + backward), eager and compiled, and the
median time of a forward and backward, the sides alternated round by round.
- Kernels on CUDA: the device's kernels, copies and memsets in a profile of one call.
- Kernels on the CPU: the aten ops that do work (not views, allocations or composite ops that only
  call others, whose callees are counted; an op that another counted op calls, such as the bias
  copy inside addmm, is part of that one) plus Inductor's generated C++ kernels
  (`cpp.enable_kernel_profile`).
Per layer a block has two LayerNorms, one bias-GeLU and two bias-dropout-adds; the `block` row is
one whole layer (with its matmuls and attention), what `train.compile` compiles.

    python bench/fusions.py                                      # the CPU bar's shape, bf16
    python bench/fusions.py --preset bloom-1b7 --seq 2048 --micro-batch 2 --device cuda

Prints a table, then one JSON line. Measures; asserts nothing.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_shape_args, alternate_rounds, shape_from_args  # noqa: E402
from bench.step_throughput import sync, timed  # noqa: E402
from bloomtrain.config import ModelConfig  # noqa: E402
from bloomtrain.model import build_model, resolve_model_config  # noqa: E402
from bloomtrain.parallel.compile import compile_blocks  # noqa: E402

# Views, allocations and bookkeeping: no pass over a tensor's elements.
NOT_KERNELS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "lift_fresh", "set_", "detach", "detach_", "resolve_conj", "resolve_neg", "alias",
    "_has_compatible_shallow_copy_type", "is_same_size", "size", "stride", "result_type",
})


def _does_work(name: str) -> bool:
    """Whether the aten op `name` ("aten::add_") passes over elements itself: not a view (its
    schema returns an alias it does not write), not an allocation, not a composite op that only
    dispatches to others (those are counted instead). The profile names no overload: the
    default one is looked at, else the first the dispatcher knows."""
    op = name.split("::", 1)[1]
    packet = getattr(torch.ops.aten, op, None)
    overloads = packet.overloads() if packet is not None else []
    if op in NOT_KERNELS or not overloads:
        return op not in NOT_KERNELS
    for name in sorted(overloads, key=lambda o: o != "default"):
        overload = getattr(packet, name)
        try:  # TorchScript-only overloads are not in the dispatcher
            composite = overload.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd)
        except RuntimeError:
            continue
        break
    else:
        return True
    if composite:
        return False
    returns = overload._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write
                                for r in returns))


def count_kernels(prof, device: torch.device) -> int:
    """Kernels in a profile (see the module docstring)."""
    if device.type == "cuda":
        return sum(1 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0)
    def working(e) -> bool:
        return e.name.startswith("aten::") and _does_work(e.name)

    def inside_work(e) -> bool:  # called by an op that is counted already (addmm's bias copy)
        parent = e.cpu_parent
        while parent is not None:
            if working(parent):
                return True
            parent = parent.cpu_parent
        return False

    return sum(1 for e in prof.events()
               if "cpp_fused" in e.name or (working(e) and not inside_work(e)))


def regions(shape, batch: tuple[int, int], device, dtype, dropout: float,
            attention: str) -> dict:
    """{name: (eager step, function that returns the compiled step)} for LayerNorm, bias-GeLU,
    bias-dropout-add and a whole block, on activations [micro-batch, seq, hidden]; a step runs
    the region's forward and its backward from a fixed gradient."""
    torch.manual_seed(0)
    h, f = shape.hidden_size, shape.ffn_hidden_size
    b, s = batch

    def leaf(*size, scale=0.02):
        return (torch.randn(*size, device=device) * scale).to(dtype).requires_grad_()

    x = leaf(b, s, h, scale=1.0)
    x4 = leaf(b, s, f, scale=1.0)
    residual = leaf(b, s, h, scale=1.0)
    ln_w, ln_b = leaf(h, scale=1.0), leaf(h)
    w1, b1, w2, b2 = leaf(f, h), leaf(f), leaf(h, f), leaf(h)
    g_h = torch.randn(b, s, h, device=device).to(dtype)
    g_f = torch.randn(b, s, f, device=device).to(dtype)
    eps = shape.layer_norm_epsilon

    def layernorm(x):
        return F.layer_norm(x, (h,), ln_w, ln_b, eps)

    def bias_gelu(x):
        return F.gelu(F.linear(x, w1, b1), approximate="tanh")

    def bias_dropout_add(x4, residual):
        return residual + F.dropout(F.linear(x4, w2, b2), dropout, True)

    # Only the block runs here: a 256-token vocabulary, not bloom-1b7's 250,880 rows, whose
    # seeded init took 20 s of the GPU section's 90 on a 2-core host.
    model = build_model(dataclasses.replace(shape, num_layers=1, hidden_dropout=dropout,
                                            attention_dropout=0.0, vocab_size=256),
                        seed=0, device=device)
    model.to(dtype).train()
    model.transformer.attention_impl = attention
    # The ALiBi bias is built once per step for every layer: outside the layer's count.
    bias = model.transformer.attention_bias(s, s, dtype)
    compiled_model = copy.deepcopy(model)
    block_params = list(model.transformer.h.parameters())
    compiled_params = list(compiled_model.transformer.h.parameters())

    def block(x):
        return model.transformer.h[0](x, bias)

    def compile_block():
        compile_blocks([compiled_model])
        return lambda x: compiled_model.transformer.h[0](x, bias)

    out = {"layernorm": (layernorm, (x,), g_h, [x, ln_w, ln_b]),
           "bias_gelu": (bias_gelu, (x,), g_f, [x, w1, b1]),
           "bias_dropout_add": (bias_dropout_add, (x4, residual), g_h, [x4, residual, w2, b2]),
           "block": (block, (x,), g_h, [x, *block_params])}
    steps = {}
    for name, (fn, inputs, grad, params) in out.items():
        if name == "block":  # train.compile's own path, on a copy of the same block
            compiled, compiled_with = compile_block, [x, *compiled_params]
        else:
            compiled, compiled_with = (lambda fn=fn: torch.compile(fn, dynamic=False)), params
        steps[name] = (_fwd_bwd(fn, inputs, grad, params),
                       lambda c=compiled, i=inputs, g=grad, p=compiled_with: _fwd_bwd(c(), i, g, p))
    return steps


def _fwd_bwd(fn, inputs, grad, params):
    def step():
        for p in params:
            p.grad = None  # AccumulateGrad then takes the gradient, no add
        fn(*inputs).backward(grad)
    return step


def profile_kernels(step, device) -> int:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        step()
        sync(device)
    return count_kernels(prof, device)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None)
    add_shape_args(ap, hidden=512, layers=1, heads=8, vocab=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="hidden dropout of bias-dropout-add and the block (BLOOM-176B: 0.0)")
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "eager", "flex"))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--regions", default="layernorm,bias_gelu,bias_dropout_add,block")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                               else ("cpu" if args.device == "auto" else args.device))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = args.device
    shape = (resolve_model_config(ModelConfig(preset=args.preset)) if args.preset
             else shape_from_args(args))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cpu":
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True  # Inductor's kernels in the profile
    steps = regions(shape, (args.micro_batch, args.seq), device, dtype, args.dropout,
                    args.attention)
    wanted = args.regions.split(",")
    print(f"h={shape.hidden_size} ffn={shape.ffn_hidden_size} heads={shape.num_heads}, seq "
          f"{args.seq}, micro-batch {args.micro_batch}, {args.dtype}, dropout {args.dropout}, "
          f"attention {args.attention}, {device}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}")
    print("| region | kernels eager | kernels compiled | eager ms | compiled ms | compiled/eager |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name in wanted:
        eager, make_compiled = steps[name]
        compiled = make_compiled()
        times = alternate_rounds({"eager": eager, "compiled": compiled},
                                 lambda st: timed(st, device), args.warmup, args.rounds,
                                 args.steps)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        kernels = {k: profile_kernels(st, device) for k, st in
                   (("eager", eager), ("compiled", compiled))}
        rows[name] = {"kernels_eager": kernels["eager"], "kernels_compiled": kernels["compiled"],
                      "eager_ms": ms["eager"], "compiled_ms": ms["compiled"],
                      "ratio": ms["compiled"] / ms["eager"]}
        r = rows[name]
        print(f"| {name} | {r['kernels_eager']} | {r['kernels_compiled']} | "
              f"{r['eager_ms']:.3f} | {r['compiled_ms']:.3f} | {r['ratio']:.2f} |")
    print(json.dumps({"bench": "fusions", "device": str(device),
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else None, "torch": torch.__version__, "preset": args.preset,
                      "hidden": shape.hidden_size, "seq": args.seq,
                      "micro_batch": args.micro_batch, "dtype": args.dtype,
                      "dropout": args.dropout, "attention": args.attention,
                      "threads": torch.get_num_threads(), "regions": rows}))


if __name__ == "__main__":
    main()
