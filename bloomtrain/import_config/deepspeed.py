"""What DeepSpeed decided in a Megatron-DeepSpeed run: precision, ZeRO stage and offload, gradient
clipping, fp16 loss scaling and the batch, from the ds_config (its "auto" values resolved from the
Megatron arguments, as transformers' DeepSpeed integration resolves them from its own), and the
batch rules checked against the world size.

Under DeepSpeed the ds_config wins over Megatron's arguments where both speak: Megatron hands its
optimizer and LR schedule to deepspeed.initialize, but clipping and loss scaling are the engine's,
from the ds_config (Megatron's --clip-grad and --loss-scale are then unused).
"""
from __future__ import annotations

import typing
from typing import Any, Mapping

from bloomtrain.config import ZeroStage
from bloomtrain.errors import UserError
from bloomtrain.import_config.conversion import Conversion, Mapped, Skipped

# DeepSpeed's stages are ours (bloomtrain.config.ZeroStage).
ZERO_STAGES = typing.get_args(ZeroStage)

_LOG = "logging and profiling; bloomtrain logs to run_dir/metrics.jsonl"
_SPEED = "a memory or speed setting of DeepSpeed's engine that leaves the math as it is"
# Top-level ds_config keys that need no more than a reason.
_TOP = {
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
                     "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
                     "comms_logger", "timers", "monitor_config"), ("ignore", _LOG)),
    **dict.fromkeys(("prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
                     "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                     "activation_checkpointing", "aio", "pipeline", "checkpoint",
                     "dataloader_drop_last", "autotuning", "nebula", "graph_harvesting",
                     "disable_allgather", "seq_parallel_communication_data_type"),
                    ("ignore", _SPEED)),
    "optimizer": ("ignore", "Megatron passes its own optimizer to deepspeed.initialize, which "
                            "then leaves this section unused"),
    # Megatron passes its LR schedule too, but DeepSpeed of Megatron-DeepSpeed's time
    # (DeepSpeedEngine._configure_lr_scheduler) built this section's schedule first and used it
    # over the one passed in: the Megatron schedule the YAML gets may not be the run's.
    "scheduler": ("unsupported", "a DeepSpeed LR schedule: the DeepSpeed versions of "
                                 "Megatron-DeepSpeed's time used it over Megatron's --lr-* "
                                 "schedule, which the YAML has; drop the section if the run's "
                                 "DeepSpeed used Megatron's"),
    **dict.fromkeys(("elasticity", "curriculum_learning", "data_efficiency",
                     "compression_training", "sparse_attention", "hybrid_engine",
                     "quantize_training", "progressive_layer_drop", "eigenvalue",
                     "torch_autocast"), ("unsupported", "a DeepSpeed training feature bloomtrain "
                                                        "does not have")),
}
_ZERO_SPEED = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
               "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
               "sub_group_size", "elastic_checkpoint", "load_from_fp32_weights",
               "ignore_unused_parameters", "legacy_stage1", "stage3_max_live_parameters",
               "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
               "stage3_gather_fp16_weights_on_model_save", "memory_efficient_linear",
               "use_multi_rank_bucket_allreduce", "cpu_offload_params",
               "prefetch_bucket_size",
               "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
               "gather_16bit_weights_on_model_save", "log_trace_cache_warnings")
_DYNAMIC = {"initial_scale_power": ("optim.initial_loss_scale", 16),
            "loss_scale_window": ("optim.loss_scale_window", 1000),
            "hysteresis": ("optim.hysteresis", 2),
            "min_loss_scale": ("optim.min_loss_scale", 1)}


def apply(c: Conversion) -> None:
    ds = c.ds
    if ds is None and c.flag("deepspeed"):
        c.unchecked("the run used DeepSpeed (--deepspeed) but its ds_config is not given: "
                    "precision, ZeRO stage, clipping, loss scaling and the batch rule come from "
                    "the Megatron arguments alone (pass --deepspeed-config)")
    if c.has("deepspeed"):
        c.ignore("deepspeed", "DeepSpeed's engine switch: bloomtrain is its own engine")
    precision = _precision(c, ds)
    _zero(c, ds, precision)
    _clip(c, ds)
    _loss_scale(c, ds, precision)
    _batch_rules(c, ds)
    if ds is not None:
        _data_types(c, ds)
        for key in ds:
            if key not in _HANDLED:
                action, reason = _TOP.get(key, ("unsupported", "a ds_config key import-config "
                                                               "does not know"))
                _skip(c, key, ds[key], reason, action)


