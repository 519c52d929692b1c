"""Layout search: every layout of a cluster, the fitting ones ranked by step time (with which are
within each other's error band), the others kept with the reason they cannot run. A layout whose
model states alone do not fit is rejected with all its micro-batch and recompute variants before
any of them is evaluated, so that a search where nothing fits costs what one that fits does.
When nothing fits, the error names the smallest change that would (more GPUs, a larger GPU)."""
from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.kernel_choice import EAGER_MAX_SEQ, flex_pays
from bloomtrain.model.presets import resolve_model_config
from bloomtrain.planner import memory as mem
from bloomtrain.planner.evaluate import (Plan, evaluate, layout_reason, limit_of,
                                         rejected)
from bloomtrain.planner.hardware import GPUS, Cluster
from bloomtrain.planner.workload import (RECOMPUTE, ZERO_STAGES, Candidate, Workload,
                                         matches, parse_pairs)
from bloomtrain.progress import ProgressLine

MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 4)


@dataclass
class SearchResult:
    plans: list[Plan]                      # fitting, fastest first
    rejected: list[Plan]                   # with .reason
    cluster: Cluster
    workload: Workload
    evaluated: int = 0
    reasons: dict = field(default_factory=dict)   # reason kind -> count

    @property
    def best(self) -> Plan:
        return self.plans[0]


def config_shape(cfg: Config):
    """The model a config trains: its shape with the tokenizer's vocabulary when it names one
    (as training resolves it; a run directory's config.yaml leaves model.vocab_size to it),
    else model.vocab_size."""
    if cfg.data.tokenizer:
        from bloomtrain.data.tokenizer import load_tokenizer
        return resolve_model_config(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size)
    return resolve_model_config(cfg.model, cfg.model.vocab_size or None)


def workload_from_config(cfg: Config, seq: int | None = None, global_batch: int | None = None,
                         system: str = "bloomtrain", device: str = "cuda",
                         shape=None) -> Workload:
    """The workload of a config (its model, batch, precision, kernels) on `device`; `shape`
    when the run already resolved it (its vocabulary from the tokenizer)."""
    shape = shape or config_shape(cfg)
    t = cfg.train
    if system == "megatron-deepspeed":
        attention = "unfused"
    elif t.attention == "eager" or (t.attention == "auto" and device == "cpu"
                                    and t.precision in ("bf16", "fp16")
                                    and (seq if seq is not None else cfg.data.seq_length)
                                    <= EAGER_MAX_SEQ):
        attention = "eager"  # what resolve_attention picks there
    elif t.attention == "flex" or (t.attention == "auto" and device == "cuda"
                                   and shape.attention_dropout == 0
                                   and flex_pays(shape.head_dim)):
        attention = "fused"
    else:
        # SDPA with the ALiBi bias tensor (CUDA: its efficient kernel; CPU without dropout:
        # fused too; CPU with attention dropout: the math path, not modelled).
        attention = "sdpa"
    c = 4 if t.precision == "fp32" else 2
    return Workload(shape=shape, seq=seq if seq is not None else cfg.data.seq_length,
                    global_batch=global_batch if global_batch is not None
                    else t.global_batch_size, precision=t.precision,
                    attention=attention, bucket_size_mb=cfg.parallel.bucket_size_mb,
                    mask_bytes=1 if device == "cuda" else c, system=system,
                    partition=cfg.parallel.pp_partition,
                    offload_pin_memory=cfg.parallel.offload_pin_memory,
                    vocab_multiple=cfg.model.make_vocab_size_divisible_by,
                    compile=t.compile, rampup=None if t.rampup_batch_size is None
                    else tuple(t.rampup_batch_size))


def config_compression(cfg: Config) -> dict:
    """The config's dp wire formats, as Candidate's fields."""
    p = cfg.parallel
    return {"grad_reduce": p.grad_reduce_dtype, "error_feedback": p.grad_error_feedback,
            "weight_gather": p.weight_gather_dtype, "hpz": p.zero_secondary_shard}


