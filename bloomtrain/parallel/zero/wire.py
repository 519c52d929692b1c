"""The sizes of compress.py's wire format (an int8 chunk: the values, then an fp32 scale per BLOCK
of them), without torch, so that the planner prices the bytes the engine sends."""
from __future__ import annotations

BLOCK = 128
QMAX = 127.0


def padded(numel: int) -> int:
    return -(-numel // BLOCK) * BLOCK


def encoded_bytes(numel: int, dtype: str) -> int:
    """Bytes of one encoded chunk of `numel` elements."""
    if dtype == "bf16":
        return 2 * numel
    return numel + 4 * (padded(numel) // BLOCK)
