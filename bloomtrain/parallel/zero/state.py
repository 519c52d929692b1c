"""The engine's state in logical coordinates: what checkpoints read and write.

`fragments()` gives this dp rank's 1/dp of every parameter (at every stage, so that the ranks
of a dp group together write each parameter once) as checkpoint Fragments: elements of the
flattened tp-local parameter, placed in the full parameter by its spec's tp split. Fragments
another rank also holds (a tp-replicated parameter off tp rank 0, the last stage's copy of the
tied embedding) are left out. `load_state()` takes full tp-local tensors by name and keeps this
rank's ranges; `master_state()` / `optim_state()` gather full tp-local tensors over dp, on the
training device. Under ZeRO-Offload the states are read from and written to host memory, in the
same coordinates: a checkpoint does not know whether the run that wrote it offloaded, nor need the
run that reads it.

Error-feedback residuals (parallel.grad_error_feedback; feedback.py does the work). Each dp
rank's residual is its own, full-size (what its compressed reductions still owe the sum), so a
checkpoint keeps all of them: one kind per saving dp rank, `grad_residual_dp{s}`, in the same
fragments as the moments (rank r writes every rank's residual on its own partition, fetched
with one all-to-all at save time).
The rule on resume:
- the same dp size: dp rank r takes `grad_residual_dp{r}` (bitwise, as the masters; tp and pp
  may change, the residual follows its parameter like any state), except on a parameter's
  uncounted copies (a tp rank's replica of a sequence-parallel LayerNorm or bias, the last
  stage's tied embedding): their residuals differ from the counted copy's, only that one is
  written, and they start at zero (feedback.load);
- another dp size: every rank takes the sum of the saved residuals over its new dp size, so the
  total still owed, the sum over ranks, is kept;
- a checkpoint without residuals (saved without error feedback, or imported): zeros.
A run without error feedback ignores saved residuals.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from bloomtrain.checkpoint import Fragment, residual_kind
from bloomtrain.model.params import tp_shard_shape
from bloomtrain.parallel import comm
from bloomtrain.parallel.zero import feedback
from bloomtrain.parallel.zero.buffers import FlatBuffers

DP = "dp"
KINDS = ("master", "exp_avg", "exp_avg_sq")
CHECKPOINT_KIND = {"master": "model", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _full_shape(spec, local_shape, tp_size: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if spec.tp_dim is not None and tp_size > 1:
        shape[spec.tp_dim] *= tp_size
    tp_shard_shape(spec, tuple(shape), tp_size)  # the split is exact
    return tuple(shape)


def fragments(bufs: FlatBuffers, topo) -> list[Fragment]:
    """This rank's unique pieces of the fp32 masters and Adam moments (and of every dp rank's
    error-feedback residual); only the residuals are exchanged. The tensors are views of the
    live state, not copies: at BLOOM's sizes a copy is as large as the states (12 bytes per
    parameter, on the device, or on the host under offload). A save that runs beside training
    snapshots them first (CheckpointWriter.save, async), a synchronous one writes them as
    they are."""
    out = []
    for seg in bufs.layout.segments:
        residuals = feedback.residuals_here(bufs, seg, topo)
        if residuals is not None and residuals.is_cuda:
            # Each segment's exchange to the host at once: all of them together on the device
            # would be 4 bytes per parameter of the full model (15 GiB per rank at BLOOM-176B).
            residuals = residuals.cpu()
        plo, phi = bufs.partition(seg)
        olo, _ = bufs.own(seg)
        for piece in seg.pieces:
            if not piece.counted:
                continue  # another rank writes it
            a, b = max(plo, piece.seg_start), min(phi, piece.seg_start + piece.numel)
            if a >= b:
                continue
            slot, split = piece.slot, piece.slot.spec.tp_dim is not None and topo.tp_size > 1
            tensors = {CHECKPOINT_KIND[k]: bufs.state_view(getattr(bufs, k), seg)
                       [a - olo:b - olo] for k in KINDS}
            if residuals is not None:  # exchanged into a tensor of their own
                tensors.update({residual_kind(s): residuals[s, a - plo:b - plo]
                                for s in range(bufs.dp_size)})
            out.append(Fragment(
                name=slot.spec.name, shape=_full_shape(slot.spec, slot.shape, topo.tp_size),
                tp_dim=slot.spec.tp_dim if split else None,
                tp_rank=topo.tp_rank if split else 0, tp_size=topo.tp_size if split else 1,
                offset=piece.param_start + a - piece.seg_start, numel=b - a, tensors=tensors))
    return out


@torch.no_grad()
def load_state(bufs: FlatBuffers, master: Mapping, optim: Mapping | None) -> None:
    """Take full tp-local tensors by local parameter name (`master`) and `exp_avg.NAME` /
    `exp_avg_sq.NAME` (`optim`), keep this rank's ranges, refresh the compute copy. No
    communication: every rank reads what it needs. Each tensor is asked for once, parameter by
    parameter, so a lazy source (a checkpoint reader) reads every tensor from disk once."""
    sources = [(bufs.master, master, "")]
    if optim:
        sources += [(bufs.exp_avg, optim, "exp_avg."), (bufs.exp_avg_sq, optim, "exp_avg_sq.")]
    pieces = {id(s): [] for s in bufs.layout.slots}
    for seg in bufs.layout.segments:
        for piece in seg.pieces:
            pieces[id(piece.slot)].append((seg, piece))
    for slot in bufs.layout.slots:
        for buf, tensors, prefix in sources:
            key = prefix + slot.name
            if key not in tensors:
                raise KeyError(f"checkpoint has no {prefix or 'weights '}"
                               f"{'' if prefix else 'for parameter '}{slot.name}")
            # The masters whole where a full compute copy is made from them (stages 0-2).
            whole = buf is bufs.master and bufs.compute is not None
            if not whole and getattr(tensors, "ranged", False):
                _load_owned(bufs, buf, tensors, key, pieces[id(slot)])
                continue
            flat = tensors[key].reshape(-1)
            for seg, piece in pieces[id(slot)]:
                lo, hi = bufs.own(seg)
                a, b = max(lo, piece.seg_start), min(hi, piece.seg_start + piece.numel)
                if a < b:
                    src = piece.param_start + a - piece.seg_start
                    bufs.state_view(buf, seg)[a - lo:b - lo].copy_(flat[src:src + b - a])
                if buf is bufs.master and bufs.compute is not None:
                    base = seg.full_off + piece.seg_start
                    bufs.compute[base:base + piece.numel].copy_(
                        flat[piece.param_start:piece.param_start + piece.numel])
    bufs.refresh_compute_shard()
    feedback.load(bufs, pieces, optim or {})


def _load_owned(bufs: FlatBuffers, buf: torch.Tensor, tensors, key: str, pieces) -> None:
    """A state's parts that this rank keeps, each read alone (`tensors.range`): under ZeRO a
    rank keeps 1/dp of each moment (and at stage 3 of each master), and reading the whole to
    keep that part read dp times the bytes, the job's optimizer states dp times over at every
    resume."""
    for seg, piece in pieces:
        lo, hi = bufs.own(seg)
        a, b = max(lo, piece.seg_start), min(hi, piece.seg_start + piece.numel)
        if a < b:
            src = piece.param_start + a - piece.seg_start
            bufs.state_view(buf, seg)[a - lo:b - lo].copy_(tensors.range(key, src, src + b - a))


@torch.no_grad()
def _full_segment(bufs: FlatBuffers, buf: torch.Tensor, seg, topo) -> torch.Tensor:
    view = bufs.state_view(buf, seg)
    if not bufs.rules.shard_optimizer or topo.dp_group is None:
        return view
    # Gathered on the training device: the dp group's backend may not take host tensors (the
    # offloaded states are there).
    full = torch.empty(seg.padded, dtype=buf.dtype, device=bufs.device)
    comm.all_gather_into_tensor(full, view.to(bufs.device).contiguous(), topo.dp_group, DP)
    return full


def full_state(bufs: FlatBuffers, buf: torch.Tensor, topo, prefix: str = "") -> dict:
    """Full tp-local tensors of `buf` by local name. A collective over dp where the state is
    sharded: every dp rank must call it."""
    flat = {s.name: torch.empty(s.numel, dtype=buf.dtype, device=bufs.device)
            for s in bufs.layout.slots}
    for seg in bufs.layout.segments:
        full = _full_segment(bufs, buf, seg, topo)
        for p in seg.pieces:
            flat[p.slot.name][p.param_start:p.param_start + p.numel].copy_(
                full[p.seg_start:p.seg_start + p.numel])
    return {prefix + s.name: flat[s.name].view(s.shape) for s in bufs.layout.slots}
