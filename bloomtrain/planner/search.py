"""Layout search: every layout of a cluster, evaluated, the fitting ones ranked by step time, the
others kept with the reason they cannot run. When nothing fits, the error names the smallest
change that would (more GPUs, a larger GPU), found by planning again with it."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import resolve_model_config
from bloomtrain.planner.evaluate import Candidate, Plan, Workload, evaluate
from bloomtrain.planner.hardware import GPUS, Cluster

MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 4)
RECOMPUTE = ("none", "selective", "full")


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


def workload_from_config(cfg: Config, seq: int | None = None, global_batch: int | None = None,
                         system: str = "bloomtrain", device: str = "cuda",
                         shape=None) -> Workload:
    """The workload of a config (its model, batch, precision, kernels) on `device`; `shape`
    when the run already resolved it (its vocabulary from the tokenizer)."""
    shape = shape or resolve_model_config(cfg.model, cfg.model.vocab_size or None)
    t = cfg.train
    if system == "megatron-deepspeed":
        attention = "unfused"
    elif t.attention == "flex" or (t.attention == "auto" and device == "cuda"
                                   and shape.attention_dropout == 0):
        attention = "fused"
    else:
        # SDPA with the ALiBi bias tensor (CUDA: its efficient kernel; CPU without dropout:
        # fused too; CPU with attention dropout: the math path, not modelled).
        attention = "sdpa"
    c = {"bf16": 2, "fp16": 2, "fp32": 4}[t.precision]
    return Workload(shape=shape, seq=seq or cfg.data.seq_length,
                    global_batch=global_batch or t.global_batch_size, compute_bytes=c,
                    attention=attention, bucket_size_mb=cfg.parallel.bucket_size_mb,
                    mask_bytes=1 if device == "cuda" else c, system=system,
                    partition=cfg.parallel.pp_partition)


def candidate_from_config(cfg: Config, world_size: int) -> Candidate:
    p, t = cfg.parallel, cfg.train
    layout = ParallelLayout.from_config(p, world_size)
    return Candidate(tp=layout.tp, pp=layout.pp, dp=layout.dp, micro_batch=t.micro_batch_size,
                     zero_stage=p.zero_stage, recompute=t.activation_checkpointing,
                     schedule=p.pp_schedule, virtual_stages=p.num_virtual_stages,
                     sequence_parallel=p.sequence_parallel, offload=p.offload_optimizer)


def candidates(work: Workload, num_gpus: int):
    """Every layout of `num_gpus` GPUs worth evaluating for `work`."""
    shape = work.shape
    mds = work.system == "megatron-deepspeed"
    tps = [t for t in _powers_of_two(min(num_gpus, shape.num_heads)) if num_gpus % t == 0]
    for tp in tps:
        for pp in _divisors(num_gpus // tp):
            if pp > shape.num_layers:
                break
            dp = num_gpus // (tp * pp)
            for mbs in MICRO_BATCHES:
                # An indivisible batch is still yielded: evaluate() rejects it with the reason.
                m = work.global_batch // (mbs * dp)
                divisible = work.global_batch % (mbs * dp) == 0
                schedules = [("1f1b", 1)]
                if pp > 1 and not mds and divisible:
                    schedules += [("interleaved", v) for v in VIRTUAL_STAGES
                                  if m % pp == 0 and pp * v <= shape.num_layers]
                for zero in ((1,) if mds else (0, 1, 2, 3)):
                    for rc in (("none", "full") if mds else RECOMPUTE):
                        for sched, v in schedules:
                            for sp in ((False,) if tp == 1 or mds else (False, True)):
                                for off in ((False,) if mds or zero == 0 else (False, True)):
                                    yield Candidate(tp, pp, dp, mbs, zero, rc, sched, v, sp, off)


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** k for k in range(int(math.log2(max(1, limit))) + 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(work: Workload, cluster: Cluster, tokens: float | None = None,
           memory_limit: float | None = None, only: str | None = None) -> SearchResult:
    """Every layout (those matching `only`, "key=value,..." as in --layout), evaluated."""
    pinned = parse_pairs(only, "--only") if only else {}
    plans, rejected, reasons = [], [], Counter()
    n = 0
    for cand in candidates(work, cluster.num_gpus):
        if any(getattr(cand, k) != v for k, v in pinned.items()):
            continue
        n += 1
        p = evaluate(cand, work, cluster, tokens, memory_limit)
        if p.fits:
            plans.append(p)
        else:
            rejected.append(p)
            reasons[_reason_kind(p.reason)] += 1
    plans.sort(key=lambda p: (p.step_time_s, p.memory_per_gpu))
    rejected.sort(key=lambda p: (p.memory_per_gpu == 0, p.memory_per_gpu - p.memory_limit))
    return SearchResult(plans, rejected, cluster, work, n, dict(reasons))


def _reason_kind(reason: str) -> str:
    if reason.startswith("out of memory"):
        return "out of memory"
    if reason.startswith("tp ("):
        return "tp larger than a node"
    return "divisibility / pipeline rules"


def plan_or_explain(work: Workload, cluster: Cluster, tokens: float | None = None,
                    memory_limit: float | None = None, only: str | None = None) -> SearchResult:
    """`search`, raising UserError with the smallest change that would fit when nothing does."""
    result = search(work, cluster, tokens, memory_limit, only)
    if result.plans:
        return result
    if not result.evaluated and only:
        raise UserError(f"--only {only} matches no layout of {cluster.num_gpus} GPUs")
    raise UserError(explain_no_fit(result, work, cluster, memory_limit, only))


def explain_no_fit(result: SearchResult, work: Workload, cluster: Cluster,
                   memory_limit: float | None, only: str | None = None) -> str:
    oom = [p for p in result.rejected if p.reason and p.reason.startswith("out of memory")]
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
    fix = _smallest_fix(work, cluster, memory_limit, bool(oom), only)
    return f"{head}. {fix}"


def _smallest_fix(work: Workload, cluster: Cluster, memory_limit, oom: bool,
                  only: str | None) -> str:
    def fits(count: int) -> Plan | None:
        r = search(work, replace(cluster, num_gpus=count), memory_limit=memory_limit, only=only)
        return r.best if r.plans else None

    found = None
    if oom:
        # More GPUs: double until a layout fits, then bisect over whole nodes (memory per GPU
        # falls as GPUs are added, so the first count that fits is the smallest).
        unit = cluster.gpus_per_node if cluster.num_gpus >= cluster.gpus_per_node else 1
        lo, hi = cluster.num_gpus // unit, None
        for k in range(1, 11):
            if fits(lo * 2 ** k * unit):
                hi = lo * 2 ** k
                lo = hi // 2
                break
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid * unit) is None else (lo, mid)
            found = (hi * unit, fits(hi * unit))
    else:  # nearby GPU counts, nearest first
        for d in range(1, 65):
            for count in (cluster.num_gpus - d, cluster.num_gpus + d):
                if count < 1 or (count > cluster.gpus_per_node
                                 and count % cluster.gpus_per_node):
                    continue
                best = fits(count)
                if best is not None:
                    found = (count, best)
                    break
            if found:
                break
    fixes = []
    if found:
        count, best = found
        fixes.append(f"the smallest change that fits: --gpus {count} ({best.label}, "
                     f"{best.memory_per_gpu / 2 ** 30:.1f} GiB per GPU)")
    if oom:
        for name, g in sorted(GPUS.items(), key=lambda kv: kv[1].memory_bytes):
            if g.memory_bytes > cluster.gpu.memory_bytes and search(
                    work, replace(cluster, gpu=g), memory_limit=memory_limit, only=only).plans:
                fixes.append(f"or the same {cluster.num_gpus} GPUs as --gpu {name}")
                break
        fixes.append("or a smaller global batch, sequence or model")
    return "; ".join(fixes) if fixes else "no nearby GPU count runs it either"


_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "mbs": "micro_batch", "micro_batch": "micro_batch",
         "zero": "zero_stage", "zero_stage": "zero_stage", "recompute": "recompute",
         "schedule": "schedule", "v": "virtual_stages", "virtual_stages": "virtual_stages",
         "sp": "sequence_parallel", "sequence_parallel": "sequence_parallel",
         "offload": "offload"}


def parse_pairs(spec: str, what: str) -> dict:
    """`key=value,...` over the layout keys (tp, pp, dp, mbs, zero, recompute, schedule, v, sp,
    offload) as Candidate fields."""
    values: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or key not in _KEYS:
            raise UserError(f"{what}: cannot read {item!r}; give key=value pairs with keys "
                            f"{', '.join(sorted(set(_KEYS)))}")
        name = _KEYS[key]
        if name in ("recompute", "schedule"):
            values[name] = val
        elif name in ("sequence_parallel", "offload"):
            if val.lower() not in ("0", "1", "true", "false"):
                raise UserError(f"{what} {key}: use 0/1 or true/false, not {val!r}")
            values[name] = val.lower() in ("1", "true")
        else:
            try:
                values[name] = int(val)
            except ValueError:
                raise UserError(f"{what} {key}: {val!r} is not an integer") from None
    if values.get("recompute", "none") not in RECOMPUTE:
        raise UserError(f"{what} recompute must be one of {', '.join(RECOMPUTE)}")
    if values.get("schedule", "1f1b") not in ("1f1b", "gpipe", "interleaved"):
        raise UserError(f"{what} schedule must be 1f1b, gpipe or interleaved")
    return values


def parse_layout(spec: str, num_gpus: int) -> Candidate:
    """`tp=4,pp=12,dp=8,mbs=2,zero=1,recompute=full[,schedule=1f1b,v=1,sp=0,offload=0]`; dp may
    be left out (what the GPUs leave)."""
    values = parse_pairs(spec, "--layout")
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values:
        if tp < 1 or pp < 1 or num_gpus % (tp * pp):
            raise UserError(f"--gpus ({num_gpus}) is not divisible by tp*pp ({tp}*{pp})")
        values["dp"] = num_gpus // (tp * pp)
    if values.get("schedule") == "interleaved" and "virtual_stages" not in values:
        values["virtual_stages"] = 2
    return Candidate(**values)
