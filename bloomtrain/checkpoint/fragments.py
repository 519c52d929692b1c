"""What a rank hands the checkpoint writer: its pieces of the parameters, in logical coordinates.

Producers (the trainer, `full_fragments`) describe where each piece sits in the full parameter;
the writer records that in the manifest, so the layout that wrote a checkpoint never constrains
the layout that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bloomtrain.checkpoint.format import TIED_ALIAS


@dataclass
class Fragment:
    """One rank's piece of one logical parameter, in logical (unsharded) coordinates: elements
    [offset, offset + numel) of the flattened tp chunk `tp_rank` of `tp_size` along `tp_dim` of
    the full parameter `name` (full shape `shape`); tp_size 1 means the full parameter itself.

    `tensors` maps a kind ("model", "exp_avg", "exp_avg_sq") to a flat tensor of `numel`
    elements, or to a `Deferred` one that the writer computes when it writes it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    tp_rank: int
    tp_size: int
    offset: int
    numel: int
    tensors: dict[str, torch.Tensor]


class Deferred:
    """A flat tensor of known dtype and size that is computed only when the writer writes it, so
    that a converter (bloomtrain import-deepspeed) holds one parameter at a time, not the model.
    Has the attributes of a flat tensor the writer reads before writing (`dtype`, `shape`,
    `numel()`, `element_size()`)."""

    def __init__(self, dtype: torch.dtype, numel: int, compute: Callable[[], torch.Tensor]):
        self.dtype, self.shape, self._compute = dtype, (numel,), compute

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        t = self._compute().detach().reshape(-1)
        if t.dtype != self.dtype or t.numel() != self.numel():
            raise ValueError(f"a deferred tensor computed {t.dtype} [{t.numel()}], "
                             f"announced {self.dtype} [{self.numel()}]")
        return t


def full_fragments(state: dict[str, torch.Tensor], kind: str = "model") -> list[Fragment]:
    """Fragments for full (unsharded) tensors, as a single process writes them."""
    out = []
    for name, t in state.items():
        if name in TIED_ALIAS:
            continue  # the tied head is the embedding
        out.append(Fragment(name=name, shape=tuple(t.shape), tp_dim=None, tp_rank=0, tp_size=1,
                            offset=0, numel=t.numel(), tensors={kind: t.detach().reshape(-1)}))
    return out
