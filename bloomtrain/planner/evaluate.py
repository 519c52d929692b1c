"""One layout of one workload on one cluster: its memory per pipeline rank, its communication per
step and its step time, each itemized.

Step time (Narayanan et al., arXiv 2104.04473, §3): a pipeline rank's time per micro-batch is its
compute (FLOPs at a calibrated fraction of peak) plus its tensor-parallel collectives and its
point-to-point sends, both on the critical path. The step is m such times of the slowest rank plus
the schedule's bubble ((p-1)/m of it for 1F1B, (p-1)/(v·m) interleaved), plus the data-parallel
reduction where our engine cannot hide it, plus the optimizer step. Which dp traffic is hidden is
the engine's (bloomtrain.parallel.zero.reduce): stages 0-1 reduce at the step, exposed; stages
2-3 reduce-scatter each micro-batch's gradients during its backward and stage 3 prefetches its
gathers, so only what outlasts the compute shows.

The `megatron-deepspeed` system models what BLOOM-176B ran (bloom_facts.md §6), so that the
planner can be checked against BLOOM's measured figures: BF16_Optimizer keeps every 16-bit
gradient of the stage until the step and all-reduces the fp32 gradients in buffers of 500M
elements (not a reduce-scatter), attention is unfused (Megatron's fused softmax), and neither
sequence parallelism nor selective recompute exists.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import BloomShape, megatron_tflops
from bloomtrain.parallel.pipeline.schedules import theoretical_bubble
from bloomtrain.planner import memory as mem
from bloomtrain.planner.hardware import (HOST_ADAM_GBS, PCIE_GBS, Cluster, ring_time)

SYSTEMS = ("bloomtrain", "megatron-deepspeed")
# DeepSpeed's `buffered_allreduce_fallback(elements_per_buffer=500000000)`: a flat fp32 copy of up
# to this many gradient elements exists during the step's all-reduce.
DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000
# CUDA context, cuBLAS workspaces and NCCL's buffers: outside torch's allocator, present on every
# GPU of a job (~0.5-1 GiB measured on A100/H100).
CONTEXT_BYTES = 2 ** 30
# The caching allocator's fragmentation over what is live: torch's reserved/allocated ratio in
# large-model training is typically 1.05-1.15; the planner adds this fraction of the peak.
ALLOCATOR_FRACTION = 0.08
# A layout fits when its worst stage needs at most (1 - HEADROOM) of the device: the margin for
# the planner's own error. Against BLOOM-176B's measured 59-60 GB it predicts 8% low.
HEADROOM = 0.10


@dataclass(frozen=True)
class Workload:
    """What is trained and how: the model, the batch, the numerics and kernels that size it."""

    shape: BloomShape
    seq: int
    global_batch: int
    compute_bytes: int = 2
    attention: str = "fused"       # fused | sdpa | unfused
    bucket_size_mb: float = 25.0
    mask_bytes: int = 1
    system: str = "bloomtrain"
    partition: str = "type:transformer|embedding"

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise UserError(f"system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if self.seq < 1 or self.global_batch < 1:
            raise UserError("--seq and --global-batch must be positive")


@dataclass(frozen=True)
class Candidate:
    """A layout: the parallel sizes and every choice that changes memory or time."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    zero_stage: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    offload: bool = False

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def layout(self, partition: str) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, dp=self.dp,
                              num_virtual_stages=self.virtual_stages,
                              sequence_parallel=self.sequence_parallel,
                              zero_stage=self.zero_stage, schedule=self.schedule,
                              partition=partition)

    def label(self) -> str:
        extra = "".join([f",v={self.virtual_stages}" if self.schedule == "interleaved" else "",
                         ",sp" if self.sequence_parallel else "",
                         ",offload" if self.offload else ""])
        sched = f",schedule={self.schedule}" if self.pp > 1 else ""
        return (f"tp={self.tp},pp={self.pp},dp={self.dp},mbs={self.micro_batch},"
                f"zero={self.zero_stage},recompute={self.recompute}{sched}{extra}")


