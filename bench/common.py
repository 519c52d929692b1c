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


def shape_from_args(args) -> BloomShape:
    """A BLOOM shape with Megatron's default 4h MLP."""
    return BloomShape(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=args.heads, ffn_hidden_size=4 * args.hidden)
