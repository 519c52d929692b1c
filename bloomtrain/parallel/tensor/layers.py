"""The layers that hold one tensor-parallel shard each (Megatron-LM, arXiv 1909.08053): column-,
row- and vocab-parallel, and the LM head tied to the vocab-parallel embedding. How each
parameter splits is also written in bloomtrain.model.params, the table the optimizer, ZeRO and
checkpoints read; tests/parallel/test_tensor_parallel.py checks that the two agree.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bloomtrain.parallel.tensor.regions import (f, g, gather_from_sequence_parallel_region,
                                                reduce_scatter_to_sequence_parallel_region)


def _shard(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    # A copy, so that the full tensor it was cut from can be freed.
    return t.detach().chunk(tp_size, dim)[tp_rank].clone()


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by output features: rank i computes Y_i = X A_i and the output stays
    split. `weight` is the [out/tp, in] row block of nn.Linear's weight, `bias` the [out/tp] block.
    The input is replicated (f) or, with sequence parallelism, gathered from sequence shards,
    unless `input_gathered`: then the caller has gathered it already, and the backward of that
    gather sums the partial input gradients."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group,
                 sequence_parallel: bool = False, input_gathered: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.input_gathered = input_gathered
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False,
                  input_gathered: bool = False) -> "ColumnParallelLinear":
        bias = None if linear.bias is None else _shard(linear.bias, 0, tp_rank, tp_size)
        return cls(_shard(linear.weight, 0, tp_rank, tp_size), bias, group, sequence_parallel,
                   input_gathered)

    def forward(self, x):  # [b, s(/tp with SP), in] -> [b, s, out/tp]
        if self.sequence_parallel:
            if not self.input_gathered:
                x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = f(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A with A split by input features: rank i holds X_i (the split output of a
    column-parallel layer) and A_i, computes the partial sum X_i A_i, and the partial sums are
    reduced (g) or, with sequence parallelism, reduce-scattered to sequence shards. The bias is
    replicated and added once, after the reduction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False) -> "RowParallelLinear":
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(_shard(linear.weight, 1, tp_rank, tp_size), bias, group, sequence_parallel)

    def forward(self, x):  # [b, s, in/tp] -> [b, s(/tp with SP), out]
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = g(partial, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank i holds rows [i*V/tp, (i+1)*V/tp) of the embedding. Token ids outside that range
    produce zero rows here, so the sum over ranks (g, or a reduce-scatter to sequence shards)
    is the full lookup."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = vocab_start
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, tp_rank: int, tp_size: int, group,
                  sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        weight = _shard(embedding.weight, 0, tp_rank, tp_size)
        return cls(weight, tp_rank * weight.shape[0], group, sequence_parallel)

    def forward(self, input_ids):  # [b, s] -> [b, s(/tp with SP), h]
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return g(out, self.group)


class VocabParallelLMHead(nn.Module):
    """The LM head as a column-parallel layer over the vocabulary, sharing the vocab-parallel
    embedding's local shard (tied, as in BLOOM: the same Parameter object, so the two
    contributions to its gradient accumulate in one .grad). The logits stay split [b, s, V/tp]
    for `vocab_parallel_cross_entropy`."""

    def __init__(self, embedding: VocabParallelEmbedding, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = embedding.weight

    def forward(self, hidden):  # [b, s(/tp with SP), h] -> [b, s, V/tp]
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.group)
        else:
            hidden = f(hidden, self.group)
        return F.linear(hidden, self.weight)
