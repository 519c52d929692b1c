"""What a plan is made of: the workload (model, batch, numerics, kernels, the system that runs it)
and a candidate layout, which is the run's own `ParallelLayout` plus the per-run choices that
change memory or time (micro-batch, recompute, optimizer offload). A candidate prints as a run's
records print their layout (`tp=4 pp=12 dp=8 zero=1 schedule=1f1b mbs=2 recompute=full`), and
`--layout` reads that text back.

Systems: `bloomtrain` is this engine. `megatron-deepspeed` is the stack BLOOM-176B ran
(docs/bloom_facts.md §6): BF16_Optimizer (bf16) or DeepSpeed's fp16 ZeRO, blocking sends, the
unfused attention, no sequence parallelism or selective recompute, and kernel launches made
synchronous by the run's CUDA_LAUNCH_BLOCKING=1. They share the efficiency model.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, fields

from bloomtrain.config import (GradReduceDtype, PipelineSchedule, Recompute, WeightGatherDtype,
                               ZeroStage)
from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import BloomShape

SYSTEMS = ("bloomtrain", "megatron-deepspeed")
# The config's domains, declared once there.
RECOMPUTE = typing.get_args(Recompute)
SCHEDULES = typing.get_args(PipelineSchedule)
GRAD_DTYPES = typing.get_args(GradReduceDtype)
GATHER_DTYPES = typing.get_args(WeightGatherDtype)
ZERO_STAGES = typing.get_args(ZeroStage)


@dataclass(frozen=True)
class Workload:
    """What is trained and how: the model, the batch, the numerics and kernels that size it."""

    shape: BloomShape
    seq: int
    global_batch: int
    precision: str = "bf16"
    attention: str = "fused"       # fused | sdpa | unfused
    bucket_size_mb: float = 25.0
    mask_bytes: int = 1
    system: str = "bloomtrain"
    partition: str = "type:transformer|embedding"
    # parallel.offload_pin_memory: under offload the states are page-locked too.
    offload_pin_memory: bool = False
    # Bytes on the wire per byte of the dp gradient reduction and of the parameter gathers that
    # the step time prices (1: uncompressed; an int8 reduction of fp32 gradients about 1/4).
    dp_reduce_bytes_ratio: float = 1.0
    dp_gather_bytes_ratio: float = 1.0
    # What the layout rules of `bloomtrain train` depend on beyond the layout itself
    # (bloomtrain.layout: tensor_parallel_problems, training_problems, BatchSchedule).
    vocab_multiple: int = 128             # model.make_vocab_size_divisible_by
    compile: bool = False                 # train.compile
    rampup: tuple[int, int, int] | None = None   # train.rampup_batch_size

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise UserError(f"system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if self.seq < 1 or self.global_batch < 1:
            raise UserError("--seq and --global-batch must be positive")

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def megatron(self) -> bool:
        return self.system == "megatron-deepspeed"


@dataclass(frozen=True)
class Candidate:
    """A layout: the run's ParallelLayout and the choices outside it that change memory or
    time."""

    layout: ParallelLayout
    micro_batch: int = 1
    recompute: str = "none"
    offload: bool = False
    # The dp communication's wire formats (parallel.grad_reduce_dtype, grad_error_feedback,
    # weight_gather_dtype, zero_secondary_shard; bloomtrain/parallel/zero/compress.py).
    grad_reduce: str = "fp32"
    error_feedback: bool = False
    weight_gather: str = "auto"
    hpz: bool = False

    def __post_init__(self):
        if self.grad_reduce not in GRAD_DTYPES:
            raise UserError(f"grad must be one of {', '.join(GRAD_DTYPES)}")
        if self.weight_gather not in GATHER_DTYPES:
            raise UserError(f"gather must be one of {', '.join(GATHER_DTYPES)}")
        if self.error_feedback and self.grad_reduce == "fp32":
            raise UserError("ef (error feedback) needs a compressed reduction: grad=bf16|int8")
        if (self.weight_gather != "auto" or self.hpz) and self.zero_stage != 3:
            raise UserError("gather= and hpz need zero=3: only ZeRO-3 gathers weights")

    @classmethod
    def of(cls, *, tp=1, pp=1, dp=1, micro_batch=1, recompute="none", offload=False,
           partition="type:transformer|embedding", grad_reduce="fp32", error_feedback=False,
           weight_gather="auto", hpz=False, **layout) -> "Candidate":
        """From the layout's field names (zero_stage, schedule, num_virtual_stages,
        sequence_parallel) and the candidate's own."""
        return cls(ParallelLayout(tp=tp, pp=pp, dp=dp, partition=partition, **layout),
                   micro_batch, recompute, offload, grad_reduce, error_feedback,
                   weight_gather, hpz)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def zero_stage(self) -> int:
        return self.layout.zero_stage

    @property
    def num_gpus(self) -> int:
        return self.layout.world_size

    def label(self) -> str:
        return (f"{self.layout.label()} mbs={self.micro_batch}"
                + (f" recompute={self.recompute}" if self.recompute != "none" else "")
                + (" offload" if self.offload else "")
                + (f" grad={self.grad_reduce}" if self.grad_reduce != "fp32" else "")
                + (" ef" if self.error_feedback else "")
                + (f" gather={self.weight_gather}" if self.weight_gather != "auto" else "")
                + (" hpz" if self.hpz else ""))

    def record(self) -> dict:
        """The layout's fields (less the partition, the workload's) and the candidate's."""
        out = {f.name: getattr(self.layout, f.name) for f in fields(ParallelLayout)
               if f.name != "partition"}
        return {**out, "micro_batch": self.micro_batch, "recompute": self.recompute,
                "offload": self.offload, "grad_reduce_dtype": self.grad_reduce,
                "grad_error_feedback": self.error_feedback,
                "weight_gather_dtype": self.weight_gather,
                "zero_secondary_shard": self.hpz}