def _skip(c: Conversion, path: str, value: Any, reason: str, action: str = "ignore") -> None:
    entry = Skipped(f"ds_config {path}: {_short(value)}", reason)
    (c.report.ignored if action == "ignore" else c.report.unsupported).append(entry)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapped(c: Conversion, key: str | None, value: Any, path: str, note: str = "") -> None:
    if key is not None:
        c.put(key, value)
    c.report.mapped.append(Mapped(f"ds_config {path}", key, value, note))


def _section(ds: Mapping, key: str) -> Mapping:
    section = ds.get(key) or {}
    if not isinstance(section, Mapping):
        raise UserError(f"ds_config {key} must be an object, got {section!r}")
    return section


def _enabled(ds: Mapping, key: str, megatron: bool) -> bool:
    value = _section(ds, key).get("enabled", False)
    return megatron if value == "auto" else bool(value)


def _precision(c: Conversion, ds: Mapping | None) -> str:
    bf16, fp16 = c.flag("bf16"), c.flag("fp16")
    if bf16 and fp16:
        raise UserError("--bf16 and --fp16 are both given; Megatron refuses that")
    megatron = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    dests = ["bf16"] if bf16 else ["fp16"] if fp16 else ["bf16", "fp16"]
    if ds is None:
        c.set("train.precision", megatron, dests)
        return megatron
    if _enabled(ds, "amp", False):
        _skip(c, "amp", ds["amp"], "NVIDIA apex AMP; bloomtrain's mixed precision is "
                                   "train.precision", "unsupported")
    ds_bf16 = _enabled(ds, "bf16", bf16) or _enabled(ds, "bfloat16", bf16)
    ds_fp16 = _enabled(ds, "fp16", fp16)
    engine = "bf16" if ds_bf16 else "fp16" if ds_fp16 else "fp32"
    if engine != megatron:
        raise UserError(f"the ds_config runs DeepSpeed in {engine} but the Megatron arguments "
                        f"build the model in {megatron}; they must agree, so fix the one that "
                        f"is wrong (ds_config bf16/fp16 \"enabled\", or --bf16/--fp16)")
    section = "bf16" if "bf16" in ds else "bfloat16" if "bfloat16" in ds else "fp16"
    c.set("train.precision", megatron, dests,
          source=f"{c.source(dests)} + ds_config {section}.enabled")
    return megatron


def _zero(c: Conversion, ds: Mapping | None, precision: str) -> None:
    if c.flag("deepspeed") or ds is not None:
        c.ignore("use_distributed_optimizer", "Megatron-LM's; under DeepSpeed its ZeRO stage "
                                              "decides")
    if ds is None:
        if c.flag("deepspeed"):
            stage = _zero_stage(c)
            c.set("parallel.zero_stage", _bf16_stage(stage, precision), "zero_stage",
                  _bf16_note(stage, precision))
        else:
            use = c.flag("use_distributed_optimizer")
            c.set("parallel.zero_stage", int(use), "use_distributed_optimizer",
                  "Megatron's distributed optimizer shards the optimizer state: ZeRO-1" if use
                  else "Megatron without DeepSpeed keeps the whole optimizer on every rank")
            c.ignore("zero_stage", "DeepSpeed's stage, and this run does not use DeepSpeed")
        return
    zero = ds.get("zero_optimization") or {}
    zero = {"stage": int(zero)} if isinstance(zero, bool) else zero  # old DeepSpeed's switch
    if not isinstance(zero, Mapping):
        raise UserError(f"ds_config zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        raise UserError(f"ds_config zero_optimization.stage must be {_stages_text()}, got "
                        f"{stage!r}")
    _mapped(c, "parallel.zero_stage", _bf16_stage(stage, precision),
            "zero_optimization.stage", _bf16_note(stage, precision))
    if c.has("zero_stage"):
        given = _zero_stage(c)
        c.ignore("zero_stage", "DeepSpeed takes the stage from the ds_config"
                 + (f" ({stage}), not this" if given != stage else ", which agrees"))
    _offload(c, zero)
    for key, value in zero.items():
        if key in _ZERO_SPEED:
            _skip(c, f"zero_optimization.{key}", value, _SPEED)
        elif key not in ("stage", "offload_optimizer", "offload_param", "cpu_offload",
                         "cpu_offload_use_pin_memory"):
            _skip(c, f"zero_optimization.{key}", value,
                  "a ZeRO setting import-config does not know", "unsupported")


def _zero_stage(c: Conversion) -> int:
    stage = c.float("zero_stage")  # Megatron's default is the float 1.0
    if stage not in ZERO_STAGES:
        raise UserError(f"{c.given_text('zero_stage')}: a ZeRO stage is {_stages_text()}")
    return int(stage)


def _stages_text() -> str:
    """`0, 1, 2 or 3`."""
    *rest, last = map(str, ZERO_STAGES)
    return f"{', '.join(rest)} or {last}"


