"""Typed run configuration: one dataclass per concern, loaded from YAML plus dotted
`section.key=value` overrides, and each key's domain (`DOMAINS`), which `Config.check()`
enforces. It imports nothing of the package but its errors, so every module can import it; the
rules that tie sections together are bloomtrain.layout's."""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from bloomtrain.errors import UserError, each_problem, raise_all

# The keys with a set of choices, declared here once: DOMAINS (the checker) reads them, and so do
# their owners (the pipeline's schedule table, the ZeRO stage table, the attention kernels, the
# compute dtypes of bloomtrain.devices and the CLI's --dtype).
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1"]
ZeroStage = Literal[0, 1, 2, 3]
Backend = Literal["auto", "gloo", "nccl"]
DecayStyle = Literal["cosine", "linear", "constant"]
Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
Attention = Literal["auto", "sdpa", "flex", "eager"]
Device = Literal["auto", "cpu", "cuda"]
OnLossSpike = Literal["log", "skip", "rollback"]
OnSaveError = Literal["continue", "stop"]
GradReduceDtype = Literal["fp32", "bf16", "int8"]
WeightGatherDtype = Literal["auto", "bf16", "int8"]


@dataclass
class ModelConfig:
    # A preset fills every shape field left at None (see bloomtrain.model.PRESETS).
    preset: str | None = "tiny"
    # Unpadded vocabulary size. None: take it from the tokenizer.
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    # None = 4 * hidden_size, as Megatron's default.
    ffn_hidden_size: int | None = None
    layer_norm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # None = the preset's value; BLOOM used 0.0048 (~sqrt(1/(3h)) for h=14336).
    init_method_std: float | None = None
    make_vocab_size_divisible_by: int = 128


@dataclass
class ParallelConfig:
    # Tensor-parallel size: Megatron column/row-split matmuls within a node.
    tp: int = 1
    # Pipeline-parallel size (arXiv 2104.04473): stages of consecutive blocks, across nodes.
    pp: int = 1
    # gpipe, 1f1b (PipeDream-flush), interleaved (needs num_virtual_stages > 1) or zb-h1 (zero
    # bubble: 1F1B with the weight gradients deferred into its bubbles; not with zero_stage 3).
    pp_schedule: PipelineSchedule = "1f1b"
    num_virtual_stages: int = 1
    # uniform, type:transformer|embedding (BLOOM's: the embedding and the tied head count as one
    # unit each on the first/last stage), or explicit block counts per stage like "5,6,6,5".
    pp_partition: str = "type:transformer|embedding"
    # Write a per-stage timeline of every logged step to run_dir/pipeline_timeline/.
    pp_timeline: bool = False
    # Shard LayerNorm/dropout activations along the sequence over the tp group (needs tp > 1).
    sequence_parallel: bool = False
    # ZeRO (arXiv 1910.02054): 0 replicates everything; 1 shards fp32 master weights and Adam
    # states over dp (BLOOM's BF16Optimizer); 2 also the fp32 gradients; 3 also the parameters.
    zero_stage: ZeroStage = 0
    # Size of the flat buckets that gradient reductions and parameter gathers move at once.
    bucket_size_mb: float = 25.0
    # Count bytes and calls per collective per group (also BLOOMTRAIN_COMM_STATS=1).
    comm_stats: bool = False
    # auto: on CUDA the per-device "cpu:gloo,cuda:nccl" (NCCL for CUDA tensors, gloo for CPU
    # ones), else gloo. nccl: the same, insisting on CUDA; gloo: CPU only.
    backend: Backend = "auto"
    # The three timeouts of a job whose network fails (README "When the network fails"), set
    # here once. The collective timeout: a collective or p2p op that waits longer fails (the
    # process groups' timeout; torch's NCCL watchdog then aborts the process, with no report).
    timeout_minutes: float = 10.0
    # The hang watchdog's (bloomtrain/train/watchdog.py): a rank waiting in one op, or in a step
    # outside any op, this long writes a report naming the op and the ranks it waits on, and
    # exits. It must fire before the collective timeout, which would end the rank without a
    # report. None: 90% of timeout_minutes.
    hang_timeout_minutes: float | None = None
    # The rendezvous timeout of `bloomtrain train --nnodes` (--rdzv-timeout, in seconds, is the
    # same setting): how long the nodes wait for each other at the start, and after a failure
    # with --max-restarts, when the nodes whose workers failed wait for the others to notice
    # theirs (within the hang timeout) and for a cut link to come back.
    rdzv_timeout_minutes: float = 10.0
    # ZeRO-Offload (arXiv 2101.06840): keep this rank's fp32 masters and Adam moments in host
    # memory (12 bytes per owned parameter) and run the optimizer step there. The copies to and
    # from the device go through a small pinned staging ring; the states stay pageable.
    offload_optimizer: bool = False
    # With offload_optimizer: page-lock the states too (DeepSpeed's offload_optimizer.pin_memory,
    # off by default as there), so that they are never swapped out. The copies go through the
    # ring either way; locked memory cannot be reclaimed, counts against ulimit -l, and torch's
    # pinned allocator rounds each buffer up to a power of two (up to twice its size).
    offload_pin_memory: bool = False
    # The wire format of the data-parallel gradient reduction (parallel/zero/compress.py): fp32
    # (exact), bf16, or int8 (blockwise absmax, ZeRO++'s qgZ: ~0.26x fp32's bytes). The sums
    # are taken in fp32 either way.
    grad_reduce_dtype: GradReduceDtype = "fp32"
    # With a bf16/int8 reduction: send what quantization dropped in the next reduction. The
    # residual is per rank, fp32, the size of the rank's gradient input (4 bytes per local
    # parameter), and is checkpointed with the optimizer state.
    grad_error_feedback: bool = False
    # ZeRO-3's parameter all-gather: auto (the compute dtype), bf16, or int8 (ZeRO++'s qwZ).
    weight_gather_dtype: WeightGatherDtype = "auto"
    # hpZ (ZeRO++): ZeRO-3 also keeps, after each forward gather, 1/s of the weights on each of
    # the s ranks of its dp group on the node (LOCAL_WORLD_SIZE, torchrun's --nproc-per-node),
    # so backward's gathers stay in the node. Bitwise the same results.
    zero_secondary_shard: bool = False

    @property
    def hang_timeout_s(self) -> float:
        """The hang watchdog's timeout in seconds: hang_timeout_minutes, or 90% of the
        collective timeout."""
        minutes = self.hang_timeout_minutes
        return (0.9 * self.timeout_minutes if minutes is None else minutes) * 60