@dataclass
class StageMemory:
    pp_rank: int
    num_blocks: int
    in_flight: tuple[int, ...]
    model_states: dict
    host: dict
    activations: dict            # bytes held at the backward peak, by item
    transients: dict             # step-phase and backward-phase extras, by item
    allocator: float = 0.0
    context: float = 0.0
    total: float = 0.0


@dataclass
class Plan:
    """A layout's record: what `bloomtrain plan` prints and `bloomtrain.plan()` returns."""

    layout: dict
    label: str
    fits: bool
    reason: str | None
    memory_per_gpu: float = 0.0           # the worst stage's total, bytes
    worst_stage: int = 0
    memory_limit: float = 0.0
    stages: list = field(default_factory=list)
    time: dict = field(default_factory=dict)
    step_time_s: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    days: float | None = None
    comm_bytes: dict = field(default_factory=dict)   # rank 0's, per "kind/group", per step

    def to_dict(self) -> dict:
        return asdict(self)


def rejected(cand: Candidate, reason: str) -> Plan:
    return Plan(layout=asdict(cand), label=cand.label(), fits=False, reason=reason)


# ---- flops ---------------------------------------------------------------------------------------
def block_forward_flops(shape: BloomShape, seq: int, micro_batch: int) -> float:
    """Matmul FLOPs of one block's forward on one micro-batch (Megatron's count: QKV, attention
    scores and context, projection, MLP)."""
    h, f, s, b = shape.hidden_size, shape.ffn_hidden_size, seq, micro_batch
    return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h


def core_forward_flops(shape: BloomShape, seq: int, micro_batch: int) -> float:
    return 4 * micro_batch * seq * seq * shape.hidden_size


def logits_forward_flops(shape: BloomShape, seq: int, micro_batch: int) -> float:
    return 2 * micro_batch * seq * shape.hidden_size * shape.vocab_size


def recompute_forward_flops(cand: Candidate, work: Workload) -> float:
    """FLOPs one block's recomputation repeats. Full: the block, less its last matmul under our
    engine: torch's non-reentrant checkpoint stops recomputing once every saved tensor is back,
    and nothing needs the 4h->h output (Megatron-DeepSpeed's reentrant one reruns it
    all). Selective: the attention core."""
    shape, s, b = work.shape, work.seq, cand.micro_batch
    if cand.recompute == "full":
        full = block_forward_flops(shape, s, b)
        if work.system == "megatron-deepspeed":
            return full
        return full - 2 * b * s * shape.hidden_size * shape.ffn_hidden_size
    if cand.recompute == "selective":
        return core_forward_flops(shape, s, b)
    return 0.0


def tp_collectives(cand: Candidate, work: Workload, blocks: int, first: bool,
                   last: bool) -> dict[str, int]:
    """[b, s, h] collectives over tp per micro-batch of one chunk, by kind (Megatron's f and g;
    with sequence parallelism each all-reduce is a reduce-scatter or all-gather and its
    conjugate). Per block: g after attention and after the MLP in forward, f before both in
    backward; the embedding's g (first stage) and the head's f (last). A full recompute repeats
    the forward's up to the last saved tensor: under our engine the attention's g (and, with
    sequence parallelism, both all-gathers and that reduce-scatter), not the MLP's; under
    Megatron-DeepSpeed's reentrant checkpoint both."""
    ends = int(first) + int(last)
    full = cand.recompute == "full"
    mds = work.system == "megatron-deepspeed"
    if cand.sequence_parallel:
        ag = blocks * (4 + (2 if full else 0)) + ends
        rs = blocks * (4 + ((2 if mds else 1) if full else 0)) + ends
        return {"all_gather": ag, "reduce_scatter": rs}
    return {"all_reduce": blocks * (4 + ((2 if mds else 1) if full else 0)) + ends}


