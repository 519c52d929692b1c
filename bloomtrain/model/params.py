"""What every BLOOM parameter is, keyed by its HF name: how tensor parallelism splits it, whether
it gets weight decay, how it is initialized, and which names are the tied embedding; one table
and a typed `ParamSpec` per parameter, held next to the parameters (`ModelParts.specs`), never
on them.

The split dims follow Megatron-LM (arXiv 1909.08053): column-parallel matmuls (the fused
query_key_value, whose per-head layout makes a block of rows a set of whole heads, and
dense_h_to_4h) split their weight and bias along the output dim 0; row-parallel ones
(self_attention.dense, dense_4h_to_h) split the weight along the input dim 1 and keep the bias
whole; the embedding and the tied LM head split the vocabulary, dim 0. LayerNorms are replicated.
Weight decay: none for biases and LayerNorms (Megatron's `_get_params_for_weight_decay_
optimization`). Initialization: Megatron's, normal(0, std) for weights, std / sqrt(2 * layers)
for the two output projections of a block, zero biases, unit LayerNorm weights.
"""
from __future__ import annotations

import dataclasses
import math
import re
import zlib
from dataclasses import dataclass

import torch

from bloomtrain.model.presets import EMBEDDING, LM_HEAD  # noqa: F401  (re-exported)

INIT_BLOCK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per generated block


@dataclass(frozen=True)
class ParamSpec:
    name: str                       # logical HF name: the LM head's is the embedding's
    tp_dim: int | None              # dim split over tp ranks; None: every tp rank holds it whole
    weight_decay: bool
    init: str                       # "normal", "scaled_normal", "zeros" or "ones"
    # Sequence parallelism: a replicated parameter sees only this rank's part of the sequence,
    # so its gradient is a partial sum over tp.
    tp_partial_grad: bool = False
    # pp > 1: one of the two copies of the tied embedding (the first stage's embedding, the last
    # stage's LM head); their gradients are summed over the embedding group.
    tied: bool = False
    # The last stage's copy: the grad norm counts it once (on the first stage) and checkpoints
    # store it once (under the embedding's name).
    tied_copy: bool = False

    @property
    def tp_replicated(self) -> bool:
        return self.tp_dim is None


_TABLE: list[tuple[str, dict]] = [
    (r"(^|\.)word_embeddings\.weight$|^lm_head\.weight$",
     dict(tp_dim=0, weight_decay=True, init="normal")),
    (r"(layernorm|(^|\.)ln_f)\.weight$", dict(tp_dim=None, weight_decay=False, init="ones")),
    (r"(layernorm|(^|\.)ln_f)\.bias$", dict(tp_dim=None, weight_decay=False, init="zeros")),
    (r"self_attention\.query_key_value\.weight$", dict(tp_dim=0, weight_decay=True, init="normal")),
    (r"self_attention\.query_key_value\.bias$", dict(tp_dim=0, weight_decay=False, init="zeros")),
    (r"self_attention\.dense\.weight$", dict(tp_dim=1, weight_decay=True, init="scaled_normal")),
    (r"self_attention\.dense\.bias$", dict(tp_dim=None, weight_decay=False, init="zeros")),
    (r"mlp\.dense_h_to_4h\.weight$", dict(tp_dim=0, weight_decay=True, init="normal")),
    (r"mlp\.dense_h_to_4h\.bias$", dict(tp_dim=0, weight_decay=False, init="zeros")),
    (r"mlp\.dense_4h_to_h\.weight$", dict(tp_dim=1, weight_decay=True, init="scaled_normal")),
    (r"mlp\.dense_4h_to_h\.bias$", dict(tp_dim=None, weight_decay=False, init="zeros")),
]
_COMPILED = [(re.compile(pattern), facts) for pattern, facts in _TABLE]


def logical_name(name: str) -> str:
    """The checkpoint name of a parameter: the LM head is the tied embedding."""
    return EMBEDDING if name == LM_HEAD else name


def base_spec(name: str) -> ParamSpec:
    """The layout-independent facts of the HF-named parameter `name`."""
    for pattern, facts in _COMPILED:
        if pattern.search(name):
            return ParamSpec(name=logical_name(name), **facts)
    raise KeyError(f"{name} is not a BLOOM parameter name")


def param_spec(name: str, *, tp: int = 1, pp: int = 1,
               sequence_parallel: bool = False) -> ParamSpec:
    """The spec of `name` in a layout with these tp and pp sizes."""
    spec = base_spec(name)
    tied = pp > 1 and spec.name == EMBEDDING
    return dataclasses.replace(
        spec, tp_partial_grad=sequence_parallel and tp > 1 and spec.tp_dim is None,
        tied=tied, tied_copy=tied and name == LM_HEAD)


