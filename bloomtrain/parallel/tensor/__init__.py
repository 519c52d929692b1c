"""Tensor parallelism (Megatron-LM, Shoeybi et al., arXiv 1909.08053) and sequence parallelism
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198), applied to the single-device `BloomForCausalLM` by a plan.

One module per concern, in reading order:
1. `regions`: the communication ops as autograd functions: Megatron's `f` (identity forward,
   all-reduce backward) and `g` (all-reduce forward, identity backward), and the sequence-parallel
   pairs all-gather/reduce-scatter along the sequence;
2. `layers`: the layers that hold one shard each: column-, row- and vocab-parallel, and the LM
   head tied to the vocab-parallel embedding;
3. `loss`: the vocab-parallel cross-entropy, which never materializes the full logits;
4. `rng`: the dropout RNG of tensor-parallel regions;
5. `plan`: the plan, `apply_tensor_parallel`, which swaps the model's modules in place.
Everything public is re-exported here, so `from bloomtrain.parallel.tensor import X` works for
every X of those modules.

Layout: hidden states are [b, s, h], batch first, so sequence parallelism splits dim 1.
Collectives work on dim 0, so the sequence dim is moved to the front around each of them.

How each parameter splits (its dim, or replicated) and which gradients are partial sums over tp
under sequence parallelism (the LayerNorms and row-parallel biases, which see only this rank's
part of the sequence) are facts of the parameter specs in bloomtrain.model.params; the optimizer
reads them there.
"""
from bloomtrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding, VocabParallelLMHead)
from bloomtrain.parallel.tensor.loss import (IGNORE_INDEX, VocabParallelLMLoss,
                                             vocab_parallel_cross_entropy, vocab_parallel_lm_loss)
from bloomtrain.parallel.tensor.plan import apply_tensor_parallel
from bloomtrain.parallel.tensor.regions import (COMM_NAME, SEQUENCE_DIM, copy_to_tp_region, f, g,
                                                gather_from_sequence_parallel_region,
                                                reduce_from_tp_region,
                                                reduce_scatter_to_sequence_parallel_region,
                                                scatter_to_sequence_parallel_region)
from bloomtrain.parallel.tensor.rng import TensorParallelRNG

__all__ = [
    "COMM_NAME",
    "IGNORE_INDEX",
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRNG",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "VocabParallelLMLoss",
    "apply_tensor_parallel",
    "copy_to_tp_region",
    "f",
    "g",
    "gather_from_sequence_parallel_region",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_lm_loss",
]
