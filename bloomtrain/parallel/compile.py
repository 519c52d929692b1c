"""`train.compile`: regional torch.compile (TorchDynamo + Inductor, Ansel et al., ASPLOS 2024) of
each transformer block's forward, the step of `parallelize` that replaces BLOOM's fused CUDA
kernels (Megatron's fused LayerNorm, bias-GeLU and bias-dropout-add): Inductor generates those
fusions, on CPU (C++/OpenMP) and CUDA (Triton) alike. The embedding, ln_f, the LM head and the
loss stay eager; they are one call each.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

from bloomtrain.model.bloom import BloomBlock
from bloomtrain.parallel import comm


@functools.cache
def compiled_block_forward():
    """`BloomBlock.forward` compiled once per process; each block binds it as its own forward.
    Every block runs the same code on the same shapes, so Dynamo traces it once and every block
    of every chunk reuses that entry (parameters are graph inputs; nothing guards on which block
    it is): compile time is one block's, whatever the depth."""
    # dynamic=False: training shapes never change, and static kernels are faster to run and to
    # compile. Eval (grad off, dropout off) adds one entry, and so does comm_stats on: at most 4
    # per code object, under Dynamo's default limit of 8. Inference steps (the harness's packed
    # scoring and generation, whose lengths vary) run the blocks eagerly (BloomModel.run_blocks). The default mode, no CUDA graphs: they
    # would bake in the data pointers that ZeRO-3's gathers and frees change every step (guards
    # check metadata only, so those never recompile).
    comm.untraced_record()
    return torch.compile(BloomBlock.forward, dynamic=False,
                         options={"guard_filter_fn": _guard_filter})


def _guard_filter(entries) -> list[bool]:
    return [comm.keeps_guard(e) for e in entries]


def is_compiled(block: nn.Module) -> bool:
    return getattr(vars(block).get("forward"), "__func__", None) is compiled_block_forward()


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Compile the forward of every BloomBlock in `chunks` (in place; names, parameters and hooks
    unchanged). Compilation itself happens at the first call. Returns the number of blocks."""
    blocks = [m for chunk in chunks for m in chunk.modules() if isinstance(m, BloomBlock)]
    for block in blocks:
        attention = block.self_attention
        if attention.attention_dropout == 0:
            # The tp fork only reseeds the dropout of the attention core; at p = 0 it would
            # draw one number from the default generator, and break the graph to do so (with
            # dropout > 0 the core runs eagerly inside the fork, the rest as separate graphs).
            attention.rng_context = contextlib.nullcontext
        # `forward` only, never `Module.__call__`: the block's hooks stay eager around the
        # compiled code (ZeRO-3's gather and free, sequence parallelism's RNG fork), and
        # activation checkpointing wraps the call, so its recomputation replays the same code.
        if not is_compiled(block):
            block.forward = types.MethodType(compiled_block_forward(), block)
    return len(blocks)
