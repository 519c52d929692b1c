"""BLOOM (arXiv 2211.05100) as a single-device PyTorch module, with the parameter names of HF
transformers' `BloomForCausalLM` so that checkpoints map one to one. What makes it BLOOM rather
than GPT-2:
- ALiBi (arXiv 2108.12409) instead of position embeddings, with HF's / Megatron's slope formula
  (including head counts that are not a power of 2);
- a LayerNorm right after the word embedding (`word_embeddings_layernorm`);
- a fused `query_key_value` whose output is laid out per head: [b, s, heads, (q, k, v), head_dim];
- pre-LN blocks, tanh-approximation GeLU, LayerNorm eps 1e-5 and an LM head tied to the embedding.
The attention core's kernels are in bloomtrain.model.attention; the module has no distributed
code (bloomtrain.parallel applies tensor, sequence and pipeline parallelism from outside).
"""
from __future__ import annotations

import contextlib
import math
import typing

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bloomtrain.model.attention import (ATTENTION_IMPLS, EagerBias, PackedAttention,
                                        StepAttention, alibi_scores, attention_core,
                                        flex_alibi)
from bloomtrain.config import Recompute
from bloomtrain.errors import UserError
from bloomtrain.model.params import base_spec, init_full, init_std
from bloomtrain.model.presets import BloomShape
from bloomtrain.model.recompute import selective_checkpoint

