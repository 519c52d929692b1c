"""The gradient analyser: per block of the model, the gradient norm and the update/weight ratio
||w_after - w_before|| / ||w_before|| of the fp32 master weights, for one optimizer step.

Entries: "embedding" (the word embeddings, which are also the tied LM head, and their
LayerNorm), "block 0" ... "block L-1", "final_ln". Each rank takes its own range of every
segment of the engine's flat buffers, split by entry at the parameters' boundaries, and of it
only the ranges the global norm counts, so the entries' squares add up to the global norm's
square. Squares are summed in fp64, as the global norm's are (in fp32 they would drift by
~1e-6 relative with the layout), in three columns per entry (gradient, update, weight), then one
all-reduce over the world sums the ranks; at stage 0, where every dp rank holds the same
numbers, only dp rank 0 adds them.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.segments import clip_ranges

GRAD, UPDATE, WEIGHT = 0, 1, 2
_BLOCK = re.compile(r"^transformer\.h\.(\d+)\.")
CHUNK = 1 << 20  # elements per fp64 norm: bounds the temporaries, as the global norm's chunks


@dataclass
class GradStats:
    names: list[str]
    grad_norm: list[float]
    update_ratio: list[float]


def entry_names(num_blocks: int) -> list[str]:
    return ["embedding"] + [f"block {i}" for i in range(num_blocks)] + ["final_ln"]


def entry_of(name: str, num_blocks: int) -> int:
    """The entry of the parameter with logical (HF) name `name`."""
    m = _BLOCK.match(name)
    if m:
        return 1 + int(m.group(1))
    if name.startswith("transformer.word_embeddings"):  # the weight and its LayerNorm
        return 0
    if name.startswith("transformer.ln_f."):
        return num_blocks + 1
    raise ValueError(f"the gradient analyser has no entry for parameter {name}")


class Analyser:
    """This rank's ranges per entry, worked out once from the layout; `begin()` starts a step."""

    def __init__(self, bufs: FlatBuffers, topo, num_blocks: int):
        self.bufs, self.topo = bufs, topo
        self.names = entry_names(num_blocks)
        # Stage 0: every dp rank holds the same whole buffers, and dp rank 0 speaks for them.
        adds = bufs.rules.shard_optimizer or topo.dp_rank == 0
        # Per segment, (entry, a, b) in the coordinates of the own range (grad_view and
        # state_view), adjacent ranges of one entry merged.
        self.ranges: list[list[tuple[int, int, int]]] = []
        for seg in bufs.layout.segments:
            lo, hi = bufs.own(seg)
            out: list[tuple[int, int, int]] = []
            for piece in seg.pieces if adds else ():
                if not piece.counted:
                    continue
                entry = entry_of(piece.slot.spec.name, num_blocks)
                for a, b in clip_ranges([(piece.seg_start, piece.seg_start + piece.numel)],
                                           lo, hi):
                    if out and out[-1][0] == entry and out[-1][2] == a - lo:
                        out[-1] = (entry, out[-1][1], b - lo)
                    else:
                        out.append((entry, a - lo, b - lo))
            self.ranges.append(out)

    def begin(self, loss_scale: float | None) -> StepStats:
        return StepStats(self, loss_scale)


class StepStats:
    """The squares of one step, summed as the step goes, then reduced once by `finish()`."""

    def __init__(self, analyser: Analyser, loss_scale: float | None):
        self.a, self.loss_scale = analyser, loss_scale
        # (column, entry, norm) per range and chunk; stacked at the end (one kernel, not one
        # per range).
        self._norms: list[tuple[int, int, torch.Tensor]] = []

    def _add(self, column: int, entry: int, x: torch.Tensor,
             minus: torch.Tensor | None = None) -> None:
        """The norm of `x` (of `x - minus`, a chunk at a time) into `column` of `entry`."""
        for i in range(0, x.numel(), CHUNK):
            chunk = x[i:i + CHUNK] if minus is None else x[i:i + CHUNK] - minus[i:i + CHUNK]
            self._norms.append((column, entry,
                                torch.linalg.vector_norm(chunk, dtype=torch.float64)))

    def grads(self) -> None:
        """The reduced gradients (call before they are clipped or zeroed)."""
        bufs = self.a.bufs
        for seg, ranges in zip(bufs.layout.segments, self.a.ranges):
            g = bufs.grad_view(seg)
            for entry, a, b in ranges:
                self._add(GRAD, entry, g[a:b])

    @contextlib.contextmanager
    def update(self, seg):
        """Around the optimizer's update of segment `seg`: its master weights before and
        after. (Only the segment being updated is copied, at most one bucket: the optimizer
        steps segment by segment on an analysed step, which gives the bits of one call.)"""
        ranges = self.a.ranges[seg.index]
        if not ranges:
            yield
            return
        bufs = self.a.bufs
        master = bufs.state_view(bufs.master, seg)
        before = master.clone()
        yield
        for entry, a, b in ranges:
            self._add(WEIGHT, entry, before[a:b])
            self._add(UPDATE, entry, master[a:b], minus=before[a:b])

    def finish(self) -> GradStats:
        """Sum over the ranks (a collective: every rank calls it on the same step)."""
        a = self.a
        num = len(a.names)
        sums = torch.zeros(num * 3, dtype=torch.float64, device=a.bufs.device)
        by_device: dict[torch.device, list] = {}
        for column, entry, norm in self._norms:
            by_device.setdefault(norm.device, []).append((entry * 3 + column, norm))
        for items in by_device.values():  # the device's; the host's too under offload
            index = torch.tensor([i for i, _ in items], device=a.bufs.device)
            values = torch.stack([n for _, n in items]).square().to(a.bufs.device)
            sums.index_add_(0, index, values)
        comm.all_reduce(sums, comm.world_group(), "grad_stats")
        sq = sums.view(num, 3).tolist()
        scale = (self.loss_scale or 1.0) ** 2
        grad_norm = [(g / scale) ** 0.5 for g, _, _ in sq]
        ratio = [_ratio(u ** 0.5, w ** 0.5) for _, u, w in sq]
        return GradStats(a.names, grad_norm, ratio)


def _ratio(update: float, weight: float) -> float:
    if update == 0.0:
        return 0.0  # a skipped step, or an entry whose weights did not move
    return update / weight if weight > 0 else float("inf")