def tp_shard_shape(spec: ParamSpec, full_shape: tuple[int, ...], tp_size: int) -> tuple:
    shape = list(full_shape)
    if spec.tp_dim is not None and tp_size > 1:
        if shape[spec.tp_dim] % tp_size:
            raise ValueError(f"{spec.name} has {shape[spec.tp_dim]} entries along dim "
                             f"{spec.tp_dim}, which do not split over tp={tp_size}")
        shape[spec.tp_dim] //= tp_size
    return tuple(shape)


# ---- initialization ----------------------------------------------------------------------------

def init_std(spec: ParamSpec, num_layers: int, std: float) -> float:
    return std / math.sqrt(2.0 * num_layers) if spec.init == "scaled_normal" else std


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def _block_seed(name_seed: int, block: int) -> int:
    # Block 0 keeps the name's seed, so a one-block tensor gets the values of one normal_ call.
    return name_seed if block == 0 else (name_seed + block * 0x9E3779B97F4A7C15) % (2 ** 63)


@torch.no_grad()
def init_into(out: torch.Tensor, spec: ParamSpec, full_shape: tuple[int, ...], std: float,
              seed: int, tp_rank: int = 0, tp_size: int = 1, start: int = 0) -> torch.Tensor:
    """Write elements [start, start + out.numel()) of the flattened tp shard `tp_rank` of
    `tp_size` (along spec.tp_dim) of the parameter's initial value into the flat tensor `out`,
    generating only the row blocks that overlap them. `std` is the normal's, already scaled for
    "scaled_normal". Returns `out`.

    Values are drawn per parameter from a generator seeded by the run seed and the logical name,
    in row blocks of at most INIT_BLOCK_ELEMENTS, block b from its own seed derived from the
    name's: any rank produces exactly its piece of any parameter (a tp shard, a ZeRO range)
    without materializing the whole, and the values do not depend on the layout. A tensor of
    one block (every parameter of the test models) gets what one `normal_` of it gives."""
    end = start + out.numel()
    if spec.init in ("zeros", "ones"):
        return out.fill_(1.0 if spec.init == "ones" else 0.0)
    rows = full_shape[0]
    cols = math.prod(full_shape[1:])
    split = spec.tp_dim if tp_size > 1 else None
    local_rows, row0, local_cols, col0 = rows, 0, cols, 0
    if split == 0:
        local_rows = rows // tp_size
        row0 = tp_rank * local_rows
    elif split == 1:
        local_cols = full_shape[1] // tp_size
        col0 = tp_rank * local_cols
    assert len(full_shape) <= 2 or split != 1
    rows_per_block = max(1, INIT_BLOCK_ELEMENTS // cols)
    first_row, last_row = start // local_cols, (end - 1) // local_cols  # local rows touched
    name_seed = _name_seed(seed, spec.name)
    for block in range((row0 + first_row) // rows_per_block,
                       (row0 + last_row) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(rows, b0 + rows_per_block)
        g = torch.Generator().manual_seed(_block_seed(name_seed, block))
        values = torch.empty(b1 - b0, cols).normal_(0.0, std, generator=g)
        # Local rows of this block, their columns, and where they sit in the local flat order.
        lo, hi = max(b0, row0) - row0, min(b1, row0 + local_rows) - row0
        piece = values[lo + row0 - b0:hi + row0 - b0, col0:col0 + local_cols].reshape(-1)
        a, b = lo * local_cols, hi * local_cols
        s, e = max(a, start), min(b, end)
        out[s - start:e - start].copy_(piece[s - a:e - a])
    return out


def init_full(spec: ParamSpec, full_shape: tuple[int, ...], std: float, seed: int,
              dtype=torch.float32) -> torch.Tensor:
    """The whole initial value of a parameter."""
    out = torch.empty(math.prod(full_shape), dtype=torch.float32)
    return init_into(out, spec, full_shape, std, seed).view(full_shape).to(dtype)


def replace_parameters(modules, new: dict) -> None:
    """Put new[id(p)] in place of every parameter p of `modules` that `new` names, in every
    module that holds p, so that parameters shared between modules (a tied LM head) stay
    shared."""
    for m in modules:
        for mod in m.modules():
            for key, p in list(mod._parameters.items()):
                if p is not None and id(p) in new:
                    mod._parameters[key] = new[id(p)]
