"""ZeRO-Offload (Ren et al., arXiv 2101.06840): the fp32 masters and Adam moments of this rank's
own range live in host memory, where the optimizer steps them (bloomtrain.optim, by the same
torch AdamW on the same views, so on one machine the bits are those of a device step). This
module moves the bytes, segment by segment: the reduced fp32 gradients of the own range to the
host (buffers.host_grad), and the updated masters, cast to the compute dtype in the host copy's
bytes, back to the device (stages 1-2 all-gather them into the compute copy, stage 0 copies them
into place, stage 3 keeps them as the shard its gathers read).

On CUDA the device-to-host copies of every segment run on a side stream while the device
computes the global norm, and the host steps segment k once its copy has landed (an event per
segment) while the later ones are in flight; the copy back and all-gather of segment k are
queued on the compute stream while the host steps segment k+1. On the CPU every copy is
synchronous and the same code runs in order, which is what the parity tests exercise.
"""
from __future__ import annotations

import contextlib

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.buffers import FlatBuffers

DP = "dp"


class HostCopies:
    def __init__(self, bufs: FlatBuffers, topo):
        self.bufs, self.topo = bufs, topo
        cuda = bufs.device.type == "cuda"
        self.stream = torch.cuda.Stream(bufs.device) if cuda else None
        # One per segment while its D2H copy is in flight (None where copies are synchronous).
        self._landed: list = []

    def _copy_stream(self):
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    @torch.no_grad()
    def grads_to_host(self) -> None:
        """Start copying every segment's reduced own gradient range into host memory; called
        right after the reductions, before the global norm."""
        bufs = self.bufs
        if self.stream is not None:
            # After the reductions (and the last step's H2D copies out of the same host bytes).
            self.stream.wait_stream(torch.cuda.current_stream(bufs.device))
        with self._copy_stream():
            for seg in bufs.layout.segments:
                bufs.state_view(bufs.host_grad, seg).copy_(bufs.grad_view(seg),
                                                           non_blocking=True)
                self._landed.append(self.stream.record_event() if self.stream else None)

    def wait(self) -> None:
        """Every D2H copy done: the device gradients may be written again (a skipped step
        leaves them to the next step's zeroing)."""
        for event in self._landed:
            if event is not None:
                event.synchronize()
        self._landed = []

    def landed(self):
        """Every segment, each once its gradients are in host memory."""
        # strict: a step without grads_to_host() first would have no gradients to read.
        for seg, event in zip(self.bufs.layout.segments, self._landed, strict=True):
            if event is not None:
                event.synchronize()
            yield seg
        self._landed = []

    @torch.no_grad()
    def send(self, seg) -> None:
        """Segment `seg`'s updated masters back to the device, in the compute dtype."""
        bufs = self.bufs
        master = bufs.state_view(bufs.master, seg)
        # The cast reuses the host gradient's bytes (c <= 4 bytes per element): no second
        # pinned buffer. Nothing reads them until the next step's D2H copy, which the copy
        # stream queues behind this H2D copy (grads_to_host waits on the compute stream).
        cast = bufs.state_view(bufs.host_grad, seg).view(bufs.compute_dtype)[:master.numel()]
        cast.copy_(master)
        if bufs.compute_shard is not None:
            bufs.state_view(bufs.compute_shard, seg).copy_(cast, non_blocking=True)
        elif not bufs.rules.shard_optimizer:
            bufs.compute[seg.full_off:seg.full_off + seg.padded].copy_(cast, non_blocking=True)
        else:
            shard = torch.empty(seg.shard, dtype=bufs.compute_dtype, device=bufs.device)
            shard.copy_(cast, non_blocking=True)
            full = bufs.compute[seg.full_off:seg.full_off + seg.padded]
            comm.all_gather_into_tensor(full, shard, self.topo.dp_group, DP)
