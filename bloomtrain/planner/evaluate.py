"""One layout of one workload on one cluster: its memory per pipeline rank
(bloomtrain.planner.memory), its communication per step (traffic) and its step time (steptime),
each itemized, with the step time's error band from the fit (efficiency)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bloomtrain.errors import UserError
from bloomtrain.layout import BatchSchedule
from bloomtrain.model.presets import megatron_tflops
from bloomtrain.planner import host
from bloomtrain.planner import memory as mem
from bloomtrain.planner.hardware import Cluster
from bloomtrain.planner.steptime import step_time
from bloomtrain.planner.traffic import comm_bytes
from bloomtrain.planner.workload import SYSTEMS, Candidate, Workload

__all__ = ["SYSTEMS", "Candidate", "Workload", "Plan", "evaluate", "check", "layout_reason",
           "HEADROOM"]

# A layout fits when its worst stage needs at most (1 - HEADROOM) of the device: the margin for
# the planner's own error (docs/planner_fit.md: within 8% of every measured memory).
HEADROOM = 0.10


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
    step_time_band_s: tuple = (0.0, 0.0)  # the fit's 1-sigma band around step_time_s
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    days: float | None = None
    comm_bytes: dict = field(default_factory=dict)   # rank 0's, per "kind/group", per step
    ties: list = field(default_factory=list)         # ranks (1-based) within each other's band
    # Offload: the host bytes of the node that needs the most, by item (planner.host), and
    # what a node may use of its host memory.
    host_per_node: dict = field(default_factory=dict)
    host_limit: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def rejected(cand: Candidate, reason: str, memory: float = 0.0, limit: float = 0.0) -> Plan:
    return Plan(layout=cand.record(), label=cand.label(), fits=False, reason=reason,
                memory_per_gpu=memory, memory_limit=limit)


def limit_of(cluster: Cluster, limit: float | None) -> float:
    """The bytes a layout may use: `limit`, or the device's memory less HEADROOM."""
    return cluster.gpu.memory_bytes * (1 - HEADROOM) if limit is None else limit


def evaluate(cand: Candidate, work: Workload, cluster: Cluster, tokens: float | None = None,
             memory_limit: float | None = None, all_stages: bool = True) -> Plan:
    """The record of `cand`, with `fits` False and a reason when it cannot run or does not fit
    `memory_limit` bytes (default: the device's memory less HEADROOM). `all_stages=False` sizes
    only the ranks that can be the largest (memory.representative_ranks), as a search does."""
    limit = limit_of(cluster, memory_limit)
    reason = check(cand, work, cluster)
    if reason:
        return rejected(cand, reason)
    m = cand.layout.num_micro_batches(work.global_batch, cand.micro_batch)
    ranks = (range(cand.pp) if all_stages
             else mem.representative_ranks(cand.layout, work.shape.num_layers))
    stages = [mem.stage_memory(cand, work, r, m, cluster.gpu.context_bytes, cluster.node_size)
              for r in ranks]
    worst = max(stages, key=lambda s: s.total)
    plan = Plan(layout=cand.record(), label=cand.label(), fits=worst.total <= limit,
                reason=None, memory_per_gpu=worst.total, worst_stage=worst.pp_rank,
                memory_limit=limit, stages=[asdict(s) for s in stages])
    if not plan.fits:
        plan.reason = over_reason(worst.pp_rank, worst.total, limit)
    if cand.offload:
        node = host_of(cand, work, cluster)
        plan.host_per_node = {**node.items, "total": node.total}
        plan.host_limit = cluster.host_bytes * (1 - HEADROOM)
        if plan.fits and node.total > plan.host_limit:
            plan.fits = False
            plan.reason = host_reason(node.total, plan.host_limit)
    if plan.fits or all_stages:  # a search keeps no time for what it rejects
        _time(plan, cand, work, cluster, m, tokens)
    return plan



