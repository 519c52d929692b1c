"""The bytes a layout's step sends, per kind of collective and group, counted as
bloomtrain.parallel.comm counts them (an all-reduce its buffer, an all-gather its output, a
reduce-scatter its input, a send or recv its tensor): exact for our engine, and the collective
counts the step time prices."""
from __future__ import annotations

from bloomtrain.parallel.zero import wire
from bloomtrain.planner import memory as mem


def reduce_ratio(cand, work) -> float:
    """Wire bytes of the dp gradient reduction per byte of fp32's: bf16 1/2, int8 (1 + 4/128)/4
    (an fp32 scale per 128 values; wire.encoded_bytes), times the workload's own ratio."""
    n = wire.BLOCK
    dtype = cand.grad_reduce
    ratio = 1.0 if dtype == "fp32" else wire.encoded_bytes(n, dtype) / (4 * n)
    return ratio * work.dp_reduce_bytes_ratio


def gather_ratio(cand, work) -> float:
    """Wire bytes of ZeRO-3's weight gather per byte of the compute dtype's (int8: (1 + 4/128)/2
    of bf16's)."""
    n, dtype = wire.BLOCK, cand.weight_gather
    ratio = (1.0 if dtype == "auto"
             else wire.encoded_bytes(n, dtype) / (work.compute_bytes * n))
    return ratio * work.dp_gather_bytes_ratio



def tp_collectives(cand, work, blocks: int, first: bool, last: bool) -> dict[str, int]:
    """[b, s, h] collectives over tp per micro-batch of one chunk, by kind (Megatron's f and g;
    with sequence parallelism each all-reduce is a reduce-scatter or all-gather and its
    conjugate). Per block: g after attention and after the MLP in forward, f before both in
    backward; the embedding's g (first stage) and the head's f (last). A full recompute repeats
    the forward's up to the last saved tensor: under our engine the attention's g (and, with
    sequence parallelism, both all-gathers and that reduce-scatter), not the MLP's; under
    Megatron-DeepSpeed's reentrant checkpoint both. Selective replays the same collectives as
    full under our engine: they write in place, so its policy recomputes them."""
    ends = int(first) + int(last)
    full = cand.recompute in ("full", "selective")
    again = (2 if work.megatron else 1) if full else 0
    if cand.layout.sequence_parallel:
        ag = blocks * (4 + (2 if full else 0)) + ends
        rs = blocks * (4 + again) + ends
        return {"all_gather": ag, "reduce_scatter": rs}
    return {"all_reduce": blocks * (4 + again) + ends}


def comm_bytes(cand, work, pp_rank: int, m: int) -> dict[str, int]:
    """Bytes per step of rank (pp_rank, dp 0, tp 0), per "kind/group". Exact for our engine,
    except the sequence-parallel LayerNorm/bias gradient all-reduce under sharded ZeRO stages,
    taken as 1/dp of the stage's (it covers the part of those parameters in the rank's own
    range)."""
    out: dict[str, int] = {}

    def add(key, n):
        if n:
            out[key] = out.get(key, 0) + int(n)
    _model_parallel(add, cand, work, pp_rank, m)
    _data_parallel(add, cand, work, pp_rank, m)
    if cand.tp * cand.pp > 1:
        add("all_reduce/model", 8)                       # the grad norm over the replica
    if cand.num_gpus > 1:
        add("all_reduce/control", 4)                     # the stop flag, every step
    return out