# ---- the evaluation ------------------------------------------------------------------------------
def evaluate(cand: Candidate, work: Workload, cluster: Cluster, tokens: float | None = None,
             memory_limit: float | None = None) -> Plan:
    """The record of `cand`, with `fits` False and a reason when it cannot run or does not fit
    `memory_limit` bytes (default: the GPU's memory less HEADROOM)."""
    shape = work.shape
    limit = (cluster.gpu.memory_bytes * (1 - HEADROOM) if memory_limit is None
             else memory_limit)
    reason = _check(cand, work, cluster)
    if reason:
        return rejected(cand, reason)
    layout = cand.layout(work.partition)
    m = work.global_batch // (cand.micro_batch * cand.dp)
    stages = [stage_memory(cand, work, layout, r, m) for r in range(cand.pp)]
    worst = max(stages, key=lambda s: s.total)
    plan = Plan(layout=asdict(cand), label=cand.label(), fits=worst.total <= limit, reason=None,
                memory_per_gpu=worst.total, worst_stage=worst.pp_rank, memory_limit=limit,
                stages=[asdict(s) for s in stages])
    if not plan.fits:
        plan.reason = (f"out of memory on pipeline stage {worst.pp_rank}: needs "
                       f"{worst.total / 2 ** 30:.1f} GiB of {limit / 2 ** 30:.1f} GiB "
                       f"({(worst.total - limit) / 2 ** 30:.1f} GiB over)")
    plan.time = step_time(cand, work, cluster, layout, m)
    plan.step_time_s = plan.time["step_s"]
    n = cand.num_gpus
    plan.tflops_per_gpu = megatron_tflops(work.global_batch, work.seq, shape.num_layers,
                                          shape.hidden_size, shape.vocab_size, plan.step_time_s,
                                          n, cand.recompute == "full")
    model_tflops = megatron_tflops(work.global_batch, work.seq, shape.num_layers,
                                   shape.hidden_size, shape.vocab_size, plan.step_time_s, n,
                                   False)
    plan.mfu = model_tflops / cluster.gpu.peak_tflops
    plan.tokens_per_s = work.global_batch * work.seq / plan.step_time_s
    if tokens:
        plan.days = tokens / plan.tokens_per_s / 86400
    plan.comm_bytes = comm_bytes(cand, work, layout, 0, m)
    return plan


def _check(cand: Candidate, work: Workload, cluster: Cluster) -> str | None:
    """Why `cand` cannot run at all (None: it can)."""
    shape = work.shape
    if cand.num_gpus != cluster.num_gpus:
        return (f"tp*pp*dp = {cand.num_gpus}, not the {cluster.num_gpus} GPUs")
    if cand.tp > cluster.node_size:
        return (f"tp ({cand.tp}) is larger than a node ({cluster.node_size} GPUs): its "
                f"all-reduces would cross the network on every layer")
    if work.system == "megatron-deepspeed":
        if cand.sequence_parallel or cand.recompute == "selective" or cand.offload:
            return "megatron-deepspeed (2022) has no sequence parallelism, selective recompute " \
                   "or optimizer offload"
        if cand.zero_stage != 1 or cand.schedule != "1f1b":
            return "megatron-deepspeed with bf16 runs BF16_Optimizer (ZeRO-1) and 1F1B only"
    layout = cand.layout(work.partition)
    try:
        layout.check_tensor_parallel(shape, work.seq, shape.vocab_size)
        layout.check_pipeline(shape.num_layers)
        layout.num_micro_batches(work.global_batch, cand.micro_batch)
    except UserError as e:
        return str(e)
    return None


def activation_spec(cand: Candidate, work: Workload) -> mem.ActivationSpec:
    d = work.shape
    return mem.ActivationSpec(seq=work.seq, micro_batch=cand.micro_batch, tp=cand.tp,
                              sequence_parallel=cand.sequence_parallel,
                              compute_bytes=work.compute_bytes, attention=work.attention,
                              hidden_dropout=d.hidden_dropout > 0,
                              attention_dropout=d.attention_dropout > 0,
                              mask_bytes=work.mask_bytes)


