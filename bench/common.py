"""Shared by the benchmarks: the model-shape flags and the shape they describe, the alternating
timing loop, the device's measured matmul peak, and a fast unseeded initialization."""
from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch

from bloomtrain.model.presets import BloomShape


def add_shape_args(ap: argparse.ArgumentParser, hidden: int = 256, layers: int = 8,
                   heads: int = 8, vocab: int = 32768) -> None:
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--vocab", type=int, default=vocab)


def alternate_rounds(steps: dict, timer, warmup: int, rounds: int,
                     steps_per_round: int) -> dict[str, list[float]]:
    """Time each side's `steps[name]()` like for like: `warmup` untimed steps per side, then
    `rounds` rounds in which every side runs `steps_per_round` timed steps, the order of the
    sides reversed every other round (so neither always runs first, on a warm or a cold cache).
    `timer(step)` returns one step's seconds. Returns every timed step per side."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    order = list(steps)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name] += [timer(steps[name]) for _ in range(steps_per_round)]
    return times


def shape_from_args(args) -> BloomShape:
    """A BLOOM shape with Megatron's default 4h MLP."""
    return BloomShape(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=args.heads, ffn_hidden_size=4 * args.hidden)


# The matmul size that reaches a device's rate: 1024³ is enough for a CPU's BLAS, but on an H200
# it ran at 122-193 TFLOP/s, under a fifth of the datasheet's 989 (too small to fill the GPU),
# so a step's fraction of it read 1.2-1.6; an 8192³ bf16 matmul runs at about 790 there.
PEAK_MATMUL_N = {"cpu": 1024, "cuda": 8192}


def matmul_peak_tflops(device, n: int | None = None, dtype=torch.bfloat16,
                       samples: int = 8) -> float:
    """This device's achievable dense-matmul rate: the best of `samples` timings of an n x n x n
    matmul (2·n³ FLOPs), in TFLOP/s, n by default the size that reaches the device's rate
    (PEAK_MATMUL_N). A measured peak rather than a datasheet one, so that a fraction of it says
    how much of what this machine's BLAS can do a training step gets. On CUDA each sample times
    a burst of matmuls, so that launch overhead does not count."""
    device = torch.device(device)
    n = n or PEAK_MATMUL_N.get(device.type, 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    burst = (50 if n <= 2048 else 5) if device.type == "cuda" else 1
    best = float("inf")
    for i in range(samples + 2):  # the first two warm up the kernel choice and the caches
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(burst):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, (time.perf_counter() - t0) / burst)
    return 2 * n ** 3 / best / 1e12


@contextlib.contextmanager
def unseeded_init():
    """Inside it, `parallelize` fills parameters with unseeded random values (the spec's std) on
    the buffer's own device instead of BLOOM's seeded, layout-independent values.

    For benches that measure speed or memory, where values only need the right sizes: the seeded
    values come from a loop of per-block CPU generators (~13 s for bloom-560m on 2 cores, over a
    minute for bloom-7b1 on a GPU host), which would take most of a GPU check's budget. The model
    is still built on the meta device and materialized by the engine, so memory peaks are those
    of a real run. Zeros/ones parameters (biases, LayerNorms) keep their exact values."""
    from bloomtrain.parallel import parallelize as par
    seeded = par.init_into  # an AttributeError here means parallelize changed: update this

    def fast(out, spec, full_shape, std, seed, *args, **kwargs):
        if spec.init in ("zeros", "ones"):
            return seeded(out, spec, full_shape, std, seed, *args, **kwargs)
        # uniform with the normal's std: half the cost of normal_ on a CPU (offloaded masters)
        bound = std * math.sqrt(3.0)
        return out.uniform_(-bound, bound)

    par.init_into = fast
    try:
        yield
    finally:
        par.init_into = seeded


def timed_on_all_ranks(step) -> float:
    """Seconds `step()` takes on the slowest rank of the world group: a barrier before and after,
    so every rank starts together and the time ends when the last one is done."""
    from bloomtrain.parallel import comm

    comm.barrier(comm.world_group(), "bench")
    t0 = time.perf_counter()
    step()
    comm.barrier(comm.world_group(), "bench")
    return time.perf_counter() - t0
