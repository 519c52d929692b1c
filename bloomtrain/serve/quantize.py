"""INT8 weight-only quantization for inference: per-output-channel symmetric absmax, the
vector-wise quantization of LLM.int8() (Dettmers et al., arXiv 2208.07339, the scheme BLOOM-176B
was first served with in int8) without its fp16 outlier decomposition. Each output channel (row)
of a weight W [out, in] gets one scale s = max|W_row| / 127 and is stored as round(W_row / s) in
int8; the matmul dequantizes inside: x Wᵀ = (x Qᵀ) * s. Every linear layer of the blocks and the
word embedding (also the tied LM head: a row of the embedding is an output channel of the head)
are quantized; LayerNorms and biases stay in floating point.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZE_CHOICES = ("int8",)


def quantize_rows(weight: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 per-row scale) of `weight` [out, in]. With `group`, the rows are
    shards of longer rows split over it (row-parallel), and the absmax is all-reduced (max)
    over it, so a tp=2 model holds exactly the int8 values of the tp=1 one; column- and
    vocab-parallel shards hold whole rows, so their scales are local."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    if group is not None:
        from bloomtrain.parallel import comm
        comm.all_reduce(absmax, group, "tp", op=comm.ReduceOp.MAX)
    # An all-zero row would divide by zero; any scale quantizes it to zeros.
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the int8 weight q [out, in] with row scales [out] -> [..., out]."""
    # torch's int8 weight kernel (aten._weight_int8pack_mm) computes the same, but on AVX2 CPUs
    # it was 10-100x slower than this cast when measured, so it is not used.
    if x.dtype == torch.float16:
        # x·qᵀ is 127 / absmax(row) times the output, and fp16 ends at 65,504: an output of
        # 300 over a row of absmax 0.05 is inf before the scale. The scaled weight cannot be.
        return F.linear(x, q.to(x.dtype) * scale[:, None].to(x.dtype))
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight. `reduce_group`: the layer is row-parallel over that
    group, so the partial products are summed (Megatron's g) before the bias is added."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 reduce_group=None):
        super().__init__()
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.reduce_group = reduce_group

    def forward(self, x):
        y = int8_matmul(x, self.weight_int8, self.scale)
        if self.reduce_group is not None:
            from bloomtrain.parallel.tensor.regions import g
            y = g(y, self.reduce_group)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """The word embedding with int8 rows and per-row scales. Under tensor parallelism it holds
    the rows [vocab_start, vocab_start + rows) and the lookups are summed over `group`, as in
    VocabParallelEmbedding."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 vocab_start: int = 0, group=None):
        super().__init__()
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.dtype, self.vocab_start, self.group = dtype, vocab_start, group

    def forward(self, input_ids):
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight_int8.shape[0])
        local = local.masked_fill(outside, 0)
        rows = F.embedding(local, self.weight_int8).to(self.dtype)
        out = rows * self.scale[local].to(self.dtype).unsqueeze(-1)
        if self.group is None:
            return out
        from bloomtrain.parallel.tensor.regions import g
        return g(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class Int8LMHead(nn.Module):
    """The LM head tied to an Int8Embedding: logits over that embedding's rows (the local
    vocabulary shard under tensor parallelism, as VocabParallelLMHead)."""

    def __init__(self, embedding: Int8Embedding):
        super().__init__()
        self.embedding = [embedding]  # a list: not a second registration of the same buffers

    def forward(self, hidden):
        emb = self.embedding[0]
        return int8_matmul(hidden, emb.weight_int8, emb.scale)


def _int8_linear(layer: nn.Module) -> Int8Linear:
    from bloomtrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.sequence_parallel:
        raise ValueError("int8 quantization does not support sequence parallelism")
    group = layer.group if isinstance(layer, RowParallelLinear) else None
    q, scale = quantize_rows(layer.weight, group)
    return Int8Linear(q, scale, layer.bias, reduce_group=group)


@torch.no_grad()
def quantize_model(model, method: str = "int8"):
    """Replace, in place, the linear layers of `model` (a BloomForCausalLM, tensor-parallel or
    not) and its tied embedding / LM head with int8 ones. Returns the model, for inference
    only (the int8 weights take no gradient)."""
    from bloomtrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelEmbedding)

    if method not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {method!r}")
    linear_types = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    tr = model.transformer
    dtype = tr.word_embeddings_layernorm.weight.dtype
    for block in tr.h:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, linear_types):
                    setattr(parent, name, _int8_linear(child))
    emb = tr.word_embeddings
    if isinstance(emb, VocabParallelEmbedding):
        if emb.sequence_parallel:
            raise ValueError("int8 quantization does not support sequence parallelism")
        q, scale = quantize_rows(emb.weight)
        new = Int8Embedding(q, scale, dtype, emb.vocab_start, emb.group)
    else:
        q, scale = quantize_rows(emb.weight)
        new = Int8Embedding(q, scale, dtype)
    tr.word_embeddings = new
    model.lm_head = Int8LMHead(new)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (the tied head is the
    embedding)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
