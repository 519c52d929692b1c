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
from torch import nn

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


def eval_config(tp: int, pp: int, precision: str = "fp32"):
    """The Config `parallelize` builds an evaluated model with: the layout's sizes and the
    precision (no ZeRO engine)."""
    from bloomtrain.config import Config
    return Config.from_dict({"parallel": {"tp": tp, "pp": pp}, "train": {"precision": precision}})


def load_eval_model(checkpoint, topo: Topology, device, dtype=None) -> EvalModel:
    """`checkpoint` (a bloomtrain checkpoint or an HF Bloom directory) as this rank's part of
    `topo`'s layout. Each rank reads only its own pipeline stage's parameters and, of those, its
    tensor-parallel shards (bloomtrain checkpoints, HF safetensors and zip-format .bin files);
    HF .bin files of the older pickle format are read whole, then cut. `dtype` (None: as
    stored)."""
    from bloomtrain.checkpoint.reader import open_model
    from bloomtrain.hf import is_hf_dir
    from bloomtrain.serve.hf_slices import HFSliceReader, sliceable

    if is_hf_dir(checkpoint) and not sliceable(checkpoint):
        model = _load_whole(checkpoint, topo, dtype)
    else:
        reader = HFSliceReader(checkpoint) if is_hf_dir(checkpoint) else open_model(checkpoint)
        model = _load_shards(reader, topo, dtype)
    for chunk in model.chunks:
        chunk.to(device)
        chunk.eval()
    model.device = torch.device(device)
    return model


def _check_layout(topo: Topology, shape: BloomShape) -> None:
    layout = topo.layout
    layout.check_tensor_parallel(shape, 1, layout.tp)
    if shape.num_layers < layout.pp:
        from bloomtrain.errors import UserError
        raise UserError(f"parallel.pp={layout.pp} needs at least {layout.pp} layers; the model "
                        f"has {shape.num_layers}")
    layout.check_pipeline(shape.num_layers)


def _load_shards(reader, topo: Topology, dtype) -> EvalModel:
    """Build on the meta device, cut by `parallelize`, then replace each local parameter by its
    shard as `reader` (a CheckpointReader or an HFSliceReader) gives it. The last stage's copy
    of the tied embedding (pp > 1) is read under the embedding's name (its spec's)."""
    from bloomtrain.model import BloomForCausalLM, alibi_slopes, check_state
    from bloomtrain.model.presets import EMBEDDING, LM_HEAD
    from bloomtrain.parallel.parallelize import parallelize
    from bloomtrain.devices import dtype_name, torch_dtype
    from bloomtrain.utils import replace_parameters

    shape = reader.shape
    check_state(shape, {n: reader.full_shape(n) for n in reader.names() if n != LM_HEAD},
                reader.path)
    _check_layout(topo, shape)
    dtype = torch_dtype(dtype) if dtype is not None else reader.dtype(EMBEDDING)
    with torch.device("meta"):
        full = BloomForCausalLM(shape)
    cfg = eval_config(topo.tp_size, topo.pp_size, dtype_name(dtype))
    parts = parallelize(full, topo, cfg, attention=EVAL_ATTENTION, device="meta", engine=False)
    new = {}
    try:
        for name, p in parts.named_parameters():
            spec = parts.specs[name]
            shard = reader.load_tp_shard(spec.name, "model", topo.tp_rank, topo.tp_size,
                                         spec.tp_dim)
            new[id(p)] = nn.Parameter(shard.to(dtype), requires_grad=False)
    finally:
        reader.close()
    replace_parameters(parts.chunks, new)
    # Non-persistent, so not read: fp32 whatever the weights' dtype, this rank's heads only.
    local = alibi_slopes(shape.num_heads).chunk(topo.tp_size)[topo.tp_rank]
    for chunk in parts.chunks:
        chunk.transformer.alibi_slopes = local.clone()
    return EvalModel(topo, shape, parts.chunks, dtype, torch.device("cpu"))


def _load_whole(checkpoint, topo: Topology, dtype) -> EvalModel:
    """HF .bin files that cannot be read in part: the whole model, then cut (parallelize copies
    each local piece out of the full weights)."""
    from bloomtrain import load_model
    from bloomtrain.parallel.parallelize import parallelize
    from bloomtrain.devices import dtype_name

    full = load_model(checkpoint, device="cpu", dtype=dtype)
    _check_layout(topo, full.shape)
    dtype = full.transformer.word_embeddings_layernorm.weight.dtype
    cfg = eval_config(topo.tp_size, topo.pp_size, dtype_name(dtype))
    parts = parallelize(full, topo, cfg, attention=EVAL_ATTENTION, device="cpu", engine=False)
    for _, p in parts.named_parameters():
        p.requires_grad_(False)
    return EvalModel(topo, full.shape, parts.chunks, dtype, torch.device("cpu"))