@dataclass
class DataConfig:
    # Dataset prefixes (as written by `bloomtrain preprocess`, without .bin/.idx), each either a
    # plain string or "WEIGHT PREFIX". With one path the weight is 1.
    paths: list[str] = field(default_factory=list)
    # A tokenizer.json, or a directory holding one (any local HF tokenizer directory), or
    # Megatron's GPT-2 vocab.json with its merges.txt beside it (or a directory of the two).
    tokenizer: str | None = None
    # Train/valid/test split of each dataset's documents, Megatron style.
    split: str = "969,30,1"
    seq_length: int = 32
    seed: int = 1234
    # Where sample-index caches go. None: next to each dataset.
    cache_dir: str | None = None
    # Megatron's --eod-mask-loss: no loss where the input token is end-of-document (so the model is
    # not trained to guess the first token of the next document). BLOOM did not set it.
    eod_mask_loss: bool = False
    # A resume whose training data order differs from the one the checkpoint's run trained on
    # (the tokens at its consumed samples: another train length that takes another epoch, which
    # Megatron's index reshuffles; other paths, split, seed or seq_length) is refused; true goes
    # on in the new order (new data for a continued pretraining, say).
    override_order: bool = False


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_samples: int = 0
    # None: decay over the whole run (train_samples).
    decay_samples: int | None = None
    decay_style: DecayStyle = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    # fp16 dynamic loss scaling, as BLOOM's smaller models ran on V100.
    initial_loss_scale: float = 2.0 ** 12
    loss_scale_window: int = 500
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # A resume whose learning-rate schedule (lr, min_lr, warm-up, decay samples, style) differs
    # from the checkpoint's is refused, as Megatron's AnnealingLR refuses it; true takes the
    # config's (Megatron's --override-lr-scheduler).
    override_schedule: bool = False


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 8
    # Exactly one of train_iters / train_samples (train_samples is required with ramp-up).
    train_iters: int | None = None
    train_samples: int | None = None
    # [start, increment, ramp_samples], Megatron's --rampup-batch-size.
    rampup_batch_size: list[int] | None = None
    precision: Precision = "bf16"
    seed: int = 1234
    # none; full: recompute every block, as BLOOM did; selective: each block under an op-level
    # policy (bloomtrain.model.recompute, torchtitan's): the outputs of its four linear layers'
    # matmuls and of a fused attention kernel are kept, LayerNorm, GeLU, bias adds, dropout
    # (the same masks: the RNG state is restored), residual adds and tp/sp's collectives are
    # recomputed in backward. An unfused core (attention=eager) is recomputed whole, softmax and
    # dropout included: Korthikanti et al.'s (arXiv 2205.05198) selective is kept, and a fused
    # kernel, which stores no s² tensors, still saves memory (issue 38).
    activation_checkpointing: Recompute = "none"
    # Regional torch.compile of each transformer block (inductor fuses LayerNorm, bias-GeLU and
    # bias-dropout-add, the kernels BLOOM needed CUDA extensions for).
    compile: bool = False
    # Attention kernel: auto (FlexAttention with an ALiBi score_mod on CUDA when available and
    # the head dimension is at most model.kernel_choice.FLEX_MAX_HEAD_DIM, where it measured
    # faster than SDPA; on CPU in bf16/fp16 at sequences up to model.kernel_choice.EAGER_MAX_SEQ
    # HF's eager math; else SDPA with the ALiBi bias as a float mask), sdpa, flex or eager.
    attention: Attention = "auto"
    log_interval: int = 10
    eval_interval: int | None = None
    eval_iters: int = 10
    # auto: cuda when available, else cpu.
    device: Device = "auto"
    # On CUDA, start even when the planner (bloomtrain plan) predicts more memory than the
    # device has.
    ignore_plan: bool = False
    # Loss-spike monitor: a robust z-score of each step's loss against the median and MAD of the
    # last `loss_spike_window` losses; above `loss_spike_zscore` it is a spike, and then:
    # log it; skip the optimizer step; or roll back to the last checkpoint and skip the samples
    # that led to it (what BLOOM's and OPT's operators did by hand).
    on_loss_spike: OnLossSpike = "log"
    loss_spike_window: int = 100
    loss_spike_zscore: float = 6.0
    # Every this many steps, the grad norm and update/weight ratio of every block (0: off).
    grad_stats_interval: int = 100
    # A rank whose busy time per step (its step time less its waits for dp peers: every rank's
    # wall step time comes out equal in a synchronous job) exceeds this times the median over
    # ranks is named a straggler.
    straggler_factor: float = 1.2
    # Save and exit before a job's time limit.
    exit_duration_minutes: float | None = None
    # BLOOM's kill switch: when this file exists, save and exit at the next step.
    kill_switch_path: str | None = None
    # Downstream evaluation (bloomtrain.eval.training): lm-evaluation-harness tasks,
    # comma-separated, run on the live model every eval_harness_interval steps (None: at the
    # end only), task YAMLs also looked up in eval_harness_include_path, at most
    # eval_harness_limit documents per task. Needs the `eval` extra and data.tokenizer.
    eval_harness_tasks: str | None = None
    eval_harness_interval: int | None = None
    eval_harness_include_path: str | None = None
    eval_harness_limit: int | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None
    save_interval: int | None = None
    save_interval_minutes: float | None = None
    keep_last: int | None = 3
    # auto: the newest valid checkpoint in `dir`; none: start fresh; or a checkpoint path.
    resume: str = "auto"
    # Write checkpoints in a background thread after a copy to CPU memory (see checkpoint/).
    async_save: bool = True
    # A save that fails (a full disk, most often): `continue` logs it and tries again at the
    # next save interval; `stop` ends the run with an error. A run's last save (at its end or
    # on a stop signal) that fails is an error either way.
    on_save_error: OnSaveError = "continue"


