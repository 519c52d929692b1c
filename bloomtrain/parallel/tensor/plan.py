"""The tensor-parallel plan, `apply_tensor_parallel`, which swaps a single-device
`BloomForCausalLM`'s modules for their tensor-parallel (Megatron-LM, arXiv 1909.08053) and
sequence-parallel (Korthikanti et al., arXiv 2205.05198) counterparts in place, and the mapping
between full and sharded tensors (pure functions of parameter names, for checkpoints).
"""
from __future__ import annotations

import torch
from torch import nn

from bloomtrain.model.bloom import BloomForCausalLM
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding, VocabParallelLMHead, _mark,
                                               _shard)
from bloomtrain.parallel.tensor.loss import VocabParallelLMLoss
from bloomtrain.parallel.tensor.regions import (COMM_NAME, _all_gather_along,
                                                gather_from_sequence_parallel_region)
from bloomtrain.parallel.tensor.rng import TensorParallelRNG, _fork_rng_around_forward
from bloomtrain.utils import UserError


def _gather_sequence_before_forward(attention: nn.Module, group) -> None:
    """BloomAttention takes the sequence length from its input, and attention needs the whole
    sequence, so under sequence parallelism the all-gather in front of query_key_value moves to
    the attention module's entrance (a pre-hook keeps the module and its names unchanged)."""

    def gather_input(mod, args):
        return (gather_from_sequence_parallel_region(args[0], group),) + tuple(args[1:])

    attention.register_forward_pre_hook(gather_input)


def validate_tensor_parallel(shape: BloomShape, tp_size: int, sequence_parallel: bool = False,
                             seq_length: int | None = None) -> None:
    """Check that `shape` splits over `tp_size` ranks; raise a UserError that says what to change.
    Pure, so config validation can call it before any process group exists."""
    if tp_size < 1:
        raise UserError(f"parallel.tp must be at least 1, got {tp_size}")
    if shape.num_heads % tp_size:
        raise UserError(f"model.num_heads ({shape.num_heads}) must be divisible by "
                        f"parallel.tp ({tp_size})")
    if shape.ffn_hidden_size % tp_size:
        raise UserError(f"model.ffn_hidden_size ({shape.ffn_hidden_size}) must be divisible by "
                        f"parallel.tp ({tp_size})")
    if shape.vocab_size % tp_size:
        raise UserError(f"the padded vocabulary ({shape.vocab_size}) must be divisible by "
                        f"parallel.tp ({tp_size}); set model.make_vocab_size_divisible_by to a "
                        f"multiple of {tp_size}")
    if sequence_parallel and seq_length is not None and seq_length % tp_size:
        raise UserError(f"data.seq_length ({seq_length}) must be divisible by parallel.tp "
                        f"({tp_size}) with parallel.sequence_parallel=true")


def apply_tensor_parallel(model: BloomForCausalLM, topo, sequence_parallel: bool = False,
                          seed: int = 1234, seq_length: int | None = None) -> BloomForCausalLM:
    """Split `model` (full weights, identical on every tp rank) over `topo.tp_group` in place and
    return it. Column-parallel: query_key_value (its per-head layout makes a row block a set of
    whole heads) and dense_h_to_4h; row-parallel: self_attention.dense and dense_4h_to_h;
    vocab-parallel: the embedding and the tied LM head; the ALiBi slopes are cut to the local
    heads and the loss becomes the vocab-parallel cross-entropy. `model(ids)` then returns
    logits split along the vocabulary [b, s, V/tp].

    With sequence parallelism the activations between the tensor-parallel regions (embedding
    LayerNorm, block LayerNorms, residuals, hidden dropout, ln_f) live on sequence shards
    [b, s/tp, h]: the embedding and the row-parallel layers reduce-scatter instead of
    all-reducing, and the column-parallel layers and the LM head all-gather their input.

    `seed` seeds the tensor-parallel dropout streams (`model.tp_rng`). Apply the plan after
    moving the model to its device: the RNG forks that device's generator. With tp=1 no module
    is replaced; only the parameter attributes are set, so consumers need no special case.
    """
    tp_size, tp_rank, group = topo.tp_size, topo.tp_rank, topo.tp_group
    validate_tensor_parallel(model.shape, tp_size, sequence_parallel, seq_length)
    if tp_size > 1:
        sp = sequence_parallel
        transformer = model.transformer
        rng = TensorParallelRNG(seed, tp_rank, transformer.word_embeddings.weight.device)
        embedding = VocabParallelEmbedding.from_full(transformer.word_embeddings, tp_rank,
                                                     tp_size, group, sp)
        transformer.word_embeddings = embedding
        for block in transformer.h:
            attn, mlp = block.self_attention, block.mlp
            attn.query_key_value = ColumnParallelLinear.from_full(
                attn.query_key_value, tp_rank, tp_size, group, sp, input_gathered=sp)
            if sp:
                _gather_sequence_before_forward(attn, group)
            attn.dense = RowParallelLinear.from_full(attn.dense, tp_rank, tp_size, group, sp)
            mlp.dense_h_to_4h = ColumnParallelLinear.from_full(mlp.dense_h_to_4h, tp_rank,
                                                               tp_size, group, sp)
            mlp.dense_4h_to_h = RowParallelLinear.from_full(mlp.dense_4h_to_h, tp_rank, tp_size,
                                                            group, sp)
            if sp:
                # Every activation inside a block is split (sequence shards or local heads).
                _fork_rng_around_forward(block, rng.fork)
            else:
                attn.rng_context = rng.fork
        transformer.alibi_slopes = transformer.alibi_slopes.chunk(tp_size)[tp_rank].clone()
        transformer.sequence_parallel_size = tp_size if sp else 1
        model.lm_head = VocabParallelLMHead(embedding, group, sp)
        model.loss_fn = VocabParallelLMLoss(group)
        model.tp_rng = rng
    for name, p in model.named_parameters():
        _mark(p, tp_split_dim_of(name), sequence_parallel and tp_size > 1)
    return model