# train.activation_checkpointing's choices.
ACTIVATION_CHECKPOINTING = typing.get_args(Recompute)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes, as HF's `build_alibi_tensor` and Megatron's `get_slopes`: a geometric
    sequence for the largest power of two c <= n, then every other slope of the 2c sequence."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** i for i in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        num_extra = num_heads - closest
        slopes += [extra_base ** i for i in range(1, 2 * num_extra, 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def local_alibi_slopes(num_heads: int, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """The slopes of the heads tensor-parallel rank `tp_rank` of `tp_size` runs (a contiguous
    block of heads, as the column-parallel QKV splits them): the one place they are cut. fp32
    whatever the weights' dtype: a slope like 2^-0.5625 rounded to bf16 would shift every
    score. Not persistent state: derived from the head count wherever a model is built."""
    return alibi_slopes(num_heads).chunk(tp_size)[tp_rank].clone()


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_len: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The ALiBi + causal bias of n query sets at once: `q_pos` [n, q] (fp32 positions) against
    keys 0..k_len-1 -> [heads, n, q, k_len], slope * (k - q) where k <= q, -inf after. Every
    ALiBi bias of the package is made here (the training forward's, and each serving step's
    prefill chunks and padded decodes)."""
    # In fp32 from *relative* positions (k - q <= 0), then cast: the entries nearest the
    # diagonal, which carry most of the weight, stay exact in bf16. HF's absolute key positions
    # are the same after softmax (it is shift-invariant) but round the larger values coarser.
    k_pos = torch.arange(k_len, device=q_pos.device, dtype=torch.float32)
    rel = k_pos[None, None, :] - q_pos[:, :, None]  # [n, q, k]
    slopes = slopes.to(device=q_pos.device, dtype=torch.float32)[:, None, None, None]
    bias = alibi_scores(slopes, k_pos[None, None, :], q_pos[:, :, None])
    bias = bias.masked_fill(rel > 0, float("-inf"))  # [heads, n, q, k]
    return bias.to(dtype)


def alibi_causal_bias(slopes: torch.Tensor, q_len: int, k_len: int, dtype: torch.dtype,
                      device=None) -> torch.Tensor:
    """Additive attention bias [1, heads, q_len, k_len]: slope * (k - q) on and below the
    diagonal, -inf above it. Queries are the last q_len positions of the k_len keys (KV cache)."""
    device = device if device is not None else slopes.device
    q_pos = torch.arange(k_len - q_len, k_len, device=device, dtype=torch.float32)
    return alibi_bias(slopes, q_pos[None], k_len, dtype)[:, 0].unsqueeze(0)


def packed_attention(lengths: list[int], slopes: torch.Tensor, dtype: torch.dtype,
                     device=None) -> PackedAttention:
    """The attention metadata of whole sequences of `lengths` packed one after the other into
    one row (a scoring step: each causal within itself, nothing cached); `slopes`: the heads
    this rank runs."""
    spans, at = [], 0
    for n in lengths:
        spans.append((at, at + n))
        at += n
    longest = max(lengths, default=1)
    device = device if device is not None else slopes.device
    return PackedAttention(spans, alibi_causal_bias(slopes, longest, longest, dtype, device)[0])


class BloomAttention(nn.Module):
    def __init__(self, shape: BloomShape, layer_idx: int = 0):
        super().__init__()
        h = shape.hidden_size
        self.head_dim = shape.head_dim
        self.layer_idx = layer_idx  # which layer's keys and values a paged KV cache holds
        self.query_key_value = nn.Linear(h, 3 * h, bias=True)
        self.dense = nn.Linear(h, h, bias=True)
        self.attention_dropout = shape.attention_dropout
        # Tensor parallelism swaps this for a context that forks a per-tp-rank RNG, so that
        # dropout on different heads differs across ranks (see parallel/tensor/rng.py).
        self.rng_context = contextlib.nullcontext

    def forward(self, x, bias):
        b, s, _ = x.shape
        qkv = self.query_key_value(x)
        # The fused projection is laid out per head, so a tensor-parallel shard of its rows is a
        # set of whole heads; the local head count follows from the width.
        num_heads = qkv.shape[-1] // (3 * self.head_dim)
        qkv = qkv.view(b, s, num_heads, 3, self.head_dim)  # [b, s, nh, 3, hd]
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, nh, s, hd]
        if isinstance(bias, StepAttention):  # inference: the metadata attends per sequence
            ctx = bias.attend(self.layer_idx, q, k, v)
            ctx = ctx.transpose(1, 2).reshape(b, s, num_heads * self.head_dim)
            return self.dense(ctx)
        p = self.attention_dropout if self.training else 0.0
        with self.rng_context():
            ctx = attention_core(q, k, v, bias, p)
        ctx = ctx.transpose(1, 2).reshape(b, s, num_heads * self.head_dim)  # [b, s, h_local]
        return self.dense(ctx)


class BloomMLP(nn.Module):
    def __init__(self, shape: BloomShape):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(shape.hidden_size, shape.ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(shape.ffn_hidden_size, shape.hidden_size)

    def forward(self, x):
        # BLOOM's tanh-approximation GeLU (HF's bloom_gelu_forward; Megatron's fused bias_gelu).
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomBlock(nn.Module):
    def __init__(self, shape: BloomShape, layer_idx: int = 0):
        super().__init__()
        eps = shape.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(shape.hidden_size, eps=eps)
        self.self_attention = BloomAttention(shape, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(shape.hidden_size, eps=eps)
        self.mlp = BloomMLP(shape)
        self.hidden_dropout = shape.hidden_dropout

    def forward(self, x, bias):
        # Pre-LN; the residual is the un-normalized input (apply_residual_connection_post_layernorm
        # = False in every BLOOM config).
        attn = self.self_attention(self.input_layernorm(x), bias)
        if self.training:  # (out of training F.dropout is the identity: not even called)
            attn = F.dropout(attn, self.hidden_dropout, True)
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        if self.training:
            mlp = F.dropout(mlp, self.hidden_dropout, True)
        x = x + mlp
        return x


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, less its N(0, 1) init when built on the meta device (every sharded build:
    training, serving, eval): a meta tensor has no values, and a meta normal_ runs through
    torch._refs, whose first call imports torch._dynamo, 1.5 s of every process's start. On a
    real device the init runs as before (the same draws from the generator, in the same order)."""
    if torch.empty(0).is_meta:  # the default device, as `with torch.device("meta")` sets it
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class BloomModel(nn.Module):
    """HF's `transformer` submodule: embedding + embedding LN, blocks `h`, final `ln_f`. What a
    parallel plan changes is derived at run time, not fixed here: the local head count from the
    width of `query_key_value`, the ALiBi slopes from a buffer the plan slices to its heads."""

    def __init__(self, shape: BloomShape):
        super().__init__()
        self.shape = shape
        self.word_embeddings = _embedding(shape.vocab_size, shape.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(shape.hidden_size,
                                                      eps=shape.layer_norm_epsilon)
        self.h = nn.ModuleList(BloomBlock(shape, i) for i in range(shape.num_layers))
        self.ln_f = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_epsilon)
        # Not persistent: derived from the head count, and a tensor-parallel plan slices it.
        self.register_buffer("alibi_slopes", alibi_slopes(shape.num_heads), persistent=False)
        self.activation_checkpointing = "none"
        # "sdpa", "flex" or "eager" (bloomtrain.model.attention); training sets it from
        # train.attention.
        self.attention_impl = "sdpa"
        # With sequence parallelism each rank holds 1/sequence_parallel_size of the sequence
        # between blocks; the attention bias is for the full sequence.
        self.sequence_parallel_size = 1

    def embed(self, input_ids):
        return self.word_embeddings_layernorm(self.word_embeddings(input_ids))

    def attention_bias(self, q_len: int, k_len: int, dtype: torch.dtype):
        """The ALiBi+causal bias in the form `attention_impl` takes."""
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if self.attention_impl == "flex":
            return flex_alibi(self.alibi_slopes, q_len, k_len)
        bias = alibi_causal_bias(self.alibi_slopes, q_len, k_len, dtype)
        return EagerBias(bias) if self.attention_impl == "eager" else bias

    def set_activation_checkpointing(self, mode: str) -> None:
        if mode not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"activation checkpointing must be one of "
                             f"{ACTIVATION_CHECKPOINTING}, got {mode!r}")
        self.activation_checkpointing = mode

    def run_blocks(self, x, blocks, paged: StepAttention | None = None):
        """Run `blocks` (an iterable of BloomBlock) over x [b, s, h]; returns x. `paged`: an
        inference step's attention metadata (bloomtrain.model.attention.StepAttention: the
        serving engine's paged KV cache, or a packed scoring step), which then is the
        attention's bias; without it every position attends to the positions before it in
        x, as training does."""
        if paged is not None:
            # An inference step: its packed length changes from call to call, and a block
            # compiled for training (train.compile, dynamic=False) recompiled for each one, up
            # to Dynamo's limit, after which the training-shaped eval ran uncompiled too. Inside
            # a trace of its own (the serving engine's captured step) it is that trace's.
            eager = contextlib.nullcontext() if torch.compiler.is_compiling() else \
                torch.compiler.set_stance("force_eager")
            with eager:
                for block in blocks:
                    x = block(x, paged)
            return x
        q_len = x.shape[1] * self.sequence_parallel_size
        bias = self.attention_bias(q_len, q_len, x.dtype)
        training = self.training and torch.is_grad_enabled()
        recompute = self.activation_checkpointing if training else "none"
        for block in blocks:
            if recompute == "full":
                # Recompute every block in backward, as BLOOM did (--checkpoint-activations).
                x = checkpoint(block, x, bias, use_reentrant=False)
            elif recompute == "selective":
                # The whole block under an op-level policy (model/recompute.py): the matmuls'
                # and fused attention's outputs kept, the rest recomputed. Called as a module,
                # as full calls it, so its hooks (ZeRO-3's gathers) run again in the replay.
                x = selective_checkpoint(block, x, bias)
            else:
                x = block(x, bias)
        return x

    def forward(self, input_ids, paged: StepAttention | None = None):
        """Hidden states [b, s, h] after ln_f. With `paged` (b = 1: an inference step's tokens
        packed into one row), attention is what it describes: per sequence, over the paged KV
        cache (PagedAttention) or the step's own keys and values (PackedAttention)."""
        return self.ln_f(self.run_blocks(self.embed(input_ids), self.h, paged))


class BloomForCausalLM(nn.Module):
    def __init__(self, shape: BloomShape):
        super().__init__()
        self.shape = shape
        self.transformer = BloomModel(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight  # tied, as in BLOOM
        # Tensor parallelism replaces this with the vocab-parallel cross-entropy.
        self.loss_fn = lm_loss

    def forward(self, input_ids, labels=None, loss_mask=None):
        """input_ids [b, s] -> logits [b, s, vocab] (padded vocab), or the mean masked
        cross-entropy when labels are given. Generation decodes through the serving engine's
        paged KV cache (bloomtrain.serve), the model's one inference protocol."""
        logits = self.lm_head(self.transformer(input_ids))
        if labels is not None:
            return self.loss_fn(logits, labels, loss_mask)
        return logits

    def set_activation_checkpointing(self, mode: str) -> None:
        """none, selective or full. "full" recomputes every block in backward, as BLOOM did;
        "selective" keeps each block's matmul outputs and a fused attention kernel's, and
        recomputes the rest: LayerNorm, GeLU, bias adds, dropout, residual adds and an unfused
        attention core's softmax and dropout (bloomtrain.model.recompute)."""
        self.transformer.set_activation_checkpointing(mode)


IGNORE_INDEX = -100  # F.cross_entropy's default: a label that is not scored (HF's convention)


def lm_loss(logits, labels, loss_mask=None):
    """Megatron's LM loss: per-token cross-entropy in fp32, averaged over the loss mask."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return mean_over_mask(losses, labels.flatten(),
                          None if loss_mask is None else loss_mask.flatten())


def mean_over_mask(losses, labels, loss_mask=None):
    """The mean of per-token `losses` over the positions scored: those of `loss_mask` (all
    when None) whose label is not IGNORE_INDEX. Counting the ignored ones too, as the plain
    mean did, scaled an HF-style labelled batch's loss and gradient down by their share."""
    scored = labels != IGNORE_INDEX
    if loss_mask is None:
        # sum / count is the mean's own arithmetic, so a batch without ignored labels keeps it.
        return losses.sum() / scored.sum().clamp(min=1)
    mask = loss_mask.float() * scored
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


# ---- initialization ----------------------------------------------------------------------------

@torch.no_grad()
def init_weights(model: BloomForCausalLM, seed: int) -> BloomForCausalLM:
    """Every parameter's initial value, by its spec (bloomtrain.model.params): the same values a
    parallel layout materializes piece by piece."""
    for name, p in model.named_parameters():
        spec = base_spec(name)
        std = init_std(spec, model.shape.num_layers, model.shape.init_method_std)
        p.copy_(init_full(spec, tuple(p.shape), std, seed))
    return model


def build_model(shape: BloomShape, seed: int = 1234, device=None,
                dtype=torch.float32) -> BloomForCausalLM:
    """The whole model, initialized, on one device: the single-process reference."""
    model = BloomForCausalLM(shape)
    init_weights(model, seed)
    model.to(device=device)
    # Cast parameters only: the ALiBi slopes buffer stays fp32 (non-power-of-2 slopes would round).
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def expected_parameters(shape: BloomShape) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every stored parameter of a BLOOM of `shape` (the tied head excluded),
    from the model built on the meta device: no memory, and always the model's own names."""
    with torch.device("meta"):
        model = BloomForCausalLM(shape)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_state(shape: BloomShape, names_shapes: dict[str, tuple[int, ...]], where) -> None:
    """A stored state (names and shapes, the tied head excluded) against the parameters of a
    BLOOM of `shape`; a UserError naming what is missing, extra or of the wrong shape."""
    expected = expected_parameters(shape)
    missing = [n for n in expected if n not in names_shapes]
    unexpected = [n for n in names_shapes if n not in expected]
    if missing:
        raise UserError(f"{where}: {len(missing)} parameter(s) missing for a "
                        f"{shape.num_layers}-layer BLOOM, e.g. {', '.join(missing[:4])}")
    if unexpected:
        raise UserError(f"{where}: unexpected tensor(s) {', '.join(unexpected[:4])}"
                        f"{' ...' if len(unexpected) > 4 else ''}")
    for name, want in expected.items():
        got = tuple(names_shapes[name])
        if got != want:
            raise UserError(f"{where}: {name} has shape {list(got)}, the config implies "
                            f"{list(want)}")
