"""The model an evaluation runs: one rank's pieces of a BLOOM under any tensor x pipeline (x data)
layout, cut by the training path (`parallelize`: the tensor-parallel plan, the pipeline's model
chunks) and filled from a bloomtrain checkpoint or an HF directory with only this rank's shards
read, or taken live from a training run's ModelParts.

Megatron-DeepSpeed's `tasks/eval_harness/evaluate.py` did the same for a 3D-parallel checkpoint,
so that a 176B model needs no conversion and no single-device copy to be evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.pipeline.stage import PipelineChunk
from bloomtrain.topology import Topology


@dataclass
class EvalModel:
    """This rank's model chunks (in virtual-stage order) and what the forward passes need to
    know about them. `sequence_parallel`: hidden states between stages are sequence shards;
    `dp_lockstep`: ZeRO-3 gathers the weights over dp as each unit runs, so every replica must
    run the same forwards."""

    topo: Topology
    shape: BloomShape
    chunks: list[PipelineChunk]
    dtype: torch.dtype
    device: torch.device
    sequence_parallel: bool = False
    dp_lockstep: bool = False

    @classmethod
    def from_parts(cls, parts, dtype: torch.dtype, device) -> "EvalModel":
        """A training run's live parts (no copy: the same parameters, ZeRO-3's gathers and all)."""
        return cls(parts.topo, parts.shape, parts.chunks, dtype, torch.device(device),
                   parts.layout.sequence_parallel,
                   dp_lockstep=parts.engine is not None and parts.layout.zero_stage == 3)

    @property
    def vocab_start(self) -> int:
        """The first vocabulary row this rank's LM head shard holds."""
        return self.topo.tp_rank * (self.shape.vocab_size // self.topo.tp_size)

    def train(self, mode: bool) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


# One kernel for every shape a harness sends.
EVAL_ATTENTION = "sdpa"


def load_eval_model(checkpoint, topo: Topology, device, dtype=None) -> EvalModel:
    """`checkpoint` (a bloomtrain checkpoint or an HF Bloom directory) as this rank's part of
    `topo`'s layout, by the one loader (bloomtrain.checkpoint.load.load_sharded): each rank reads
    only its own pipeline stage's parameters and, of those, its tensor-parallel shards. `dtype`
    (None: as stored)."""
    from bloomtrain.checkpoint.load import load_sharded

    loaded = load_sharded(checkpoint, topo, dtype, attention=EVAL_ATTENTION, device=device)
    model = EvalModel(topo, loaded.shape, loaded.chunks, loaded.dtype, torch.device(device))
    for chunk in model.chunks:
        chunk.to(device)
        chunk.eval()
    return model
