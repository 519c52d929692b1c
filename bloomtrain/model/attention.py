"""BLOOM's attention core, softmax(q kᵀ / sqrt(d) + ALiBi + causal mask) v, by one of four
kernels, chosen by `transformer.attention_impl` (resolve_attention, below, turns
`train.attention` into sdpa, flex or eager):
- "sdpa": `F.scaled_dot_product_attention` with ALiBi (Press et al., arXiv 2108.12409) and the
  causal mask as one float bias [1, heads, q, k], built once per forward and shared by the
  layers: the fused CPU kernel or CUDA's memory-efficient one (flash kernels take no bias);
- "flex": FlexAttention (Dong et al., arXiv 2412.05496), ALiBi as a `score_mod` in fp32 and
  causality a `BlockMask`, so no bias is materialized; no dropout, and in torch 2.13 no
  backward on CPU, so training uses it on CUDA only;
- "eager": HF BloomAttention's math (baddbmm with the same float bias, fp32 softmax, bmm), the
  scores and probabilities materialized; on CPU in bf16/fp16 at short sequences faster than
  SDPA's fused kernel, whose reduced-precision backward is slow there (see
  bloomtrain.model.kernel_choice.EAGER_MAX_SEQ for the measured crossover and its memory);
- "paged", for serving: keys and values in the engine's block-paged KV cache (PagedAttention,
  Kwon et al., arXiv 2309.06180), attended per sequence with HF BloomAttention's math;
  "packed", for scoring (eval's loglikelihoods): whole sequences packed into one row, each
  attending causally to its own keys and values, no cache (PackedAttention). Both are the
  model's one inference protocol (StepAttention): `BloomModel.forward(ids [1, T], paged=meta)`,
  each layer calling `meta.attend(layer, q, k, v)`.
"""
from __future__ import annotations

import functools
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from bloomtrain.config import DOMAINS, Attention
from bloomtrain.errors import UserError
from bloomtrain.model.kernel_choice import EAGER_MAX_SEQ, check_attention, flex_pays

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    create_block_mask = flex_attention = None

# The kernels: train.attention's choices (config.Attention) but "auto", which resolves to one.
ATTENTION_IMPLS = tuple(a for a in typing.get_args(Attention) if a != "auto")


def flex_attention_available() -> bool:
    return flex_attention is not None


# ---- the kernel a run trains with ---------------------------------------------------------

def resolve_attention(requested: str, attention_dropout: float, device,
                      precision: str = "fp32", seq_length: int | None = None,
                      head_dim: int | None = None) -> str:
    """The kernel for `train.attention` when training on `device` in `precision` at
    `seq_length` tokens with heads of `head_dim` (needed for auto on CUDA).

    auto is flex on CUDA when FlexAttention imports, attention dropout is 0 and the head
    dimension is one where it measured faster than SDPA (kernel_choice.FLEX_MAX_HEAD_DIM: 64,
    bloom-560m's; the larger BLOOMs' 128 ran faster with SDPA), else sdpa. On
    CPU it is eager in bf16/fp16 when seq_length <= EAGER_MAX_SEQ (faster there: kernel_choice.py),
    else sdpa (bench/attention.py); FlexAttention cannot run backward on CPU. Raises UserError
    for a combination that cannot train."""
    DOMAINS["train.attention"].check("train.attention", requested)
    check_attention(requested, attention_dropout)
    device = torch.device(device)
    if requested in ("sdpa", "eager"):
        return requested
    if requested == "auto":
        if (device.type == "cpu" and precision in ("bf16", "fp16") and seq_length is not None
                and seq_length <= EAGER_MAX_SEQ):
            return "eager"
        if device.type != "cuda" or not flex_attention_available():
            return "sdpa"
        if head_dim is None:
            raise ValueError("resolve_attention: auto on CUDA needs the model's head_dim")
        if not flex_pays(head_dim):
            return "sdpa"
        if attention_dropout > 0:
            warnings.warn(f"train.attention=auto: using SDPA, not FlexAttention, because "
                          f"FlexAttention has no dropout and model.attention_dropout is "
                          f"{attention_dropout}; set it to 0 to use FlexAttention", stacklevel=2)
            return "sdpa"
        return "flex"
    if not flex_attention_available():
        raise UserError(f"train.attention=flex needs torch.nn.attention.flex_attention, which "
                        f"torch {torch.__version__} lacks; set train.attention=sdpa or auto")
    if device.type in ("cpu", "mps"):
        raise UserError(f"train.attention=flex cannot train on {device.type}: FlexAttention has "
                        f"no backward there (torch {torch.__version__}); set "
                        f"train.attention=sdpa or auto")
    return "flex"