@dataclass
class RunConfig:
    # TensorBoard event files under run_dir/tensorboard: None writes them when the `tensorboard`
    # package is installed, true requires it, false never.
    tensorboard: bool | None = None
    # A W&B project: log to it in offline mode (run_dir/wandb) when `wandb` is installed.
    wandb: str | None = None


@dataclass(frozen=True)
class Domain:
    """The values a key takes beyond its type (which loading enforces): an interval, a set of
    choices, a form a parser accepts, or anything of the type (`free`; `note` says where else it
    is checked). None passes wherever the key's type allows it. Config.check() enforces each
    key's domain; tests/test_config.py generates values inside and outside each one."""

    kind: str                       # interval | choice | parsed | free
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    parse: Callable[[Any], Any] | None = None
    note: str = ""                  # interval: appended to its message; free: where it is checked

    def describe(self) -> str:
        if self.kind == "choice":
            names = [str(c) for c in self.choices]
            return ", ".join(names[:-1]) + " or " + names[-1]
        def num(x) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"
        if self.high == math.inf:
            if self.low == 0:
                return "positive" if self.low_open else ">= 0"
            return f"{'>' if self.low_open else '>='} {num(self.low)}"
        return (f"in {'(' if self.low_open else '['}{num(self.low)}, {num(self.high)}"
                f"{')' if self.high_open else ']'}")

    def check(self, key: str, value) -> None:
        if value is None or self.kind == "free":
            return
        if self.kind == "parsed":
            self.parse(value)
            return
        if self.kind == "choice":
            ok = value in self.choices
        else:
            ok = ((value > self.low if self.low_open else value >= self.low)
                  and (value < self.high if self.high_open else value <= self.high))
        if not ok:
            note = f" ({self.note})" if self.note else ""
            shown = repr(value) if self.kind == "choice" else value
            raise UserError(f"{key} must be {self.describe()}{note}, got {shown}")


