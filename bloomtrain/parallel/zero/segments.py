"""Where every parameter of a rank lives in ZeRO's flat buffers. Pure: no tensors are allocated
and nothing is communicated, so the layout of any rank can be computed anywhere.

Parameters are laid out in *backward order* (the reverse of the forward order of their modules),
so the gradients of a reduction bucket arrive one after the other and a bucket's fp32 staging
lives only while backward passes through it. The sequence is cut into *segments* of at most
`bucket` elements (a multiple of dp), and a parameter may straddle two segments. A segment is the
unit of every bucketed collective and is sharded over the dp ranks on its own: its P elements
(padded to a multiple of dp at the end of a run) split into dp shards of S = P / dp, and dp rank r
owns [r·S, (r+1)·S).

Runs: the cuts restart (and padding is added) only where a run of parameters ends. Within a run
the segments are adjacent and unpadded, so every parameter is one contiguous range of the full
flat space and can be a view into a flat buffer. Runs end around a tied embedding copy (pp > 1:
the first stage's embedding and the last stage's LM head must shard identically, so that their
shards can be summed over the embedding group) and, under stage 3, at every *group*: the
parameters a module owns (a BloomBlock, the embedding, a LayerNorm, ...), gathered together.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: the planner sizes layouts without torch
    from torch import nn

    from bloomtrain.model.params import ParamSpec


@dataclass
class Slot:
    """One parameter: its place in the full flat space."""

    name: str
    param: nn.Parameter
    spec: ParamSpec
    full_off: int
    numel: int
    shape: tuple[int, ...]
    group: int


@dataclass
class Piece:
    """The part of a parameter inside one segment: [param_start, param_start + numel) of the
    flattened parameter is [seg_start, seg_start + numel) of the segment."""

    slot: Slot
    seg_start: int
    param_start: int
    numel: int
    counted: bool  # counts towards the global grad norm on this rank


@dataclass
class Segment:
    index: int
    pieces: list[Piece]
    numel: int
    padded: int       # P, a multiple of dp
    shard: int        # S = P / dp
    full_off: int     # offset in full-size flat buffers
    shard_off: int    # offset in shard-size flat buffers
    group: int
    tied: bool
    # Merged ranges in segment coordinates.
    decay: list[tuple[int, int]] = field(default_factory=list)
    counted: list[tuple[int, int]] = field(default_factory=list)
    tp_partial: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Group:
    """Parameters owned by one module, and the segments that hold them (stage 3 gathers a group
    with one buffer; in stages 0-2 groups only order the layout)."""

    index: int
    slots: list[Slot]
    segments: list[Segment] = field(default_factory=list)

    @property
    def full_off(self) -> int:
        return self.segments[0].full_off

    @property
    def padded(self) -> int:
        return sum(s.padded for s in self.segments)


@dataclass
class SegmentLayout:
    segments: list[Segment]
    groups: list[Group]
    slots: list[Slot]
    full_numel: int
    shard_numel: int


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _runs(groups: list[list], per_group: bool, tied: Callable) -> list[list]:
    """Items (slots) in backward order, cut into runs: at every group when `per_group`, and
    around every item that is a tied-embedding copy (`tied(item)`)."""
    runs: list[list] = [[]]
    for group in reversed(groups):
        if per_group and runs[-1]:
            runs.append([])
        for item in reversed(group):
            if tied(item):
                runs += [[item], []]
            else:
                runs[-1].append(item)
    return [r for r in runs if r]


def _segment_sizes(total: int, cap: int, dp: int) -> list[tuple[int, int, int]]:
    """(start, numel, padded) of the segments a run of `total` elements is cut into."""
    return [(start, min(cap, total - start), -(-min(cap, total - start) // dp) * dp)
            for start in range(0, total, cap)]


def _cap(dp: int, bucket: int) -> int:
    return max(dp, bucket // dp * dp)


def bucket_elements(bucket_size_mb: float) -> int:
    """fp32 elements of one bucket of `parallel.bucket_size_mb`: the segments' cap."""
    return max(1, int(bucket_size_mb * 2 ** 20 / 4))


