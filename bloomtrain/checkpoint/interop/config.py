"""The bloomtrain config that continues an imported run, written beside the checkpoint as
`OUT/bloomtrain.yaml`.

A Megatron-DeepSpeed checkpoint carries its launch arguments (`args`): they go through the same
conversion as `bloomtrain import-config` (bloomtrain.import_config.megatron_to_config), with the
ds_config the checkpoint saved. An HF model under DeepSpeed has no such record: its config.json,
the optimizer's hyperparameters (param_groups) and the ds_config stand in, and what none of them
records is said so: the run's length and LR schedule where neither HF Trainer's trainer_state.json
nor a DeepSpeed scheduler in the ds_config gives them, and always the sequence length. Either
way the model section is pinned to the checkpoint's exact shape, and `checkpoint.dir` is the
import (as its --output was given), so that `bloomtrain train --config OUT/bloomtrain.yaml`
resumes from it (`checkpoint.resume: auto`).
"""
from __future__ import annotations

import json
from pathlib import Path

from bloomtrain.checkpoint.interop.safe_load import InteropError
from bloomtrain.checkpoint.interop.source import Source

CONFIG_NAME = "bloomtrain.yaml"
BLOOM_SEQ = 2048


# The notes of an import: what it took from where (NOTE), and what the checkpoint does not
# record and the user must choose before training (CHOOSE), both written at the top of the YAML.
NOTE, CHOOSE = "NOTE", "CHOOSE"


def _hf_args(src: Source, notes: list[tuple[str, str]]) -> tuple[dict, dict]:
    """Megatron-style arguments for an HF model trained under DeepSpeed, and where each came
    from (config.json's fields, the optimizer's groups, the ds_config, HF Trainer's state)."""
    args = {**src.args, "position_embedding_type": "alibi", "embed_layernorm": True,
            "bf16": src.layout.get("precision") == "bf16",
            "fp16": src.layout.get("precision") == "fp16"}
    layout = "the run's layout (an HF model under DeepSpeed: tp 1, pp 1)"
    labels = {**src.arg_labels, "position_embedding_type": "BLOOM (model_type bloom)",
              "embed_layernorm": "BLOOM (model_type bloom)", "ffn_hidden_size": "BLOOM's 4 x hidden",
              "tensor_model_parallel_size": layout, "pipeline_model_parallel_size": layout,
              "make_vocab_size_divisible_by": "the embedding's rows",
              "bf16": "ds_config bf16.enabled", "fp16": "ds_config fp16.enabled"}
    # The optimizer's own groups, else what the ds_config gave it, else bloomtrain's defaults.
    groups = src.param_groups or []
    ds = src.ds_config or {}
    ds_opt = (ds.get("optimizer") or {}).get("params") or {}
    g, origin = (groups[0], "the optimizer's param_groups") if groups else \
        (ds_opt, "ds_config optimizer.params")
    if not g:
        from bloomtrain.config import OptimConfig
        o = OptimConfig()
        g, origin = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps,
                     "weight_decay": o.weight_decay}, "bloomtrain's default"
        notes.append((CHOOSE, f"the optimizer's settings: none in the checkpoint, bloomtrain's "
                              f"defaults written (lr {o.lr})"))
    betas = g.get("betas") or (0.9, 0.999)
    args.update(lr=float(g.get("lr", 0.0)), adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
                adam_eps=float(g.get("eps", 1e-8)),
                weight_decay=max(float(h.get("weight_decay", 0) or 0) for h in groups or [g]))
    labels.update(lr=f"{origin} lr", adam_beta1=f"{origin} betas[0]",
                  adam_beta2=f"{origin} betas[1]", adam_eps=f"{origin} eps",
                  weight_decay=f"{origin} weight_decay")
    for dest, key in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                      ("global_batch_size", "train_batch_size")):
        if isinstance(ds.get(key), int):
            args[dest], labels[dest] = ds[key], f"ds_config {key}"
    args["seq_length"] = BLOOM_SEQ
    labels["seq_length"] = f"not in a DeepSpeed checkpoint: BLOOM's {BLOOM_SEQ}, to choose"
    notes.append((CHOOSE, f"data.seq_length: the sequence length is not in a DeepSpeed "
                          f"checkpoint; {BLOOM_SEQ} (BLOOM's) is written, set your run's"))
    state = _trainer_state(src.path)
    if state.get("max_steps"):
        args["train_iters"] = int(state["max_steps"])
        labels["train_iters"] = "HF Trainer's trainer_state.json max_steps"
    else:
        # Needed by the conversion; replaced by the scheduler's length or taken out again.
        args["train_samples"] = max(1, src.train_state["consumed_samples"])
    args["lr_decay_style"] = "constant"
    labels["lr_decay_style"] = "no LR schedule in the checkpoint"
    return args, labels