def alibi_scores(slopes, k_pos, q_pos):
    """ALiBi's bias (Press et al., arXiv 2108.12409), slope * (k - q), from relative positions
    and in fp32 (slopes are): the one formula behind every bias of the model, the materialized
    ones (bloomtrain.model.bloom.alibi_bias) and FlexAttention's score_mods (training's below,
    the paged decode's in bloomtrain.model.paged_flex). Broadcasts; positions int or float."""
    return slopes * (k_pos - q_pos)


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention is a slow reference loop; the kernel only exists compiled. dynamic=False:
    # training shapes are fixed, and a static kernel per shape compiles faster than a dynamic one.
    return torch.compile(flex_attention, dynamic=False)


class FlexAlibi(NamedTuple):
    """The ALiBi+causal bias in FlexAttention's form: the (local) heads' slopes, fp32, for the
    score_mod, and the causal BlockMask for (q_len, k_len)."""

    slopes: torch.Tensor
    block_mask: object


@functools.lru_cache(maxsize=16)
def causal_block_mask(q_len: int, k_len: int, device: torch.device):
    """Queries are the last q_len of k_len positions (a KV cache holds the first k_len - q_len)."""
    offset = k_len - q_len

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, None, None, q_len, k_len, device=device)


def flex_alibi(slopes: torch.Tensor, q_len: int, k_len: int) -> FlexAlibi:
    return FlexAlibi(slopes, causal_block_mask(q_len, k_len, slopes.device))


class EagerBias(NamedTuple):
    """The "eager" kernel's bias: the same additive float bias [1, nh, q_len, k_len] as SDPA's,
    marked so that attention_core takes HF's math path."""
    bias: torch.Tensor


def _eager_core(q, k, v, bias: torch.Tensor, dropout_p: float):
    """HF BloomAttention's training math on [b, nh, s, hd]: baddbmm(bias, q, kᵀ, alpha=1/sqrt(hd)),
    softmax in fp32, cast back, dropout on the probabilities, bmm with v."""
    b, nh, q_len, hd = q.shape
    k_len = k.shape[2]
    n = b * nh
    scores = torch.baddbmm(bias.expand(b, nh, q_len, k_len).reshape(n, q_len, k_len),
                           q.reshape(n, q_len, hd), k.reshape(n, k_len, hd).transpose(1, 2),
                           beta=1.0, alpha=1.0 / math.sqrt(hd))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.bmm(probs, v.reshape(n, k_len, hd)).view(b, nh, q_len, hd)


def attention_core(q, k, v, bias, dropout_p: float = 0.0):
    """q [b, nh, q_len, hd], k and v [b, nh, k_len, hd] -> context [b, nh, q_len, hd]. `bias` is
    an additive float bias [1, nh, q_len, k_len] (SDPA), an EagerBias (HF's math) or a
    FlexAlibi (FlexAttention). Under selective recomputation (bloomtrain.model.recompute) a
    fused kernel's outputs are kept and an unfused core (eager, SDPA's math path) is recomputed
    whole, its O(s²) scores, softmax and dropout mask (the same mask:
    torch.utils.checkpoint restores the RNG state it saw in forward)."""
    if isinstance(bias, EagerBias):
        return _eager_core(q, k, v, bias.bias, dropout_p)
    if not isinstance(bias, FlexAlibi):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    if dropout_p > 0:
        raise UserError("FlexAttention has no attention dropout; set model.attention_dropout=0 "
                        "or train.attention=sdpa")
    slopes = bias.slopes
    offset = k.shape[2] - q.shape[2]

    def alibi(score, b, h, q_idx, kv_idx):
        # Relative positions, as the SDPA bias: 0 on the diagonal, negative below it.
        return score + alibi_scores(slopes[h], kv_idx, q_idx + offset)

    # Inside a compiled region (train.compile) that region's compilation lowers the kernel.
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return flex(q, k, v, score_mod=alibi, block_mask=bias.block_mask)


class PagedKV(Protocol):
    """The KV cache a paged step reads and writes (bloomtrain.serve.kv_cache.PagedKVCache)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None: ...

    def read(self, layer: int, tables: torch.Tensor, buffer
             ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def planes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def eager_attention(q, k, v, bias):
    """q [n, q_len, hd], k and v [n, L, hd], bias [n, q_len, L] -> [n, q_len, hd] for n
    independent (head, sequence) pairs, as HF's BloomAttention computes it (baddbmm, fp32
    softmax, bmm). Not SDPA, for serving: on CPU its fused kernel rounds a head differently
    depending on the thread its work lands on, and so on the batch, which would break the
    engine's batch invariance (bloomtrain.serve.runner)."""
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0,
                           alpha=1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v)


