"""Pipeline stages (Narayanan et al., arXiv 2104.04473): `build_pipeline_chunks` keeps this rank's
share of a full (possibly tensor-parallel) model, with the tied embedding copied onto the last
stage, and the helpers that name and reduce that tied copy.
"""
from __future__ import annotations

import torch
from torch import nn

from bloomtrain.model.bloom import BloomForCausalLM, BloomModel
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline.partition import partition_layers
from bloomtrain.utils import UserError

TIED_EMBEDDING_NAME = "transformer.word_embeddings.weight"
TIED_HEAD_NAME = "lm_head.weight"


class StageTransformer(nn.Module):
    """This stage's share of BloomModel: the same methods (embed, attention_bias, run_blocks),
    only the modules the stage runs. Blocks are keyed by their global index so that parameter
    names stay `transformer.h.{i}.…`, the model's own names."""

    embed = BloomModel.embed
    attention_bias = BloomModel.attention_bias
    run_blocks = BloomModel.run_blocks

    def __init__(self, full: BloomModel, block_range: tuple[int, int], has_embedding: bool,
                 has_final_norm: bool):
        super().__init__()
        self.shape = full.shape
        if has_embedding:
            self.word_embeddings = full.word_embeddings
            self.word_embeddings_layernorm = full.word_embeddings_layernorm
        self.h = nn.ModuleDict({str(i): full.h[i] for i in range(*block_range)})
        if has_final_norm:
            self.ln_f = full.ln_f
        # Shared with the full model (and every chunk): tensor parallelism has already cut it to
        # the local heads.
        self.register_buffer("alibi_slopes", full.alibi_slopes, persistent=False)
        self.activation_checkpointing = full.activation_checkpointing
        self.sequence_parallel_size = full.sequence_parallel_size


class PipelineChunk(nn.Module):
    """The blocks of one virtual stage, plus the embedding on the first and ln_f, the LM head and
    the loss on the last. `named_parameters()` gives the full model's HF names."""

    def __init__(self, model: BloomForCausalLM, block_range: tuple[int, int], virtual_stage: int,
                 num_stages: int, index: int):
        super().__init__()
        self.virtual_stage, self.num_stages, self.index = virtual_stage, num_stages, index
        self.block_range = block_range
        self.is_first = virtual_stage == 0
        self.is_last = virtual_stage == num_stages - 1
        self.transformer = StageTransformer(model.transformer, block_range, self.is_first,
                                            self.is_last)
        if self.is_last:
            self.lm_head = model.lm_head
            self.loss_fn = model.loss_fn
        if hasattr(model, "tp_rng"):
            self.tp_rng = model.tp_rng

    def forward(self, x, labels=None, loss_mask=None):
        """x: token ids [b, s] on the first virtual stage, else hidden states [b, s(/tp), h].
        Returns hidden states, or on the last virtual stage the loss (logits without labels)."""
        if self.is_first:
            x = self.transformer.embed(x)
        x, _ = self.transformer.run_blocks(x, self.transformer.h.values())
        if not self.is_last:
            return x
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits if labels is None else self.loss_fn(logits, labels, loss_mask)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.transformer.activation_checkpointing = enabled


def build_pipeline_chunks(model: BloomForCausalLM, topo, partition_method="uniform",
                          num_virtual_stages: int = 1) -> list[PipelineChunk]:
    """This rank's model chunks (one per virtual stage it runs, in chunk order) cut from `model`,
    the full model (tensor-parallel already if tp > 1) built identically on every rank.

    The chunks take the model's modules; drop every other reference to `model` afterwards so that
    the modules of other stages are freed. With pp > 1 the last stage's LM head gets its own
    Parameter, a copy of the (vocab-shard of the) embedding it was tied to, and `model.lm_head` is
    changed accordingly. See the module docstring for the parameter attributes."""
    pp, v = topo.pp_size, num_virtual_stages
    if v < 1 or (v > 1 and pp < 2):
        raise UserError(f"parallel.num_virtual_stages ({v}) must be 1, or >= 2 with "
                        f"parallel.pp >= 2")
    num_stages = pp * v
    ranges = partition_layers(model.shape.num_layers, num_stages, partition_method,
                              interleaved=v > 1)
    chunks = [PipelineChunk(model, ranges[c * pp + topo.pp_rank], c * pp + topo.pp_rank,
                            num_stages, c) for c in range(v)]
    for chunk in chunks:
        for p in chunk.parameters():
            p.tied_embedding = False
            p.tied_embedding_copy = False
    if pp > 1:
        for chunk in chunks:
            if chunk.is_first:
                chunk.transformer.word_embeddings.weight.tied_embedding = True
            if chunk.is_last:
                tied = chunk.lm_head.weight
                copy = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
                for attr in ("tp_split_dim", "tp_replicated", "grad_needs_tp_allreduce"):
                    if hasattr(tied, attr):
                        setattr(copy, attr, getattr(tied, attr))
                copy.tied_embedding = True
                copy.tied_embedding_copy = True
                chunk.lm_head.weight = copy
    return chunks


def pipeline_named_parameters(chunks) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of this rank's chunks with its HF name (unique: blocks keep their global
    index, and the embedding and the head copy live on different virtual stages)."""
    return [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]


def logical_name(name: str) -> str:
    """The checkpoint name of a parameter: the last stage's LM head copy is the embedding."""
    return TIED_EMBEDDING_NAME if name == TIED_HEAD_NAME else name


def tied_embedding_params(chunks) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in pipeline_named_parameters(chunks)
            if getattr(p, "tied_embedding", False)]


@torch.no_grad()
def allreduce_tied_embedding_grads(grads_or_params, topo) -> None:
    """Sum the tied embedding's grads over `topo.embedding_group` (first and last stage), in place,
    so that both copies take the same step. Pass the `tied_embedding` parameters (their .grad is
    reduced) or their grad tensors, e.g. views into an fp32 flat buffer, in the same order on both
    ranks. A no-op with pp = 1 and on stages that hold no copy (they pass an empty list)."""
    grads = [t.grad if isinstance(t, nn.Parameter) else t for t in grads_or_params]
    grads = [t for t in grads if t is not None]
    if topo.embedding_group is None or not grads:
        return
    flat = torch.cat([t.reshape(-1) for t in grads]) if len(grads) > 1 else grads[0]
    comm.all_reduce(flat, topo.embedding_group, "emb")
    if len(grads) > 1:
        offset = 0
        for t in grads:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
