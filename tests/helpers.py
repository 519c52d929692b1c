"""Helpers shared by tests (bloomtrain never imports them): configs for the tiny model (`config`
for a model built in process, `make_cfg` for a run on a dataset), a run's metrics, a rank's
parts built through `parallelize`, and the tp gathers and sums tests use to compare a
parallel run with one process."""
from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist

from bloomtrain.config import Config
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.attention import resolve_attention
from bloomtrain.model import BloomForCausalLM
from bloomtrain.model.params import ParamSpec, base_spec, tp_shard_shape
from bloomtrain.model.presets import BloomShape, resolve_model_config
from bloomtrain.parallel import comm
from bloomtrain.parallel.parallelize import ModelParts, parallelize
from bloomtrain.topology import Topology

TINY = dict(hidden_size=64, num_layers=4, num_heads=4, vocab_size=256)


def config(shape: BloomShape | None = None, parallel: dict | None = None, optim: dict | None = None,
           **train) -> Config:
    """A Config for the tiny model (or `shape`): `train` keys go to the train section."""
    model = TINY if shape is None else dict(hidden_size=shape.hidden_size,
                                            num_layers=shape.num_layers,
                                            num_heads=shape.num_heads,
                                            vocab_size=shape.vocab_size)
    init_std = {} if shape is None else {"init_method_std": shape.init_method_std}
    return Config.from_dict({
        "model": {"preset": None, **model, **init_std},
        "parallel": parallel or {},
        "optim": optim or {},
        "train": {"train_iters": 1, **train}})


def run_dict(dataset, run_dir, /, **over) -> dict:
    """The sections of a training run of the tiny preset on `dataset` (the `dataset` fixture's
    synthetic corpus) in `run_dir`: fp32, 6 steps of 8 samples on the CPU. `over`: whole
    sections (`train={...}`) or single keys (`train__precision="bf16"`). make_cfg's Config and
    write_config's YAML file are both this."""
    d = {
        "model": {"preset": "tiny", "vocab_size": 256},
        "data": {"paths": [str(dataset)], "seq_length": 32, "split": "90,10,0"},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 16, "decay_samples": 400},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "train_iters": 6,
                  "precision": "fp32", "log_interval": 1, "device": "cpu"},
        "run_dir": str(run_dir),
    }
    for key, val in over.items():
        section, _, name = key.partition("__")
        if name:
            d.setdefault(section, {})[name] = val
        else:
            d[section] = val
    return d


def make_cfg(dataset, tmp_path, **over) -> Config:
    """run_dict's run in `tmp_path/run`, as a Config."""
    return Config.from_dict(run_dict(dataset, tmp_path / "run", **over))


def write_config(tmp_path, dataset, run):
    """run_dict's run as a YAML file `tmp_path/RUN.yaml` (run_dir `tmp_path/RUN`), for the CLI."""
    import yaml

    cfg = tmp_path / f"{run}.yaml"
    cfg.write_text(yaml.safe_dump(run_dict(dataset, tmp_path / run)))
    return cfg


def read_rest(proc, timeout: float) -> str:
    """The rest of a child's text stdout once it has ended, the child killed after `timeout`
    seconds: a child that ignores the signal a test sent fails that test (its exit code, its
    output) instead of hanging the run. (communicate(timeout=) would skip what iterating
    proc.stdout has already buffered.)"""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        return proc.stdout.read()
    finally:
        timer.cancel()


def metrics(run_dir) -> list[dict]:
    """A run directory's metrics.jsonl, one dict per record."""
    from bloomtrain import jsonl
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [jsonl.loads(line) for line in f]


