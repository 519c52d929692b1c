"""Pipeline stages (Narayanan et al., arXiv 2104.04473): `build_pipeline_chunks` keeps a rank's
share of a full (possibly tensor-parallel) model, with the tied embedding copied onto the last
stage. With pp = 1 the one chunk is the whole model, so a training step runs through the same
schedule runtime whatever the layout.
"""
from __future__ import annotations

from torch import nn

from bloomtrain.model.bloom import BloomForCausalLM, BloomModel


class StageTransformer(nn.Module):
    """This stage's share of BloomModel: the same methods (embed, attention_bias, run_blocks,
    set_activation_checkpointing), only the modules the stage runs. Blocks are keyed by their
    global index so that parameter names stay `transformer.h.{i}.…`, the model's own names."""

    embed = BloomModel.embed
    attention_bias = BloomModel.attention_bias
    run_blocks = BloomModel.run_blocks
    set_activation_checkpointing = BloomModel.set_activation_checkpointing

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
        self.attention_impl = full.attention_impl
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
        x = self.transformer.run_blocks(x, self.transformer.h.values())
        if not self.is_last:
            return x
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits if labels is None else self.loss_fn(logits, labels, loss_mask)

    def set_activation_checkpointing(self, mode: str) -> None:
        """none, selective (the attention core) or full (every block)."""
        self.transformer.set_activation_checkpointing(mode)


def build_pipeline_chunks(model: BloomForCausalLM, layout, pp_rank: int) -> list[PipelineChunk]:
    """Pipeline rank `pp_rank`'s model chunks (one per virtual stage it runs, in chunk order) cut
    from `model`, the full model (tensor-parallel already if tp > 1; on the meta device, or built
    identically on every rank), by `layout`'s partition and virtual stages.

    The chunks take the model's modules; drop every other reference to `model` afterwards so that
    the modules of other stages are freed. With pp > 1 the last stage's LM head gets its own
    Parameter, a copy of the (vocab shard of the) embedding it was tied to: the two copies are
    the `tied` parameters of bloomtrain.model.params, whose gradients the optimizer sums over the
    embedding group so that they never drift apart."""
    ranges = layout.stage_ranges(model.shape.num_layers)
    chunks = [PipelineChunk(model, ranges[vs], vs, layout.num_stages, c)
              for c, vs in enumerate(layout.virtual_stages(pp_rank))]
    if layout.pp > 1:
        for chunk in chunks:
            if chunk.is_last:
                tied = chunk.lm_head.weight
                chunk.lm_head.weight = nn.Parameter(tied.detach().clone(),
                                                    requires_grad=tied.requires_grad)
    return chunks
