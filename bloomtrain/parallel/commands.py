"""Rank 0 drives, the other ranks follow: the one command protocol of the jobs in which one rank
decides what every rank runs (bloomtrain eval: the harness on global rank 0, every rank of any
layout running its forwards; bloomtrain serve --nproc: the scheduler on the tp group's first
rank, its peers running each step's shards).

A command is a header of five int64, (op, three sizes the op reads, the payload's length), then
an int64 payload of that length, both broadcast from the group's first rank. The driver calls
`send` before running the command itself; the others loop in `follow`, running each command
they receive until STOP. Without a group (one process) nothing is sent: the driver just runs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from bloomtrain.parallel import comm

STOP = 0
Sizes = tuple[int, int, int]


class Commands:
    """One group's command channel; `name` labels its collectives (comm's counts and errors)."""

    def __init__(self, group, name: str):
        self.group, self.name = group, name
        self.src = 0 if group is None else _first_global_rank(group)

    def send(self, op: int, sizes: Sizes = (0, 0, 0), payload: torch.Tensor | None = None
             ) -> None:
        n = 0 if payload is None else payload.numel()
        comm.broadcast(torch.tensor([op, *sizes, n], dtype=torch.int64), self.src, self.group,
                       self.name)
        if n:
            comm.broadcast(payload.reshape(-1), self.src, self.group, self.name)

    def stop(self) -> None:
        self.send(STOP)

    def receive(self) -> tuple[int, Sizes, torch.Tensor]:
        head = torch.empty(5, dtype=torch.int64)
        comm.broadcast(head, self.src, self.group, self.name)
        op, a, b, c, n = head.tolist()
        payload = torch.empty(n, dtype=torch.int64)
        if n:
            comm.broadcast(payload, self.src, self.group, self.name)
        return op, (a, b, c), payload


def follow(commands: Commands, run: Callable[[int, Sizes, torch.Tensor], None]) -> int:
    """A follower's loop: run(op, sizes, payload) for every command until STOP; returns how
    many ran."""
    count = 0
    while True:
        op, sizes, payload = commands.receive()
        if op == STOP:
            return count
        run(op, sizes, payload)
        count += 1


def _first_global_rank(group) -> int:
    return dist.get_global_rank(group, 0)