# The keys --layout and --only read: the layout's field names, the label's short ones.
_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "mbs": "micro_batch", "micro_batch": "micro_batch",
         "zero": "zero_stage", "zero_stage": "zero_stage", "recompute": "recompute",
         "schedule": "schedule", "v": "num_virtual_stages",
         "num_virtual_stages": "num_virtual_stages", "sp": "sequence_parallel",
         "sequence_parallel": "sequence_parallel", "offload": "offload",
         "grad": "grad_reduce", "grad_reduce_dtype": "grad_reduce", "ef": "error_feedback",
         "grad_error_feedback": "error_feedback", "gather": "weight_gather",
         "weight_gather_dtype": "weight_gather", "hpz": "hpz", "zero_secondary_shard": "hpz"}
_FLAGS = ("sequence_parallel", "offload", "error_feedback", "hpz")


def parse_pairs(spec: str, what: str) -> dict:
    """`key=value` items, separated by commas or spaces, over the layout keys (tp, pp, dp, mbs,
    zero, recompute, schedule, v, sp, offload, grad, ef, gather, hpz, or the layout's and the
    config's field names); a bare `sp`, `offload`, `ef` or `hpz` is true, so that a printed
    label reads back."""
    values: dict = {}
    for item in spec.replace(",", " ").split():
        key, eq, val = item.partition("=")
        name = _KEYS.get(key)
        if name is None or (not eq and name not in _FLAGS):
            raise UserError(f"{what}: cannot read {item!r}; give key=value pairs with keys "
                            f"{', '.join(sorted(set(_KEYS)))}")
        values[name] = _value(name, val if eq else "1", key, what)
    if values.get("recompute", "none") not in RECOMPUTE:
        raise UserError(f"{what} recompute must be one of {', '.join(RECOMPUTE)}")
    if values.get("schedule", "1f1b") not in SCHEDULES:
        raise UserError(f"{what} schedule must be one of {', '.join(SCHEDULES)}")
    if values.get("grad_reduce", "fp32") not in GRAD_DTYPES:
        raise UserError(f"{what} grad must be one of {', '.join(GRAD_DTYPES)}")
    if values.get("weight_gather", "auto") not in GATHER_DTYPES:
        raise UserError(f"{what} gather must be one of {', '.join(GATHER_DTYPES)}")
    return values


def _value(name: str, val: str, key: str, what: str):
    if name in ("recompute", "schedule", "grad_reduce", "weight_gather"):
        return val
    if name in _FLAGS:
        if val.lower() not in ("0", "1", "true", "false"):
            raise UserError(f"{what} {key}: use 0/1 or true/false, not {val!r}")
        return val.lower() in ("1", "true")
    try:
        number = int(val)
    except ValueError:
        raise UserError(f"{what} {key}: {val!r} is not an integer") from None
    # Sizes and counts are at least 1 (mbs=0 divided by zero, dp=-4,tp=-1 multiplied to 4);
    # the ZeRO stage is the one that may be 0.
    if number < (0 if name == "zero_stage" else 1):
        raise UserError(f"{what} {key}: must be at least {0 if name == 'zero_stage' else 1}, "
                        f"got {number}")
    return number


def parse_layout(spec: str, num_gpus: int, partition: str,
                 defaults: dict | None = None) -> Candidate:
    """`tp=4 pp=12 dp=8 zero=1 mbs=2 recompute=full` (or comma-separated; schedule, v, sp,
    offload, grad=fp32|bf16|int8, ef, gather=auto|bf16|int8, hpz optional); dp may be left out
    (what the GPUs leave). `defaults`: Candidate fields the text does not set (the config's
    grad_reduce, error_feedback, weight_gather, hpz)."""
    values = parse_pairs(spec, "--layout")
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values:
        if tp < 1 or pp < 1 or num_gpus % (tp * pp):
            raise UserError(f"--gpus ({num_gpus}) is not divisible by tp*pp ({tp}*{pp})")
        values["dp"] = num_gpus // (tp * pp)
    if values.get("schedule") == "interleaved" and "num_virtual_stages" not in values:
        values["num_virtual_stages"] = 2
    values.setdefault("zero_stage", 1)
    for key, val in (defaults or {}).items():  # the config's dp wire formats, where they apply
        if values["zero_stage"] == 3 or key not in ("weight_gather", "hpz"):
            values.setdefault(key, val)
    return Candidate.of(partition=partition, **values)


def matches(cand: Candidate, pinned: dict) -> bool:
    """Whether `cand` has every value `pinned` (parse_pairs' names) asks for."""
    return all((getattr(cand, k) if hasattr(cand, k) else getattr(cand.layout, k)) == v
               for k, v in pinned.items())