POSITIVE = Domain("interval", low=0, low_open=True)
# Minutes, a week at most: a process group's timeout is a timedelta, which overflows somewhere
# past 10^12 minutes, and no collective or rendezvous should wait longer than a week.
WEEK_MINUTES = 7 * 24 * 60
TIMEOUT = Domain("interval", low=0, low_open=True, high=WEEK_MINUTES)
NON_NEGATIVE = Domain("interval", low=0)
FRACTION = Domain("interval", low=0, high=1, high_open=True)  # dropout, Adam's betas
SEED = Domain("interval", low=0, high=2 ** 32 - 1)  # numpy's RandomState (Megatron's sample order)
BOOL = Domain("free", note="true or false")
# What users of Megatron (--data-parallel-size is derived there too) and DeepSpeed try to set.
DERIVED_DP = ("dp", "dp_size", "data_parallel_size")
# bool | None keys whose None default means "decide by itself", spelled `auto` as the README does.
AUTO_SWITCHES = ("run.tensorboard",)


def choice(literal) -> Domain:
    """The domain of a key typed with one of the Literal choice types above."""
    return Domain("choice", choices=typing.get_args(literal))


def free(note: str) -> Domain:
    return Domain("free", note=note)


def _split_domain(value) -> None:
    try:
        parse_split(value)
    except ValueError as e:
        raise UserError(f"data.split: {e}") from None