def _trainer_state(path: Path) -> dict:
    """HF Trainer's trainer_state.json beside the step (max_steps), if any."""
    for d in (path, path.parent):
        f = d / "trainer_state.json"
        if f.is_file():
            try:
                state = json.loads(f.read_text(encoding="utf-8"))
                return state if isinstance(state, dict) else {}
            except (OSError, ValueError):
                return {}
    return {}


def _ds_schedule(ds: dict, lr: float) -> tuple[dict, int | None, list[str]] | None:
    """DeepSpeed's own LR scheduler (ds_config `scheduler`, deepspeed/runtime/lr_schedules.py)
    as bloomtrain's Megatron-style schedule, in steps: ({optim key: (value in steps or as
    is, its source)}, the run's length in steps if the scheduler has one, what differs). None
    for a scheduler bloomtrain has no counterpart of (OneCycle, LRRangeTest) or none."""
    sched = ds.get("scheduler") if isinstance(ds.get("scheduler"), dict) else None
    if not sched:
        return None
    kind, p = sched.get("type"), sched.get("params") or {}
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR") or not isinstance(p, dict):
        return None
    where = f"ds_config scheduler {kind}"

    def num(key, default):
        value = p.get(key)
        value = default if value is None else value
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    warmup, total = num("warmup_num_steps", 1000), num("total_num_steps", None)
    warmup = None if warmup is None else max(2, warmup)  # as DeepSpeed clamps it
    keys: dict = {"warmup_steps": (warmup, f"{where} warmup_num_steps")}
    # DeepSpeed steps its scheduler after the optimizer, from iteration -1: its optimizer step s
    # runs at the rate of the scheduler's iteration s - 1 (step 0 at the warm-up's start).
    # bloomtrain's step s runs at iteration s, as Megatron's does; no key shifts a schedule.
    differs = ["it steps after the optimizer, so each of its steps runs at the rate bloomtrain "
               "gives the step before (bloomtrain's schedule is one step ahead of it)"]
    if (p.get("warmup_type") or "log") != "linear":
        differs.append(f"its warm-up is {p.get('warmup_type') or 'log'} (DeepSpeed's default "
                       f"log), bloomtrain's is linear")
    if kind == "WarmupCosineLR":
        keys["lr"] = (lr, "the optimizer's lr (WarmupCosineLR scales it)")
        keys["decay_style"] = ("cosine", where)
        keys["min_lr"] = (lr * (num("cos_min_ratio", 0.0001) or 0.0),
                          f"{where} cos_min_ratio x lr")
        differs.append("its cosine runs one step ahead of Megatron's (it counts the first "
                       "step after the warm-up as 1)")
        if num("warmup_min_ratio", 0.0):
            differs.append("it warms up from warmup_min_ratio x lr, bloomtrain from 0")
    else:
        top, bottom = num("warmup_max_lr", lr), num("warmup_min_lr", 0.0)
        keys["lr"] = (top, f"{where} warmup_max_lr")
        if bottom:
            differs.append(f"it warms up from warmup_min_lr {bottom:g}, bloomtrain from 0")
        if kind == "WarmupLR":
            keys["decay_style"] = ("constant", f"{where}: constant after the warm-up")
        else:
            keys["decay_style"] = ("linear", where)
            keys["min_lr"] = (bottom or 0.0, f"{where} warmup_min_lr (its decay ends there)")
    if kind != "WarmupLR":
        if total is None:
            return None
        keys["decay_steps"] = (total, f"{where} total_num_steps")
    if any(v is None for v, _ in keys.values()):
        return None
    return keys, (int(total) if kind != "WarmupLR" else None), differs


def _apply_ds_schedule(src: Source, config: dict, report, notes) -> None:
    """The ds_config's scheduler in the config of an HF import, else a note that the LR is the
    run's last, constant."""
    from bloomtrain.import_config.conversion import Mapped

    optim, train = config.setdefault("optim", {}), config.setdefault("train", {})
    found = _ds_schedule(src.ds_config or {}, float(optim.get("lr", 0.0)))
    if found is None:
        optim.pop("decay_samples", None)  # constant: no decay to place
        notes.append((CHOOSE, f"the LR schedule: none the checkpoint records (no ds_config "
                              f"scheduler bloomtrain knows): optim.lr is the run's current "
                              f"{optim.get('lr')}, constant; set optim.decay_style, "
                              f"optim.warmup_samples and optim.decay_samples"))
        return
    keys, total, differs = found
    gbs = int(train["global_batch_size"])

    def put(section: dict, key: str, value, source: str) -> None:
        full = f"{'optim' if section is optim else 'train'}.{key}"
        report.mapped[:] = [m for m in report.mapped if m.key != full]
        report.mapped.append(Mapped(source, full, value))
        section[key] = value

    for key, (value, source) in keys.items():
        if key.endswith("_steps"):
            put(optim, key.replace("_steps", "_samples"), int(value) * gbs,
                f"{source} x train_batch_size {gbs}")
        else:
            put(optim, key, value, source)
    if keys["decay_style"][0] == "constant":
        optim.pop("decay_samples", None)
    if total is not None and "train_iters" not in train:
        train.pop("train_samples", None)
        put(train, "train_iters", total, f"ds_config scheduler {src.ds_config['scheduler']['type']}"
                                          f" total_num_steps")
    if differs:
        notes.append((NOTE, "DeepSpeed's scheduler taken as bloomtrain's: " + "; ".join(differs)))