def _model_parallel(add, cand, work, pp_rank: int, m: int) -> None:
    """tp's collectives, pp's sends, and the sequence-parallel gradient sums."""
    shape, c, t, layout = work.shape, work.compute_bytes, cand.tp, cand.layout
    s, b, h = work.seq, cand.micro_batch, shape.hidden_size
    act = c * b * s * h                              # a full [b, s, h] activation
    # DeepSpeed's pipeline sends 1/tp of each tensor (steptime.rank_time)
    p2p = act // t if layout.sequence_parallel or (work.megatron and t > 1) else act
    ranges = layout.stage_ranges(shape.num_layers)
    for vs in layout.virtual_stages(pp_rank):
        first, last = vs == 0, vs == layout.num_stages - 1
        if t > 1:
            blocks = ranges[vs][1] - ranges[vs][0]
            for kind, n in tp_collectives(cand, work, blocks, first, last).items():
                add(f"{kind}/tp", m * n * act)
            if last:
                add("all_reduce/tp", m * 3 * 4 * b * s)   # vocab-parallel cross-entropy
        if cand.pp > 1:
            add("send/pp", m * p2p * ((not last) + (not first)))
            add("recv/pp", m * p2p * ((not last) + (not first)))
    if cand.pp > 1:
        add("broadcast/pp", 8)                          # the step's loss, float64
    if layout.sequence_parallel and t > 1:
        partial = sum(6 * h * (ranges[vs][1] - ranges[vs][0]) + 2 * h * (vs == 0)
                      + 2 * h * (vs == layout.num_stages - 1)
                      for vs in layout.virtual_stages(pp_rank))
        add("all_reduce/tp", 4 * partial // (cand.dp if cand.zero_stage >= 1 else 1))


def _data_parallel(add, cand, work, pp_rank: int, m: int) -> None:
    """dp's reduction and gathers, and the tied embedding's sum over its two copies."""
    c, z = work.compute_bytes, cand.zero_stage
    groups, states = mem.rank_states(work.shape, cand.layout, pp_rank, work.system,
                                     work.precision, cand.offload)
    full = states["flat_numel"]
    if cand.dp > 1:
        _reduction(add, cand, work, full, m)
        if z in (1, 2):
            add("all_gather/dp", c * full)
        if z == 3:
            forward, backward = stage3_gather_bytes(groups, cand.dp, c, m)
            ratio = gather_ratio(cand, work)
            add("all_gather/dp", forward * ratio)
            add("all_gather/dp_node" if cand.hpz else "all_gather/dp",
                backward * (1.0 if cand.hpz else ratio))  # hpZ's node copy: compute dtype
        if z >= 1:
            add("all_reduce/dp", 8)                      # the grad norm's partial sum, float64
        add("all_reduce/dp", 8)                          # the loss summed over dp, in fp64
    if cand.pp > 1:
        tied = sum(mem.flat_numel([g], cand.dp, True) for g in groups if g.tied)
        # Whole under Megatron's BF16_Optimizer, the own shard under our ZeRO 1-3 (steptime's
        # tied_exposed prices the same).
        add("all_reduce/emb", 4 * tied // (cand.dp if z >= 1 and not work.megatron else 1))


def _reduction(add, cand, work, full: int, m: int) -> None:
    """The fp32 gradient sum over dp: plain collectives in fp32; bf16/int8 (compress.py) as an
    all-to-all of the encoded chunks (and, at stage 0, an all-gather of the encoded sums), their
    bytes the ratio of fp32's (exact for bf16; int8 less the padding of each chunk's last
    block)."""
    z = cand.zero_stage
    if work.megatron and work.precision == "fp16":  # DeepSpeed's fp16 ZeRO: 16-bit gradients
        add("all_reduce/dp" if z == 0 else "reduce_scatter/dp", 2 * full)
        return
    if cand.grad_reduce != "fp32" and not work.megatron:
        wire = reduce_ratio(cand, work) * 4 * full
        add("all_to_all/dp", wire * (m if z >= 2 else 1))
        if z == 0:
            add("all_gather/dp", wire)
        return
    if z == 0 or work.megatron:
        add("all_reduce/dp", 4 * full)  # BF16_Optimizer all-reduces, then gathers (ZeRO-1)
    elif z == 1:
        add("reduce_scatter/dp", 4 * full)
    else:
        add("reduce_scatter/dp", 4 * full * m)


def stage3_gather_bytes(groups, dp: int, c: int, m: int) -> tuple[int, int]:
    """(forward's, backward's) bytes: stage 3 gathers each unit for its forward and again for its
    backward, every micro-batch. With the head tied to the embedding on one stage (pp = 1) the
    embedding is gathered for the head's forward too, and for the head's backward, whose
    gathered copy the embedding's own backward then uses: 3 uses, 2 in forward."""
    forward = sum((2 if g.shared else 1) * mem.padded(g.numel, dp) for g in groups)
    backward = sum(mem.padded(g.numel, dp) for g in groups)
    return c * forward * m, c * backward * m