# Every key's domain, in the order check() reports them. Keys of several sections are tied
# together by check()'s cross-key rules below and by bloomtrain.layout.
DOMAINS: dict[str, Domain] = {
    "model.preset": free("a preset name, checked when the model is built "
                         "(bloomtrain.model.presets)"),
    **{f"model.{k}": POSITIVE for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                         "ffn_hidden_size", "layer_norm_epsilon")},
    "model.hidden_dropout": FRACTION,
    "model.attention_dropout": FRACTION,
    "model.init_method_std": POSITIVE,
    "model.make_vocab_size_divisible_by": POSITIVE,
    "parallel.tp": POSITIVE,
    "parallel.pp": POSITIVE,
    "parallel.pp_schedule": choice(PipelineSchedule),
    "parallel.num_virtual_stages": POSITIVE,
    "parallel.pp_partition": free("checked against the stages by bloomtrain.layout"),
    "parallel.pp_timeline": BOOL,
    "parallel.sequence_parallel": BOOL,
    "parallel.zero_stage": choice(ZeroStage),
    "parallel.bucket_size_mb": POSITIVE,
    "parallel.comm_stats": BOOL,
    "parallel.backend": choice(Backend),
    "parallel.timeout_minutes": TIMEOUT,
    # Below the collective timeout (checked beside it), so below its ceiling too.
    "parallel.hang_timeout_minutes": Domain("interval", low=0, low_open=True, high=WEEK_MINUTES,
                                            high_open=True),
    "parallel.rdzv_timeout_minutes": TIMEOUT,
    "parallel.offload_optimizer": BOOL,
    "parallel.offload_pin_memory": BOOL,
    "parallel.grad_reduce_dtype": choice(GradReduceDtype),
    "parallel.grad_error_feedback": BOOL,
    "parallel.weight_gather_dtype": choice(WeightGatherDtype),
    "parallel.zero_secondary_shard": BOOL,
    "data.paths": Domain("parsed", parse=lambda v: parse_data_paths(v),
                         note="'PREFIX', or 'WEIGHT PREFIX' entries with positive weights"),
    "data.tokenizer": free("a path, checked when it is loaded"),
    "data.split": Domain("parsed", parse=_split_domain,
                         note="up to three non-negative numbers with a positive sum"),
    "data.seq_length": POSITIVE,
    "data.seed": SEED,
    "data.cache_dir": free("a directory"),
    "data.eod_mask_loss": BOOL,
    "optim.lr": POSITIVE,
    "optim.min_lr": NON_NEGATIVE,
    "optim.warmup_samples": NON_NEGATIVE,
    "optim.decay_samples": POSITIVE,
    "optim.decay_style": choice(DecayStyle),
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": FRACTION,
    "optim.beta2": FRACTION,
    "optim.eps": POSITIVE,
    "optim.clip_grad": Domain("interval", low=0, note="0 disables clipping"),
    "optim.initial_loss_scale": POSITIVE,
    "optim.loss_scale_window": POSITIVE,
    "optim.hysteresis": POSITIVE,
    "optim.min_loss_scale": POSITIVE,
    "optim.override_schedule": BOOL,
    "data.override_order": BOOL,
    "train.micro_batch_size": POSITIVE,
    "train.global_batch_size": POSITIVE,
    "train.train_iters": POSITIVE,
    "train.train_samples": POSITIVE,
    "train.rampup_batch_size": free("checked against the batch sizes by bloomtrain.layout"),
    "train.precision": choice(Precision),
    "train.seed": SEED,
    "train.activation_checkpointing": choice(Recompute),
    "train.compile": BOOL,
    "train.attention": choice(Attention),
    "train.log_interval": POSITIVE,
    "train.eval_interval": POSITIVE,
    "train.eval_iters": POSITIVE,
    "train.device": choice(Device),
    "train.ignore_plan": BOOL,
    "train.on_loss_spike": choice(OnLossSpike),
    "train.loss_spike_window": POSITIVE,
    "train.loss_spike_zscore": POSITIVE,
    "train.grad_stats_interval": Domain("interval", low=0, note="0 turns it off"),
    "train.straggler_factor": Domain("interval", low=1, low_open=True),
    "train.exit_duration_minutes": POSITIVE,
    "train.kill_switch_path": free("a path"),
    "train.eval_harness_tasks": free("harness task names, comma-separated, looked up when the "
                                     "evaluation runs"),
    "train.eval_harness_interval": POSITIVE,
    "train.eval_harness_include_path": free("a directory of task YAMLs"),
    "train.eval_harness_limit": POSITIVE,
    "checkpoint.dir": free("a directory"),
    "checkpoint.save_interval": POSITIVE,
    "checkpoint.save_interval_minutes": POSITIVE,
    "checkpoint.keep_last": POSITIVE,
    "checkpoint.resume": free("auto, none or a checkpoint path, checked when resuming"),
    "checkpoint.async_save": BOOL,
    "checkpoint.on_save_error": choice(OnSaveError),
    "run.tensorboard": BOOL,
    "run.wandb": free("a W&B project name"),
    "run_dir": free("a directory"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    run_dir: str = "runs/default"

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """The config of a mapping of sections; one UserError names every unknown key and every
        value of the wrong type."""
        d = dict(d or {})
        cfg, problems = cls(), []
        for f in fields(cls):
            if f.name not in d:
                continue
            val = d.pop(f.name)
            current = getattr(cfg, f.name)
            try:
                if dataclasses.is_dataclass(current):
                    if val is None:
                        continue
                    if not isinstance(val, dict):
                        raise UserError(f"config section '{f.name}' must be a mapping, got "
                                        f"{val!r}")
                    setattr(cfg, f.name, _section_from_dict(type(current), val, f.name))
                else:
                    setattr(cfg, f.name, _coerce(val, _field_type(cls, f.name), f.name))
            except UserError as e:
                problems += each_problem(e)
        if d:
            # key=str: YAML keys can be numbers, booleans or null, which do not sort with strings.
            unknown = sorted(d, key=str)
            problems.append(f"unknown config section(s) {unknown}"
                            f"{did_you_mean([str(k) for k in unknown], '')}; valid sections are "
                            f"{[f.name for f in fields(cls)]}")
        raise_all(problems)
        return cfg

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | None = None) -> "Config":
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise UserError(f"config file {path} does not exist")
            try:
                data = _yaml_load(p.read_text(encoding="utf-8")) or {}
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise UserError(f"config file {path} is not valid YAML: {e}") from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise UserError(f"config file {path}: {e}") from None
            except RecursionError:
                raise UserError(f"config file {path} nests too deeply to be a config") from None
            if not isinstance(data, dict):
                raise UserError(f"config file {path} must hold a mapping of sections")
        for ov in overrides or []:
            apply_override(data, ov)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---- per-key checks ------------------------------------------------------------------
    def check(self) -> None:
        """Check every key against its domain (DOMAINS), then the rules between keys of one
        section; raises one UserError naming every key out of its domain, else every broken
        rule. The rules across sections are bloomtrain.validate's, which calls this
        first."""
        problems = []
        for key, domain in DOMAINS.items():
            try:
                domain.check(key, self.get(key))
            except UserError as e:
                problems += each_problem(e)
        raise_all(problems)  # the rules below compare values each inside its domain
        t, o, c, p = self.train, self.optim, self.checkpoint, self.parallel
        if (t.train_iters is None) == (t.train_samples is None):
            problems.append("set exactly one of train.train_iters and train.train_samples")
        if o.min_lr > o.lr:
            problems.append(f"optim.min_lr ({o.min_lr}) must not exceed optim.lr ({o.lr})")
        if o.decay_samples is not None and o.decay_samples <= o.warmup_samples:
            problems.append(f"optim.decay_samples ({o.decay_samples}) must exceed "
                            f"optim.warmup_samples ({o.warmup_samples})")
        if o.min_loss_scale > o.initial_loss_scale:  # Megatron's DynamicGradScaler asserts it
            problems.append(f"optim.min_loss_scale ({o.min_loss_scale:g}) must not exceed "
                            f"optim.initial_loss_scale ({o.initial_loss_scale:g})")
        if (c.save_interval or c.save_interval_minutes) and not c.dir:
            problems.append("checkpoint.save_interval needs checkpoint.dir")
        if p.hang_timeout_minutes is not None and p.hang_timeout_minutes >= p.timeout_minutes:
            problems.append(f"parallel.hang_timeout_minutes ({p.hang_timeout_minutes:g}) must be "
                            f"less than parallel.timeout_minutes ({p.timeout_minutes:g}): the "
                            f"watchdog reports a hung rank before the collective timeout ends it "
                            f"without a report; lower it or raise parallel.timeout_minutes")
        if p.grad_error_feedback and p.grad_reduce_dtype == "fp32":
            problems.append("parallel.grad_error_feedback needs a compressed reduction: set "
                            "parallel.grad_reduce_dtype to bf16 or int8 (fp32 loses nothing)")
        if p.offload_pin_memory and not p.offload_optimizer:
            problems.append("parallel.offload_pin_memory pins the offloaded optimizer states: it "
                            "needs parallel.offload_optimizer=true")
        if p.weight_gather_dtype != "auto" and p.zero_stage != 3:
            problems.append(f"parallel.weight_gather_dtype={p.weight_gather_dtype} needs "
                            f"parallel.zero_stage=3 (got {p.zero_stage}): only ZeRO-3 gathers "
                            f"weights before each use")
        if p.zero_secondary_shard and p.zero_stage != 3:
            problems.append(f"parallel.zero_secondary_shard needs parallel.zero_stage=3 (got "
                            f"{p.zero_stage}): the secondary shard holds ZeRO-3's gathered "
                            f"weights for backward")
        raise_all(problems)

    def get(self, key: str):
        """The value of a dotted key ("train.seed", "run_dir")."""
        node = self
        for part in key.split("."):
            node = getattr(node, part)
        return node