class StepAttention:
    """The model's one inference protocol: a step's tokens packed into one padding-free row
    [1, T] (then padding rows), run through `BloomModel.forward(ids, paged=meta)`, whose every
    layer hands its q, k, v [1, nh, T, hd] to `meta.attend(layer_idx, q, k, v)` for the
    context [1, nh, T, hd]; the metadata says which rows are which sequence and where their
    keys and values are. Row-wise work (embedding, LayerNorms, matmuls, GeLU) sees one row."""

    def attend(self, layer: int, q, k, v):
        raise NotImplementedError


@dataclass
class PackedAttention(StepAttention):
    """A prefill-only step, for scoring (eval's loglikelihoods): whole sequences packed into
    one row, rows [start, end) of `spans` one sequence each, attending causally to that
    sequence's own keys and values from this step (HF BloomAttention's math, as the engine's
    prefill chunks); nothing is cached, for nothing decodes after. `bias` [nh, L, L] is the
    ALiBi+causal bias of the longest sequence: its top-left n x n corner is a sequence of n's
    own, since ALiBi depends only on k - q (bloomtrain.model.bloom.alibi_bias)."""

    spans: list
    bias: torch.Tensor

    def attend(self, layer: int, q, k, v):
        """q, k, v [1, nh, rows, hd] -> context [1, nh, rows, hd]."""
        q, k, v = q[0], k[0], v[0]
        ctx = torch.zeros_like(q)  # padding rows attend to nothing
        for start, end in self.spans:
            n = end - start
            ctx[:, start:end] = eager_attention(q[:, start:end], k[:, start:end],
                                                v[:, start:end], self.bias[:, :n, :n])
        return ctx[None]


@dataclass
class PagedAttention(StepAttention):
    """One serving step's attention metadata, which the model takes in place of the bias
    (`BloomModel.forward(ids, paged=...)`); each layer writes its keys and values, then attends
    per sequence. The step's rows are `num_tokens` new tokens packed into one row of tokens
    (then padding rows, which attend to nothing), whose keys and values go to `write_slots`.
    - `prefills`: (start, end, table [1, W], read buffer, context length L, bias [nh, q, L])
      per prompt chunk: rows [start, end) attend to the first L positions of their blocks;
    - `decodes`: (rows [D], tables [D, W], read buffer, bias [nh * D, 1, W * block_size]) for
      the sequences decoding one token, attended in one batched call over their blocks padded
      to a common width (the padding is masked by the bias);
    - `flex_decodes`: decoding sequences read in place from the cache's planes by FlexAttention
      (bloomtrain.model.paged_flex.FlexPagedDecode), instead of `decodes`."""

    cache: PagedKV
    write_slots: torch.Tensor
    num_tokens: int
    prefills: list
    decodes: list
    flex_decodes: list = field(default_factory=list)

    def attend(self, layer: int, q, k, v):
        """q, k, v [1, nh, rows, hd] of `layer` -> context [1, nh, rows, hd]."""
        n = self.num_tokens
        self.cache.write(layer, self.write_slots, k[0, :, :n], v[0, :, :n])
        q = q[0]  # [nh, rows, hd]
        num_heads, _, head_dim = q.shape
        ctx = torch.zeros_like(q)  # padding rows attend to nothing
        for start, end, table, buffer, length, bias in self.prefills:
            keys, values = self.cache.read(layer, table, buffer)  # [nh, 1, W * bs, hd]
            ctx[:, start:end] = eager_attention(q[:, start:end], keys[:, 0, :length],
                                                values[:, 0, :length], bias)
        for rows, tables, buffer, bias in self.decodes:
            keys, values = self.cache.read(layer, tables, buffer)  # [nh, D, Lp, hd]
            m = bias.shape[0]  # nh * D matrices, head-major like the cache
            qd = q.index_select(1, rows).reshape(m, 1, head_dim)
            out = eager_attention(qd, keys.reshape(m, -1, head_dim),
                                  values.reshape(m, -1, head_dim), bias)  # [nh * D, 1, hd]
            ctx.index_copy_(1, rows, out.view(num_heads, -1, head_dim))
        for d in self.flex_decodes:
            keys, values = self.cache.planes(layer)  # [1, nh, P * bs, hd], read in place
            out = d.attend(q.index_select(1, d.rows), keys, values)  # [nh, num_real, hd]
            ctx.index_copy_(1, d.rows[:d.num_real], out.to(ctx.dtype))
        return ctx[None]
