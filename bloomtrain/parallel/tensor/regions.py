"""The communication ops of tensor and sequence parallelism as autograd functions: Megatron's `f`
(identity forward, all-reduce backward) and `g` (all-reduce forward, identity backward) from
Megatron-LM (Shoeybi et al., arXiv 1909.08053), and the sequence-parallel all-gather /
reduce-scatter / scatter along the sequence of Korthikanti et al. (arXiv 2205.05198).

Hidden states are [b, s, h], batch first, so sequence parallelism splits dim 1. Collectives work on
dim 0, so the sequence dim is moved to the front around each of them.
"""
from __future__ import annotations

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.comm import group_rank, group_size
from bloomtrain.errors import UserError

SEQUENCE_DIM = 1  # hidden states are [b, s, h]
COMM_NAME = "tp"


def _check_sequence_divisible(seq_len: int, world: int) -> None:
    if seq_len % world:
        raise UserError(f"the sequence length ({seq_len}) must be divisible by parallel.tp "
                        f"({world}) with parallel.sequence_parallel=true; change data.seq_length "
                        f"or turn sequence parallelism off")


def _all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    front = x.movedim(dim, 0).contiguous()  # [n_local, ...]
    out = front.new_empty((world * front.shape[0],) + tuple(front.shape[1:]))  # [n, ...]
    comm.all_gather_into_tensor(out, front, group, COMM_NAME)
    return out.movedim(0, dim)


def _reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    _check_sequence_divisible(x.shape[dim], world)
    front = x.movedim(dim, 0).contiguous()  # [n, ...]
    out = front.new_empty((front.shape[0] // world,) + tuple(front.shape[1:]))  # [n_local, ...]
    comm.reduce_scatter_tensor(out, front, group, COMM_NAME)
    return out.movedim(0, dim)


def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    _check_sequence_divisible(x.shape[dim], world)
    return x.chunk(world, dim)[group_rank(group)].contiguous()


def _all_reduced_copy(x: torch.Tensor, group) -> torch.Tensor:
    # A copy, not in place: the input may be referenced elsewhere in the graph (autograd can hand
    # the same gradient tensor to several consumers, e.g. both operands of an add).
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group, COMM_NAME)
    return out


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel layer is replicated; each rank's gradient
    w.r.t. it covers only its output columns, so the backward sums them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced_copy(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: a row-parallel layer yields partial sums; the forward adds them up, and the
    (replicated) gradient of the sum is the gradient of each part."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's replacement for f: all-gather the sequence shards in front of a
    column-parallel layer. Each rank's gradient w.r.t. the full sequence is partial (its output
    columns only), so the backward reduces it and keeps this rank's shard: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's replacement for g: sum the row-parallel partial outputs and keep
    this rank's sequence shard. The backward all-gathers the shard gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Enter a sequence-parallel region from a replicated tensor: keep this rank's shard."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


def f(x: torch.Tensor, group) -> torch.Tensor:
    """copy_to_tp_region: identity forward, all-reduce backward."""
    return x if group is None else _CopyToTensorParallelRegion.apply(x, group)


def g(x: torch.Tensor, group) -> torch.Tensor:
    """reduce_from_tp_region: all-reduce forward, identity backward."""
    return x if group is None else _ReduceFromTensorParallelRegion.apply(x, group)


copy_to_tp_region = f
reduce_from_tp_region = g


def gather_from_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """All-gather along `dim` forward, reduce-scatter backward."""
    return x if group is None else _GatherFromSequenceParallelRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """Reduce-scatter along `dim` forward, all-gather backward."""
    return x if group is None else _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x, group, dim: int = SEQUENCE_DIM):
    """Split along `dim` forward, all-gather backward."""
    return x if group is None else _ScatterToSequenceParallelRegion.apply(x, group, dim)