def parse_split(s: str) -> list[float]:
    """`"969,30,1"`, `"98/2"` or `"1"` -> three normalized fractions (train, valid, test)."""
    text = str(s).strip()
    sep = "," if "," in text else "/"
    parts = [p.strip() for p in text.split(sep)]
    if not text or any(p == "" for p in parts):
        raise ValueError(f"split {s!r} must be up to three comma-separated numbers, "
                         f"e.g. '969,30,1'")
    if len(parts) > 3:
        raise ValueError(f"split {s!r} has {len(parts)} parts; give at most three "
                         f"(train, valid, test)")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {s!r} must be numbers, e.g. '969,30,1'") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"split {s!r} must be finite and non-negative")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"split {s!r} sums to zero; at least one part must be positive")
    if values[0] <= 0:  # the run would build no training data (a traceback on its first step)
        raise ValueError(f"split {s!r} gives training (the first part) no share")
    return [v / total for v in values]


def data_path_entry(entry) -> tuple[float | None, str]:
    """One data.paths entry as (weight or None, prefix): `WEIGHT PREFIX` when its first word is
    a number, else the whole entry is the prefix, spaces and all (a directory named `my data`,
    which preprocess writes without complaint)."""
    text = str(entry).strip()
    parts = text.split(None, 1)
    if len(parts) == 2:
        try:
            return float(parts[0]), parts[1].strip()
        except ValueError:
            pass
    return None, text


def data_paths_weighted(paths: list[str] | str) -> bool:
    """Whether data.paths gives weights: Megatron blends a weighted --data-path even alone."""
    paths = [paths] if isinstance(paths, str) else paths
    return any(data_path_entry(e)[0] is not None for e in paths)