def derive_config(src: Source, output: Path, tokenizer_dir: Path | None):
    """(config dict, the conversion's report, notes: [(NOTE or CHOOSE, text)]) of the run `src`
    continues."""
    from bloomtrain.import_config import megatron_to_config
    from bloomtrain.import_config.conversion import Mapped
    from bloomtrain.errors import UserError

    notes: list[tuple[str, str]] = []
    megatron = "tensor_model_parallel_size" in src.args
    args, labels = (dict(src.args), {}) if megatron else _hf_args(src, notes)
    world = src.layout["tp"] * src.layout["pp"] * src.layout["dp"]
    try:
        config, report = megatron_to_config(args, src.ds_config, world_size=world,
                                            saved=megatron, labels=labels)
    except UserError as e:  # arguments the conversion cannot take
        raise InteropError(f"{src.path}: the run's arguments do not convert to a bloomtrain "
                           f"config: {e}") from None
    s = src.shape
    model = config.setdefault("model", {})
    model.update(preset=None, vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                 num_layers=s.num_layers, num_heads=s.num_heads, ffn_hidden_size=s.ffn_hidden_size,
                 layer_norm_epsilon=s.layer_norm_epsilon, init_method_std=s.init_method_std,
                 hidden_dropout=s.hidden_dropout, attention_dropout=s.attention_dropout)
    multiple = model.get("make_vocab_size_divisible_by", 128)
    if s.vocab_size % multiple:
        # An HF vocabulary, or Megatron's --pad-vocab-size-to: keep the rows as they are, with
        # the largest power-of-two multiple they have (what a tp split must divide).
        multiple = s.vocab_size & -s.vocab_size
        model["make_vocab_size_divisible_by"] = min(multiple, 128)
    data = config.setdefault("data", {})
    if tokenizer_dir is not None:
        data["tokenizer"] = str(tokenizer_dir)
    elif data.pop("tokenizer", None) or not megatron:
        notes.append((CHOOSE, "data.tokenizer: the run's tokenizer was not imported "
                              "(import-deepspeed --tokenizer DIR keeps it with the checkpoint)"))
    if not megatron:
        _apply_ds_schedule(src, config, report, notes)
        if "train_iters" not in config.get("train", {}):
            config["train"].pop("train_samples", None)
            notes.append((CHOOSE, "train.train_iters or train.train_samples: the run's length "
                                  "is not in the checkpoint (no HF Trainer trainer_state.json "
                                  "max_steps, no ds_config scheduler total_num_steps); add e.g. "
                                  "train.train_iters=1000 to `bloomtrain train`"))
    # The import's directory as it was given: relative to where import-deepspeed ran, so the
    # checkpoint and its YAML move together with the directory they are in.
    config["checkpoint"] = {**config.get("checkpoint", {}), "dir": str(output), "resume": "auto"}
    report.mapped.append(Mapped("import-deepspeed --output (as given)", "checkpoint.dir",
                                str(output)))
    _check(config, world)
    return config, report, notes


def _check(config: dict, world: int) -> None:
    """The config passes bloomtrain's checks at the source's world size (where the train length
    is unknown, with a stand-in for it)."""
    from bloomtrain.config import Config
    from bloomtrain.validate import validate
    from bloomtrain.errors import UserError

    probe = json.loads(json.dumps(config))
    train = probe.setdefault("train", {})
    if train.get("train_iters") is None and train.get("train_samples") is None:
        # Long, so that no rule on the length (a warmup inside the run) judges the stand-in.
        train["train_iters"] = 10 ** 9
    try:
        validate(Config.from_dict(probe), world)
    except UserError as e:
        raise InteropError(f"the imported run's config does not pass bloomtrain's checks at its "
                           f"{world} processes: {e}") from None


def render_config(config: dict, report, notes: list[tuple[str, str]], src: Source) -> str:
    """The text of OUT/bloomtrain.yaml, each key commented with the argument it came from, and
    at the top what the checkpoint did not record and the user must choose."""
    from bloomtrain.import_config.cli import render_yaml

    header = [f"the run imported by `bloomtrain import-deepspeed` from {src.path}",
              f"({src.label}); continue it with `bloomtrain train --config THIS_FILE`"]
    choose = [text for kind, text in notes if kind == CHOOSE]
    if choose:
        header.append("TO CHOOSE before training (the checkpoint does not record it):")
        header += [f"  - {text}" for text in choose]
    header += [f"NOTE: {text}" for kind, text in notes if kind == NOTE]
    return render_yaml(config, report, header)


def write_config(text: str, output: Path) -> Path:
    from bloomtrain.files import atomic_output

    path = output / CONFIG_NAME
    with atomic_output(path, "w") as f:
        f.write(text)
    return path
