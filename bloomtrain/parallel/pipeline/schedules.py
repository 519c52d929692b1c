"""Pipeline schedules (Narayanan et al., arXiv 2104.04473 §2.2): GPipe, 1F1B (PipeDream-flush)
and interleaved 1F1B, and ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241
§3.1), as plain functions that list a rank's forward/backward ops in named warmup / steady /
cooldown phases, the messages of each op, and `schedule_grid`, which replays those lists under
per-op costs: that is where the bubble of a schedule is counted.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from bloomtrain.config import PipelineSchedule
from bloomtrain.layout import check_micro_batches


class Op(NamedTuple):
    # "F" (forward) or "B" (backward); under zb-h1 "B" is the input gradient only and "W" the
    # deferred weight gradients of the same micro-batch.
    kind: str
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


def zb_h1_schedule(pp_size: int, pp_rank: int, num_micro: int, num_chunks: int = 1) -> list[Op]:
    """ZB-H1 (arXiv 2401.10241 §3.1): 1F1B with each backward split into B (the input's gradient,
    on the critical path to the previous stage) and W (the weights' gradients, needed by nobody
    until the optimizer step). Rank r keeps 1F1B's pp - r - 1 warm-up forwards and then runs
    F, B, W per micro-batch, but holds back its W passes by r micro-batches, so the last ranks'
    W fill their warm-up and cool-down waits. A micro-batch is in flight from its F to its W, so
    every rank has at most min(pp, m) micro-batches in flight, 1F1B's first-stage count; from B
    to W it holds only what W needs (weightgrad), less than its activations, so no rank's peak
    exceeds 1F1B's largest, its first stage's (ZB-H1's bound, over stages: rank r > 0 holds more
    than under 1F1B). Rank 0 holds back nothing: its op list is 1F1B's with each W right after
    its B. Bubble with m >= pp: (p-1)(T_F + T_B - T_W), against 1F1B's (p-1)(T_F + T_B + T_W)."""
    num_warmup = min(pp_size - pp_rank - 1, num_micro)
    warmup = [Op("F", 0, i, "warmup") for i in range(num_warmup)]
    steady, cooldown, held = [], [], []

    def backward(i: int, phase: list, name: str, hold: int) -> None:
        phase.append(Op("B", 0, i, name))
        held.append(i)
        if len(held) > hold:
            phase.append(Op("W", 0, held.pop(0), name))

    for i in range(num_micro - num_warmup):
        steady.append(Op("F", 0, num_warmup + i, "steady"))
        backward(i, steady, "steady", pp_rank)
    for i in range(num_micro - num_warmup, num_micro):
        backward(i, cooldown, "cooldown", pp_rank)
    cooldown += [Op("W", 0, i, "cooldown") for i in held]
    return warmup + steady + cooldown


# Schedules whose backward is split into B (input gradient) and W (weight gradients).
SPLIT_BACKWARD = frozenset({"zb-h1"})

# Keyed by the names of config.PipelineSchedule, each of which this table implements
# (tests/infra/test_structure.py checks that it covers them).
SCHEDULES: dict[PipelineSchedule, Callable[..., list[Op]]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_schedule,
    "zb-h1": zb_h1_schedule,
}


def theoretical_bubble(schedule: str, pp_size: int, num_micro: int,
                       num_virtual_stages: int = 1, costs: dict | None = None) -> float:
    """Bubble time over ideal compute time (arXiv 2104.04473 §2.2): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved. ZB-H1 (arXiv 2401.10241 §3.1, m >= p): the paper's
    (p-1)(T_F + T_B - T_W) over m(T_F + T_B + T_W), which is (p-1)/(3m) when the three passes
    cost the same (`costs`, as op_costs gives them; default that). The paper's term assumes
    T_W <= T_F, T_B; in general the replay of our op lists gives (p-1)·max(T_F, T_B,
    T_F + T_B - T_W): the last stage still waits (p-1)·T_F for its first input and the first
    stage (p-1)·T_B for its last gradient. With m < p the replay (schedule_grid) is the
    measure, and is what this returns there (the closed form under-counted it: 0.50 for 0.83
    at p=4, m=2, and the planner ranked such layouts too high)."""
    if schedule in SPLIT_BACKWARD and num_micro < pp_size:
        return replayed_bubble(schedule, pp_size, num_micro, num_virtual_stages, costs)
    if schedule in SPLIT_BACKWARD:
        c = costs or op_costs(schedule)
        per_stage = max(c["F"], c["B"], c["F"] + c["B"] - c["W"])
        return (pp_size - 1) * per_stage / (num_micro * (c["F"] + c["B"] + c["W"]))
    v = num_virtual_stages if schedule == "interleaved" else 1
    return (pp_size - 1) / (v * num_micro)


