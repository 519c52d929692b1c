"""Tensor parallelism (Megatron-LM, Shoeybi et al., arXiv 1909.08053) and sequence parallelism
(Korthikanti et al., arXiv 2205.05198), applied to the single-device `BloomForCausalLM` by a
plan, one module per concern in reading order: `regions` (Megatron's f and g, the
sequence-parallel all-gather/reduce-scatter pairs), `layers` (column-, row- and vocab-parallel,
the tied LM head), `loss` (vocab-parallel cross-entropy), `rng` (dropout RNG of the regions) and
`plan` (`apply_tensor_parallel`). Everything public is re-exported here. How each parameter
splits, and which gradients are partial over tp, is in bloomtrain.model.params.
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