def parse_data_paths(paths: list[str] | str) -> list[tuple[float, str]]:
    """`["0.3 a_text_document", "0.7 b_text_document"]` or `["a_text_document"]` ->
    [(weight, prefix)]. Weights are returned as given (normalized by the blender)."""
    if isinstance(paths, str):
        paths = [paths]
    out, bare = [], 0
    for entry in paths:
        w, prefix = data_path_entry(entry)
        if not prefix:
            raise UserError(f"data.paths entry {entry!r}: expected 'PREFIX' or 'WEIGHT PREFIX'")
        if w is not None and not (w > 0 and math.isfinite(w)):
            raise UserError(f"data.paths entry {entry!r}: weight must be positive")
        bare += w is None
        out.append((1.0 if w is None else w, prefix))
    if len(out) > 1 and bare:
        raise UserError("with several data.paths, give each a weight: 'WEIGHT PREFIX'")
    if not math.isfinite(sum(w for w, _ in out)):
        raise UserError(f"data.paths weights {[w for w, _ in out]} sum past the largest float; "
                        f"give smaller ones (they are normalized to sum 1)")
    return out


def parse_tasks(text: str | None) -> list[str]:
    """`train.eval_harness_tasks`: "a, b" -> ["a", "b"]."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `section.key=value` to a nested dict. The value is parsed as YAML, so
    `parallel.tp=2`, `train.rampup_batch_size=[16,16,1000]` and `checkpoint.dir=null` work."""
    if "=" not in override:
        raise UserError(f"override {override!r} must look like section.key=value")
    key, _, raw = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise UserError(f"override {override!r}: empty key component")
    try:
        value = _yaml_load(raw) if raw.strip() != "" else None
    except (yaml.YAMLError, ValueError, RecursionError):
        # Not YAML (or an integer too long to convert): the text itself, which the key's type
        # check then accepts as a string or refuses with its name.
        value = raw
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"override {override!r}: {part} is not a section")
        node = nxt
    if not isinstance(value, (str, list, dict)) and value is not None:
        # A number, boolean or date as YAML reads it; a string-typed key takes the text as typed
        # instead (run_dir=0100 made a directory named 64, run_dir=2026-12-07 a date).
        value = _Typed(raw.strip(), value)
    elif isinstance(value, list):
        value = _typed_items(raw, value)
    node[parts[-1]] = value


def _typed_items(raw: str, value: list) -> list:
    """A list override's scalar items with their text as typed, as a scalar override's
    (data.paths=[0100] read ['64'])."""
    try:
        texts = yaml.load(raw, Loader=yaml.BaseLoader)  # every scalar as its text
    except yaml.YAMLError:
        return value
    if not isinstance(texts, list) or len(texts) != len(value):
        return value
    return [_Typed(t, v) if isinstance(t, str) and v is not None
            and not isinstance(v, (str, list, dict)) else v for t, v in zip(texts, value)]


class _Typed:
    """An override's text and its YAML value: `_coerce` gives a string-typed key the text, any
    other key the value."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value):
        self.text, self.value = text, value

    def __repr__(self) -> str:  # errors show the value as it was read
        return repr(self.value)

    def __eq__(self, other) -> bool:
        return self.value == (other.value if isinstance(other, _Typed) else other)

    __hash__ = None


def _takes_text(tp) -> bool:
    """Whether a field of type `tp` is a string (str, str | None, a Literal of strings)."""
    if tp is str:
        return True
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in args)
    return typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType",
                                                           None)) and str in args


class _UniqueKeySafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """libyaml's safe loader where PyYAML has it (it refuses deep nesting at once, where the pure
    Python scanner takes quadratic time on it: seconds for a few thousand "["), refusing a key
    given twice in one mapping. YAML keeps the last silently: a second `parallel:` section
    dropped the first's tp and zero_stage, and the run started on another layout."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges, as YAML says
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first is not None:
                raise yaml.YAMLError(
                    f"{key!r} is given twice in one mapping (line {first.line + 1} column "
                    f"{first.column + 1}, and line {key_node.start_mark.line + 1} column "
                    f"{key_node.start_mark.column + 1}); keep one")
        return super().construct_mapping(node, deep)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_UniqueKeySafeLoader)


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates every annotation string: once per class


def _field_type(cls, name: str):
    return _type_hints(cls)[name]


