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

import math

import torch

from bloomtrain.errors import UserError


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
    """Keys and values of every layer, one [2, heads, num_blocks + 1, block_size, head_dim]
    tensor each: head-major planes (keys or values of one head) cut into blocks, so that a block of
    one plane is one contiguous run of block_size x head_dim numbers. Gathering a batch of block
    tables then copies whole blocks straight into the layout attention multiplies, one copy in
    all: [heads, sequences, blocks x block_size, head_dim], each (head, sequence) matrix
    contiguous. (Token-major slots, gathered and then transposed to head-major, copied the
    context twice and took a quarter of a decode step on CPU.) Zeroed, so that the padding
    blocks a batched attention reads are finite (they are masked with -inf, and 0 times a
    finite value stays 0).

    Beyond the pool's `num_blocks` each plane holds one more block, `scratch_block`, that no
    sequence ever owns (BlockPool hands out ids below num_blocks): the padding rows of a
    decode replayed from a CUDA graph (bloomtrain.serve.graphs) write their keys and values
    there, since a captured graph writes every row it was captured with."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, device, layers=None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scratch_block = num_blocks
        self._plane_blocks = num_blocks + 1  # the pool's blocks and the scratch block
        shape = (2, num_heads, self._plane_blocks, block_size, head_dim)
        # By global layer index: `layers` (a pipeline stage's own) or all of them.
        layers = range(num_layers) if layers is None else layers
        try:
            self.kv = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if "memory" not in str(e).lower():
                raise
            need = len(layers) * math.prod(shape) * dtype.itemsize
            raise UserError(f"the KV cache ({need / 2 ** 30:,.1f} GiB: {num_blocks} blocks of "
                            f"{block_size} tokens, {len(layers)} layers) does not fit in the "
                            f"memory of {device}; lower --kv-cache-tokens (or the lengths "
                            f"that size it)") from None
        # Each layer as rows of one block of one plane ([2 * heads * (num_blocks + 1),
        # block_size * head_dim] views, made once): a gather is then one index_select of whole
        # rows.
        self._rows = {i: kv.view(-1, block_size * head_dim) for i, kv in self.kv.items()}
        self._workspace = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values of n tokens, k and v [heads, n, head_dim], into `slots` [n]."""
        flat = self.kv[layer].view(2, self.num_heads, -1, self.head_dim)
        flat[0].index_copy_(1, slots, k)
        flat[1].index_copy_(1, slots, v)

    def buffer(self, tables: torch.Tensor):
        """Room for `read` of the block tables `tables` [b, w] on CPU, and the rows it reads,
        to reuse at every layer of a step: a layer's attention is done with what it read
        before the next layer reads, and each group of a layer (a prompt chunk, a group of
        decodes) before the next group reads. So every buffer is a view of one workspace,
        kept from step to step at the largest size a step has needed: a new one per step, a
        few MB, came as fresh pages from the kernel, faulted in by the gather that filled them
        (on the serve benchmark's load that gather ran at half the speed of a copy into warm
        memory). None on CUDA, where `read` gathers in one kernel into a new tensor."""
        first = next(iter(self.kv.values()))
        if first.is_cuda:
            return None
        planes = torch.arange(2 * self.num_heads, device=tables.device)[:, None]
        rows = (planes * self._plane_blocks + tables.reshape(1, -1)).reshape(-1)
        n = rows.numel()
        if self._workspace is None or self._workspace.shape[0] < n:
            self._workspace = first.new_empty((n, self.block_size * self.head_dim))
        return self._workspace[:n], rows

    def read(self, layer: int, tables: torch.Tensor, buffer=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the blocks `tables` [b, w] (b block tables of w blocks)
        -> [heads, b, w * block_size, head_dim] each, every (head, table) matrix
        contiguous; into `buffer` (from `buffer(tables)`) when given."""
        cache = self.kv[layer]
        b, w = tables.shape
        ids = tables.reshape(-1)
        if cache.is_cuda:
            out = cache.index_select(2, ids)
        else:
            # index_select over an inner dimension goes element by element on CPU; over the
            # leading dimension it copies whole rows, here whole blocks of every plane at once.
            out, rows = buffer if buffer is not None else self.buffer(tables)
            torch.index_select(self._rows[layer], 0, rows, out=out)
        out = out.view(2, self.num_heads, b, w * self.block_size, self.head_dim)
        return out[0], out[1]

    def planes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values in place, each [1, heads, (num_blocks + 1) *
        block_size, head_dim]: every slot of every block as one long sequence (slot s at
        position s), for FlexAttention's paged decode (bloomtrain.model.paged_flex)."""
        kv = self.kv[layer].view(2, 1, self.num_heads, -1, self.head_dim)
        return kv[0], kv[1]

    @property
    def plane_blocks(self) -> int:
        """Blocks per plane: the pool's and the scratch block."""
        return self._plane_blocks


def slots_of(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Slots of positions [0, length) of a sequence whose block table is `blocks` [n] (or
    [b, n] for b tables at once -> [b, length])."""
    offsets = torch.arange(block_size, device=blocks.device)
    slots = blocks.unsqueeze(-1) * block_size + offsets  # [..., n, block_size]
    return slots.flatten(-2)[..., :length]
