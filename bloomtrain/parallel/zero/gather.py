"""ZeRO-3's parameter gathering (arXiv 1910.02054): a unit's compute weights exist only while it
runs. A *unit* is each BloomBlock as a whole and every other module that owns parameters directly
(the embedding, its LayerNorm, ln_f, an untied LM head). The waits for the gathers of a training
step are timed by the engine's WaitClock (waits.py): under stage 3 they are where a slow dp peer
makes the others wait.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero import compress
from bloomtrain.parallel.zero.buffers import FlatBuffers
from bloomtrain.parallel.zero.memory import Counters
from bloomtrain.parallel.zero.waits import WaitClock

DP = "dp"


@dataclass
class Unit:
    module: nn.Module
    groups: list[int]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def secondary_group(topo, per_node: int):
    """hpZ's group: the ranks of this rank's dp group on its node (nodes of `per_node` ranks,
    numbered as the launcher does: global rank // per_node). Collective: every rank makes every
    group. Refused unless every dp group has the same number s >= 2 of ranks on each node."""
    import torch.distributed as dist

    from bloomtrain.errors import UserError
    mine = None
    for groups in topo.layout.dp_groups_by_node(per_node):
        for node_ranks in groups:
            g = dist.new_group(node_ranks) if len(node_ranks) > 1 else None
            if topo.rank in node_ranks:
                mine = g
    if problem := topo.layout.secondary_shard_problem(per_node):  # validate said it first
        raise UserError(problem)
    return mine


class Stage3Gatherer:
    """Before a unit runs forward, the groups of parameters it uses are all-gathered over dp into
    their buffers, cast from the fp32 master shards on the way (no compute-dtype copy is kept
    beside the master; under ZeRO-Offload, whose masters are on the host, from the device's
    compute-dtype copy of the own shard); after its forward they are released (storage resized
    to 0). Backward gathers them again from a hook on the unit's outputs and releases them when
    their last gradient has arrived. The first forward records the order of units; from then on
    the next unit's gather is prefetched while the current one computes (the previous one's in
    backward). Recomputation runs a unit's forward inside backward: its weights are kept, since
    its backward comes next.

    `wire` (parallel.weight_gather_dtype): auto gathers in the compute dtype; bf16 or int8
    (ZeRO++'s qwZ, blockwise absmax) encode each shard for the collective and decode the
    gathered bytes into the compute dtype (compress.py). Every rank, the shard's owner too,
    computes with the decoded weights, so the replicas stay equal; the masters are untouched."""

    def __init__(self, bufs: FlatBuffers, topo, counters: Counters, units: list[Unit],
                 prefetch: bool = True, on_backward=None, waits: WaitClock | None = None,
                 wire: str = "auto", secondary=None):
        self.bufs, self.topo, self.counters = bufs, topo, counters
        # hpZ: the node-local part of the dp group, and this rank's copies by group index.
        self.secondary = secondary
        self._secondary: dict[int, torch.Tensor] = {}
        plain = (wire == "auto" or topo.dp_group is None
                 or (wire == "bf16" and bufs.compute_dtype == torch.bfloat16))
        self.wire = None if plain else wire
        self.waits = waits or WaitClock(bufs.device)
        # Called when backward reaches a unit: the end of that backward frees what it gathered,
        # even if no parameter gradient arrives in it.
        self.on_backward = on_backward
        self.units, self.prefetch = units, prefetch
        self._gathered: set[int] = set()
        self._pending: dict[int, tuple[object, list[torch.Tensor]]] = {}
        self._forward_order: list[Unit] = []
        self._order_done = False

    def hooks(self) -> list:
        handles = []
        for unit in self.units:
            handles.append(unit.module.register_forward_pre_hook(
                lambda m, args, u=unit: self._pre_forward(u)))
            handles.append(unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self._post_forward(u, out)))
        return handles

    # ---- gather and free -------------------------------------------------------------------------
    def gather(self, g: int, async_op: bool = False) -> None:
        if g in self._gathered:
            if not async_op:
                self._wait(g)
            return
        if g in self._secondary and _in_backward():
            self._gather_secondary(g, async_op)
            return
        bufs = self.bufs
        group, buf = bufs.layout.groups[g], bufs.gathered[g]
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.counters.gathered(buf.numel() * buf.element_size())
        handles, casts = [], []
        # Under offload the masters are in host memory; the device keeps their compute-dtype
        # cast (offload.py refreshes it after every step), so a gather never reads the host.
        source = bufs.master if bufs.compute_shard is None else bufs.compute_shard
        for seg in group.segments:
            out = buf[seg.full_off - group.full_off:][:seg.padded]
            # Without offload the compute-dtype shard exists only for the collective. A
            # compressed gather encodes it too, not the fp32 master: what an offloaded run's
            # device holds, so that offload changes no bits (int8's absmax scales of fp32
            # values differed from those of their bf16 cast).
            shard = bufs.state_view(source, seg).to(bufs.compute_dtype)
            if self.wire is not None:
                with contextlib.nullcontext() if async_op else self._stall():
                    handles.append(compress.all_gather(out, shard, self.topo.dp_group, DP,
                                                       self.wire, async_op=async_op))
                casts.append(shard)
                continue
            with contextlib.nullcontext() if async_op else self._stall():
                handles.append(comm.all_gather_into_tensor(out, shard, self.topo.dp_group, DP,
                                                           async_op=async_op))
            casts.append(shard)
        self._gathered.add(g)
        if async_op:
            self._pending[g] = (handles, casts)

    def _pieces(self, g: int):
        """(segment's slice of the gathered buffer, its node-local 1/s, this rank's part of the
        secondary copy) per segment of group `g`."""
        group, buf = self.bufs.layout.groups[g], self.bufs.gathered[g]
        s, k = comm.group_size(self.secondary), comm.group_rank(self.secondary)
        off = 0
        for seg in group.segments:
            full = buf[seg.full_off - group.full_off:][:seg.padded]
            c = seg.padded // s
            yield full, full[k * c:(k + 1) * c], (off, c)
            off += c

    def _keep_secondary(self, g: int) -> None:
        group = self.bufs.layout.groups[g]
        copy = self._secondary.get(g)
        if copy is None:
            n = group.padded // comm.group_size(self.secondary)
            copy = self._secondary[g] = torch.empty(n, dtype=self.bufs.compute_dtype,
                                                    device=self.bufs.device)
        for _, part, (off, c) in self._pieces(g):
            copy[off:off + c].copy_(part)

    def _gather_secondary(self, g: int, async_op: bool) -> None:
        buf = self.bufs.gathered[g]
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.counters.gathered(buf.numel() * buf.element_size())
        handles = []
        for full, _, (off, c) in self._pieces(g):
            with contextlib.nullcontext() if async_op else self._stall():
                handles.append(comm.all_gather_into_tensor(
                    full, self._secondary[g][off:off + c], self.secondary, "dp_node",
                    async_op=async_op))
        self._gathered.add(g)
        if async_op:
            self._pending[g] = (handles, [])

    def _wait(self, g: int) -> None:
        handles, _ = self._pending.pop(g, ((), ()))
        handles = [h for h in handles if h is not None]
        if handles:
            with self._stall():
                for h in handles:
                    h.wait()

    def _stall(self):
        # An evaluation's forward (no grad, outside backward) is not part of a training step;
        # without dp peers there is nothing to wait for.
        timed = self.topo.dp_group is not None and (torch.is_grad_enabled() or _in_backward())
        return self.waits.waiting() if timed else contextlib.nullcontext()

    def free(self, g: int) -> None:
        if g not in self._gathered:
            return
        self._wait(g)
        buf = self.bufs.gathered[g]
        buf.untyped_storage().resize_(0)
        self._gathered.discard(g)
        self.counters.gathered(-buf.numel() * buf.element_size())

    # ---- hooks -----------------------------------------------------------------------------------
    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if not self._order_done:
            return None
        i = next((k for k, u in enumerate(self._forward_order) if u is unit), None)
        if i is None or not 0 <= i + step < len(self._forward_order):
            return None
        return self._forward_order[i + step]

    def _prefetch(self, unit: Unit | None) -> None:
        if unit is None or not self.prefetch:
            return
        for g in unit.groups:
            if g not in self._gathered:
                self.counters.num_prefetches += 1
                self.gather(g, async_op=True)

    def _pre_forward(self, unit: Unit) -> None:
        in_backward = _in_backward()
        if not in_backward and not self._order_done:
            # The first forward records the order of units; a unit seen twice means the pass
            # has wrapped around.
            if any(u is unit for u in self._forward_order):
                self._order_done = True
            else:
                self._forward_order.append(unit)
        for g in unit.groups:
            self.gather(g)
        if not in_backward:
            self._prefetch(self._neighbour(unit, +1))

    def _post_forward(self, unit: Unit, output) -> None:
        if _in_backward():
            return  # recomputation: backward needs these weights next
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._pre_backward(u))
            if self.secondary is not None:
                for g in unit.groups:
                    self._wait(g)
                    self._keep_secondary(g)
        for g in unit.groups:
            self.free(g)

    def _pre_backward(self, unit: Unit) -> None:
        if self.on_backward is not None:
            self.on_backward()
        for g in unit.groups:
            self.gather(g)
        self._prefetch(self._neighbour(unit, -1))
