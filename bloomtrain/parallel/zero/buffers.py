"""ZeRO's flat buffers on one rank, the parameters as views into them, and their first values.
Per rank (Ψ = parameters on this rank, tp-local and of this pipeline stage; N = dp; c = bytes of
the compute dtype, 2 for bf16), against the ZeRO paper's (arXiv 1910.02054) fp16 counts:

    stage  compute  master  grad   Adam m+v  ours (bf16)       ZeRO paper (fp16 grads)
    0      cΨ       4Ψ      4Ψ     8Ψ        18Ψ               16Ψ
    1      cΨ       4Ψ/N    4Ψ     8Ψ/N      2Ψ + 4Ψ + 12Ψ/N   4Ψ + 12Ψ/N
    2      cΨ       4Ψ/N    4Ψ/N   8Ψ/N      2Ψ + 16Ψ/N        2Ψ + 14Ψ/N
    3      -        4Ψ/N    4Ψ/N   8Ψ/N      16Ψ/N + W         16Ψ/N

Gradients are fp32 where the paper counts fp16 (BLOOM's BF16Optimizer accumulates in fp32).
Stage 3 keeps no compute copy: a unit's weights are cast from the fp32 master shards as they are
gathered (W, the gathered working set, is transient). Offload: FlatBuffers.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bloomtrain.model.params import ParamSpec
from bloomtrain.parallel.zero.memory import RING_SLOTS, pinned_size, staging_chunk
from bloomtrain.parallel.zero.segments import Segment, SegmentLayout, Slot
from bloomtrain.parallel.zero.stages import StageRules
from bloomtrain.model.params import replace_parameters

# Elements per copy when the stage-3 compute shard is refreshed from offloaded masters (64 MiB of
# fp32 at a time; see refresh_compute_shard).
REFRESH_CHUNK = 1 << 24

# values(param, spec, start, out): write elements [start, start + out.numel()) of the flattened
# (tp-local) first value of `param` into the flat fp32 tensor `out`.
Values = Callable[[nn.Parameter, ParamSpec, int, torch.Tensor], None]


class FlatBuffers:
    """One rank's flat buffers (the module's table). With ZeRO-Offload (arXiv 2101.06840,
    `offload`) the master and Adam columns (12Ψ/N; 12Ψ at stage 0) live in host memory, where
    the step runs (offload.py), in ordinary pageable memory (`pin_states`: page-locked on CUDA,
    parallel.offload_pin_memory). What crosses between device and host, the own fp32 gradients
    on their way to the step and the compute-dtype cast of the updated masters on their way
    back, goes chunk by chunk through `staging`, a ring of RING_SLOTS pinned fp32 buffers of
    `chunk` elements each (R bytes, about one reduction bucket whatever Ψ): the only memory
    pinned by default. A pageable buffer would turn every asynchronous copy into a synchronous
    staged one, and pinning 12-16 bytes per parameter exhausts a host that holds them. Stage 3
    then keeps on the device the compute-dtype copy of its own shard (cΨ/N) that its gathers
    read, since the masters they would cast from are on the host:

        stage  device (bf16)           host
        0-2    as above, less 12Ψ/N    12Ψ/N + R     (stage 0: 12Ψ + R)
        3      4Ψ/N + 2Ψ/N + W         12Ψ/N + R
    """

    def __init__(self, layout: SegmentLayout, rules: StageRules, dp_size: int, dp_rank: int,
                 compute_dtype: torch.dtype, device, offload: bool = False,
                 error_feedback: bool = False, bucket: int | None = None,
                 pin_states: bool = False):
        self.layout, self.rules = layout, rules
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.compute_dtype, self.device = compute_dtype, torch.device(device)
        self.offload = offload
        # Where the optimizer states live: the host under offload (meta stays meta, so that any
        # rank can still be described without memory).
        self.state_device = (self.device if not offload or self.device.type == "meta"
                     else torch.device("cpu"))
        full, shard = layout.full_numel, layout.shard_numel
        state = shard if rules.shard_optimizer else full
        # The optimizer steps every segment's own range in chunks of this many elements, with
        # or without offload (memory.staging_chunk); `bucket` None: one chunk per segment.
        largest = max((s.shard if rules.shard_optimizer else s.padded
                       for s in layout.segments), default=1)
        self.chunk = staging_chunk(largest, bucket or largest * RING_SLOTS)
        # Bytes of host memory page-locked on CUDA, as torch's pinned allocator takes them
        # (memory.pinned_size). A CPU device pins nothing (no copy engine to serve; torch
        # refuses pin_memory without an accelerator), but the count is the same: it comes from
        # the flag each allocation passes.
        self.pinned = 0

        def zeros(n, dtype=torch.float32, device=self.device, pinned=False):
            if pinned:
                self.pinned += pinned_size(n * torch.empty(0, dtype=dtype).element_size())
            pin = pinned and device.type == "cpu" and self.device.type == "cuda"
            return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin)
        pin_states = offload and pin_states
        self.master, self.exp_avg, self.exp_avg_sq = (
            zeros(state, device=self.state_device, pinned=pin_states) for _ in range(3))
        self.grad = zeros(shard if rules.shard_grads else full)
        self.compute = None if rules.shard_params else zeros(full, compute_dtype)
        # Offload: the staging ring (offload.py). A slot carries a chunk of fp32 gradients to
        # the host, then the same bytes carry the chunk's cast masters back.
        self.staging = ([zeros(self.chunk, device=self.state_device, pinned=True)
                         for _ in range(RING_SLOTS)] if offload else [])
        # Offload, stage 3: the compute-dtype copy of the own shard that gathers read.
        self.compute_shard = (zeros(shard, compute_dtype) if offload and rules.shard_params
                              else None)
        # parallel.grad_error_feedback: what this rank's compressed dp reductions have not sent
        # yet, laid out like the full gradient (compress.py), on the device that reduces.
        self.grad_residual = zeros(full) if error_feedback else None
        # Stage 3: one gathered buffer per group, its storage released (size 0) when not in use;
        # made by `bind`, one group at a time.
        self.gathered: dict[int, torch.Tensor] = {}
        # The optimizer's views of each run of consecutive chunks it steps in one call, made on
        # first use (optimizer.batch_tensors).
        self.batch_views: dict[tuple[int, int, int | None, int], tuple] = {}

    # ---- ranges ----------------------------------------------------------------------------------
    def own(self, seg: Segment) -> tuple[int, int]:
        """The range of `seg` whose master weights and moments this rank holds and updates."""
        return self.partition(seg) if self.rules.shard_optimizer else (0, seg.padded)

    def partition(self, seg: Segment) -> tuple[int, int]:
        """This dp rank's 1/dp of `seg`, at every stage (what it writes to checkpoints)."""
        return self.dp_rank * seg.shard, (self.dp_rank + 1) * seg.shard

    def state_view(self, buf: torch.Tensor, seg: Segment) -> torch.Tensor:
        lo, hi = self.own(seg)
        off = seg.shard_off if self.rules.shard_optimizer else seg.full_off
        return buf[off:off + hi - lo]

    def chunks(self, seg: Segment) -> list[tuple[int, int]]:
        """[a, b) ranges of `seg`'s own range (state_view coordinates) that the optimizer
        steps as one, offloaded or not."""
        lo, hi = self.own(seg)
        return [(a, min(a + self.chunk, hi - lo)) for a in range(0, hi - lo, self.chunk)]

    def grad_view(self, seg: Segment) -> torch.Tensor:
        """fp32 gradient of the own range (valid after the dp reduction)."""
        if self.rules.shard_grads:
            return self.grad[seg.shard_off:seg.shard_off + seg.shard]
        lo, hi = self.own(seg)
        return self.grad[seg.full_off + lo:seg.full_off + hi]

    def full_grad(self, seg: Segment) -> torch.Tensor:
        return self.grad[seg.full_off:seg.full_off + seg.padded]

    def param_view(self, slot: Slot) -> torch.Tensor:
        if self.rules.shard_params:
            group = self.layout.groups[slot.group]
            base, off = self.gathered[group.index], slot.full_off - group.full_off
        else:
            base, off = self.compute, slot.full_off
        return base[off:off + slot.numel].view(slot.shape)

    # ---- first values ----------------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, values: Values) -> None:
        """Fill the compute copy (stages 0-2) and this rank's own master range from `values`,
        one piece at a time, straight into this rank's buffers: a meta parameter's initial value
        is generated only for the ranges this rank keeps (bloomtrain.model.params.init_into), a
        real one is copied. No rank ever holds a full-size copy of the model."""
        for seg in self.layout.segments:
            lo, hi = self.own(seg)
            master = self.state_view(self.master, seg)
            for piece in seg.pieces:
                a, b = piece.seg_start, piece.seg_start + piece.numel
                if self.compute is not None:
                    # Every rank keeps the whole compute copy: generate the whole piece once.
                    tmp = torch.empty(piece.numel, dtype=torch.float32, device=self.device)
                    values(piece.slot.param, piece.slot.spec, piece.param_start, tmp)
                    self.compute[seg.full_off + a:seg.full_off + b].copy_(tmp)
                    s, e = max(a, lo), min(b, hi)
                    if s < e:
                        master[s - lo:e - lo].copy_(tmp[s - a:e - a])
                    continue
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    values(piece.slot.param, piece.slot.spec, piece.param_start + s - a,
                           master[s - lo:e - lo])
        self.refresh_compute_shard()

    @torch.no_grad()
    def refresh_compute_shard(self) -> None:
        """Offload, stage 3: the device's compute-dtype shard from the host masters, after they
        were written outside the step (first values, a checkpoint)."""
        if self.compute_shard is not None:
            # Chunk by chunk: a blocking host-fp32 to device-bf16 copy converts on the host
            # first, into a temporary as large as its source (2 bytes per parameter: 14 GB at
            # bloom-7b1 on one GPU, beside the offloaded states).
            step = REFRESH_CHUNK
            for a in range(0, self.master.numel(), step):
                self.compute_shard[a:a + step].copy_(self.master[a:a + step])

    def bind(self, modules: list[nn.Module]) -> dict[int, nn.Parameter]:
        """Replace every parameter of `modules` by a Parameter that is a view into the flat
        buffers, in every module that holds it (ties are kept). Returns old id -> new."""
        new = {}
        for group in self.layout.groups:
            if self.rules.shard_params and group.segments:
                # A view needs its storage to exist when it is made; it is released right
                # after, so at most one unit's compute copy is ever allocated here.
                self.gathered[group.index] = torch.empty(group.padded, dtype=self.compute_dtype,
                                                         device=self.device)
            for s in group.slots:
                new[id(s.param)] = self._parameter(s)
            if self.rules.shard_params and group.segments and self.device.type != "meta":
                self.gathered[group.index].untyped_storage().resize_(0)
        replace_parameters(modules, new)
        for s in self.layout.slots:
            s.param = new[id(s.param)]
        return new

    def _parameter(self, slot: Slot) -> nn.Parameter:
        # Assigned through `.data`, the Parameter aliases the buffer's storage but keeps its own
        # version counter: refilling the buffer (stage 3's gather before backward, the compute
        # refresh after a step) must not look like an in-place change of a tensor autograd saved.
        p = nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device),
                         requires_grad=slot.param.requires_grad)
        p.data = self.param_view(slot)
        return p

    def nbytes(self) -> dict[str, int]:
        """Model-state bytes on the training device, by category."""
        on_device = not self.offload
        return {"compute_params": _size(self.compute) + _size(self.compute_shard),
                "fp32_master": _size(self.master) * on_device,
                "fp32_grads": _size(self.grad),
                "adam_m": _size(self.exp_avg) * on_device,
                "adam_v": _size(self.exp_avg_sq) * on_device,
                **({"grad_residual": _size(self.grad_residual)}
                   if self.grad_residual is not None else {})}

    def host_nbytes(self) -> dict[str, int]:
        """Offload: the bytes held in host memory, by category (all 0 without offload)."""
        off = self.offload
        return {"fp32_master": _size(self.master) * off, "adam_m": _size(self.exp_avg) * off,
                "adam_v": _size(self.exp_avg_sq) * off,
                "staging_ring": sum(_size(t) for t in self.staging)}


def _size(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