def replayed_bubble(schedule: str, pp_size: int, num_micro: int, num_virtual_stages: int = 1,
                    costs: dict | None = None) -> float:
    """Bubble time over ideal compute time from the replay of the op lists (schedule_grid): the
    longest stage's span less its ops' time, over that time."""
    c = costs or op_costs(schedule)
    grid = schedule_grid(schedule, pp_size, num_micro, num_virtual_stages, c)
    span = max(start + c[op.kind] for ops in grid for start, op in ops)
    work = sum(c[op.kind] for _, op in grid[0])
    return (span - work) / work


def op_costs(schedule: str, forward: float = 1.0, backward_input: float = 1.0,
             backward_weight: float = 1.0) -> dict[str, float]:
    """Per-op costs for schedule_grid: the three passes' times (default: equal, the usual
    backward = 2 x forward split evenly between the input and the weight gradients). Schedules
    that do not split the backward run B as the sum of both parts."""
    if schedule in SPLIT_BACKWARD:
        return {"F": forward, "B": backward_input, "W": backward_weight}
    return {"F": forward, "B": backward_input + backward_weight, "W": 0.0}


def peak_in_flight(ops: list[Op], num_chunks: int = 1) -> int:
    """The most micro-batches whose activations a rank holds at once under its op list: from a
    forward to the op that frees them, the backward, or W where the backward is split."""
    release = "W" if any(op.kind == "W" for op in ops) else "B"
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1 if op.kind == release else 0
        peak = max(peak, live)
    return peak


def op_p2p(op: Op, pp_size: int, pp_rank: int, num_chunks: int):
    """The messages of `op`: (recv, send), each None or (peer pp rank, "activation"|"gradient",
    receiving virtual stage). A forward receives its input from the previous virtual stage and
    sends its output to the next; a backward receives the output's gradient from the next and
    sends the input's gradient to the previous."""
    if op.kind == "W":
        return None, None  # local: the weights' gradients from what B left
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
                  costs: dict[str, float] | None = None) -> list[list[tuple[float, Op]]]:
    """Replay every rank's op list under per-op `costs` ({"F", "B", "W"}: seconds or slots;
    default op_costs(schedule): a forward 1, a backward 2, split 1 + 1 where the schedule splits
    it) and free communication. Returns, per stage, the (start, op) pairs. An op starts when its
    rank is free and its input is there: the previous virtual stage's forward of the
    micro-batch, or the next one's backward (W: this stage's own B). Raises if the op lists
    deadlock."""
    v = num_virtual_stages
    cost = costs or op_costs(schedule)
    orders = [SCHEDULES[schedule](pp_size, r, num_micro, v) for r in range(pp_size)]
    last = pp_size * v - 1
    done: dict[tuple[str, int, int], float] = {}
    grid: list[list[tuple[float, Op]]] = [[] for _ in range(pp_size)]
    pos, free = [0] * pp_size, [0.0] * pp_size
    while any(pos[r] < len(orders[r]) for r in range(pp_size)):
        progressed = False
        for r in range(pp_size):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                vs = op.chunk * pp_size + r
                if any(d not in done for d in _deps(op, vs, last)):
                    break
                start = max([free[r]] + [done[d] for d in _deps(op, vs, last)])
                free[r] = start + cost[op.kind]
                done[(op.kind, vs, op.micro_batch)] = free[r]
                grid[r].append((start, op))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp_size) if pos[r] < len(orders[r])}
            raise RuntimeError(f"schedule {schedule} (pp={pp_size}, m={num_micro}, v={v}) "
                               f"deadlocks; next ops: {stuck}")
    return grid


def _deps(op: Op, vs: int, last: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", vs - 1, op.micro_batch)] if vs > 0 else []
    if op.kind == "W":
        return [("B", vs, op.micro_batch)]
    return [("F", vs, op.micro_batch)] + ([("B", vs + 1, op.micro_batch)] if vs < last else [])


def grid_bubble(grid: list[list[tuple[float, Op]]], costs: dict[str, float] | None = None) -> float:
    """Bubble time over compute time of the busiest stage, counted from the grid's slots (with the
    costs the grid was replayed under)."""
    cost = costs or op_costs("zb-h1" if any(op.kind == "W" for row in grid for _, op in row)
                             else "1f1b")
    makespan = max(start + cost[op.kind] for row in grid for start, op in row)
    busy = max(sum(cost[op.kind] for _, op in row) for row in grid)
    return (makespan - busy) / busy