def host_of(cand: Candidate, work: Workload, cluster: Cluster) -> host.NodeHost:
    return host.worst_node(work.shape, cand.layout, cluster.node_size, work.precision,
                           work.bucket_size_mb, work.offload_pin_memory, cluster.gpu.kind,
                           cand.error_feedback)


def host_reason(total: float, limit: float) -> str:
    return (f"out of host memory: offload needs {total / 2 ** 30:.1f} GiB per node of "
            f"{limit / 2 ** 30:.1f} GiB ({(total - limit) / 2 ** 30:.1f} GiB over; "
            f"--host-memory-gib sets a node's)")


def over_reason(pp_rank: int, total: float, limit: float) -> str:
    return (f"out of memory on pipeline stage {pp_rank}: needs {total / 2 ** 30:.1f} GiB of "
            f"{limit / 2 ** 30:.1f} GiB ({(total - limit) / 2 ** 30:.1f} GiB over)")


def _time(plan: Plan, cand: Candidate, work: Workload, cluster: Cluster, m: int,
          tokens: float | None) -> None:
    shape = work.shape
    plan.time = step_time(cand, work, cluster, m)
    t = plan.step_time_s = plan.time["step_s"]
    band = cluster.rates.band_factor
    plan.step_time_band_s = (t / band, t * band)
    n = cand.num_gpus
    args = (work.global_batch, work.seq, shape.num_layers, shape.hidden_size, shape.vocab_size,
            t, n)
    plan.tflops_per_gpu = megatron_tflops(*args, cand.recompute == "full")
    plan.mfu = megatron_tflops(*args, False) / cluster.gpu.peak_tflops
    plan.tokens_per_s = work.global_batch * work.seq / t
    if tokens:
        plan.days = tokens / plan.tokens_per_s / 86400
    plan.comm_bytes = comm_bytes(cand, work, 0, m)


def check(cand: Candidate, work: Workload, cluster: Cluster) -> str | None:
    """Why `cand` cannot run at all (None: it can)."""
    reason = layout_reason(cand, work, cluster)
    if reason:
        return reason
    try:
        cand.layout.num_micro_batches(work.global_batch, cand.micro_batch)
    except UserError as e:
        return str(e)
    if work.rampup:  # `bloomtrain train` runs every batch size of the ramp-up too
        batches = BatchSchedule(work.global_batch, cand.micro_batch, cand.layout, work.rampup)
        return batches.ramp_problem()
    return None


def layout_reason(cand: Candidate, work: Workload, cluster: Cluster) -> str | None:
    """Why `cand`'s layout cannot run whatever its micro-batch (None: it can): what a search
    asks once per layout, before sizing any of its variants."""
    shape, layout = work.shape, cand.layout
    if cand.num_gpus != cluster.num_gpus:
        return f"tp*pp*dp = {cand.num_gpus}, not the {cluster.num_gpus} GPUs"
    if cand.tp > cluster.node_size:
        return (f"tp ({cand.tp}) is larger than a node ({cluster.node_size} GPUs): its "
                f"all-reduces would cross the network on every layer")
    if work.megatron:
        if layout.sequence_parallel or cand.recompute == "selective" or cand.offload:
            return ("megatron-deepspeed (2022) has no sequence parallelism, selective recompute "
                    "or optimizer offload")
        if layout.schedule != "1f1b" or cand.zero_stage > 1 or (
                work.precision != "fp16" and cand.zero_stage != 1):
            return ("megatron-deepspeed runs 1F1B, with BF16_Optimizer (ZeRO-1) in bf16 or "
                    "DeepSpeed's ZeRO 0-1 in fp16")
    problems = (layout.tensor_parallel_problems(shape, work.seq, work.vocab_multiple)
                + layout.pipeline_problems(shape.num_layers)
                + layout.training_problems(cand.grad_reduce, cand.weight_gather, work.compile))
    return problems[0] if problems else None