def sequence_parallel_grad_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters whose grads are partial sums over tp (`grad_needs_tp_allreduce`)."""
    return [(n, p) for n, p in model.named_parameters()
            if getattr(p, "grad_needs_tp_allreduce", False)]


@torch.no_grad()
def allreduce_sequence_parallel_grads(model_or_grads, group) -> None:
    """Sum the sequence-parallel partial grads over tp, in place, with one all-reduce.

    Pass the model (its flagged parameters' .grad are reduced) or an iterable of grad tensors,
    e.g. the slices of an optimizer's flat fp32 grad buffer that belong to the parameters of
    `sequence_parallel_grad_params`."""
    if isinstance(model_or_grads, nn.Module):
        grads = [p.grad for _, p in sequence_parallel_grad_params(model_or_grads)
                 if p.grad is not None]
    else:
        grads = list(model_or_grads)
    comm.all_reduce_coalesced(grads, group, COMM_NAME)


_COLUMN_PARALLEL = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_ROW_PARALLEL_WEIGHTS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
_VOCAB_PARALLEL = ("word_embeddings.weight", "lm_head.weight")


def tp_split_dim_of(name: str) -> int | None:
    """The dim along which the HF-named parameter `name` is split over tp, or None if
    replicated (LayerNorms, row-parallel biases). Names may carry a prefix."""
    if name.endswith(_COLUMN_PARALLEL) or name.endswith(_VOCAB_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL_WEIGHTS):
        return 1
    return None


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp_rank-th shard of the full tensor `name` (a copy; the full tensor itself if it is
    replicated)."""
    dim = tp_split_dim_of(name)
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise UserError(f"{name} has {full.shape[dim]} entries along dim {dim}, which do not "
                        f"split over parallel.tp ({tp_size})")
    return _shard(full, dim, tp_rank, tp_size)


def shard_full_state(full_state: dict[str, torch.Tensor], topo) -> dict[str, torch.Tensor]:
    """Inverse of gather_full_state: this rank's shards, ready for model.load_state_dict."""
    return {n: shard_tensor(n, t, topo.tp_rank, topo.tp_size) for n, t in full_state.items()}


@torch.no_grad()
def gather_full_tensors(tensors: dict[str, torch.Tensor], topo) -> dict[str, torch.Tensor]:
    """All-gather each tensor named like a parameter (a weight, its grad, an optimizer moment)
    to full shape along its tp split dim; replicated ones are copied. Collective over tp: every
    tp rank must pass the same names in the same order."""
    out = {}
    for name, t in tensors.items():
        dim = tp_split_dim_of(name)
        if dim is None or topo.tp_size == 1:
            out[name] = t.detach().clone()
        else:
            out[name] = _all_gather_along(t.detach(), dim, topo.tp_group).contiguous()
    return out


def gather_full_state(model: nn.Module, topo) -> dict[str, torch.Tensor]:
    """The full (tp=1) state dict of a tensor-parallel model, on every tp rank."""
    return gather_full_tensors(model.state_dict(), topo)
