"""The 3D rank grid (Megatron-LM, arXiv 2104.04473, §3): `arange(world).view(pp, dp, tp)`.

Tensor-parallel ranks are innermost, so they are adjacent and land on one node (their all-reduces
sit on the critical path of every layer); pipeline stages are outermost and talk point to point
across nodes. One Topology object is built per process and passed explicitly; there are no module
globals. With one process every group is None and every collective is a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from bloomtrain.utils import UserError


@dataclass
class Topology:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    rank: int = 0
    # Process groups that contain this rank; None when the dimension has size 1 or there is no
    # process group at all.
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    # Ranks that hold a copy of the tied embedding (first and last pipeline stage, same dp/tp).
    embedding_group: object = None
    # tp x pp of one replica: every parameter of the model once (used for the global grad norm).
    model_group: object = None
    grid: torch.Tensor = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp_size * self.tp_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp, tp), or None on the first."""
        if self.is_first_stage:
            return None
        return int(self.grid[self.pp_rank - 1, self.dp_rank, self.tp_rank])

    @property
    def next_rank(self) -> int | None:
        if self.is_last_stage:
            return None
        return int(self.grid[self.pp_rank + 1, self.dp_rank, self.tp_rank])

    def coords(self) -> dict[str, int]:
        return dict(pp=self.pp_rank, dp=self.dp_rank, tp=self.tp_rank)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (pp {self.pp_rank}/{self.pp_size}, "
                f"dp {self.dp_rank}/{self.dp_size}, tp {self.tp_rank}/{self.tp_size})")

    @classmethod
    def single(cls) -> "Topology":
        return cls(grid=torch.zeros(1, 1, 1, dtype=torch.long))

    @classmethod
    def build(cls, tp: int, pp: int, timeout_minutes: float | None = None) -> "Topology":
        """Create every group of the grid. All ranks must call this together (new_group is
        collective), after init_process_group."""
        if not dist.is_initialized():
            if tp * pp != 1:
                raise UserError(f"parallel.tp={tp} and parallel.pp={pp} need {tp * pp} or more "
                                f"processes; launch with --nproc or torchrun")
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (tp * pp):
            raise UserError(f"world size {world} is not divisible by tp*pp ({tp}*{pp})")
        dp = world // (tp * pp)
        grid = torch.arange(world).view(pp, dp, tp)
        kw = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
        topo = cls(tp_size=tp, pp_size=pp, dp_size=dp, rank=rank, grid=grid)

        def make(rank_lists):
            mine = None
            for ranks in rank_lists:
                ranks = [int(r) for r in ranks]
                g = dist.new_group(ranks, **kw)  # collective: every rank creates every group
                if rank in ranks:
                    mine = g
            return mine

        topo.tp_group = make(grid[p, d, :] for p in range(pp) for d in range(dp)) if tp > 1 else None
        topo.dp_group = make(grid[p, :, t] for p in range(pp) for t in range(tp)) if dp > 1 else None
        topo.pp_group = make(grid[:, d, t] for d in range(dp) for t in range(tp)) if pp > 1 else None
        topo.embedding_group = (make([grid[0, d, t].item(), grid[-1, d, t].item()]
                                     for d in range(dp) for t in range(tp)) if pp > 1 else None)
        topo.model_group = (make(grid[:, d, :].flatten() for d in range(dp))
                            if tp * pp > 1 else None)
        return topo
