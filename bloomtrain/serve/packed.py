"""MKL's packed GEMM for the serving runner's small steps on CPU.

A batch-invariant step pads its matmul rows to `min_rows` (runner.py: below that count a CPU
GEMM rounds a row differently), so a lone decode pays for `min_rows` rows: on a 2-core CPU a
16-row GEMM of a small model costs 2-5x a 1-row one, and it was most of the gap between the
server at one client and `generate` alone. MKL can pre-pack a weight for a known row count
(cblas_sgemm_pack, torch's mkl::_mkl_reorder_linear_weight, which inductor's CPU freezing uses),
and its packed product at exactly that count runs about twice as fast as the plain one
(16 rows of the demo model's layers: 14-19 us against 27-68 us; its LM head 137 against
312 us). torch.ops.mkl._mkl_linear runs the packed product when the input has exactly the
packed row count and the plain F.linear otherwise, so a step of `min_rows` rows or fewer (every
decode step of a small batch, padded to `min_rows`) takes the packed kernel, larger steps the
plain one.

That is batch-invariant only where the packed product gives each row bitwise what the plain
one gives at `min_rows` rows and more, which depends on the CPU, MKL and the matrix's shape (on
this project's 2-core CPU it holds for the demo model's 128-wide layers and not for 1024-wide
ones, whose K blocking differs): each distinct shape is probed, as batch_invariant_rows probes
the padding, and only the layers whose shape passes are packed. The others keep F.linear.

Costs a packed copy of each packed weight (reported by `pack_linears`); the copy is taken once,
so it is for a model that is served, not trained on. Plain nn.Linear layers only (tp=1): a
tensor-parallel layer keeps its own forward.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bloomtrain.serve.runner import PROBE_ROWS

__all__ = ["PackedLinear", "mkl_packing_available", "pack_linears"]


def mkl_packing_available() -> bool:
    """Whether this torch has MKL's packed GEMM ops (x86 builds with MKL)."""
    return (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight is also held packed for `packed_rows`-row inputs (set by
    pack_linears, which turns a probed nn.Linear into one); other row counts run F.linear on
    the weight as before. Same parameters and state dict as nn.Linear."""

    packed: torch.Tensor
    packed_rows: int

    def forward(self, x):
        # As the probe ran it, on a matrix: given the runner's [1, rows, hidden], the op's
        # fall-through for other row counts took another kernel, whose rows differed from
        # F.linear's (in 256 inputs, on an AVX-512 CPU) where the probe's had not.
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias,
                                        self.packed_rows)
        return out.view(*x.shape[:-1], out.shape[-1])


def _packed_rows_match(weight, bias, rows: int, max_rows: int, probe_cols: int) -> bool:
    """Whether a PackedLinear of this weight's shape gives, at `rows` rows (the packed product)
    and at the probed counts above (its fall-through to aten's linear), bitwise F.linear's rows
    at `max_rows` rows: probed on the first `probe_cols` output features, as
    runner.batch_invariant_rows probes the padding."""
    g = torch.Generator().manual_seed(0)
    w = weight.detach()[:probe_cols]
    b = None if bias is None else bias.detach()[:probe_cols]
    top = max(max_rows, rows)
    x = torch.randn((top, w.shape[1]), generator=g)
    ref = F.linear(x, w, b)
    packed = _pack(w, rows)
    counts = sorted({rows, top} | {m for m in PROBE_ROWS if rows < m < top})
    return all(torch.equal(torch.ops.mkl._mkl_linear(x[:m], packed, w, b, rows), ref[:m])
               for m in counts)


def pack_linears(model: nn.Module, rows: int, max_rows: int, probe_cols: int = 16384) -> int:
    """Turn each plain fp32 CPU nn.Linear of `model` whose shape passes the probe (see the
    module doc) into a PackedLinear for `rows`-row inputs. Returns the bytes the packed copies
    take (0 when nothing was packed: no MKL, another dtype or device, or no shape passed)."""
    if rows <= 1 or not mkl_packing_available():
        return 0
    verdicts: dict[tuple, bool] = {}
    added = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            continue
        key = (tuple(w.shape), module.bias is not None)
        if key not in verdicts:
            verdicts[key] = _packed_rows_match(w, module.bias, rows, max_rows, probe_cols)
        if verdicts[key]:
            module.packed = _pack(w, rows)
            module.packed_rows = rows
            module.__class__ = PackedLinear
            added += w.numel() * w.element_size()
    return added
