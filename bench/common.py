"""Shared by the benchmarks: the model-shape flags and the shape they describe."""
from __future__ import annotations

import argparse

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