def _bf16_stage(stage: int, precision: str) -> int:
    return 1 if stage == 0 and precision == "bf16" else stage


def _bf16_note(stage: int, precision: str) -> str:
    if stage == 0 and precision == "bf16":
        return ("DeepSpeed runs bf16 at stage 0 with its BF16_Optimizer, which shards the fp32 "
                "masters and Adam moments over dp: bloomtrain's zero_stage 1")
    return ""


def _offload(c: Conversion, zero: Mapping) -> None:
    device = _section(zero, "offload_optimizer").get("device")
    path = "zero_optimization.offload_optimizer.device"
    if zero.get("cpu_offload") is True:  # old DeepSpeed's spelling
        device, path = "cpu", "zero_optimization.cpu_offload"
    if device == "cpu":
        _mapped(c, "parallel.offload_optimizer", True, path)
        pin, pin_path = (_section(zero, "offload_optimizer").get("pin_memory"),
                         "zero_optimization.offload_optimizer.pin_memory")
        if zero.get("cpu_offload") is True:
            pin, pin_path = (zero.get("cpu_offload_use_pin_memory"),
                             "zero_optimization.cpu_offload_use_pin_memory")
        if pin is not None:
            _mapped(c, "parallel.offload_pin_memory", bool(pin), pin_path)
    elif device == "nvme":
        _skip(c, path, device, "optimizer state on NVMe (ZeRO-Infinity); bloomtrain offloads "
                               "to host memory only (parallel.offload_optimizer)", "unsupported")
    elif device is not None:
        _mapped(c, "parallel.offload_optimizer", False, path)
    param = _section(zero, "offload_param").get("device")
    if param not in (None, "none"):
        _skip(c, "zero_optimization.offload_param.device", param,
              "parameters offloaded (ZeRO-Infinity); bloomtrain keeps them on the device",
              "unsupported")


def _clip(c: Conversion, ds: Mapping | None) -> None:
    clip = c.float("clip_grad")
    if ds is None:
        c.set("optim.clip_grad", clip, "clip_grad")
        return
    value = ds.get("gradient_clipping")
    if value == "auto":
        c.set("optim.clip_grad", clip, "clip_grad", "ds_config gradient_clipping \"auto\"")
    elif value is None:
        # Under --deepspeed Megatron hands DeepSpeed a plain optimizer, so --clip-grad is never
        # applied; DeepSpeed's own default is what clipped. It was 0 (off) in every release until
        # PR #8068 (June 2026) made it 1.0: the Megatron-DeepSpeed era ran unclipped.
        c.set("optim.clip_grad", 0.0, None, "DeepSpeed's default before June 2026",
              source="ds_config gradient_clipping (not given)")
        c.ignore("clip_grad", "under --deepspeed only the ds_config's gradient_clipping clips")
        c.unchecked("the ds_config sets no gradient_clipping: DeepSpeed did not clip by default "
                    "before PR #8068 (June 2026; 1.0 since, as in 0.19), so optim.clip_grad is 0; "
                    "set optim.clip_grad=1.0 if the run used a DeepSpeed from after that change")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UserError(f"ds_config gradient_clipping must be a number >= 0, got {value!r}")
        _mapped(c, "optim.clip_grad", float(value), "gradient_clipping")
        c.ignore("clip_grad", "DeepSpeed clips at the ds_config's gradient_clipping"
                 + (f" ({float(value):g}), not this" if float(value) != clip else ", the same"))


