"""The bloomtrain config that continues an imported run, written beside the checkpoint as
`OUT/bloomtrain.yaml`.

A Megatron-DeepSpeed checkpoint carries its launch arguments (`args`): they go through the same
conversion as `bloomtrain import-config` (bloomtrain.import_config.megatron_to_config), with the
ds_config the checkpoint saved. An HF model under DeepSpeed has no such record: its config.json,
the optimizer's hyperparameters (param_groups) and the ds_config stand in, and what none of them
records (the sequence length, the run's length, the LR schedule) is said so. Either way the model
section is pinned to the checkpoint's exact shape, and `checkpoint.dir` is the import, so that
`bloomtrain train --config OUT/bloomtrain.yaml` resumes from it (`checkpoint.resume: auto`).
"""
from __future__ import annotations

import json
from pathlib import Path

from bloomtrain.checkpoint.interop.safe_load import InteropError
from bloomtrain.checkpoint.interop.source import Source

CONFIG_NAME = "bloomtrain.yaml"
BLOOM_SEQ = 2048


def _hf_args(src: Source, notes: list[str]) -> dict:
    """Megatron-style arguments for an HF model trained under DeepSpeed."""
    args = {**src.args, "position_embedding_type": "alibi", "embed_layernorm": True,
            "bf16": src.layout.get("precision") == "bf16",
            "fp16": src.layout.get("precision") == "fp16"}
    # The optimizer's own groups, else what the ds_config gave it, else bloomtrain's defaults.
    groups = src.param_groups or []
    ds_opt = ((src.ds_config or {}).get("optimizer") or {}).get("params") or {}
    g = groups[0] if groups else ds_opt
    if not g:
        from bloomtrain.config import OptimConfig
        o = OptimConfig()
        g = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
        notes.append(f"no optimizer settings found: bloomtrain's defaults (lr {o.lr})")
    betas = g.get("betas") or (0.9, 0.999)
    args.update(lr=float(g.get("lr", 0.0)), adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
                adam_eps=float(g.get("eps", 1e-8)),
                weight_decay=max(float(h.get("weight_decay", 0) or 0) for h in groups or [g]))
    args["lr_decay_style"] = "constant"
    notes.append(f"the LR schedule is not in a DeepSpeed checkpoint: optim.lr is the run's "
                 f"current {args.get('lr')}, constant; set the schedule you want")
    ds = src.ds_config or {}
    for dest, key in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                      ("global_batch_size", "train_batch_size")):
        if isinstance(ds.get(key), int):
            args[dest] = ds[key]
    args["seq_length"] = BLOOM_SEQ
    notes.append(f"the sequence length is not in a DeepSpeed checkpoint: data.seq_length is "
                 f"{BLOOM_SEQ} (BLOOM's); set your run's")
    state = _trainer_state(src.path)
    if state.get("max_steps"):
        args["train_iters"] = int(state["max_steps"])
    else:
        # Needed by the conversion; taken out of the config again below.
        args["train_samples"] = max(1, src.train_state["consumed_samples"])
    return args


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


def derive_config(src: Source, output: Path, tokenizer_dir: Path | None):
    """(config dict, the conversion's report, notes) of the run `src` continues."""
    from bloomtrain.import_config import megatron_to_config
    from bloomtrain.errors import UserError

    notes: list[str] = []
    megatron = "tensor_model_parallel_size" in src.args
    args = dict(src.args) if megatron else _hf_args(src, notes)
    world = src.layout["tp"] * src.layout["pp"] * src.layout["dp"]
    try:
        config, report = megatron_to_config(args, src.ds_config, world_size=world,
                                            saved=megatron)
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
    elif data.pop("tokenizer", None):
        notes.append("data.tokenizer left unset: the run's tokenizer was not imported "
                     "(--tokenizer DIR)")
    if not megatron:
        config.get("optim", {}).pop("decay_samples", None)  # constant: no decay to place
    if not megatron and "train_iters" not in config.get("train", {}):
        config["train"].pop("train_samples", None)
        notes.append("the run's length is not in a DeepSpeed checkpoint: set train.train_iters "
                     "or train.train_samples")
    config["checkpoint"] = {**config.get("checkpoint", {}), "dir": str(output.resolve()),
                            "resume": "auto"}
    _check(config, world)
    return config, report, notes


def _check(config: dict, world: int) -> None:
    """The config passes bloomtrain's checks at the source's world size (where the train length
    is unknown, with a stand-in for it)."""
    from bloomtrain.config import Config
    from bloomtrain.layout import validate
    from bloomtrain.errors import UserError

    probe = json.loads(json.dumps(config))
    train = probe.setdefault("train", {})
    if train.get("train_iters") is None and train.get("train_samples") is None:
        train["train_iters"] = 1
    try:
        validate(Config.from_dict(probe), world)
    except UserError as e:
        raise InteropError(f"the imported run's config does not pass bloomtrain's checks at its "
                           f"{world} processes: {e}") from None


def render_config(config: dict, report, notes: list[str], src: Source) -> str:
    """The text of OUT/bloomtrain.yaml, each key commented with the argument it came from."""
    from bloomtrain.import_config.cli import render_yaml

    header = [f"the run imported by `bloomtrain import-deepspeed` from {src.path}",
              f"({src.label}); continue it with `bloomtrain train --config THIS_FILE`"]
    header += [f"NOTE: {n}" for n in notes]
    return render_yaml(config, report, header)


def write_config(text: str, output: Path) -> Path:
    from bloomtrain.utils import atomic_output

    path = output / CONFIG_NAME
    with atomic_output(path, "w") as f:
        f.write(text)
    return path
