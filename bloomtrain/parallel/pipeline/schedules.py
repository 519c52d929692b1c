"""Pipeline schedules (Narayanan et al., arXiv 2104.04473 §2.2): GPipe, 1F1B (PipeDream-flush)
and interleaved 1F1B as plain functions that list a rank's forward/backward ops in named warmup /
steady / cooldown phases, the messages of each op, and `schedule_grid`, which replays those lists
under unit costs: that is where the bubble of a schedule is counted.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from bloomtrain.config import PipelineSchedule
from bloomtrain.layout import check_micro_batches


class Op(NamedTuple):
    kind: str  # "F" (forward) or "B" (backward)
    chunk: int  # model chunk on this rank; virtual stage = chunk * pp + pp_rank
    micro_batch: int
    phase: str  # "warmup", "steady" or "cooldown"


def gpipe_schedule(pp_size: int, pp_rank: int, num_micro: int, num_chunks: int = 1) -> list[Op]:
    """GPipe (Huang et al. 2019): every forward, then every backward. There is no steady phase;
    every rank stashes the activations of all m micro-batches."""
    warmup = [Op("F", 0, i, "warmup") for i in range(num_micro)]
    cooldown = [Op("B", 0, i, "cooldown") for i in range(num_micro)]
    return warmup + cooldown


def one_f_one_b_schedule(pp_size: int, pp_rank: int, num_micro: int,
                         num_chunks: int = 1) -> list[Op]:
    """PipeDream-flush (1F1B): rank r runs pp - r - 1 forwards to fill the pipeline, then
    alternates one forward and one backward, then drains the outstanding backwards. The bubble
    is GPipe's, but a rank stashes at most pp - r micro-batches of activations, not m."""
    num_warmup = min(pp_size - pp_rank - 1, num_micro)
    warmup = [Op("F", 0, i, "warmup") for i in range(num_warmup)]
    steady = []
    for i in range(num_micro - num_warmup):
        steady += [Op("F", 0, num_warmup + i, "steady"), Op("B", 0, i, "steady")]
    cooldown = [Op("B", 0, i, "cooldown") for i in range(num_micro - num_warmup, num_micro)]
    return warmup + steady + cooldown


def interleaved_schedule(pp_size: int, pp_rank: int, num_micro: int,
                         num_chunks: int = 2) -> list[Op]:
    """Megatron's interleaved 1F1B: each rank holds v model chunks and works through the
    micro-batches in groups of pp, running a group through chunk 0, then chunk 1, ... (and
    backwards through the chunks in reverse). A forward or backward costs 1/v of a
    non-interleaved one, so the fill and drain shrink v-fold: bubble (p-1)/(v·m), for v times
    the point-to-point traffic. Needs m % pp == 0 so that every group is full."""
    check_micro_batches(num_micro, pp_size, "interleaved")
    group = pp_size * num_chunks
    total = num_micro * num_chunks

    def forward(k: int, phase: str) -> Op:
        chunk = (k % group) // pp_size
        return Op("F", chunk, (k // group) * pp_size + k % pp_size, phase)

    def backward(k: int, phase: str) -> Op:
        chunk = num_chunks - 1 - (k % group) // pp_size
        return Op("B", chunk, (k // group) * pp_size + k % pp_size, phase)

    # Enough forwards that the first backward's gradient can arrive: the v-1 chunk rounds ahead
    # of the last chunk, plus twice the distance to the last rank (there and back).
    num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    warmup = [forward(k, "warmup") for k in range(num_warmup)]
    steady = []
    for k in range(total - num_warmup):
        steady += [forward(num_warmup + k, "steady"), backward(k, "steady")]
    cooldown = [backward(k, "cooldown") for k in range(total - num_warmup, total)]
    return warmup + steady + cooldown


# Keyed by the names of config.PipelineSchedule, each of which this table implements
# (tests/test_structure.py checks that it covers them).
SCHEDULES: dict[PipelineSchedule, Callable[..., list[Op]]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_schedule,
}


def theoretical_bubble(schedule: str, pp_size: int, num_micro: int,
                       num_virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time (arXiv 2104.04473 §2.2): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved."""
    v = num_virtual_stages if schedule == "interleaved" else 1
    return (pp_size - 1) / (v * num_micro)


def op_p2p(op: Op, pp_size: int, pp_rank: int, num_chunks: int):
    """The messages of `op`: (recv, send), each None or (peer pp rank, "activation"|"gradient",
    receiving virtual stage). A forward receives its input from the previous virtual stage and
    sends its output to the next; a backward receives the output's gradient from the next and
    sends the input's gradient to the previous."""
    vs = op.chunk * pp_size + pp_rank
    last = pp_size * num_chunks - 1
    prev_rank, next_rank = (pp_rank - 1) % pp_size, (pp_rank + 1) % pp_size
    if op.kind == "F":
        recv = (prev_rank, "activation", vs) if vs > 0 else None
        send = (next_rank, "activation", vs + 1) if vs < last else None
    else:
        recv = (next_rank, "gradient", vs) if vs < last else None
        send = (prev_rank, "gradient", vs - 1) if vs > 0 else None
    return recv, send


def schedule_grid(schedule: str, pp_size: int, num_micro: int, num_virtual_stages: int = 1,
                  forward_cost: int = 1, backward_cost: int = 2) -> list[list[tuple[int, Op]]]:
    """Replay every rank's op list under unit costs (a forward of one model chunk costs
    `forward_cost`, a backward `backward_cost`: the usual 2x, since a backward computes the grads
    of both the input and the weights) and free communication. Returns, per stage, the
    (start slot, op) pairs. An op starts when its rank is free and its input is there: the
    previous virtual stage's forward of the micro-batch, or the next one's backward. Raises if
    the op lists deadlock."""
    v = num_virtual_stages
    orders = [SCHEDULES[schedule](pp_size, r, num_micro, v) for r in range(pp_size)]
    last = pp_size * v - 1
    done: dict[tuple[str, int, int], int] = {}
    grid: list[list[tuple[int, Op]]] = [[] for _ in range(pp_size)]
    pos, free = [0] * pp_size, [0] * pp_size
    while any(pos[r] < len(orders[r]) for r in range(pp_size)):
        progressed = False
        for r in range(pp_size):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                vs = op.chunk * pp_size + r
                if op.kind == "F":
                    deps = [("F", vs - 1, op.micro_batch)] if vs > 0 else []
                else:
                    deps = [("F", vs, op.micro_batch)]
                    deps += [("B", vs + 1, op.micro_batch)] if vs < last else []
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + (forward_cost if op.kind == "F" else backward_cost)
                done[(op.kind, vs, op.micro_batch)] = free[r]
                grid[r].append((start, op))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp_size) if pos[r] < len(orders[r])}
            raise RuntimeError(f"schedule {schedule} (pp={pp_size}, m={num_micro}, v={v}) "
                               f"deadlocks; next ops: {stuck}")
    return grid


def grid_bubble(grid: list[list[tuple[int, Op]]], forward_cost: int = 1,
                backward_cost: int = 2) -> float:
    """Bubble time over compute time of the busiest stage, counted from the grid's slots."""
    cost = {"F": forward_cost, "B": backward_cost}
    makespan = max(start + cost[op.kind] for row in grid for start, op in row)
    busy = max(sum(cost[op.kind] for _, op in row) for row in grid)
    return (makespan - busy) / busy
