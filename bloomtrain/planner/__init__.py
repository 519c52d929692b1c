"""The planner: memory and step time of a layout before anything runs, and a search over layouts.

    bloomtrain plan --model bloom-176b --gpus 384 --gpu a100-80g --global-batch 2048 --seq 2048

Model states come from the engine's own buffer layout, activations from Korthikanti et al.'s
per-layer terms for the kernels that run, communication from the collectives our engine issues,
step time from efficiency terms fitted to BLOOM-176B's public runs (docs/planner_fit.md).
Modules: workload (what is planned), hardware (devices, links, collective times), efficiency
(the fitted rates), memory (per-rank bytes), host (offload's host bytes per node, and the check
`bloomtrain train` makes), traffic (bytes per step), steptime, evaluate (one
layout), search (all layouts, and what to change when none fits), calibrate (the GEMM rate of a
real run), fit (the fit itself), cli (`bloomtrain plan`).

(The package is `planner`, not `plan`, so that the `bloomtrain.plan` function is never shadowed
by a submodule of the same name.)
"""
from __future__ import annotations

import os

from dataclasses import replace

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.planner.evaluate import Plan, evaluate
from bloomtrain.planner.hardware import GPUS, Cluster, gpu
from bloomtrain.planner.search import (SearchResult, candidate_from_config, config_compression,
                                       config_shape, plan_or_explain, workload_from_config)
from bloomtrain.planner.workload import Candidate, Workload, parse_layout

__all__ = ["plan", "Plan", "Candidate", "Workload", "Cluster", "GPUS", "evaluate",
           "make_inputs", "SearchResult"]
GIB = 2 ** 30


def make_inputs(*, model: str | None = None, config: str | None = None, overrides=(),
                gpus: int, gpu_name: str = "a100-80g", gpus_per_node: int = 8,
                intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
                global_batch: int | None = None, seq: int | None = None,
                system: str = "bloomtrain", efficiency: float | None = None,
                calibrate: str | None = None,
                host_memory_gib: float | None = None) -> tuple[Config, Workload, Cluster]:
    """The config, workload and cluster a plan is made for."""
    overrides = list(overrides)
    if model:
        overrides = [f"model.preset={model}"] + overrides
    if not config and not model and not _model_in(overrides):
        raise UserError("give a model: --model PRESET, --config FILE, or the overrides "
                        "model.preset=PRESET or model.hidden_size=H model.num_layers=L "
                        "model.num_heads=N (with model.preset=null for a shape of your own)")
    if not config and (global_batch is None or seq is None):
        raise UserError("give the batch: --global-batch B and --seq S (or --config FILE, whose "
                        "train.global_batch_size and data.seq_length are used)")
    cfg = Config.load(config, overrides)
    if cfg.train.train_iters is None and cfg.train.train_samples is None:
        cfg.train.train_iters = 1  # a plan does not depend on the run's length
    cfg.check()
    spec = gpu(gpu_name)
    work = workload_from_config(cfg, seq, global_batch, system, device=spec.kind,
                                shape=config_shape(cfg))
    cluster = Cluster(spec, gpus, gpus_per_node, intra_node_gbps, inter_node_gbps, efficiency,
                      None if host_memory_gib is None else host_memory_gib * GIB)
    if calibrate:
        from bloomtrain.planner.calibrate import calibrate_efficiency
        fitted = calibrate_efficiency(calibrate, cluster)
        cluster = cluster.with_efficiency(fitted.efficiency)
    return cfg, work, cluster


def _model_in(overrides) -> bool:
    """Whether the overrides name a model: a preset (model.preset=..., null included), or the
    three numbers of a shape. Anything less would plan the default config's toy model, which
    nobody asked for."""
    keys = {str(o).split("=", 1)[0].strip() for o in overrides}
    return "model.preset" in keys or {"model.hidden_size", "model.num_layers",
                                      "model.num_heads"} <= keys


def check_request(top: int | None, layout: str | None, only: str | None,
                  tokens: float | None = None) -> None:
    """What `bloomtrain plan` and `plan()` refuse alike."""
    if tokens is not None and not 0 < tokens < float("inf"):  # -1 printed "-0.0 days"
        raise UserError(f"tokens (--tokens) must be a positive finite number, got {tokens:g}")
    if top is not None and top < 1:  # 0 had no best layout to show, -2 dropped the last two
        raise UserError(f"top (--top) must be >= 1, got {top}")
    if layout and only:
        raise UserError("only (--only) pins values for the search; with a layout (--layout) "
                        "there is none: give the values in the layout")


