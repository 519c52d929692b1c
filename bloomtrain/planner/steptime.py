"""Step time of a layout (Narayanan et al., arXiv 2104.04473, §3): a pipeline rank's time per
micro-batch is its GEMMs, its memory-bound kernels, its host time where launches are synchronous,
its tensor-parallel collectives and its point-to-point sends, all on the critical path. The step
is m such times of the slowest rank, plus the schedule's bubble ((p-1)/m of it for 1F1B,
(p-1)/(v·m) interleaved), plus the data-parallel reduction where the engine cannot hide it, plus
the optimizer step. The rates are bloomtrain.planner.efficiency's fitted ones.

Where the systems differ (bloomtrain.planner.workload): the recompute (torch's non-reentrant
checkpoint stops before the block's last matmul; Megatron-DeepSpeed's reruns it all), the
attention (a fused causal kernel computes half the scores and stores none; the unfused one
writes, reads and drops out every score), the sends (ours batch each send with its receive;
DeepSpeed's pipeline blocks on each), the host (BLOOM's CUDA_LAUNCH_BLOCKING=1 puts every op's
host time on the device's critical path; asynchronous launches hide it) and the dp reduction
(ours: by ZeRO stage, with stages 2-3 overlapping the backward; BF16_Optimizer: an fp32
all-reduce and a bf16 all-gather after the last micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bloomtrain.parallel.pipeline.schedules import theoretical_bubble
from bloomtrain.planner import memory as mem
from bloomtrain.planner.efficiency import BLOCK_OPS, DROPOUT_OPS, OUTER_OPS
from bloomtrain.planner.hardware import HOST_ADAM_GBS, PCIE_GBS, Cluster, ring_time
from bloomtrain.planner.traffic import gather_ratio, reduce_ratio, tp_collectives


@dataclass
class RankTime:
    """Seconds per micro-batch on one pipeline rank, by term."""

    gemm: float = 0.0
    memory: float = 0.0
    host: float = 0.0
    tp: float = 0.0
    p2p: float = 0.0
    forward: float = 0.0     # the forward's share of gemm + memory (what stage 2 overlaps)

    def total(self, synchronous: bool) -> float:
        device = self.gemm + self.memory + self.tp + self.p2p
        return device + self.host if synchronous else max(device, self.host)


def synchronous(work, cluster: Cluster) -> bool:
    """Whether every op's host time is on the critical path: on a CPU, and under BLOOM's
    CUDA_LAUNCH_BLOCKING=1."""
    return cluster.gpu.kind == "cpu" or work.megatron


def linears(shape, tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of a block's tp-local GEMMs: [tokens, K] x [K, N]."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return [("qkv", h, 3 * h // tp), ("dense", h // tp, h), ("h4h", h, f // tp),
            ("4hh", f // tp, h)]


@lru_cache(maxsize=4096)
def block_gemm_seconds(shape, seq: int, micro_batch: int, tp: int, recompute: str,
                       system: str, attention: str, cluster: Cluster) -> tuple[float, float]:
    """(all, forward) GEMM seconds of one block and micro-batch."""
    eff, peak, wave = cluster.rates, cluster.peak_flops, cluster.gpu.wave

    def gemm(m, n, k, batch=1):
        return eff.gemm_seconds(m, n, k, peak, wave, batch)
    tokens = micro_batch * seq
    fwd = bwd = again = 0.0
    for name, k, n in linears(shape, tp):
        f = gemm(tokens, n, k)
        fwd += f
        bwd += gemm(tokens, k, n) + gemm(k, n, tokens)
        if recompute == "full" and (system == "megatron-deepspeed" or name != "4hh"):
            again += f
    heads, d = shape.num_heads // tp, shape.head_dim
    batch = micro_batch * heads
    full = attention in ("unfused", "eager")  # fused kernels skip the masked half and recompute
    causal = 1.0 if full else 0.5             # the scores in backward; these store them
    scores, context = gemm(seq, seq, d, batch) * causal, gemm(seq, d, seq, batch) * causal
    core_bwd = 2 * scores + 2 * context + (0.0 if full else scores)
    fwd += scores + context
    bwd += core_bwd
    # Selective recompute (bloomtrain.model.recompute) keeps every linear's output and a fused
    # kernel's: it replays only an unfused core's matmuls (a fused kernel with attention dropout,
    # recomputed for its RNG draw, is left out: no BLOOM config has attention dropout).
    if recompute == "full" or (recompute == "selective" and full):
        again += scores + context
    return fwd + bwd + again, fwd


def block_memory_bytes(shape, seq: int, micro_batch: int, tp: int, sp: bool, c: int,
                       mask_bytes: int, attention: str, dropout: tuple[bool, bool]) -> float:
    """Bytes the memory-bound kernels of one block's forward move: two LayerNorms, two
    bias-dropout-residual adds, the GeLU, and the unfused softmax and its dropout."""
    tokens = micro_batch * seq
    rep = tokens * shape.hidden_size / (tp if sp else 1)
    ffn = tokens * shape.ffn_hidden_size / tp
    hidden_drop, attn_drop = dropout
    out = 2 * 2 * c * rep + 2 * (3 * c + (mask_bytes if hidden_drop else 0)) * rep + 2 * c * ffn
    if attention in ("unfused", "eager"):
        scores = micro_batch * (shape.num_heads // tp) * seq * seq
        # eager's softmax writes float32 and its cast reads it back: 8 bytes more per score
        softmax = 2 * c + (8 if attention == "eager" else 0)
        out += (softmax + ((2 * c + mask_bytes) if attn_drop else 0)) * scores
    return out


def _passes(recompute: str) -> float:
    """Forward-equivalents of memory traffic per micro-batch: forward, backward (twice the
    forward's) and the recompute (full and selective both replay the memory-bound kernels)."""
    return 3.0 + (1.0 if recompute in ("full", "selective") else 0.0)


def rank_time(cand, work, cluster: Cluster, pp_rank: int) -> RankTime:
    """One pipeline rank's seconds per micro-batch, by term."""
    shape, layout = work.shape, cand.layout
    t, s, b, c = cand.tp, work.seq, cand.micro_batch, work.compute_bytes
    eff, hbm = cluster.rates, cluster.gpu.hbm_gbs * 1e9
    act = c * b * s * shape.hidden_size
    tp_link = cluster.group_link(t, 1)
    pp_link = cluster.p2p_link(t * cand.dp, cand.pp)
    # DeepSpeed's pipeline sends each tp rank's 1/tp of the activation and its gradient and
    # all-gathers them over tp at the receiver (pipe_partitioned, grad_partitioned: on by
    # default); our engine sends the whole tensor unless sequence parallelism shards it.
    partitioned = layout.sequence_parallel or (work.megatron and t > 1)
    p2p_bytes = act / t if partitioned else act
    regather = ring_time("all_gather", act, t, tp_link) if work.megatron else 0.0
    block_all, block_fwd = block_gemm_seconds(shape, s, b, t, cand.recompute, work.system,
                                              work.attention, cluster)
    drop = (shape.hidden_dropout > 0, shape.attention_dropout > 0)
    block_bytes = block_memory_bytes(shape, s, b, t, layout.sequence_parallel, c,
                                     work.mask_bytes, work.attention, drop)
    ops = _block_ops(cand.recompute, drop[0])
    ranges = layout.stage_ranges(shape.num_layers)
    out = RankTime()
    _add_accumulation(out, cand, work, cluster, pp_rank)
    for vs in layout.virtual_stages(pp_rank):
        blocks = ranges[vs][1] - ranges[vs][0]
        first, last = vs == 0, vs == layout.num_stages - 1
        out.gemm += blocks * block_all
        out.forward += blocks * (block_fwd + eff.memory_seconds(block_bytes, hbm))
        out.memory += eff.memory_seconds(blocks * block_bytes * _passes(cand.recompute), hbm)
        out.host += (blocks * ops + (first + last) * sum(OUTER_OPS.values()) / 2) * eff.op_s
        if last:
            _add_head(out, shape, b * s, t, c, cluster)
        if t > 1:
            for kind, n in tp_collectives(cand, work, blocks, first, last).items():
                out.tp += n * ring_time(kind, act, t, tp_link)
            if last:
                out.tp += 3 * ring_time("all_reduce", 4 * b * s, t, tp_link)
        if layout.pp > 1:
            hops = (not first) + (not last)
            transfers = hops * (2 if work.megatron else 1)
            out.p2p += transfers * (p2p_bytes / pp_link[0] + pp_link[1]) + hops * regather
    return out


def _add_accumulation(out: RankTime, cand, work, cluster: Cluster, pp_rank: int) -> None:
    """The accumulation loop: after each micro-batch's backward every 16-bit gradient is added
    into its fp32 accumulator (our engine's hooks, BF16_Optimizer's), reading the gradient and
    reading and writing the accumulator, one cast and one add per parameter; DeepSpeed's fp16
    ZeRO lets autograd accumulate in 16 bits."""
    groups, states = mem.rank_states(work.shape, cand.layout, pp_rank, work.system,
                                     work.precision, cand.offload)
    psi, c = states["flat_numel"], work.compute_bytes
    nbytes = 3 * c * psi if work.megatron and work.precision == "fp16" else (c + 8) * psi
    out.memory += cluster.rates.memory_seconds(nbytes, cluster.gpu.hbm_gbs * 1e9)
    out.host += 2 * sum(g.params for g in groups) * cluster.rates.op_s


def _block_ops(recompute: str, hidden_dropout: bool) -> int:
    keys = ("forward", "backward") + (("recompute",) if recompute != "none" else ())
    return sum(BLOCK_OPS[k] + (DROPOUT_OPS[k] if hidden_dropout else 0) for k in keys)


def _add_head(out: RankTime, shape, tokens: int, tp: int, c: int, cluster: Cluster) -> None:
    """The LM head's GEMMs and the cross-entropy's float32 softmax over the local vocabulary."""
    eff, peak, wave = cluster.rates, cluster.peak_flops, cluster.gpu.wave
    h, v = shape.hidden_size, shape.vocab_size // tp
    fwd = eff.gemm_seconds(tokens, v, h, peak, wave)
    out.gemm += fwd + eff.gemm_seconds(tokens, h, v, peak, wave) + eff.gemm_seconds(
        h, v, tokens, peak, wave)
    out.forward += fwd
    out.memory += eff.memory_seconds(3 * (c + 4) * tokens * v, cluster.gpu.hbm_gbs * 1e9)


def step_time(cand, work, cluster: Cluster, m: int) -> dict:
    """The step's seconds by term (the slowest rank's compute, tp, p2p; the bubble; the exposed
    dp reduction; the optimizer)."""
    sync = synchronous(work, cluster)
    ranks = {r: rank_time(cand, work, cluster, r)
             for r in mem.representative_ranks(cand.layout, work.shape.num_layers)}
    slowest = max(ranks.values(), key=lambda x: x.total(sync))
    per_micro = slowest.total(sync)
    layout = cand.layout
    bubble = (theoretical_bubble(layout.schedule, layout.pp, m, layout.num_virtual_stages)
              * m * per_micro if layout.pp > 1 else 0.0)
    full = max(mem.rank_states(work.shape, layout, r, work.system, work.precision,
                               cand.offload)[1]["flat_numel"] for r in ranks)
    dp = dp_exposed(cand, work, cluster, full, slowest, m) + tied_exposed(cand, work, cluster)
    optimizer = optimizer_seconds(cand, work, cluster, full)
    device = slowest.gemm + slowest.memory
    host = (slowest.host if sync else max(0.0, per_micro - (device + slowest.tp
                                                            + slowest.p2p)))
    return {"compute_s": m * device, "host_s": m * host, "tp_comm_s": m * slowest.tp,
            "pp_p2p_s": m * slowest.p2p, "bubble_s": bubble, "dp_comm_exposed_s": dp,
            "optimizer_s": optimizer, "step_s": m * per_micro + bubble + dp + optimizer,
            "micro_batches": m, "efficiency": cluster.compute_efficiency}


def dp_exposed(cand, work, cluster: Cluster, full: int, slowest: RankTime, m: int) -> float:
    """The data-parallel traffic the step waits for (module doc)."""
    if cand.dp <= 1:
        return 0.0
    c, z = work.compute_bytes, cand.zero_stage
    link = cluster.group_link(cand.dp, cand.tp)

    def ring(kind, nbytes):
        ratio = gather_ratio(cand, work) if kind == "all_gather" else reduce_ratio(cand, work)
        return ring_time(kind, nbytes * ratio, cand.dp, link)
    if work.megatron:
        if work.precision == "fp16":   # DeepSpeed's fp16 ZeRO: 16-bit gradients
            return ring("all_reduce", 2 * full) if z == 0 else (
                ring("reduce_scatter", 2 * full) + ring("all_gather", 2 * full))
        return ring("all_reduce", 4 * full) + ring("all_gather", c * full)
    if z == 0:
        return ring("all_reduce", 4 * full)
    if z == 1:
        return ring("reduce_scatter", 4 * full) + ring("all_gather", c * full)
    rs = ring("reduce_scatter", 4 * full)
    backward = slowest.gemm + slowest.memory - slowest.forward
    if z == 2:
        return m * max(0.0, rs - backward) + ring("all_gather", c * full)
    if cand.hpz:  # backward's gathers in the node, from hpZ's compute-dtype copy
        s = mem.secondary_size(cand, cluster.node_size)
        backward_gather = ring_time("all_gather", c * full, s, cluster.group_link(s, cand.tp))
    else:
        backward_gather = ring("all_gather", c * full)
    gathers = ring("all_gather", c * full) + backward_gather
    return m * max(0.0, rs + gathers - slowest.gemm - slowest.memory)


def tied_exposed(cand, work, cluster: Cluster) -> float:
    """The step's sum of the tied embedding's fp32 gradient over its two copies (first and last
    stage, on different nodes): whole under BF16_Optimizer, the own shard under our ZeRO 1-3."""
    if cand.pp <= 1:
        return 0.0
    groups, _ = mem.rank_states(work.shape, cand.layout, 0, work.system, work.precision,
                                cand.offload)
    tied = sum(mem.flat_numel([g], cand.dp, True) for g in groups if g.tied)
    if not work.megatron and cand.zero_stage >= 1:
        tied //= cand.dp
    link = cluster.p2p_link(cluster.num_gpus // cand.pp * (cand.pp - 1))
    return ring_time("all_reduce", 4 * tied, 2, link)


def optimizer_seconds(cand, work, cluster: Cluster, full: int) -> float:
    """AdamW on the rank's own range: read and write master, m and v (24 B), read the grad
    (4 B), write the compute copy (c B), and the grad norm's read (4 B): memory bound."""
    own = full // cand.dp if cand.zero_stage >= 1 else full
    c = work.compute_bytes
    step_bytes = (32 + c) * own
    if cand.offload:
        return step_bytes / (HOST_ADAM_GBS * 1e9) + (4 + c) * own / (PCIE_GBS * 1e9)
    return cluster.rates.memory_seconds(step_bytes, cluster.gpu.hbm_gbs * 1e9)
