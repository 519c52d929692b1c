"""`bloomtrain plan`: the best layouts for a model on a cluster, or one layout's full breakdown."""
from __future__ import annotations

import json

from bloomtrain.planner import check_request, make_inputs
from bloomtrain.planner.evaluate import SYSTEMS, Plan, evaluate
from bloomtrain.planner.hardware import GPUS
from bloomtrain.planner.search import config_compression, plan_or_explain
from bloomtrain.planner.workload import parse_layout
from bloomtrain.progress import ProgressLine

GIB = 2 ** 30


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def seconds(t: float) -> str:
    """A duration in the unit that keeps it readable: 104.6 s, 12.3 ms, 190.7 us."""
    if t >= 1:
        return f"{t:.4g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.4g} ms"
    return f"{t * 1e6:.4g} us"


def count(n: float) -> str:
    """A parameter count: 176.25B, 1.21M, 23.4K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_table(plans: list[Plan], with_days: bool) -> str:
    head = (f"{'#':>2}  {'layout':<72} {'GiB/GPU':>7} {'step':>10} {'band':>6} {'TFLOP/s':>7} "
            f"{'MFU':>5} {'tok/s':>9}" + (f" {'days':>7}" if with_days else "") + "  within band")
    rows = [head]
    for i, p in enumerate(plans, 1):
        band = p.step_time_band_s[1] / p.step_time_s - 1 if p.step_time_s else 0.0
        ties = ",".join(map(str, p.ties[:6])) + ("..." if len(p.ties) > 6 else "")
        rows.append(f"{i:>2}  {p.label:<72} {_gib(p.memory_per_gpu):>7} "
                    f"{seconds(p.step_time_s):>10} {'±' + format(band, '.0%'):>6} "
                    f"{p.tflops_per_gpu:>7.3g} {p.mfu * 100:>4.1f}% {p.tokens_per_s:>9,.0f}"
                    + (f" {p.days:>7.1f}" if with_days and p.days is not None else "")
                    + (f"  {ties}" if ties else ""))
    return "\n".join(rows)


def format_breakdown(p: Plan) -> str:
    """Everything about one layout: memory of the worst stage by item, every stage's total, the
    step time by term, the communication per step."""
    if not p.stages:
        return f"{p.label}: cannot run: {p.reason}"
    s = p.stages[p.worst_stage]
    lines = [f"{p.label}",
             f"  fits: {'yes' if p.fits else 'NO: ' + str(p.reason)}; worst stage "
             f"{p.worst_stage} ({s['num_blocks']} blocks, {', '.join(map(str, s['in_flight']))} "
             f"micro-batches in flight): {_gib(p.memory_per_gpu)} GiB of "
             f"{_gib(p.memory_limit)} GiB planned"]
    lines.append("  memory of the worst stage, GiB:")
    lines += [f"    model states  {k:<24} {_gib(v):>8}" for k, v in s["model_states"].items()]
    lines += [f"    activations   {k:<24} {_gib(v):>8}" for k, v in s["activations"].items()]
    lines += [f"    transient     {k:<24} {_gib(v):>8}" for k, v in s["transients"].items() if v]
    lines.append(f"    allocator     {'fragmentation allowance':<24} {_gib(s['allocator']):>8}")
    if s["context"]:
        lines.append(f"    context       {'CUDA, cuBLAS, NCCL':<24} {_gib(s['context']):>8}")
    if p.host_per_node:
        h = p.host_per_node
        lines.append(f"  host memory per node (offload), GiB: {_gib(h['total'])} of "
                     f"{_gib(p.host_limit)} GiB planned "
                     f"({h['total']:,.0f} bytes, the node that needs the most):")
        lines += [f"    {k:<38} {_gib(v):>8}" for k, v in h.items() if k != "total"]
    lines.append("  per stage, GiB: " + " ".join(_gib(x["total"]) for x in p.stages))
    t = p.time
    lo, hi = p.step_time_band_s
    lines.append(f"  step {seconds(t['step_s'])} ({seconds(lo)} to {seconds(hi)}, the fit's band) "
                 f"over {t['micro_batches']} micro-batches (large GEMMs at "
                 f"{t['efficiency']:.3g} of peak):")
    for k in ("compute_s", "host_s", "tp_comm_s", "pp_p2p_s", "bubble_s", "dp_comm_exposed_s",
              "optimizer_s"):
        lines.append(f"    {k[:-2]:<20} {seconds(t[k]):>10}  {100 * t[k] / t['step_s']:5.1f}%")
    lines.append(f"  {p.tflops_per_gpu:.4g} TFLOP/s per GPU (Megatron's formula), MFU "
                 f"{p.mfu * 100:.1f}%, {p.tokens_per_s:,.0f} tokens/s"
                 + (f", {p.days:.1f} days" if p.days is not None else ""))
    lines.append("  communication per step on rank 0, MiB: " + ", ".join(
        f"{k} {v / 2 ** 20:,.1f}" for k, v in sorted(p.comm_bytes.items())))
    return "\n".join(lines)


def cmd_plan(args) -> int:
    check_request(args.top, args.layout, args.only, args.tokens)
    cfg, work, cluster = make_inputs(
        model=args.model, config=args.config, overrides=args.overrides, gpus=args.gpus,
        gpu_name=args.gpu, gpus_per_node=args.gpus_per_node,
        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
        global_batch=args.global_batch, seq=args.seq, system=args.system,
        efficiency=args.efficiency, calibrate=args.calibrate,
        host_memory_gib=args.host_memory_gib)
    shape = work.shape
    what = (f"{count(shape.num_parameters())} parameters (L={shape.num_layers}, "
            f"h={shape.hidden_size}, heads={shape.num_heads}, vocab={shape.vocab_size}), global "
            f"batch {work.global_batch} x seq {work.seq} on {cluster.num_gpus} x "
            f"{cluster.gpu.name} ({cluster.node_size} per node), system {work.system}")
    if args.calibrate:
        what += (f"; compute efficiency {cluster.compute_efficiency:.4g} fitted to "
                 f"{args.calibrate}")
    if args.layout:
        p = evaluate(parse_layout(args.layout, args.gpus, work.partition,
                                  config_compression(cfg)), work, cluster, args.tokens)
        if args.json:
            print(json.dumps(p.to_dict()))
        else:
            print(f"plan: {what}")
            print(format_breakdown(p))
        return 0 if p.fits else 1
    progress = ProgressLine()
    try:
        result = plan_or_explain(work, cluster, args.tokens, only=args.only, progress=progress,
                                 compression=config_compression(cfg))
    finally:
        progress.close()
    top = result.plans[:args.top]
    if args.json:
        print(json.dumps({"workload": what, "evaluated": result.evaluated,
                          "fitting": len(result.plans), "rejected_by_reason": result.reasons,
                          "plans": [p.to_dict() for p in top],
                          "closest_rejected": [p.to_dict() for p in result.rejected[:args.top]]}))
        return 0
    print(f"plan: {what}")
    print(f"{result.evaluated} layouts evaluated, {len(result.plans)} fit; rejected: "
          + ", ".join(f"{k} {v}" for k, v in result.reasons.items()))
    print(format_table(top, args.tokens is not None))
    print("(band: the step time's 1-sigma error, from the fit's leave-one-out spread; "
          "'within band' lists the ranks the planner cannot tell apart from that row)")
    print("\nbest layout:")
    print(format_breakdown(top[0]))
    near = [p for p in result.rejected if p.memory_per_gpu][:3]
    if near:
        print("\nclosest rejected:")
        for p in near:
            print(f"  {p.label}: {p.reason}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict memory and step time of layouts; find the best ones",
        description="Memory per GPU and step time of every layout of a model on a cluster, "
                    "the best ones first, each itemized; or one layout with --layout.")
    p.add_argument("--model", help="a model preset (e.g. bloom-176b)")
    p.add_argument("--config", help="a training config YAML (its model, batch, precision)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides, e.g. model.hidden_dropout=0.1")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="a100-80g", choices=sorted(GPUS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-gbps", type=float, help="NVLink Gbit/s one way per GPU")
    p.add_argument("--inter-node-gbps", type=float, help="network Gbit/s per node")
    p.add_argument("--host-memory-gib", type=float,
                   help="host memory of a node, GiB: what offload layouts must fit in, less 10%% "
                        "(default: the GPU's usual node, 2048 for a100-80g, h100, h200; 1024 "
                        "for a100-40g; this machine's for cpu)")
    p.add_argument("--global-batch", type=int, help="samples per step (default: the config's)")
    p.add_argument("--seq", type=int, help="sequence length (default: the config's)")
    p.add_argument("--tokens", type=float, help="tokens to train: report days")
    p.add_argument("--layout", help="evaluate one layout: 'tp=4 pp=12 dp=8 mbs=2 zero=1 "
                                    "recompute=full' (or comma-separated; schedule=, v=, sp, "
                                    "offload, grad=fp32|bf16|int8, ef, gather=auto|bf16|int8, "
                                    "hpz optional)")
    p.add_argument("--only", help="search only layouts with these values, e.g. recompute=full; "
                                  "grad=, ef, gather=, hpz apply to every layout that can have "
                                  "them")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--system", choices=SYSTEMS, default="bloomtrain",
                   help="whose memory and communication to model: this engine, or the "
                        "Megatron-DeepSpeed stack BLOOM-176B ran (to check against its figures)")
    p.add_argument("--efficiency", type=float,
                   help="fraction of peak a large GEMM sustains (default: fitted to BLOOM's "
                        "runs, docs/planner_fit.md)")
    p.add_argument("--calibrate", metavar="RUN_DIR",
                   help="fit the GEMM efficiency to a real run's metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.set_defaults(func=cmd_plan)
