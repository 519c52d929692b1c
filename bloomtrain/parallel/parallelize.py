"""`parallelize(model, topo, cfg, attention=...) -> ModelParts`: the one place where tensor,
pipeline and ZeRO data parallelism compose, on the layout and attention kernel the caller
resolved (the Trainer: bloomtrain.validate and model.attention.resolve_attention, once per run).
`shard_model(model, topo, attention)` is its Config-free core (the tensor-parallel plan and the
pipeline's chunks), which the sharded loader (bloomtrain.checkpoint.load) builds on too.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from bloomtrain.config import Config
from bloomtrain.model.bloom import BloomForCausalLM, local_alibi_slopes
from bloomtrain.model.params import ParamSpec, init_into, init_std, param_spec
from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel.zero.optimizer import ZeroAdamW
from bloomtrain.parallel.compile import compile_blocks
from bloomtrain.parallel.pipeline.stage import PipelineChunk, build_pipeline_chunks
from bloomtrain.parallel.tensor.plan import apply_tensor_parallel
from bloomtrain.parallel.zero.engine import ZeroEngine
from bloomtrain.devices import torch_dtype
from bloomtrain.topology import Topology
from bloomtrain.model.params import replace_parameters


@dataclass
class ModelParts:
    """What one rank trains: its model chunks (in virtual-stage order), the specs of their
    parameters by name, the ZeRO engine that owns their storage, and the optimizer that steps
    the engine's fp32 masters."""

    topo: Topology
    shape: BloomShape
    chunks: list[PipelineChunk]
    specs: dict[str, ParamSpec]
    engine: ZeroEngine | None
    optimizer: ZeroAdamW | None = None

    @property
    def layout(self):
        return self.topo.layout

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters by HF name, each once (the tied head of a single stage is the
        embedding)."""
        seen, out = set(), []
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def _values(shape: BloomShape, topo: Topology, seed: int):
    """First values of a local parameter piece: generated from the spec when the parameter is on
    the meta device, copied when it already holds values."""
    def values(param: nn.Parameter, spec: ParamSpec, start: int, out: torch.Tensor) -> None:
        if not param.is_meta:
            out.copy_(param.detach().reshape(-1)[start:start + out.numel()])
            return
        full = list(param.shape)
        if spec.tp_dim is not None:
            full[spec.tp_dim] *= topo.tp_size
        std = init_std(spec, shape.num_layers, shape.init_method_std)
        init_into(out, spec, tuple(full), std, seed, topo.tp_rank, topo.tp_size, start)
    return values


def _materialize_each(parts: ModelParts, seed: int, dtype: torch.dtype, device) -> None:
    """Without the engine: one tensor per local parameter on `device` (ties kept)."""
    values = _values(parts.shape, parts.topo, seed)
    new = {}
    for name, p in parts.named_parameters():
        flat = torch.empty(math.prod(p.shape), dtype=torch.float32, device=device)
        values(p, parts.specs[name], 0, flat)
        new[id(p)] = nn.Parameter(flat.view(p.shape).to(dtype), requires_grad=p.requires_grad)
    replace_parameters(parts.chunks, new)


def _per_node(topo: Topology) -> int:
    """Processes per node, as the launcher (torchrun, `--nproc-per-node`) says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", topo.layout.world_size))


def shard_model(model: BloomForCausalLM, topo: Topology, attention: str, *, seed: int = 1234,
                device=None) -> tuple[list[PipelineChunk], dict[str, ParamSpec]]:
    """This rank's model chunks of `model` under `topo`'s layout, and their parameters' specs by
    name: the tensor-parallel plan (sequence parallel as the layout says; `seed` seeds its
    dropout streams), the pipeline's chunks, the `attention` kernel. No training settings: what
    parallelize adds for training (recompute, the ZeRO engine, compile) and what the loaders add
    (bloomtrain.checkpoint.load: the weights) come after. Like torchtitan's parallelize_*
    functions, a model and a plan, no Config."""
    layout = topo.layout
    apply_tensor_parallel(model, topo, layout.sequence_parallel, seed=seed, device=device)
    chunks = build_pipeline_chunks(model, layout, topo.pp_rank)
    specs = {}
    for chunk in chunks:
        chunk.transformer.attention_impl = attention
        for name, _ in chunk.named_parameters():
            specs[name] = param_spec(name, tp=layout.tp, pp=layout.pp,
                                     sequence_parallel=layout.sequence_parallel)
    return chunks, specs