def _loss_scale(c: Conversion, ds: Mapping | None, precision: str) -> None:
    megatron = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                "hysteresis")
    if precision != "fp16":
        for dest in megatron:
            c.ignore(dest, "only fp16 scales the loss")
        if ds is not None and "fp16" in ds:
            _skip(c, "fp16", ds["fp16"], "only fp16 scales the loss")
        return
    if ds is None:
        if c.has("loss_scale"):
            c.unsupported("loss_scale", "a static loss scale; bloomtrain's fp16 scales "
                                        "dynamically")
        for dest, key in zip(megatron[1:], ("initial_loss_scale", "min_loss_scale",
                                            "loss_scale_window", "hysteresis")):
            value = c.float(dest) if dest != "hysteresis" else c.int(dest)
            c.set(f"optim.{key}", int(value) if key == "loss_scale_window" else value, dest)
        return
    for dest in megatron:
        c.ignore(dest, "DeepSpeed scales the loss from the ds_config's fp16 section")
    fp16 = _section(ds, "fp16")
    if fp16.get("loss_scale", 0) != 0:
        _skip(c, "fp16.loss_scale", fp16["loss_scale"], "a static loss scale; bloomtrain's fp16 "
                                                         "scales dynamically", "unsupported")
    for name, (key, default) in _DYNAMIC.items():
        value = fp16.get(name, default)
        # A scale beyond 2^127 is no float32 number.
        top = 127 if name == "initial_scale_power" else 1e9
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 <= value <= top:
            raise UserError(f"ds_config fp16.{name} must be a number in [0, {top:g}], got "
                            f"{value!r}")
        value = 2.0 ** value if name == "initial_scale_power" else value
        _mapped(c, key, float(value) if key.endswith("_scale") else int(value), f"fp16.{name}",
                "" if name in fp16 else "not given: DeepSpeed's default")
    if "initial_scale_power" not in fp16:
        c.unchecked("the ds_config's fp16 section sets no initial_scale_power: DeepSpeed's "
                    "default is 16 since 0.8.0 (January 2023) and was 32 before; set "
                    "optim.initial_loss_scale=4294967296 if the run used an older DeepSpeed")
    for name, value in fp16.items():
        if name == "consecutive_hysteresis" and value:
            _skip(c, "fp16.consecutive_hysteresis", value, "hysteresis restored after every "
                  "step without overflow; bloomtrain's (Megatron's) restores it when the scale "
                  "grows", "unsupported")
        elif name not in (*_DYNAMIC, "enabled", "loss_scale", "consecutive_hysteresis",
                          "auto_cast"):
            _skip(c, f"fp16.{name}", value, "an fp16 setting import-config does not know",
                  "unsupported")


def _data_types(c: Conversion, ds: Mapping) -> None:
    for path, value in (("data_types.grad_accum_dtype",
                         _section(ds, "data_types").get("grad_accum_dtype")),
                        ("communication_data_type", ds.get("communication_data_type"))):
        if value is None:
            continue
        if str(value).lower() in ("fp32", "float32", "float"):
            _skip(c, path, value, "bloomtrain accumulates and reduces gradients in fp32")
        else:
            _skip(c, path, value, "gradients kept in a 16-bit type; bloomtrain accumulates "
                                  "and reduces them in fp32", "unsupported")


def _ds_batch(ds: Mapping, key: str, auto: int | None) -> int | None:
    value = ds.get(key)
    if value == "auto" or value is None:
        return auto if value == "auto" else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"ds_config {key} must be a positive integer or \"auto\", got {value!r}")
    return value


def _batch_rules(c: Conversion, ds: Mapping | None) -> None:
    """DeepSpeed's train_batch_size = micro x accumulation x dp, and Megatron's global batch in
    whole micro-batches per dp rank, at the run's world size."""
    m, g, dp = c.micro, c.gbs, c.dp
    arith = f"dp {dp} ({c.world} GPUs / (tp {c.tp} x pp {c.pp}))"
    steps = g // (m * dp) if dp and g % (m * dp) == 0 else None
    if ds is not None:
        micro = _ds_batch(ds, "train_micro_batch_size_per_gpu", m)
        total = _ds_batch(ds, "train_batch_size", g)
        accum = _ds_batch(ds, "gradient_accumulation_steps", steps)
        for key, value, flag, ours in (("train_micro_batch_size_per_gpu", micro,
                                        "--micro-batch-size", m),
                                       ("train_batch_size", total, "--global-batch-size", g)):
            if value is not None and value != ours:
                raise UserError(f"ds_config {key} {value} != {flag} {ours}: the run cannot have "
                                f"had both; fix the one that is wrong")
            if key in ds:
                _mapped(c, None, value, key, f"{'auto: ' if ds[key] == 'auto' else ''}"
                        f"train.{'micro' if flag == '--micro-batch-size' else 'global'}"
                        f"_batch_size, as {flag}")
        if dp is not None and accum is not None and total is not None and \
                total != micro * accum * dp:
            raise UserError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} "
                            f"x gradient_accumulation_steps {accum} x {arith} = "
                            f"{micro * accum * dp}")
        if "gradient_accumulation_steps" in ds:
            _mapped(c, None, accum, "gradient_accumulation_steps",
                    "bloomtrain derives it: global batch / (micro x dp)")
    if dp is None:
        c.unchecked("the batch rules (DeepSpeed's train_batch_size = micro x accumulation x dp, "
                    "Megatron's global batch a multiple of micro x dp): the world size is "
                    "unknown (pass --world-size)")
    elif g % (m * dp):
        raise UserError(f"--global-batch-size {g} is not a multiple of --micro-batch-size {m} x "
                        f"{arith} = {m * dp}")


_HANDLED = {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
            "gradient_clipping", "zero_optimization", "bf16", "bfloat16", "fp16", "amp",
            "data_types", "communication_data_type"}
