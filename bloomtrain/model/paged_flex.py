"""Decode attention read in place from the paged KV cache with FlexAttention (Dong et al., arXiv
2412.05496), instead of gathering each sequence's blocks into a padded copy at every step.

A layer's key (or value) planes, [heads, blocks, block_size, head_dim] in the cache
(bloomtrain.serve.kv_cache.PagedKVCache), are viewed as one long sequence [1, heads,
blocks x block_size, head_dim]: physical slot s is key s. The D decoding sequences are the
batch (queries [D, heads, 1, head_dim], keys and values broadcast over it), and a BlockMask built
from the block tables says which blocks each one reads: its own, as FlexAttention's KV block size
is the cache's block size, so the kernel visits a sequence's blocks and no other. Every block but
a sequence's last is full (no mask evaluated); in the last, `mask_mod` keeps the slots at logical
position <= the query's. `score_mod` adds ALiBi from the logical position, through the model's
one formula (bloomtrain.model.attention.alibi_scores, which bloom.alibi_bias also calls).

All metadata is made with tensor ops from the block tables and query positions (no host sync, no
shape that depends on values), so a CUDA graph can capture it from static buffers
(bloomtrain.serve.graphs). Which kernel a decode uses: `decode_kernel` below.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from bloomtrain.errors import UserError
from bloomtrain.model.attention import alibi_scores, flex_attention, flex_attention_available

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:
    BlockMask = None

# BLOOMTRAIN_PAGED_DECODE: "gather" (copy the blocks, HF's eager math: the CPU default, and
# batch invariant there), "flex" (this module) or "auto" (flex on CUDA where the block size
# suits its kernel, gather elsewhere).
DECODE_KERNEL_ENV = "BLOOMTRAIN_PAGED_DECODE"
DECODE_KERNELS = ("auto", "gather", "flex")
# The query-side block of the BlockMask. A decode has one query per sequence; flex's decoding
# kernel tiles queries by at least 16 and needs this to be a multiple of its tile.
Q_BLOCK = 128
# Compiled shapes: batch padded to a power of two, block-table width to a power of two, so a
# server meets a few dozen (batch, width) pairs; each is one compilation (dynamic=False: flex's
# decoding kernel wants a static batch). Dynamo's default of 8 per function would send the rest
# to the dense eager reference.
RECOMPILE_LIMIT = 256


def decode_kernel(device, block_size: int, choice: str | None = None) -> str:
    """"gather" or "flex" for decodes on `device`, from `choice` (or the environment's
    BLOOMTRAIN_PAGED_DECODE, or "auto"). Auto takes flex on CUDA with a block size that is a
    power of two >= 16 (the smallest tile its kernel's dot products take). On CPU, gather: flex's
    eager reference scores the whole pool, and its compiled CPU kernel, faster at larger batches,
    rounds a sequence differently alone than batched (bench/paged_decode_cpu.py; README, Serve),
    which would break the engine's batch invariance there."""
    choice = choice or os.environ.get(DECODE_KERNEL_ENV) or "auto"
    if choice not in DECODE_KERNELS:
        raise UserError(f"{DECODE_KERNEL_ENV}={choice!r}: choose one of {DECODE_KERNELS}")
    if choice == "auto":
        fits = block_size >= 16 and block_size & (block_size - 1) == 0
        cuda = torch.device(device).type == "cuda"
        return "flex" if cuda and fits and flex_attention_available() else "gather"
    if choice == "flex" and not flex_attention_available():
        raise UserError(f"{DECODE_KERNEL_ENV}=flex needs FlexAttention (torch >= 2.5)")
    return choice


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def pad_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class FlexPagedDecode:
    """D sequences decoding one token each, for PagedAttention's `flex_decodes`: query row
    `rows[i]` is sequence i (rows may hold padding sequences beyond the real ones, whose output
    is dropped: `num_real`), `block_mask` its blocks, `logical` [D, P] each physical block's
    logical index in sequence i (-1: not its block), `q_pos` [D] the query positions."""

    rows: torch.Tensor
    num_real: int
    block_mask: object
    logical: torch.Tensor
    q_pos: torch.Tensor
    slopes: torch.Tensor
    block_size: int
    compiled: bool

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [nh, D, hd] (the sequences' query rows), keys and values [1, nh, P*bs, hd] (a
        layer's planes) -> [nh, num_real, hd]."""
        logical, q_pos, slopes, bs = self.logical, self.q_pos, self.slopes, self.block_size

        def alibi(score, b, h, q_idx, kv_idx):
            k_pos = logical[b, kv_idx // bs] * bs + kv_idx % bs
            return score + alibi_scores(slopes[h], k_pos, q_pos[b])

        queries = q.transpose(0, 1).unsqueeze(2).contiguous()  # [D, nh, 1, hd]
        if self.compiled and not torch.compiler.is_compiling():
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = _compiled()(queries, keys, values, score_mod=alibi,
                                  block_mask=self.block_mask)
        else:  # the eager reference (CPU), or inside a region being compiled
            out = flex_attention(queries, keys, values, score_mod=alibi,
                                 block_mask=self.block_mask)
        return out[:self.num_real, :, 0].transpose(0, 1)


def flex_paged_decode(rows: torch.Tensor, tables: torch.Tensor, q_pos: torch.Tensor,
                      slopes: torch.Tensor, block_size: int, plane_blocks: int,
                      num_real: int | None = None, compiled: bool = True) -> FlexPagedDecode:
    """The FlexAttention decode of sequences whose block tables are `tables` [D, W] (entries past
    a sequence's last block are ignored, whatever they hold) and whose query positions are
    `q_pos` [D] (int or float), over a cache of `plane_blocks` blocks per plane; `rows` [D]
    their query rows. Tensor ops only: capturable in a CUDA graph."""
    dev, bs = tables.device, block_size
    D, W = tables.shape
    pos = q_pos.reshape(D).to(torch.int64)
    used = pos // bs + 1  # blocks holding positions 0..pos
    j = torch.arange(W, device=dev)
    # Physical block -> logical index, per sequence. Ignored entries (padding, which may repeat
    # a block another entry holds) are sent to a dump column, so no two writes meet in a real one.
    owned = torch.where(j[None] < used[:, None], tables, plane_blocks)
    logical = torch.full((D, plane_blocks + 1), -1, dtype=torch.int32, device=dev)
    logical.scatter_(1, owned, j.to(torch.int32).expand(D, W).contiguous())
    logical = logical[:, :plane_blocks]
    pos32 = pos.to(torch.int32)

    def owned_and_causal(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // bs]
        return (block >= 0) & (block * bs + kv_idx % bs <= pos32[b])

    i32 = tables.to(torch.int32)
    last = i32.gather(1, (used - 1)[:, None])  # [D, 1]: the one partial block
    if compiled and dev.type == "cpu":
        # Inductor's CPU template wants index rows as wide as the whole key length; the extra
        # entries are past every count, so never read.
        i32 = torch.nn.functional.pad(i32, (0, plane_blocks - W))
        last = torch.nn.functional.pad(last, (0, plane_blocks - 1))
    mask = BlockMask.from_kv_blocks(
        torch.ones((D, 1, 1), dtype=torch.int32, device=dev), last[:, None, None, :],
        (used - 1).to(torch.int32)[:, None, None], i32[:, None, None, :],
        BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=owned_and_causal, seq_lengths=(1, plane_blocks * bs),
        compute_q_blocks=False)
    return FlexPagedDecode(rows, D if num_real is None else num_real, mask, logical, pos32,
                           slopes.to(device=dev, dtype=torch.float32), bs, compiled)
