"""The tensor-parallel plan, `apply_tensor_parallel`, which swaps a single-device
`BloomForCausalLM`'s modules for their tensor-parallel (Megatron-LM, arXiv 1909.08053) and
sequence-parallel (Korthikanti et al., arXiv 2205.05198) counterparts in place. Which matmul is
column- or row-parallel is read from the parameter specs (bloomtrain.model.params), the one place
that says how each parameter splits.
"""
from __future__ import annotations

from torch import nn

from bloomtrain.model.bloom import BloomForCausalLM, local_alibi_slopes
from bloomtrain.model.params import base_spec
from bloomtrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding, VocabParallelLMHead)
from bloomtrain.parallel.tensor.loss import VocabParallelLMLoss
from bloomtrain.parallel.tensor.regions import gather_from_sequence_parallel_region
from bloomtrain.parallel.tensor.rng import TensorParallelRNG, fork_rng_around_forward


def _gather_sequence_before_forward(attention: nn.Module, group) -> None:
    """BloomAttention takes the sequence length from its input, and attention needs the whole
    sequence, so under sequence parallelism the all-gather in front of query_key_value moves to
    the attention module's entrance (a pre-hook keeps the module and its names unchanged)."""

    def gather_input(mod, args):
        return (gather_from_sequence_parallel_region(args[0], group),) + tuple(args[1:])

    attention.register_forward_pre_hook(gather_input)


def _split_linears(block: nn.Module, tp_rank: int, tp_size: int, group, sp: bool) -> None:
    """Swap each nn.Linear of a block for its column- or row-parallel counterpart, as its weight's
    spec says (bloomtrain.model.params: output dim 0 split -> column, input dim 1 -> row)."""
    for name, parent in list(block.named_modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            dim = base_spec(f"{name}.{attr}.weight" if name else f"{attr}.weight").tp_dim
            if dim == 0:
                # query_key_value: the sequence-parallel gather happens at the attention's
                # entrance (below), so the layer gets its input gathered already.
                gathered = sp and attr == "query_key_value"
                new = ColumnParallelLinear.from_full(child, tp_rank, tp_size, group, sp, gathered)
            elif dim == 1:
                new = RowParallelLinear.from_full(child, tp_rank, tp_size, group, sp)
            else:
                continue
            setattr(parent, attr, new)


def apply_tensor_parallel(model: BloomForCausalLM, topo, sequence_parallel: bool = False,
                          seed: int = 1234, device=None) -> BloomForCausalLM:
    """Split `model` over `topo.tp_group` in place and return it. The model holds full weights,
    identical on every tp rank, or is on the meta device (then the layers hold meta shards for
    bloomtrain.parallel.parallelize to materialize). Column-parallel: query_key_value (its
    per-head layout makes a row block a set of whole heads) and dense_h_to_4h; row-parallel:
    self_attention.dense and dense_4h_to_h; vocab-parallel: the embedding and the tied LM head;
    the ALiBi slopes are cut to the local heads and the loss becomes the vocab-parallel
    cross-entropy. `model(ids)` then returns logits split along the vocabulary [b, s, V/tp].

    With sequence parallelism the activations between the tensor-parallel regions (embedding
    LayerNorm, block LayerNorms, residuals, hidden dropout, ln_f) live on sequence shards
    [b, s/tp, h]: the embedding and the row-parallel layers reduce-scatter instead of
    all-reducing, and the column-parallel layers and the LM head all-gather their input.

    `seed` seeds the tensor-parallel dropout streams (`model.tp_rng`), which fork the generator
    of `device` (default: the model's). With tp = 1 only the loss changes, to the same in-place
    one. The shapes must split (see bloomtrain.layout, which checks them before anything is
    built).
    """
    tp_size, tp_rank, group = topo.tp_size, topo.tp_rank, topo.tp_group
    if tp_size == 1:
        # The same loss over the one whole shard (no group, no collectives): its backward works
        # in place on the saved softmax, where F.cross_entropy's holds three fp32 [b, s, V]
        # tensors at once (12 bytes a logit, 7.7 GiB more at bloom-560m, micro-batch 8).
        model.loss_fn = VocabParallelLMLoss(None)
        return model
    sp = sequence_parallel
    transformer = model.transformer
    device = device if device is not None else transformer.word_embeddings.weight.device
    rng = TensorParallelRNG(seed, tp_rank, device)
    embedding = VocabParallelEmbedding.from_full(transformer.word_embeddings, tp_rank, tp_size,
                                                 group, sp)
    transformer.word_embeddings = embedding
    for block in transformer.h:
        _split_linears(block, tp_rank, tp_size, group, sp)
        if sp:
            _gather_sequence_before_forward(block.self_attention, group)
            # Every activation inside a block is split (sequence shards or local heads).
            fork_rng_around_forward(block, rng.fork)
        else:
            block.self_attention.rng_context = rng.fork
    transformer.alibi_slopes = local_alibi_slopes(model.shape.num_heads, tp_size,
                                                  tp_rank).to(transformer.alibi_slopes.device)
    transformer.sequence_parallel_size = tp_size if sp else 1
    model.lm_head = VocabParallelLMHead(embedding, group, sp)
    model.loss_fn = VocabParallelLMLoss(group)
    model.tp_rng = rng
    return model