def topology(cfg: Config, base: Topology | None = None) -> Topology:
    """cfg.parallel's Topology over the current job (one process without one). With `base`, its
    process groups are reused for a layout of the same sizes (building groups is collective and
    slow)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = ParallelLayout.from_config(cfg.parallel, world)
    if base is not None:
        b = base.layout
        assert (b.tp, b.pp, b.dp) == (layout.tp, layout.pp, layout.dp)
        return dataclasses.replace(base, layout=layout)
    if not dist.is_initialized():
        return Topology.describe_rank(layout, 0)
    return Topology.build(layout=layout)


def build(cfg: Config, topo: Topology | None = None, *, engine: bool = True,
          device=None) -> ModelParts:
    """This rank's parts of cfg's model, built on meta and parallelized."""
    with torch.device("meta"):
        model = BloomForCausalLM(resolve_model_config(cfg.model))
    device = device or "cpu"
    attention = resolve_attention(cfg.train.attention, cfg.model.attention_dropout, device,
                                  head_dim=model.shape.head_dim)
    return parallelize(model, topo or topology(cfg), cfg, attention=attention, engine=engine,
                       device=device)


def step(optimizer, lr: float, grad_stats: bool = False):
    """The end of a train step, after every micro-batch's backward, as the Trainer runs it: the
    engine's reductions, the clip, the optimizer's step; then the gradients zeroed for the next
    step's backward (the Trainer zeroes them as its step begins)."""
    optimizer.engine.reduce_gradients()
    optimizer.clip_grad_norm()
    result = optimizer.step(lr, grad_stats=grad_stats)
    optimizer.zero_grad()
    return result


@torch.no_grad()
def gather_full_tensors(tensors: dict[str, torch.Tensor], topo) -> dict[str, torch.Tensor]:
    """Full (tp = 1) tensors from this rank's tp shards, named like parameters (weights, grads,
    moments): all-gathered along each one's split dim. Collective over tp."""
    out = {}
    for name, t in tensors.items():
        key = name.split(".", 1)[1] if name.startswith(("exp_avg.", "exp_avg_sq.")) else name
        dim = base_spec(key).tp_dim
        t = t.detach()
        if dim is None or topo.tp_size == 1:
            out[name] = t.clone()
            continue
        front = t.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
        full = front.new_empty((topo.tp_size * front.shape[0],) + tuple(front.shape[1:]))
        comm.all_gather_into_tensor(full, front, topo.tp_group, "tp")
        out[name] = full.movedim(0, dim).contiguous()
    return out


def tp_shard(spec: ParamSpec, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The tp_rank-th shard of a full tensor by its spec (the tensor itself if replicated)."""
    if spec.tp_dim is None or tp_size == 1:
        return full
    tp_shard_shape(spec, tuple(full.shape), tp_size)  # the split is exact
    return full.chunk(tp_size, spec.tp_dim)[tp_rank]


def shard_full(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return tp_shard(base_spec(name), full, tp_rank, tp_size).clone()


@torch.no_grad()
def sum_partial_grads(parts: ModelParts) -> None:
    """What the engine does before a step, for tests that step a torch optimizer on .grad:
    sum sequence-parallel partial grads over tp and the tied embedding's copies over the
    embedding group."""
    named = parts.named_parameters()
    for flag, group in (("tp_partial_grad", parts.topo.tp_group),
                        ("tied", parts.topo.embedding_group)):
        grads = [p.grad for n, p in named if getattr(parts.specs[n], flag) and p.grad is not None]
        comm.all_reduce_coalesced(grads, group, "test")


def paged_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits [b, S - prefill, V] (fp32, on the CPU) of positions prefill..S-1 of `ids` [b, S]
    decoded as inference does, through the serving engine's paged KV cache and the model's paged
    attention: each row's first `prefill` tokens in one step, then one token per step (queries
    at the end of a growing key range)."""
    from bloomtrain.serve.batch import SeqStep, StepBatch
    from bloomtrain.serve.kv_cache import PagedKVCache
    from bloomtrain.serve.runner import ModelRunner

    b, seq = ids.shape
    shape, weight = model.shape, model.transformer.word_embeddings_layernorm.weight
    block = 8
    per = -(-seq // block)
    cache = PagedKVCache(shape.num_layers, b * per, block, shape.num_heads, shape.head_dim,
                         weight.dtype, weight.device)
    runner = ModelRunner(model, cache, min_rows=1)
    rows = ids.tolist()
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    with torch.no_grad():
        runner.forward(StepBatch(sum((r[:prefill] for r in rows), []),
                                 [SeqStep(i * prefill, prefill, prefill, tables[i])
                                  for i in range(b)], []))
        steps = []
        for t in range(prefill, seq):
            n = -(-(t + 1) // block)
            batch = StepBatch([r[t] for r in rows],
                              [SeqStep(i, 1, t + 1, tables[i][:n]) for i in range(b)],
                              list(range(b)))
            steps.append(runner.forward(batch).cpu())  # [b, V]
    return torch.stack(steps, dim=1)