def stage_memory(cand: Candidate, work: Workload, layout: ParallelLayout, pp_rank: int,
                 m: int) -> StageMemory:
    shape, c = work.shape, work.compute_bytes
    groups = mem.rank_groups(shape, layout, pp_rank)
    states = mem.model_states(groups, cand.zero_stage, cand.dp, c, cand.offload)
    a = activation_spec(cand, work)
    ranges = layout.stage_ranges(shape.num_layers)
    vstages = layout.virtual_stages(pp_rank)
    flight = mem.in_flight(cand.schedule if cand.pp > 1 else "1f1b", cand.pp, pp_rank, m,
                           cand.virtual_stages)
    acts: dict[str, float] = {}
    for vs, count in zip(vstages, flight):
        start, end = ranges[vs]
        items = mem.chunk_activation_items(shape, a, end - start, vs == 0,
                                           vs == layout.num_stages - 1, cand.recompute)
        for k, v in items.items():
            acts[k] = acts.get(k, 0.0) + v * count
    last_here = layout.num_stages - 1 in vstages
    backward = {
        "recompute_working_set": mem.recompute_working_set(shape, a, cand.recompute),
        "loss_working_set": mem.loss_working_set(shape, a) if last_here else 0.0,
    }
    psi = states["flat_numel"]
    if work.system == "megatron-deepspeed":
        backward["compute_grads"] = c * psi  # BF16_Optimizer keeps every 16-bit grad to the step
    else:
        backward["compute_grads"] = mem.compute_grads_held(groups, c)
    bucket = work.bucket_size_mb * 2 ** 20  # fp32 bytes of one reduction bucket
    if cand.zero_stage >= 2:
        backward["grad_staging"] = mem.STAGING_BUCKETS * bucket
    if cand.zero_stage == 3:
        backward["stage3_gathered"] = mem.stage3_working_set(groups, cand.dp, c)
    step = {}
    if work.system == "megatron-deepspeed":
        step["allreduce_buffer"] = 4 * min(psi, DEEPSPEED_ALLREDUCE_ELEMENTS)
    elif cand.zero_stage == 1 and cand.dp > 1:
        step["reduce_scatter_out"] = 4 * min(psi, bucket / 4) / cand.dp
    static = sum(states["device"].values())
    peak_dynamic = max(sum(acts.values()) + sum(backward.values()), sum(step.values()))
    live = static + peak_dynamic
    out = StageMemory(pp_rank=pp_rank, num_blocks=sum(ranges[v][1] - ranges[v][0]
                                                       for v in vstages),
                      in_flight=flight, model_states=states["device"], host=states["host"],
                      activations=acts, transients={**backward, **step})
    out.allocator = ALLOCATOR_FRACTION * live
    out.context = CONTEXT_BYTES
    out.total = live + out.allocator + out.context
    return out


