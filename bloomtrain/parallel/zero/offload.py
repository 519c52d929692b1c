"""ZeRO-Offload (Ren et al., arXiv 2101.06840): the fp32 masters and Adam moments of this rank's
own range live in host memory, where the optimizer steps them (zero/optimizer.py, by the same
torch AdamW on the same chunks, so on one machine the bits are those of a device step). This
module moves the bytes, chunk by chunk (FlatBuffers.chunks: a segment's own range, cut at the
ring's slot size), through the staging ring (FlatBuffers.staging, RING_SLOTS page-locked
slots; nothing else is pinned): a chunk's reduced fp32 gradients go from the device into a
slot, the host steps the chunk reading them there, casts the updated masters to the compute
dtype into the same slot, and they go back to the device (stages 1-2 all-gather a segment once
its last chunk is back, stage 0 copies into place, stage 3 keeps them as the shard its gathers
read). Then the slot takes chunk k + RING_SLOTS.

On CUDA the device-to-host copies run on a side stream, the first RING_SLOTS of them while the
device computes the global norm; each later one is queued behind the host-to-device copy that
frees its slot (an event per slot), so the device never overwrites a slot still being read.
The host steps chunk k once its copy has landed (an event per chunk) while the later ones are in
flight, and the copy back of chunk k runs on the compute stream while the host steps k + 1. On
the CPU every copy is synchronous and the same code runs in order, which is what the parity
tests exercise.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.segments import Segment

DP = "dp"


@dataclass
class Chunk:
    """Elements [a, b) of `seg`'s own range, in staging slot `slot`: made once, with the views
    the host reads and writes every step (made per step, they were Python on the step's path)."""

    seg: Segment
    a: int
    b: int
    slot: int
    last: bool             # the segment's last chunk
    grad: torch.Tensor     # its fp32 gradients, in the slot (valid once landed)
    master: torch.Tensor   # its fp32 masters
    cast: torch.Tensor     # the slot as the compute dtype: the masters cast, going back


class HostCopies:
    def __init__(self, bufs: FlatBuffers, topo):
        self.bufs, self.topo = bufs, topo
        cuda = bufs.device.type == "cuda"
        self.stream = torch.cuda.Stream(bufs.device) if cuda else None
        slots = len(bufs.staging)
        # Every chunk of the step, in order; chunk k always in slot k % slots.
        self.order: list[Chunk] = []
        for seg in bufs.layout.segments:
            ranges, master = bufs.chunks(seg), bufs.state_view(bufs.master, seg)
            for a, b in ranges:
                slot = len(self.order) % slots
                self.order.append(Chunk(seg, a, b, slot, b == ranges[-1][1],
                                        bufs.staging[slot][:b - a], master[a:b],
                                        bufs.staging[slot].view(bufs.compute_dtype)[:b - a]))
        # Per slot: the event after the last host-to-device copy out of it (None: free).
        self._freed: list = [None] * slots
        # The chunks whose device-to-host copies are issued and not yet stepped, in order, each
        # with its event (None where copies are synchronous).
        self._pending: collections.deque = collections.deque()
        self._issued = 0
        # Stages 1-2: the device shard of the segment being sent back, gathered once complete.
        self._shard: torch.Tensor | None = None

    def _copy_stream(self):
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    @torch.no_grad()
    def _issue(self) -> None:
        """Start the device-to-host copy of the next chunk into its slot."""
        chunk = self.order[self._issued]
        with self._copy_stream():
            if self.stream is not None and self._freed[chunk.slot] is not None:
                self.stream.wait_event(self._freed[chunk.slot])
            chunk.grad.copy_(self.bufs.grad_view(chunk.seg)[chunk.a:chunk.b], non_blocking=True)
            event = self.stream.record_event() if self.stream else None
        self._pending.append((chunk, event))
        self._issued += 1

    @torch.no_grad()
    def grads_to_host(self) -> None:
        """Start copying the first chunks' reduced gradients into the ring; called right after
        the reductions, before the global norm. The others follow as slots free up."""
        if self.stream is not None:
            # After the reductions.
            self.stream.wait_stream(torch.cuda.current_stream(self.bufs.device))
        self._issued = 0
        self._pending.clear()
        while self._issued < min(len(self.order), len(self.bufs.staging)):
            self._issue()

    def wait(self) -> None:
        """Every device-to-host copy issued is done: the device gradients may be written again
        (a skipped step leaves them to the next step's zeroing)."""
        for _, event in self._pending:
            if event is not None:
                event.synchronize()
        self._pending.clear()

    def landed(self):
        """Every chunk, in order, once its gradients are in its slot. The caller steps it and
        `send`s it back before asking for the next; its slot then takes chunk k + RING_SLOTS
        at once, so that on a GPU the copy into it runs while the host steps the chunks
        between."""
        # A step without grads_to_host() first would have no gradients to read.
        if len(self.order) and not self._pending:
            raise RuntimeError("HostCopies.landed() needs grads_to_host() first")
        while self._pending:
            chunk, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            yield chunk
            if self._issued < len(self.order):
                self._issue()

    def cast(self, chunk: Chunk) -> torch.Tensor:
        """The host's part of `send`: the chunk's updated masters in the compute dtype, written
        into its slot (over the gradients the step has read: c <= 4 bytes per element), right
        after the step, which has just left them in the cache."""
        chunk.cast.copy_(chunk.master)
        return chunk.cast

    @torch.no_grad()
    def send(self, chunk: Chunk) -> None:
        """The chunk's updated masters back to the device, in the compute dtype, through its
        slot."""
        self.copy_back(chunk, self.cast(chunk))

    def copy_back(self, chunk: Chunk, cast: torch.Tensor) -> None:
        """The copy of `send`, from the slot `cast` filled."""
        bufs, seg, a, b = self.bufs, chunk.seg, chunk.a, chunk.b
        if bufs.compute_shard is not None:
            bufs.state_view(bufs.compute_shard, seg)[a:b].copy_(cast, non_blocking=True)
        elif not bufs.rules.shard_optimizer:
            bufs.compute[seg.full_off + a:seg.full_off + b].copy_(cast, non_blocking=True)
        else:
            if a == 0:
                self._shard = torch.empty(seg.shard, dtype=bufs.compute_dtype,
                                          device=bufs.device)
            self._shard[a:b].copy_(cast, non_blocking=True)
        if self.stream is not None:
            # The slot is free once this copy has read it (queued on the compute stream).
            self._freed[chunk.slot] = torch.cuda.current_stream(bufs.device).record_event()
        if self._shard is not None and chunk.last:
            full = bufs.compute[seg.full_off:seg.full_off + seg.padded]
            comm.all_gather_into_tensor(full, self._shard, self.topo.dp_group, DP)
            self._shard = None
