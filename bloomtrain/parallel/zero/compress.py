"""Compressed data-parallel communication, as ZeRO++ (Wang et al., arXiv 2306.10209) does it:
qgZ, the gradient reduce-scatter in int8 as an all-to-all, and qwZ, stage 3's weight all-gather in
int8; bf16 as a plainer 2:1 choice for the gradients.

int8 is blockwise absmax quantization: every `BLOCK` consecutive elements share one fp32 scale,
absmax / 127, and are rounded to the nearest integer in [-127, 127]. A rank's chunk for a peer
is one byte buffer, the int8 values then their scales' bytes, so one collective carries both:
(1 + 4 / BLOCK) bytes per element against fp32's 4 (0.258x at BLOCK 128) or bf16's 2 (0.516x).
The last block of a chunk may be short; it is padded for the arithmetic, never on the wire.

Gradient reduce-scatter (`reduce_scatter`): every rank encodes its whole input chunk by chunk
(chunk j is rank j's shard), exchanges the chunks with one all-to-all, decodes what it received
and sums it in fp32, in rank order: quantize, exchange, dequantize, sum. The sum itself is never
rounded, unlike a reduction in a narrow dtype on the wire. The all-reduce of stage 0 is this
reduce-scatter followed by an all-gather of the reduced shards, encoded again; every rank, the
shard's owner too, takes the decoded values, so the replicas stay equal.

Error feedback (Seide et al. 2014; Karimireddy et al., arXiv 1901.09847): with a residual
buffer, the rank sends Q(g + e) and keeps e <- (g + e) - D(Q(g + e)), so what quantization drops
in one reduction is sent in a later one. The residual is this rank's own (each rank's input
differs), as large as its input, in fp32.

fp32 does not come here: the engine calls comm's plain collectives for it, so choosing fp32 is
exactly the uncompressed engine.
"""
from __future__ import annotations

import torch

from bloomtrain.parallel import comm
# The wire format's sizes live in wire.py, torch-free for the planner.
from bloomtrain.parallel.zero.wire import BLOCK, QMAX, encoded_bytes, padded


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


def _encode_with_feedback(x: torch.Tensor, dtype: str, residual: torch.Tensor | None):
    """encode(x + residual), the residual updated to what the encoding lost."""
    if residual is None:
        return encode(x, dtype)
    residual.add_(x)
    payload = encode(residual, dtype)
    residual.sub_(decode(payload, x.shape[1], dtype))
    return payload


class Pending:
    """A compressed reduce-scatter in flight: `wait()` finishes it, writing the fp32 sum into
    its output."""

    def __init__(self, handle, received: torch.Tensor, out: torch.Tensor, dtype: str):
        self.handle, self.received, self.out, self.dtype = handle, received, out, dtype

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        parts = decode(self.received, self.out.numel(), self.dtype)
        # fp32, in rank order: the same sum on every run.
        torch.sum(parts, dim=0, out=self.out)


@torch.no_grad()
def reduce_scatter(out: torch.Tensor, input_: torch.Tensor, group, name: str, dtype: str,
                   residual: torch.Tensor | None = None, async_op: bool = False) -> Pending:
    """Sum fp32 `input_` ([n * m] over n ranks) over `group`, this rank's chunk of m into `out`,
    sending `dtype`-encoded chunks. `residual` (like `input_`): error feedback. Returns a Pending
    (already finished unless `async_op`)."""
    n = comm.group_size(group)
    x = input_.view(n, -1)
    payload = _encode_with_feedback(x, dtype, None if residual is None else residual.view(n, -1))
    received = torch.empty_like(payload)
    handle = comm.all_to_all_single(received, payload, group, name, async_op=async_op)
    pending = Pending(handle, received, out, dtype)
    if not async_op:
        pending.wait()
    return pending


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, group, name: str, dtype: str,
               residual: torch.Tensor | None = None) -> None:
    """Sum fp32 `tensor` (numel divisible by the group's size) over `group` in place: the
    compressed reduce-scatter, then an all-gather of the encoded sums."""
    n = comm.group_size(group)
    m = tensor.numel() // n
    shard = torch.empty(m, dtype=torch.float32, device=tensor.device)
    reduce_scatter(shard, tensor, group, name, dtype, residual)
    mine = encode(shard.view(1, m), dtype)
    gathered = torch.empty((n, mine.shape[1]), dtype=torch.int8, device=tensor.device)
    comm.all_gather_into_tensor(gathered.view(-1), mine.view(-1), group, name)
    tensor.view(n, m).copy_(decode(gathered, m, dtype))


@torch.no_grad()
def all_gather(out: torch.Tensor, shard: torch.Tensor, group, name: str, dtype: str,
               async_op: bool = False):
    """qwZ: all-gather fp32 `shard` into `out` (of any float dtype, n times the shard) through
    the `dtype` encoding. Returns a handle whose `wait()` finishes the decode (None when done)."""
    n, m = comm.group_size(group), shard.numel()
    mine = encode(shard.reshape(1, m).float(), dtype)
    gathered = torch.empty((n, mine.shape[1]), dtype=torch.int8, device=shard.device)
    handle = comm.all_gather_into_tensor(gathered.view(-1), mine.view(-1), group, name,
                                         async_op=async_op)
    done = _Gathered(handle, gathered, out, m, dtype)
    if not async_op:
        done.wait()
        return None
    return done


class _Gathered:
    def __init__(self, handle, gathered, out, m, dtype):
        self.handle, self.gathered, self.out, self.m, self.dtype = handle, gathered, out, m, dtype

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.gathered is not None:
            self.out.view(-1, self.m).copy_(decode(self.gathered, self.m, self.dtype))
            self.gathered = None
