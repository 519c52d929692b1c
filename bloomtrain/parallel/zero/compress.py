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

Error feedback (feedback.py, all of its life): with a residual buffer, the rank sends
Q(g + e) and keeps e <- (g + e) - D(Q(g + e)), so what quantization drops in one reduction is
sent in a later one.

fp32 does not come here: the engine calls comm's plain collectives for it, so choosing fp32 is
exactly the uncompressed engine.
"""
from __future__ import annotations

import torch

from bloomtrain.parallel import comm
# The codec (encode, decode) in codec.py, error feedback's step in feedback.py, the wire
# format's sizes in wire.py (torch-free for the planner); encode, decode and encoded_bytes are
# importable from here too.
from bloomtrain.parallel.zero.codec import decode, encode
from bloomtrain.parallel.zero.feedback import encode_with_feedback
from bloomtrain.parallel.zero.wire import encoded_bytes

__all__ = ["Pending", "all_gather", "all_reduce", "decode", "encode", "encoded_bytes",
           "reduce_scatter"]


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
    payload = encode_with_feedback(x, dtype, None if residual is None else residual.view(n, -1))
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
    if residual is not None:
        # The sum is encoded a second time for the gather, and what that loses is owed by
        # the whole group. Charged to this rank's residual for its own chunk, the next
        # reduce-scatter sends it into the same sum (1-bit Adam's server-side error): without
        # it the applied gradient's error grew with every step.
        residual.view(n, m)[comm.group_rank(group)].add_(shard - decode(mine, m, dtype)[0])
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
