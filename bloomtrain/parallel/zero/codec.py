"""The wire codec of compressed data-parallel communication (compress.py): int8 blockwise absmax
quantization, every `BLOCK` consecutive elements sharing one fp32 scale, absmax / 127, rounded to
the nearest integer in [-127, 127]; a row's encoding is one byte buffer, the int8 values then
their scales' bytes (wire.py has the sizes, torch-free for the planner), so one collective
carries both. bf16 is the plainer 2:1 choice: the values' bytes. The last block of a row may be
short; it is padded for the arithmetic, never on the wire."""
from __future__ import annotations

import torch

from bloomtrain.parallel.zero.wire import BLOCK, QMAX, padded


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """[n, m] fp32 -> [n, encoded_bytes(m)] int8: each row encoded on its own."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.int8)
    n, m = x.shape
    blocks = torch.nn.functional.pad(x, (0, padded(m) - m)).view(n, -1, BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True) / QMAX
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).clamp_(-QMAX, QMAX)
    return torch.cat([q.to(torch.int8).view(n, -1)[:, :m],
                      scale.view(n, -1).contiguous().view(torch.int8)], dim=1)


def decode(payload: torch.Tensor, numel: int, dtype: str) -> torch.Tensor:
    """encode's inverse: [n, encoded_bytes(numel)] int8 -> [n, numel] fp32."""
    n = payload.shape[0]
    if dtype == "bf16":
        return payload.contiguous().view(torch.bfloat16).float()
    m = padded(numel)
    q = torch.nn.functional.pad(payload[:, :numel].float(), (0, m - numel)).view(n, -1, BLOCK)
    scale = payload[:, numel:].contiguous().view(torch.float32).view(n, -1, 1)
    return (q * scale).view(n, m)[:, :numel]