def plan(model: str | None = None, *, gpus: int, gpu: str = "a100-80g",
         global_batch: int | None = None, seq: int | None = None, config: str | None = None,
         overrides=(), layout: str | None = None, gpus_per_node: int = 8,
         intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
         tokens: float | None = None, system: str = "bloomtrain", only: str | None = None,
         efficiency: float | None = None, calibrate: str | None = None,
         top: int | None = 5, host_memory_gib: float | None = None) -> list[Plan]:
    """The records `bloomtrain plan` prints: with `layout` ("tp=4 pp=12 mbs=2 zero=1 ...") that
    layout's record (fitting or not, with the reason); otherwise the fitting layouts, fastest
    first (`top` of them; None: all). Raises UserError when no layout fits, naming the smallest
    change that would."""
    check_request(top, layout, only, tokens)
    cfg, work, cluster = make_inputs(model=model, config=config, overrides=overrides, gpus=gpus,
                                   gpu_name=gpu, gpus_per_node=gpus_per_node,
                                   intra_node_gbps=intra_node_gbps,
                                   inter_node_gbps=inter_node_gbps, global_batch=global_batch,
                                   seq=seq, system=system, efficiency=efficiency,
                                   calibrate=calibrate, host_memory_gib=host_memory_gib)
    comp = config_compression(cfg)
    if layout:
        return [evaluate(parse_layout(layout, gpus, work.partition, comp), work, cluster,
                         tokens)]
    result = plan_or_explain(work, cluster, tokens, only=only, compression=comp)
    return result.plans if top is None else result.plans[:top]


def plan_for_run(cfg: Config, shape, world_size: int, device) -> tuple[Plan, str]:
    """The prediction for a training run's own layout on its own device, and the line
    `bloomtrain train` logs. A layout predicted to need more than the device's memory (on the
    CPU, the host's available memory over this node's processes) is refused (UserError) unless
    train.ignore_plan is set."""
    import torch
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if on_cuda else None
    work = workload_from_config(cfg, device=device.type, shape=shape)
    base = GPUS["a100-80g"] if on_cuda else GPUS["cpu"]
    spec = replace(base, name=str(device), memory_bytes=total or 1 << 62)
    # The launcher's processes per node (torchrun's LOCAL_WORLD_SIZE; srun's tasks per node
    # through env_from_slurm): node-local groups such as ZeRO's hpZ are sized by it.
    per_node = max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE") or world_size), world_size))
    # Nodes of different sizes (srun's "2,1"): the model counts equal nodes, so the largest
    # that divide the job stand in (a prediction, where `plan`'s refusal of uneven nodes
    # failed the run with an error about options it has not got).
    per_node = max(d for d in range(1, per_node + 1) if world_size % d == 0)
    cluster = Cluster(spec, world_size, per_node)
    p = evaluate(candidate_from_config(cfg, world_size), work, cluster,
                 memory_limit=float(spec.memory_bytes))
    if not p.stages:  # validation passed, so this is a planner gap: say so, do not block
        return p, f"plan: no prediction for this layout ({p.reason})"
    s = p.stages[p.worst_stage]
    acts = sum(s["activations"].values())
    text = (f"plan: {p.memory_per_gpu / GIB:.2f} GiB per device predicted at the peak, on "
            f"pipeline stage {p.worst_stage} (model states "
            f"{sum(s['model_states'].values()) / GIB:.2f}, activations {acts / GIB:.2f} for "
            f"{'+'.join(map(str, s['in_flight']))} micro-batch(es) in flight, transients "
            f"{sum(s['transients'].values()) / GIB:.2f}, allocator and context "
            f"{(s['allocator'] + s['context']) / GIB:.2f}); ")
    if total is not None:
        text += f"the device has {total / GIB:.2f} GiB"
        where, unit = f"the {total / GIB:.2f} GiB this GPU has", "GPU"
    else:
        # On the CPU the device is the host: its available memory, shared by this node's
        # processes (a run past it ended in an allocator traceback, the plan unread).
        from bloomtrain.planner.host import available_host_memory
        avail, source = available_host_memory()
        total = avail // max(1, min(per_node, world_size))
        text += f"{source} gives each of this node's processes {total / GIB:.2f} GiB"
        where, unit = (f"the {total / GIB:.2f} GiB this host has for each of its processes "
                       f"({source})"), "process"
    if p.memory_per_gpu > total:
        if not cfg.train.ignore_plan:
            raise UserError(
                f"the planner predicts {p.memory_per_gpu / GIB:.2f} GiB per {unit} on pipeline "
                f"stage {p.worst_stage}, more than {where}; run `bloomtrain plan` for a layout "
                f"that fits (more pp or tp, ZeRO stage 2-3, activation checkpointing, a smaller "
                f"micro-batch or sequence), or set train.ignore_plan=true to start anyway")
        text += " (over; starting anyway: train.ignore_plan=true)"
    return p, text
