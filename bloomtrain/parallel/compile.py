"""`train.compile`: regional torch.compile (TorchDynamo + Inductor, Ansel et al., ASPLOS 2024) of
each transformer block, the step of `parallelize` that replaces BLOOM's fused CUDA kernels
(Megatron's fused LayerNorm, bias-GeLU and bias-dropout-add): Inductor generates those fusions,
on CPU (C++/OpenMP) and CUDA (Triton) alike.

Why this shape:
- One block, not the model. Every BloomBlock runs the same code on the same shapes, so Dynamo
  traces `BloomBlock.forward` once and every block of every pipeline chunk reuses that cache
  entry: compile time is one block's, whatever the depth (parameters are graph inputs, not
  constants; nothing guards on which block it is). The embedding, ln_f, the LM head and the loss
  stay eager; they are one call each.
- `forward` only, never `Module.__call__`: the block's hooks stay eager around the compiled
  code. ZeRO-3 (zero/gather.py) all-gathers a unit's parameters in a forward pre-hook and frees
  them (storage resized to 0) after it; sequence parallelism forks the dropout RNG in hooks
  (tensor/rng.py). Guards check tensor metadata (shape, stride, dtype, device), not data
  pointers, so re-gathered, re-allocated or refreshed storage never recompiles; no CUDA graphs
  (mode="default"), which would bake those pointers in.
- `dynamic=False`: training shapes never change; static kernels are faster and compile faster.
  Eval runs the same shapes with grad off and dropout off: one more cache entry, compiled at the
  first eval. A new shape compiles once more; `generate()` never runs the parallel parts.
- Activation checkpointing: "full" wraps the block call (torch.utils.checkpoint around the hooks
  and the compiled forward; the recomputation replays the same compiled code and, after
  checkpoint restores the RNG state, the same Inductor dropout seeds). "selective" checkpoints
  the attention core inside forward, which Dynamo traces as a checkpointed region.

Tensor parallelism: Dynamo traces the f/g/sequence-parallel autograd functions (regions.py)
through `bloomtrain.parallel.comm` and rewrites its torch.distributed calls into functional
collectives inside the graph, so a tp block is one graph, without breaks. comm's per-call host
work then runs at trace time only: the device check (a change of device fails a tensor guard
and retraces, so it is checked again), and counting, which is why `CommStats.record` is
excluded from tracing: with `parallel.comm_stats` on, the region ops fall back to eager at the
record call (graph breaks there, counts equal to eager's); with it off nothing breaks. The
device check reads comm's per-group cache, a dict Dynamo would guard on: `_keep_guard` drops
those guards, or the first use of any later group (the checkpoint writer's, at the first save)
would recompile every block. (The groups a block uses are guarded by name themselves: a new
Topology in the same process compiles anew.)

Remaining graph break: the tensor-parallel attention-dropout fork (`rng.fork`, without sequence
parallelism) reseeds the default generator, which Dynamo cannot trace; with attention dropout
> 0 the attention core runs eagerly inside it, and Dynamo compiles the rest of the block as
separate graphs. With attention dropout 0 (every BLOOM config) the fork has nothing to do, and
the compiled blocks go without it.

Cache: every block shares one entry per (grad mode, train/eval, comm_stats on/off), at most 4
of Dynamo's default 8 per code object, so no limit is raised here.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

from bloomtrain.model.bloom import BloomBlock


def _keep_guard(entries) -> list[bool]:
    """Dynamo's guard filter: every guard but those on comm's cache of the devices each process
    group serves. Tracing a collective reads that dict, so Dynamo would guard on its length and
    keys, and every group used for the first time later (the checkpoint writer's, at the first
    save) would recompile every block. What a group serves never changes, and the groups a
    block uses are guarded by name."""
    return [not (e.is_global and "_GROUP_DEVICES" in e.name) for e in entries]


@functools.cache
def compiled_block_forward():
    """`BloomBlock.forward` compiled once per process; each block binds it as its own forward."""
    return torch.compile(BloomBlock.forward, dynamic=False,
                         options={"guard_filter_fn": _keep_guard})


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
            # draw one number from the default generator, and break the graph to do so.
            attention.rng_context = contextlib.nullcontext
        if not is_compiled(block):
            block.forward = types.MethodType(compiled_block_forward(), block)
    return len(blocks)
