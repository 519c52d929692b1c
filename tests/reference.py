"""A plain single-process training loop that shares no code with bloomtrain's engine: the
reference for the trainer under every layout and precision.

What it uses of bloomtrain: the single-device model (checked against HF transformers in
tests/checkpoint/test_hf.py) for forward and backward, and the data pipeline (checked against Megatron's own
files in tests/data/) for the samples. Everything the engine does is written out here instead:
BF16Optimizer semantics (compute in bf16/fp16, gradients accumulated over micro-batches in fp32,
fp32 master weights), fp16 loss scaling, `torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW`
with Megatron's no-decay groups, Megatron's learning-rate schedule and batch-size ramp-up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bloomtrain.config import Config
from bloomtrain.data.loader import build_train_valid_test_datasets
from bloomtrain.model.attention import resolve_attention
from bloomtrain.model import build_model, resolve_model_config
from bloomtrain.devices import torch_dtype

TIED_HEAD = "lm_head.weight"


def megatron_lr(s, max_lr, min_lr, warmup, decay, style):
    """Megatron-DeepSpeed's AnnealingLR.get_lr written out, in samples."""
    if warmup > 0 and s <= warmup:
        return max_lr * s / warmup
    if style == "constant":
        return max_lr
    if s > decay:
        return min_lr
    r = (s - warmup) / (decay - warmup)
    coeff = 1.0 - r if style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def rampup_batch_size(consumed: int, global_batch: int, rampup) -> int:
    """Megatron's RampupBatchsizeNumMicroBatches.update, written out."""
    if not rampup:
        return global_batch
    start, increment, ramp_samples = rampup
    if consumed > ramp_samples:
        return global_batch
    per_increment = ramp_samples / ((global_batch - start) // increment)
    return start + int(consumed / per_increment) * increment


def num_train_samples(cfg: Config) -> int:
    t = cfg.train
    return t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size


def num_valid_samples(cfg: Config) -> int:
    # The valid split is built for every evaluation of the run (GPTDataset's sample order depends
    # on how many samples it is built for); these tests evaluate once, at the end.
    assert cfg.train.eval_interval is None
    return cfg.train.eval_iters * cfg.train.global_batch_size


def is_no_decay(name: str, p) -> bool:
    """Megatron's rule, written out here: no weight decay for biases and LayerNorm parameters
    (all the 1-D ones)."""
    return p.ndim < 2


def datasets(cfg: Config):
    train, valid, _ = build_train_valid_test_datasets(
        cfg.data, None, [num_train_samples(cfg), num_valid_samples(cfg), 0], cfg.data.seq_length)
    return train, valid


def _batch(dataset, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([torch.from_numpy(dataset[i].astype("int64"))
                        for i in range(first, first + count)])  # [count, seq + 1]
    return rows[:, :-1], rows[:, 1:]


@dataclass
class ReferenceRun:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    master: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_train(cfg: Config) -> ReferenceRun:
    """Train as cfg says on one process, micro-batch by micro-batch (the trainer's micro-batches
    are groups of `micro_batch_size` consecutive samples, whatever the dp size)."""
    t, o = cfg.train, cfg.optim
    assert cfg.model.hidden_dropout == 0 and cfg.model.attention_dropout == 0
    shape = resolve_model_config(cfg.model)
    compute_dtype = torch_dtype(t.precision)
    model = build_model(shape, seed=t.seed, dtype=compute_dtype)
    model.train()
    # The attention kernel the trainer resolves on the CPU for this precision and sequence.
    model.transformer.attention_impl = resolve_attention(
        t.attention, cfg.model.attention_dropout, "cpu", t.precision, cfg.data.seq_length)
    params = {n: p for n, p in model.named_parameters()}  # the tied head appears once
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in
               build_model(shape, seed=t.seed).named_parameters()}
    decay = [p for p in masters.values() if p.ndim >= 2]  # biases and LayerNorms: no decay
    no_decay = [p for p in masters.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    # fp16: Megatron's dynamic loss scaler, written out.
    scale = o.initial_loss_scale if t.precision == "fp16" else 1.0
    hysteresis, growth = o.hysteresis, 0
    train_ds, _ = datasets(cfg)
    total = num_train_samples(cfg)
    decay_samples = o.decay_samples or total
    out = ReferenceRun()
    # Megatron steps its scheduler by the batch only after an applied update (training.py
    # train_step: lr_scheduler.step(increment) if update_successful): `applied` is where the LR
    # is. A partial last batch is not trained (update_train_iters floors).
    consumed = applied = 0
    while consumed + rampup_batch_size(consumed, t.global_batch_size,
                                       t.rampup_batch_size) <= total:
        gbs = rampup_batch_size(consumed, t.global_batch_size, t.rampup_batch_size)
        lr = megatron_lr(applied, o.lr, o.min_lr, o.warmup_samples, decay_samples,
                         o.decay_style)
        num_micro = gbs // t.micro_batch_size
        acc = {n: torch.zeros_like(m) for n, m in masters.items()}
        loss_sum = 0.0
        for k in range(num_micro):
            tokens, labels = _batch(train_ds, consumed + k * t.micro_batch_size,
                                    t.micro_batch_size)
            loss = model(tokens, labels=labels)
            (loss * scale / num_micro).backward()
            for n, p in params.items():
                acc[n] += p.grad.float()  # fp32 accumulation of each micro-batch's gradient
                p.grad = None
            loss_sum += loss.item()
        for n, m in masters.items():
            m.grad = acc[n] / scale
        norm = float(torch.nn.utils.clip_grad_norm_(list(masters.values()),
                                                    o.clip_grad or float("inf")))
        finite = math.isfinite(norm)
        out.loss_scales.append(scale)
        if t.precision == "fp16":
            if finite:
                growth += 1
                if growth == o.loss_scale_window:
                    growth, hysteresis, scale = 0, o.hysteresis, scale * 2
            else:
                growth, hysteresis = 0, hysteresis - 1
                if hysteresis <= 0:
                    scale = max(scale / 2, o.min_loss_scale)
        if finite:
            applied += gbs
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(masters[n])  # the compute copy: the master rounded
        opt.zero_grad(set_to_none=True)
        out.losses.append(loss_sum / num_micro)
        out.grad_norms.append(norm)
        out.skipped.append(not finite)
        consumed += gbs
    out.master = {n: m.detach().clone() for n, m in masters.items()}
    for n, m in masters.items():
        state = opt.state.get(m, {})
        out.exp_avg[n] = state.get("exp_avg", torch.zeros_like(m)).clone()
        out.exp_avg_sq[n] = state.get("exp_avg_sq", torch.zeros_like(m)).clone()
    return out


@torch.no_grad()
def reference_eval(cfg: Config, weights: dict[str, torch.Tensor]) -> float:
    """Mean validation loss of `weights` (full tensors by HF name) cast to the compute dtype, over
    the trainer's eval batches: `eval_iters` global batches from the start of the valid split."""
    t = cfg.train
    shape = resolve_model_config(cfg.model)
    model = build_model(shape, seed=t.seed, dtype=torch_dtype(t.precision)).eval()
    params = dict(model.named_parameters())
    for n, w in weights.items():
        params[n].copy_(w)
    _, valid_ds = datasets(cfg)
    losses = []
    for first in range(0, t.eval_iters * t.global_batch_size, t.micro_batch_size):
        tokens, labels = _batch(valid_ds, first, t.micro_batch_size)
        losses.append(model(tokens, labels=labels).item())
    return sum(losses) / len(losses)