def set_local_slopes(chunks, shape: BloomShape, topo: Topology, device) -> None:
    """Each chunk's ALiBi slopes: this tp rank's heads, fp32, on `device` (not persistent, so
    never read from a checkpoint)."""
    local = local_alibi_slopes(shape.num_heads, topo.tp_size, topo.tp_rank).to(device)
    for chunk in chunks:
        chunk.transformer.alibi_slopes = local.clone()


def parallelize(model: BloomForCausalLM, topo: Topology, cfg: Config, *, attention: str,
                device=None, engine: bool = True) -> ModelParts:
    """This rank's parts of `model` under `topo`'s (validated) layout, running the `attention`
    kernel (bloomtrain.model.attention.resolve_attention's), set up as `cfg` says (precision, seed,
    activation checkpointing, optimizer and ZeRO settings). `device` defaults to the model's (or
    cpu for a meta model); with device "meta" nothing is materialized, which describes any rank
    of any size cheaply.

    The model comes in single-device, normally built on meta so that no rank ever holds it
    whole. In order: the tensor-parallel plan swaps modules for their tp-sharded counterparts
    (meta shards); the pipeline keeps this rank's chunks (pp = 1: one chunk, through the same
    schedule runtime); the parameter specs (bloomtrain.model.params) for this layout; the ZeRO
    engine lays the local parameters out in flat buffers and materializes there only the ranges
    this rank keeps, from the per-name seeds a single process uses, so the values never depend
    on the layout (`engine=False`, for tests that drive their own optimizer: each parameter a
    tensor of its own); then the ALiBi slopes, cut to the local heads, and with
    `train.compile` each block's compiled forward (bloomtrain.parallel.compile)."""
    layout, t = topo.layout, cfg.train
    if device is None:
        device = "cpu" if model.lm_head.weight.is_meta else model.lm_head.weight.device
    device = torch.device(device)
    chunks, specs = shard_model(model, topo, attention, seed=t.seed, device=device)
    for chunk in chunks:
        chunk.set_activation_checkpointing(t.activation_checkpointing)
    parts = ModelParts(topo, model.shape, chunks, specs, None)
    if engine:
        parts.engine = ZeroEngine(chunks, specs, topo, t.precision, zero_stage=layout.zero_stage,
                                  bucket_size_mb=cfg.parallel.bucket_size_mb, device=device,
                                  values=_values(model.shape, topo, t.seed),
                                  offload=cfg.parallel.offload_optimizer,
                                  offload_pin_memory=cfg.parallel.offload_pin_memory,
                                  grad_reduce_dtype=cfg.parallel.grad_reduce_dtype,
                                  error_feedback=cfg.parallel.grad_error_feedback,
                                  weight_gather_dtype=cfg.parallel.weight_gather_dtype,
                                  secondary_per_node=_per_node(topo)
                                  if cfg.parallel.zero_secondary_shard else None)
        parts.optimizer = ZeroAdamW(parts.engine, cfg.optim, t.precision,
                                    num_blocks=model.shape.num_layers)
    elif device.type != "meta":
        _materialize_each(parts, t.seed, torch_dtype(t.precision), device)
    if device.type != "meta":
        # Not persistent: derived from the head count, and fp32 whatever the compute dtype
        # (a non-power-of-2 slope rounded to bf16 would shift every score).
        set_local_slopes(chunks, model.shape, topo, device)
    if t.compile:
        compile_blocks(chunks)
    return parts
