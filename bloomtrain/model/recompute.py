"""Selective activation recomputation (train.activation_checkpointing=selective) as an op-level
policy over a whole transformer block, as torchtitan applies it: torch.utils.checkpoint with
`create_selective_checkpoint_contexts`. In forward every op of the block runs once; the policy
keeps the outputs of the expensive ones, and backward re-runs the block with those outputs taken
from the cache and every other op recomputed.

Kept: the matmuls of the linear layers (aten.mm/addmm: QKV, attention dense, h->4h, 4h->h) and a
fused attention kernel's outputs (its context and logsumexp). Recomputed: the memory-bound ops,
LayerNorm, GeLU, bias adds, dropout and the residual adds, whose outputs are as large as the
matmuls' but cost a small share of the block's time.

Why not the attention core alone (Korthikanti et al., arXiv 2205.05198, what "selective" meant
here before): that saves the a·s² softmax and dropout tensors of an *unfused* core, and a fused
kernel (SDPA's flash/efficient/CPU-flash, FlexAttention) stores none, only q, k, v, its output
and a logsumexp, which the checkpointed core kept anyway. At bloom-1b7 on an H200 selective
saved nothing (issue 38). Under this policy an unfused core (train.attention=eager, or SDPA's
math path with attention dropout on CPU) is recomputed whole, since its bmm/baddbmm outputs
are the s² scores and its softmax and dropout are not kept: Megatron's meaning still holds.

Random ops: the checkpoint restores the RNG state before the replay, so every op that draws
(dropout's bernoulli, tensor parallelism's fork draw in parallel/tensor/rng.py) must run again
in the same order to draw the same numbers. A fused attention kernel with dropout draws too, so
with attention dropout > 0 its outputs are recomputed, not kept: kept, the replay would skip
its draw and the hidden dropout after it would draw a different mask.

Collectives (tensor and sequence parallelism's all-reduce, all-gather, reduce-scatter) write
their outputs in place, which a cache cannot replay: they run again in backward, as under full
recompute.

Under train.compile the block's compiled code runs inside the policy's dispatch mode, where
Inductor calls its matmuls as addmm.out into buffers of its own (which it may reuse, so they are
not kept): there selective keeps the attention kernel's outputs and replays the rest, about as
full does, with the same gradients (tests/parallel/test_compile.py). A selective that the compiler
partitions itself (the checkpoint inside the compiled region) is not done yet.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

_aten = torch.ops.aten

# Linear layers: F.linear lowers to addmm (with bias) or mm. bmm and baddbmm are left out on
# purpose: in this model they only run in an unfused attention core, where baddbmm's output is
# the a·s² scores, the very tensor that recomputing the core exists to drop.
KEPT_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})

KEPT_ATTENTION = frozenset(
    getattr(_aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                 "_efficient_attention_forward")
    if hasattr(_aten, name)) | frozenset({torch.ops.higher_order.flex_attention})


def _dropout_p(func, args, kwargs) -> float:
    """The op's dropout_p argument (0 when it has none), read by name from its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:  # a higher-order op (FlexAttention): no dropout
        return 0.0
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            return float(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0))
    return 0.0


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the matmuls' and fused attention's outputs; recompute everything else (see the module
    docstring for why, and for why an attention kernel that draws dropout is recomputed)."""
    if func in KEPT_MATMULS:
        return CheckpointPolicy.MUST_SAVE
    if func in KEPT_ATTENTION and _dropout_p(func, args, kwargs) == 0.0:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(fn, *args):
    """fn(*args) under the selective policy (non-reentrant checkpoint: the RNG state is saved
    and restored around the replay, so dropout masks are the same)."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                   selective_policy))