def _section_from_dict(cls, d: dict[str, Any], section: str):
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    problems = []
    if unknown:
        names = sorted(f"{section}.{k}" for k in unknown)
        problems.append(f"unknown key(s) {names}{did_you_mean(names, section)}; valid keys "
                        f"in '{section}' are {sorted(known)}")
    kwargs = {}
    for k, v in d.items():
        if k in known:
            try:
                kwargs[k] = _coerce(v, _field_type(cls, k), f"{section}.{k}")
            except UserError as e:
                problems += each_problem(e)
    raise_all(problems)
    return cls(**kwargs)


# Megatron's, DeepSpeed's and HF Trainer's names for our keys, which users type first; the
# closest spelling misled (train.fp16 -> train.compile, train.iters -> train.eval_iters).
KEY_ALIASES = {
    "fp16": "train.precision=fp16", "bf16": "train.precision=bf16",
    "learning_rate": "optim.lr", "max_steps": "train.train_iters",
    "iters": "train.train_iters", "train_steps": "train.train_iters",
    "batch_size": "train.global_batch_size", "train_batch_size": "train.global_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    "seq_len": "data.seq_length", "max_seq_length": "data.seq_length",
    "warmup_steps": "optim.warmup_samples (in samples)",
    "lr_warmup_samples": "optim.warmup_samples", "lr_decay_samples": "optim.decay_samples",
    "lr_decay_style": "optim.decay_style", "gradient_clipping": "optim.clip_grad",
    "max_grad_norm": "optim.clip_grad", "zero_stage": "parallel.zero_stage",
}


def did_you_mean(names: list[str], section: str) -> str:
    """` (did you mean optim.lr?)` for mistyped dotted keys (or sections, with section ""), as
    git suggests a command: the same key name in another section first (`train.lr`), else the
    closest keys of the section (difflib), else the closest of all. Empty when nothing is close."""
    sections = [f.name for f in fields(Config)]
    every = [*DOMAINS, *sections]
    pool = [k for k in DOMAINS if k.startswith(section + ".")] if section else sections
    derived = [n for n in names if n.rpartition(".")[2] in DERIVED_DP]
    if derived:  # Megatron and DeepSpeed users reach for it; the closest key, tp, is another axis
        return (f" ({derived[0]} is not a key: the data-parallel size is the number of "
                f"processes / (parallel.tp * parallel.pp); set it with --nproc, or torchrun's "
                f"--nproc-per-node and --nnodes)")
    guesses = []
    for name in names:
        leaf = name.rpartition(".")[2]
        moved = [k for k in DOMAINS if k.rpartition(".")[2] == leaf and k != name]
        alias = [KEY_ALIASES[leaf]] if leaf in KEY_ALIASES else []
        close = (alias or moved or difflib.get_close_matches(name, pool, n=1)
                 or difflib.get_close_matches(name, every, n=1))
        if close:
            guesses.append(close[0] if len(names) == 1 else f"{close[0]} for {name}")
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if isinstance(value, _Typed):
        # A list of strings takes the text too (data.paths=0100 became ['64']).
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and \
            typing.get_args(tp) else None
        value = value.text if _takes_text(tp) or (item is not None and _takes_text(item)) \
            else value.value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        if args == (bool, type(None)) and isinstance(value, str) and value.lower() == "auto":
            return None  # a switch whose unset default decides by itself (run.tensorboard)
        non_none = [a for a in args if a is not type(None)]
        last_err = None
        for a in non_none:
            try:
                return _coerce(value, a, key)
            except UserError as e:
                last_err = e
        raise last_err  # type: ignore[misc]
    if origin is list:
        (item,) = args or (Any,)
        if isinstance(value, (str, int, float)) and item is str:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, item, key) for v in value]
    if tp is Any:
        return value
    if origin is Literal:  # the type of its choices; the domain check says which are allowed
        return _coerce(value, type(args[0]), key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{key} must be true or false{' (or auto)' if key in AUTO_SWITCHES else ''}"
                        f", got {value!r}")
    if tp is int:
        return _to_int(value, key)
    if tp is float:
        return _to_float(value, key)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, datetime.date):  # a file's `run_dir: 2026-12-07`, as written
            return value.isoformat()
        raise UserError(f"{key} must be a string, got {value!r}")
    return value


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise UserError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""))
        except ValueError:
            pass
    raise UserError(f"{key} must be an integer, got {value!r}")


def _to_float(value: Any, key: str) -> float:
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except (ValueError, OverflowError):  # OverflowError: an int beyond float's range
            pass
    # nan or inf would pass every range check (all comparisons with nan are false) and poison
    # the run; no key gives them a meaning.
    if number is None or not math.isfinite(number):
        raise UserError(f"{key} must be a finite number, got {_short(value)}")
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
