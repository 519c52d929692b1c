"""The process groups of one rank, built from a ParallelLayout (bloomtrain.layout).

One Topology object is built per process and passed explicitly; no module globals hold
groups (the package's module state is the allow-list in tests/structure.py).
Sizes and coordinates come from the layout, so a Topology without process groups
(`Topology.describe_rank`) still says exactly which pieces a rank holds: every group is None and
every collective on it is a no-op, which is also what one process sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from bloomtrain.layout import ParallelLayout, RankCoords
from bloomtrain.errors import UserError


@dataclass
class Topology:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0
    # Process groups that contain this rank; None when the dimension has size 1, or when this
    # Topology only describes a rank (no process group at all).
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    # Ranks that hold a copy of the tied embedding (first and last pipeline stage, same dp/tp).
    embedding_group: object = None
    # tp x pp of one replica: every parameter of the model once (used for the global grad norm).
    model_group: object = None

    @property
    def coords(self) -> RankCoords:
        return self.layout.coords(self.rank)

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline stage `pp_rank` in this rank's pipeline (same dp, tp)."""
        c = self.coords
        return self.layout.rank_of(pp_rank, c.dp, c.tp)

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    def describe(self) -> str:
        c = self.coords
        return (f"rank {self.rank}/{self.world_size} (pp {c.pp}/{self.pp_size}, "
                f"dp {c.dp}/{self.dp_size}, tp {c.tp}/{self.tp_size})")

    @classmethod
    def single(cls) -> "Topology":
        return cls()

    @classmethod
    def describe_rank(cls, layout: ParallelLayout, rank: int) -> "Topology":
        """Rank `rank` of `layout` without process groups: for building its parts on the meta
        device, or planning, on one process."""
        layout.coords(rank)  # in range
        return cls(layout=layout, rank=rank)

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, timeout_minutes: float | None = None,
              layout: ParallelLayout | None = None) -> "Topology":
        """Create every group of the grid (of `layout`, or of tp x pp over the world). All ranks
        must call this together (new_group is collective), after init_process_group."""
        if not dist.is_initialized():
            layout = layout or ParallelLayout(tp=tp, pp=pp)
            if layout.world_size != 1:
                raise UserError(f"parallel.tp={layout.tp} and parallel.pp={layout.pp} need "
                                f"{layout.tp * layout.pp} or more processes; launch with --nproc "
                                f"or torchrun")
            return cls(layout=layout)  # one process: the config's ZeRO stage, schedule, ...
        world = dist.get_world_size()
        layout = layout or ParallelLayout.for_world(world, tp, pp)
        if layout.world_size != world:
            raise UserError(f"the layout tp={layout.tp} x pp={layout.pp} x dp={layout.dp} does "
                            f"not match the {world} processes of the job")
        kw = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
        topo = cls(layout=layout, rank=dist.get_rank())

        def make(rank_lists, size):
            if size == 1:
                return None
            mine = None
            for ranks in rank_lists:
                g = dist.new_group(ranks, **kw)  # collective: every rank creates every group
                if topo.rank in ranks:
                    mine = g
            return mine

        topo.tp_group = make(layout.tp_groups(), layout.tp)
        topo.dp_group = make(layout.dp_groups(), layout.dp)
        topo.pp_group = make(layout.pp_groups(), layout.pp)
        topo.embedding_group = make(layout.embedding_groups(), layout.pp)
        topo.model_group = make(layout.model_groups(), layout.tp * layout.pp)
        return topo