# ---- communication -------------------------------------------------------------------------------
def comm_bytes(cand: Candidate, work: Workload, layout: ParallelLayout, pp_rank: int,
               m: int) -> dict[str, int]:
    """Bytes per step of rank (pp_rank, dp 0, tp 0), per "kind/group", counted as
    bloomtrain.parallel.comm counts them (an all-reduce its buffer, an all-gather its output, a
    reduce-scatter its input, a send or recv its tensor). Exact for our engine, except the
    sequence-parallel LayerNorm/bias gradient all-reduce under sharded ZeRO stages, taken as 1/dp
    of the stage's (it covers the part of those parameters in the rank's own range)."""
    shape, c, t = work.shape, work.compute_bytes, cand.tp
    s, b, h = work.seq, cand.micro_batch, shape.hidden_size
    out: dict[str, int] = {}

    def add(key, n):
        if n:
            out[key] = out.get(key, 0) + int(n)

    act = c * b * s * h                              # a full [b, s, h] activation
    p2p = act // t if cand.sequence_parallel else act
    ranges = layout.stage_ranges(shape.num_layers)
    groups = mem.rank_groups(shape, layout, pp_rank)
    for vs in layout.virtual_stages(pp_rank):
        blocks = ranges[vs][1] - ranges[vs][0]
        first, last = vs == 0, vs == layout.num_stages - 1
        if t > 1:
            for kind, n in tp_collectives(cand, work, blocks, first, last).items():
                add(f"{kind}/tp", m * n * act)
            if last:
                add("all_reduce/tp", m * 3 * 4 * b * s)   # vocab-parallel cross-entropy
        if cand.pp > 1:
            add("send/pp", m * p2p * ((not last) + (not first)))
            add("recv/pp", m * p2p * ((not last) + (not first)))
    if cand.pp > 1:
        add("broadcast/pp", 8)                          # the step's loss, float64
    states = mem.model_states(groups, cand.zero_stage, cand.dp, c, cand.offload)
    full = states["flat_numel"]
    if cand.sequence_parallel and t > 1:
        partial = sum(6 * h * (ranges[vs][1] - ranges[vs][0]) + 2 * h * (vs == 0)
                      + 2 * h * (vs == layout.num_stages - 1)
                      for vs in layout.virtual_stages(pp_rank))
        add("all_reduce/tp", 4 * partial // (cand.dp if cand.zero_stage >= 1 else 1))
    if cand.dp > 1:
        if cand.zero_stage == 0 or work.system == "megatron-deepspeed":
            add("all_reduce/dp", 4 * full)  # BF16_Optimizer all-reduces, then gathers (ZeRO-1)
        elif cand.zero_stage == 1:
            add("reduce_scatter/dp", 4 * full)
        else:
            add("reduce_scatter/dp", 4 * full * m)
        if cand.zero_stage in (1, 2):
            add("all_gather/dp", c * full)
        if cand.zero_stage == 3:
            add("all_gather/dp", stage3_gather_bytes(groups, cand, c, m))
        if cand.zero_stage >= 1:
            add("all_reduce/dp", 8)                      # the grad norm's partial sum, float64
        add("all_reduce/dp", 8)                          # the loss summed over dp, in fp64
    if t * cand.pp > 1:
        add("all_reduce/model", 8)                       # the grad norm over the replica
    if cand.pp > 1:
        tied = sum(mem.flat_numel([g], cand.dp, True) for g in groups if g.tied)
        add("all_reduce/emb", 4 * tied // (cand.dp if cand.zero_stage >= 1 else 1))
    if cand.num_gpus > 1:
        add("all_reduce/control", 4)                     # the stop flag, every step
    return out


def stage3_gather_bytes(groups, cand: Candidate, c: int, m: int) -> int:
    """Stage 3 gathers each unit for its forward and again for its backward, every micro-batch.
    With the head tied to the embedding on one stage (pp = 1) the embedding is gathered for the
    head's forward and backward too, and its own backward finds it still gathered: 3 uses."""
    per_micro = 0
    for g in groups:
        padded = mem.flat_numel([g], cand.dp, True)
        uses = 3 if g.shared else 2
        per_micro += uses * padded
    return c * per_micro * m


# ---- time ----------------------------------------------------------------------------------------
def step_time(cand: Candidate, work: Workload, cluster: Cluster, layout: ParallelLayout,
              m: int) -> dict:
    shape, c, t = work.shape, work.compute_bytes, cand.tp
    s, b, h = work.seq, cand.micro_batch, shape.hidden_size
    flops_per_s = cluster.flops_per_s(b * s)
    tp_link = cluster.group_link(t, 1)
    dp_link = cluster.group_link(cand.dp, t)
    pp_link = cluster.p2p_link(t * cand.dp)
    ranges = layout.stage_ranges(shape.num_layers)
    act = c * b * s * h
    p2p_bytes = act / t if cand.sequence_parallel else act
    blk = block_forward_flops(shape, s, b)
    per_rank = []
    for r in range(cand.pp):
        compute = tp_comm = p2p = 0.0
        fwd_total = 0.0
        for vs in layout.virtual_stages(r):
            blocks = ranges[vs][1] - ranges[vs][0]
            first, last = vs == 0, vs == layout.num_stages - 1
            fwd = blocks * blk + (logits_forward_flops(shape, s, b) if last else 0.0)
            extra = blocks * recompute_forward_flops(cand, work)
            compute += (3 * fwd + extra) / t / flops_per_s
            fwd_total += fwd / t / flops_per_s
            if t > 1:
                for kind, n in tp_collectives(cand, work, blocks, first, last).items():
                    tp_comm += n * ring_time(kind, act, t, tp_link)
                if last:
                    tp_comm += 3 * ring_time("all_reduce", 4 * b * s, t, tp_link)
            if cand.pp > 1:
                hops = (not first) + (not last)
                p2p += hops * (p2p_bytes / pp_link[0] + pp_link[1])
        per_rank.append({"compute": compute, "tp": tp_comm, "p2p": p2p, "forward": fwd_total})
    slowest = max(per_rank, key=lambda x: x["compute"] + x["tp"] + x["p2p"])
    per_micro = slowest["compute"] + slowest["tp"] + slowest["p2p"]
    bubble = theoretical_bubble(cand.schedule, cand.pp, m, cand.virtual_stages) * m * per_micro \
        if cand.pp > 1 else 0.0
    # Data parallelism, by what our engine overlaps (module doc).
    worst_groups = max((mem.rank_groups(shape, layout, r) for r in range(cand.pp)),
                       key=lambda g: sum(x.numel for x in g))
    full = mem.flat_numel(worst_groups, cand.dp, cand.zero_stage == 3)
    dp_exposed = 0.0
    if cand.dp > 1:
        if work.system == "megatron-deepspeed":
            dp_exposed = (ring_time("all_reduce", 4 * full, cand.dp, dp_link)
                          + ring_time("all_gather", c * full, cand.dp, dp_link))
        elif cand.zero_stage == 0:
            dp_exposed = ring_time("all_reduce", 4 * full, cand.dp, dp_link)
        elif cand.zero_stage == 1:
            dp_exposed = (ring_time("reduce_scatter", 4 * full, cand.dp, dp_link)
                          + ring_time("all_gather", c * full, cand.dp, dp_link))
        else:
            rs = ring_time("reduce_scatter", 4 * full, cand.dp, dp_link)
            backward = slowest["compute"] - slowest["forward"]
            if cand.zero_stage == 2:
                dp_exposed = m * max(0.0, rs - backward) + ring_time("all_gather", c * full,
                                                                    cand.dp, dp_link)
            else:
                gathers = 2 * ring_time("all_gather", c * full, cand.dp, dp_link)
                dp_exposed = m * max(0.0, rs + gathers - slowest["compute"])
    own = full // cand.dp if cand.zero_stage >= 1 else full
    # AdamW on the own range: read and write master, m, v (24 B), read the grad (4 B), write the
    # compute copy (c B), and the grad norm's read (4 B): memory bound.
    step_bytes = (32 + c) * own
    if cand.offload:
        optimizer = (step_bytes / (HOST_ADAM_GBS * 1e9)
                     + (4 + c) * own / (PCIE_GBS * 1e9))
    else:
        optimizer = step_bytes / (cluster.gpu.hbm_gbs * 1e9)
    pipeline = m * per_micro
    total = pipeline + bubble + dp_exposed + optimizer
    return {"compute_s": m * slowest["compute"], "tp_comm_s": m * slowest["tp"],
            "pp_p2p_s": m * slowest["p2p"], "bubble_s": bubble, "dp_comm_exposed_s": dp_exposed,
            "optimizer_s": optimizer, "step_s": total, "micro_batches": m,
            "efficiency": cluster.compute_efficiency}
