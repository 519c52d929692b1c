"""The block-paged KV cache of the serving engine (PagedAttention, Kwon et al., arXiv 2309.06180).

Keys and values live in one pool of fixed-size blocks per layer. A sequence owns a list of block
ids (its block table) that grows one block at a time as it gets longer, so memory is taken as
tokens are produced, not reserved for `max_tokens` up front, and a finished or aborted sequence
hands its blocks back to the free list at once. Token position p of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size` of the flat pool.

`BlockPool` is the bookkeeping (one per engine, on the scheduling rank); `PagedKVCache` is the
storage (one per rank: under tensor parallelism each rank keeps the keys and values of its own
heads at the same slots, so one block table serves every rank).
"""
from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class BlockPool:
    """A free list of block ids. Allocation takes the lowest free ids first, so a lightly
    loaded server touches a compact region of the pool."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"{num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() is the lowest id
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:  # a double free would hand one block to two sequences
                raise ValueError(f"block {b} is already free")
            self._is_free[b] = True
        # Back in reverse, so that the next allocation reuses the same (warm) blocks.
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Keys and values of every layer, one [num_blocks * block_size, 2, heads, head_dim] tensor
    each: slot-major, so that writing a token or gathering a sequence's context copies one
    contiguous row (keys and values of every head) per position; the gathered context is then
    laid out head-major, [2, heads, ..., head_dim], the matrices attention multiplies. Zeroed,
    so that the padding slots a batched attention reads are finite (they are masked with -inf,
    and 0 times a finite value stays 0)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, 2, num_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """kv [n, heads, 2, head_dim] (keys and values of n tokens) into `slots` [n]."""
        self.kv[layer].index_copy_(0, slots, kv.transpose(1, 2))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at `slots` (any shape [...]) -> [heads, ..., head_dim] each,
        contiguous."""
        kv = self.kv[layer].index_select(0, slots.reshape(-1))  # [n, 2, nh, hd]
        kv = kv.view(tuple(slots.shape) + kv.shape[1:]).movedim((-3, -2), (0, 1)).contiguous()
        return kv[0], kv[1]


def slots_of(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Slots of positions [0, length) of a sequence whose block table is `blocks` [n] (or
    [b, n] for b tables at once -> [b, length])."""
    offsets = torch.arange(block_size, device=blocks.device)
    slots = blocks.unsqueeze(-1) * block_size + offsets  # [..., n, block_size]
    return slots.flatten(-2)[..., :length]
