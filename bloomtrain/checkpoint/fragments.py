"""What a rank hands the checkpoint writer: its pieces of the parameters, in logical coordinates.

Producers (the trainer, `full_fragments`) describe where each piece sits in the full parameter;
the writer records that in the manifest, so the layout that wrote a checkpoint never constrains
the layout that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bloomtrain.checkpoint.format import TIED_ALIAS


@dataclass
class Fragment:
    """One rank's piece of one logical parameter, in logical (unsharded) coordinates: elements
    [offset, offset + numel) of the flattened tp chunk `tp_rank` of `tp_size` along `tp_dim` of
    the full parameter `name` (full shape `shape`); tp_size 1 means the full parameter itself.

    `tensors` maps a kind ("model", "exp_avg", "exp_avg_sq") to a flat tensor of `numel`
    elements."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    tp_rank: int
    tp_size: int
    offset: int
    numel: int
    tensors: dict[str, torch.Tensor]


def full_fragments(state: dict[str, torch.Tensor], kind: str = "model") -> list[Fragment]:
    """Fragments for full (unsharded) tensors, as a single process writes them."""
    out = []
    for name, t in state.items():
        if name in TIED_ALIAS:
            continue  # the tied head is the embedding
        out.append(Fragment(name=name, shape=tuple(t.shape), tp_dim=None, tp_rank=0, tp_size=1,
                            offset=0, numel=t.numel(), tensors={kind: t.detach().reshape(-1)}))
    return out