def candidate_from_config(cfg: Config, world_size: int) -> Candidate:
    t = cfg.train
    return Candidate(ParallelLayout.from_config(cfg.parallel, world_size), t.micro_batch_size,
                     t.activation_checkpointing, cfg.parallel.offload_optimizer,
                     **config_compression(cfg))


def layouts(work: Workload, num_gpus: int):
    """Every ParallelLayout of `num_gpus` GPUs worth evaluating for `work`, with offload."""
    shape, mds = work.shape, work.megatron
    tps = [t for t in _powers_of_two(min(num_gpus, shape.num_heads)) if num_gpus % t == 0]
    for tp in tps:
        for pp in (p for p in _divisors(num_gpus // tp) if p <= shape.num_layers):
            dp = num_gpus // (tp * pp)
            scheds = [("1f1b", 1)] + ([] if pp == 1 or mds else [
                ("interleaved", v) for v in VIRTUAL_STAGES if pp * v <= shape.num_layers]
                + [("zb-h1", 1)])
            zeros = ((0, 1) if work.precision == "fp16" else (1,)) if mds else ZERO_STAGES
            for zero in zeros:
                # zb-h1 refuses ZeRO-3 (layout.check_pipeline says why)
                for sched, v in (s for s in scheds if not (s[0] == "zb-h1" and zero == 3)):
                    for sp in ((False,) if tp == 1 or mds else (False, True)):
                        for off in ((False,) if mds or zero == 0 else (False, True)):
                            yield ParallelLayout(tp, pp, dp, v, sp, zero, sched,
                                                 work.partition), off


COMPRESSION = ("grad_reduce", "error_feedback", "weight_gather", "hpz")


def compression_spec(comp: dict) -> str:
    """Candidate's compression fields as --only text (the defaults left out)."""
    out = [f"grad={comp['grad_reduce']}" if comp.get("grad_reduce", "fp32") != "fp32" else "",
           "ef" if comp.get("error_feedback") else "",
           f"gather={comp['weight_gather']}" if comp.get("weight_gather", "auto") != "auto"
           else "", "hpz" if comp.get("hpz") else ""]
    return " ".join(filter(None, out))


def candidates(work: Workload, layout: ParallelLayout, offload: bool,
               compression: dict | None = None):
    """The micro-batch and recompute variants of one layout, with `compression` (Candidate's
    grad_reduce, error_feedback, weight_gather, hpz) where the layout can have it: the gather
    options need ZeRO-3, and a layout without is searched without them."""
    recompute = ("none", "full") if work.megatron else RECOMPUTE
    comp = dict(compression or {})
    if layout.zero_stage != 3:
        comp.pop("weight_gather", None)
        comp.pop("hpz", None)
    for mbs in MICRO_BATCHES:
        for rc in recompute:
            yield Candidate(layout, mbs, rc, offload, **comp)


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** k for k in range(int(math.log2(max(1, limit))) + 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(work: Workload, cluster: Cluster, tokens: float | None = None,
           memory_limit: float | None = None, only: str | None = None,
           first_fit: bool = False, progress: ProgressLine | None = None,
           compression: dict | None = None) -> SearchResult:
    """Every layout (those matching `only`, "key=value,..." as in --layout), evaluated;
    `first_fit` stops at the first that fits. The dp wire formats (`compression`, or `only`'s
    grad=, ef, gather=, hpz) apply to every layout that can have them."""
    pinned = parse_pairs(only, "--only") if only else {}
    comp = {**(compression or {}), **{k: v for k, v in pinned.items() if k in COMPRESSION}}
    pinned = {k: v for k, v in pinned.items() if k not in COMPRESSION}
    limit = limit_of(cluster, memory_limit)
    result = SearchResult([], [], cluster, work)
    reasons = Counter()
    groups = list(layouts(work, cluster.num_gpus))
    best = None  # the fastest plan so far, for the progress line
    for i, (layout, offload) in enumerate(groups):
        cands = [c for c in candidates(work, layout, offload, comp) if matches(c, pinned)]
        before = len(result.plans)
        _evaluate_group(cands, work, cluster, tokens, limit, result, reasons, first_fit)
        best = min(filter(None, [best, *result.plans[before:]]), key=lambda p: p.step_time_s,
                   default=None)
        if progress is not None:
            _draw(progress, i + 1, len(groups), result, best)
        if first_fit and result.plans:
            break
    result.reasons = dict(reasons)
    result.plans.sort(key=lambda p: (p.step_time_s, p.memory_per_gpu))
    result.rejected.sort(key=lambda p: (p.memory_per_gpu == 0, p.memory_per_gpu - p.memory_limit))
    mark_ties(result.plans, cluster.rates.band)
    return result


def _evaluate_group(cands, work, cluster, tokens, limit, result, reasons, first_fit) -> None:
    """One layout's variants: all rejected at once when its model states alone are over."""
    if not cands:
        return
    result.evaluated += len(cands)
    reason = layout_reason(cands[0], work, cluster)
    if reason:
        result.rejected += [rejected(c, reason) for c in cands]
        reasons[_reason_kind(reason)] += len(cands)
        return
    static = (mem.static_bytes(cands[0], work, cluster.node_size)
              + cluster.gpu.context_bytes)
    if static > limit:
        reason = (f"out of memory: the model states alone need {static / 2 ** 30:.1f} GiB of "
                  f"{limit / 2 ** 30:.1f} GiB ({(static - limit) / 2 ** 30:.1f} GiB over)")
        result.rejected += [rejected(c, reason, static, limit) for c in cands]
        reasons["out of memory"] += len(cands)
        return
    for cand in cands:
        p = evaluate(cand, work, cluster, tokens, limit, all_stages=False)
        if p.fits:
            result.plans.append(p)
            if first_fit:
                return
        else:
            result.rejected.append(p)
            reasons[_reason_kind(p.reason)] += 1


def _draw(progress: ProgressLine, done: int, total: int, result: SearchResult,
          best: Plan | None) -> None:
    progress.update(f"plan | layout {done:,} of {total:,}", f"{result.evaluated:,} evaluated",
                    f"{len(result.plans):,} fit",
                    f"best {best.step_time_s:.4g} s/step {best.label}" if best else "none fits",
                    progress.elapsed())


def mark_ties(plans: list[Plan], band: float) -> None:
    """Give each plan the ranks (1-based) whose step time lies within its error band: layouts
    the planner cannot tell apart. The candidates come from a window over the step times in
    order (bisect, with a margin for rounding), the test is each pair's own: the same ties as
    comparing every pair, in n log n rather than n² (a search's ~7,000 plans took 30 s)."""
    order = sorted(range(len(plans)), key=lambda j: plans[j].step_time_s)
    logs = [math.log(plans[j].step_time_s) for j in order]
    margin = band + 1e-9
    for plan in plans:
        here = math.log(plan.step_time_s)
        lo = bisect.bisect_left(logs, here - margin)
        hi = bisect.bisect_right(logs, here + margin)
        plan.ties = sorted(j + 1 for j in (order[k] for k in range(lo, hi))
                           if plans[j] is not plan
                           and abs(math.log(plans[j].step_time_s / plan.step_time_s)) <= band)


OUT_OF_MEMORY = ("out of memory", "out of host memory")


def _reason_kind(reason: str) -> str:
    if reason.startswith("out of host memory"):
        return "out of host memory"
    if reason.startswith("out of memory"):
        return "out of memory"
    if reason.startswith("tp ("):
        return "tp larger than a node"
    return "divisibility / pipeline rules"


def plan_or_explain(work: Workload, cluster: Cluster, tokens: float | None = None,
                    memory_limit: float | None = None, only: str | None = None,
                    progress: ProgressLine | None = None,
                    compression: dict | None = None) -> SearchResult:
    """`search`, raising UserError with the smallest change that would fit when nothing does
    (the searches that look for it keep `compression`, as text pinned in `only`)."""
    only = " ".join(filter(None, [only, compression_spec(compression or {})])) or None
    result = search(work, cluster, tokens, memory_limit, only, progress=progress)
    if result.plans:
        return result
    if not result.evaluated and only:
        raise UserError(f"--only {only} matches no layout of {cluster.num_gpus} GPUs")
    raise UserError(explain_no_fit(result, work, cluster, memory_limit, only))


def explain_no_fit(result: SearchResult, work: Workload, cluster: Cluster,
                   memory_limit: float | None, only: str | None = None) -> str:
    oom = [p for p in result.rejected if p.reason and p.reason.startswith(OUT_OF_MEMORY)]
    if oom:
        closest = oom[0]
        head = (f"no layout of {cluster.num_gpus} x {cluster.gpu.name} fits "
                f"{work.shape.num_parameters() / 1e9:.1f}B parameters at global batch "
                f"{work.global_batch}, seq {work.seq}: the closest, {closest.label}, is "
                f"{closest.reason}")
    else:
        kinds = ", ".join(f"{k} ({v})" for k, v in result.reasons.items())
        example = result.rejected[0].reason if result.rejected else "no layouts"
        head = (f"no layout of {cluster.num_gpus} GPUs can run global batch {work.global_batch} "
                f"of {work.shape.num_layers} layers / {work.shape.num_heads} heads: {kinds}; "
                f"e.g. {example}")
    return f"{head}. {_smallest_fix(work, cluster, memory_limit, bool(oom), only)}"


def _fits(work, cluster, memory_limit, only) -> bool:
    return bool(search(work, cluster, memory_limit=memory_limit, only=only,
                       first_fit=True).plans)


def _smallest_fix(work: Workload, cluster: Cluster, memory_limit, oom: bool,
                  only: str | None) -> str:
    count = (_more_gpus(work, cluster, memory_limit, only) if oom
             else _nearby_count(work, cluster, memory_limit, only))
    fixes = []
    if count:
        best = search(work, replace(cluster, num_gpus=count), memory_limit=memory_limit,
                      only=only).best
        fixes.append(f"the smallest change that fits: --gpus {count} ({best.label}, "
                     f"{best.memory_per_gpu / 2 ** 30:.1f} GiB per GPU)")
    if oom:
        for name, g in sorted(GPUS.items(), key=lambda kv: kv[1].memory_bytes):
            if g.kind == cluster.gpu.kind and g.memory_bytes > cluster.gpu.memory_bytes and _fits(
                    work, replace(cluster, gpu=g), memory_limit, only):
                fixes.append(f"or the same {cluster.num_gpus} GPUs as --gpu {name}")
                break
        fixes.append("or a smaller global batch, sequence or model")
    return "; ".join(fixes) if fixes else "no nearby GPU count runs it either"


def _more_gpus(work, cluster, memory_limit, only) -> int | None:
    """Double until a layout fits, then bisect between the last two counts (memory per GPU
    falls as GPUs are added, so the first count that fits is the smallest). Past one node only
    whole nodes are counts (a cluster of 28 GPUs of 8 per node is not one)."""
    node = cluster.gpus_per_node

    def valid(count):
        return count if count <= node else -(-count // node) * node
    lo, hi = cluster.num_gpus, None
    for _ in range(10):
        count = valid(lo * 2)
        if _fits(work, replace(cluster, num_gpus=count), memory_limit, only):
            hi = count
            break
        lo = count
    if hi is None:
        return None
    while True:
        mid = valid((lo + hi) // 2)
        if mid <= lo or mid >= hi:
            return hi
        fits = _fits(work, replace(cluster, num_gpus=mid), memory_limit, only)
        lo, hi = (lo, mid) if fits else (mid, hi)


def _nearby_count(work, cluster, memory_limit, only) -> int | None:
    """The nearest GPU count (whole nodes past one) that runs the workload."""
    for d in range(1, 65):
        for count in (cluster.num_gpus - d, cluster.num_gpus + d):
            if count < 1 or (count > cluster.gpus_per_node and count % cluster.gpus_per_node):
                continue
            if _fits(work, replace(cluster, num_gpus=count), memory_limit, only):
                return count
    return None