def segment_sizes(groups: list[list[tuple[int, bool]]], dp: int, bucket: int,
                  per_group: bool) -> list[int]:
    """The padded size P of every segment `build_layout` makes for `groups` (each a module's
    parameters as (numel, is a tied-embedding copy), in forward order), without the parameters:
    what the planner sizes a rank with."""
    runs = _runs(groups, per_group, tied=lambda item: item[1])
    return [padded for run in runs
            for _, _, padded in _segment_sizes(sum(n for n, _ in run), _cap(dp, bucket), dp)]


def flat_sizes(groups: list[list[tuple[int, bool]]], dp: int, bucket: int,
               per_group: bool) -> int:
    """Elements of the full-size flat buffers for `groups` (segment_sizes' sum). The shards are
    this / dp."""
    return sum(segment_sizes(groups, dp, bucket, per_group))


def build_layout(groups: list[list[tuple[str, nn.Parameter, ParamSpec]]], dp: int, tp_rank: int,
                 bucket: int, per_group: bool) -> SegmentLayout:
    """Lay out `groups` (each a module's (name, param, spec) in forward order; the groups in
    forward order) for `dp` ranks in segments of at most `bucket` elements."""
    cap = _cap(dp, bucket)
    slot_groups = [Group(g, [Slot(n, p, s, -1, p.numel(), tuple(p.shape), g) for n, p, s in ps])
                   for g, ps in enumerate(groups)]
    segments: list[Segment] = []
    full_off = shard_off = 0
    for run in _runs([g.slots for g in slot_groups], per_group, tied=lambda s: s.spec.tied):
        total = sum(s.numel for s in run)
        for slot, start in zip(run, _prefix_sums(run)):
            slot.full_off = full_off + start
        for seg_start, numel, padded in _segment_sizes(total, cap, dp):
            seg = _segment(len(segments), run, seg_start, numel, padded, dp, tp_rank)
            seg.full_off, seg.shard_off = full_off, shard_off
            full_off += padded
            shard_off += padded // dp
            segments.append(seg)
            slot_groups[seg.group].segments.append(seg)
    # Stage 3 gathers a group with one buffer, so its segments must be adjacent: they are, since
    # a run is one group then. Otherwise a group may be spread; only its slots matter.
    slots = [s for g in slot_groups for s in g.slots]
    return SegmentLayout(segments, slot_groups, slots, full_off, shard_off)


def _prefix_sums(run: list[Slot]) -> list[int]:
    out, acc = [], 0
    for s in run:
        out.append(acc)
        acc += s.numel
    return out


def _segment(index: int, run: list[Slot], seg_start: int, numel: int, padded: int, dp: int,
             tp_rank: int) -> Segment:
    pieces, run_off = [], 0
    for slot in run:
        a, b = max(seg_start, run_off), min(seg_start + numel, run_off + slot.numel)
        if a < b:
            counted = not slot.spec.tied_copy and not (slot.spec.tp_replicated and tp_rank != 0)
            pieces.append(Piece(slot, a - seg_start, a - run_off, b - a, counted))
        run_off += slot.numel
    seg = Segment(index, pieces, numel, padded, padded // dp, 0, 0, group=pieces[-1].slot.group,
                  tied=any(p.slot.spec.tied for p in pieces))
    span = [(p.seg_start, p.seg_start + p.numel) for p in pieces]
    seg.decay = _merge([r for r, p in zip(span, pieces) if p.slot.spec.weight_decay])
    seg.counted = _merge([r for r, p in zip(span, pieces) if p.counted])
    seg.tp_partial = _merge([r for r, p in zip(span, pieces) if p.slot.spec.tp_partial_grad])
    return seg


def clip_ranges(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `ranges` inside [lo, hi)."""
    return [(max(a, lo), min(b, hi)) for a, b in ranges if max(a, lo) < min(b, hi)]
