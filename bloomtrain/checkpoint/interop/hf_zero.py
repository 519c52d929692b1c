"""HF transformers' BloomForCausalLM trained under DeepSpeed (ZeRO 1, 2 or 3, fp32, fp16 or bf16,
the BF16_Optimizer included), as HF's Trainer or a plain `deepspeed.initialize(model=...)` saves
it: one model-parallel rank, parameters under their HF names.

The weights are the module's own (`mp_rank_00_model_states.pt`'s `module`, the tied head stored
as the embedding); under ZeRO-3 that file holds empty placeholders and the weights are the fp32
masters cast to the run's dtype, as DeepSpeed's own consolidation makes them. The shape comes
from HF's `config.json` beside the step directory (HF's Trainer saves it there): the tensors
alone cannot tell the number of attention heads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bloomtrain.checkpoint.interop import files as dsfiles
from bloomtrain.checkpoint.interop.safe_load import InteropError, load
from bloomtrain.checkpoint.interop.source import WEIGHTS, Source, check_decay_groups
from bloomtrain.checkpoint.interop.zero import ZeroShards
from bloomtrain.devices import torch_dtype
from bloomtrain.model.params import EMBEDDING, LM_HEAD



def precision_of(ds_config: dict | None, optim_prefix: str = "") -> str:
    cfg = ds_config or {}
    for key in ("bf16", "bfloat16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True:
            return "bf16"
    if isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") is True:
        return "fp16"
    return "bf16" if optim_prefix == "bf16_" else "fp32"


def zero_stage_of(ds_config: dict | None) -> int:
    z = (ds_config or {}).get("zero_optimization") or {}
    return int(z.get("stage", 0)) if isinstance(z, dict) else 0


def hf_shape(files, where, model_config: Path | None = None, vocab_rows: int | None = None):
    """(BloomShape, Megatron-style args, their labels) of an HF model under DeepSpeed: from
    `model_config` (--model-config: an HF config or a bloomtrain model section) when given, else
    the HF config.json beside the checkpoint."""
    from bloomtrain.checkpoint.hf.convert import shape_from_hf_config
    from bloomtrain.errors import UserError

    if model_config is not None:
        return model_config_shape(Path(model_config), vocab_rows)
    path = dsfiles.find_config_json(files)
    if path is None:
        raise InteropError(f"{where}: no config.json beside the checkpoint; a model trained under "
                           f"DeepSpeed is read with its HF config (HF's Trainer saves it in "
                           f"checkpoint-N/): give it with --model-config FILE (the model's HF "
                           f"config.json, or a bloomtrain YAML with its model section)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        return (shape_from_hf_config(cfg), *_args_from_hf(cfg, path.name))
    except (OSError, ValueError) as e:
        raise InteropError(f"cannot read {path}: {e}") from None
    except UserError as e:  # another architecture, or a setting bloomtrain's model lacks
        raise InteropError(f"{path}: {e}") from None


def model_config_shape(path: Path, vocab_rows: int | None):
    """--model-config FILE: an HF config.json (a `model_type`), or a bloomtrain config's model
    section (YAML or JSON, `model:` with a preset or an explicit shape, or its keys alone).
    Without a vocabulary of its own, a model section takes the checkpoint's embedding rows."""
    import yaml

    from bloomtrain.errors import UserError
    from bloomtrain.checkpoint.hf.convert import shape_from_hf_config

    try:
        text = path.read_text(encoding="utf-8")
        try:  # JSON first: YAML 1.1 reads JSON's 1e-05 as a string
            data = json.loads(text)
        except ValueError:
            data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InteropError(f"--model-config {path}: cannot read it: "
                           f"{str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise InteropError(f"--model-config {path}: expected an HF config.json or a bloomtrain "
                           f"model section (a mapping), got {type(data).__name__}")
    try:
        if "model_type" in data:
            return (shape_from_hf_config(data), *_args_from_hf(data, path.name))
        return _model_section_shape(data.get("model", data), path, vocab_rows)
    except UserError as e:
        raise InteropError(f"--model-config {path}: {e}") from None


def _model_section_shape(section, path: Path, vocab_rows: int | None):
    from bloomtrain.config import Config
    from bloomtrain.model.presets import resolve_model_config

    if not isinstance(section, dict):
        raise InteropError(f"--model-config {path}: `model` must be a mapping of model.* keys")
    section = {"preset": None, **section}  # an explicit shape, not bloomtrain's default preset
    if section.get("vocab_size") is None and vocab_rows:
        section.update(vocab_size=vocab_rows, make_vocab_size_divisible_by=1)
    model = Config.from_dict({"model": section}).model
    shape = resolve_model_config(model)
    label = f"{path.name} model."
    args = {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
            "num_attention_heads": shape.num_heads, "ffn_hidden_size": shape.ffn_hidden_size,
            "padded_vocab_size": shape.vocab_size, "layernorm_epsilon": shape.layer_norm_epsilon,
            "init_method_std": shape.init_method_std, "hidden_dropout": shape.hidden_dropout,
            "attention_dropout": shape.attention_dropout}
    keys = {"num_layers": "num_layers", "hidden_size": "hidden_size",
            "num_attention_heads": "num_heads", "ffn_hidden_size": "ffn_hidden_size",
            "padded_vocab_size": "vocab_size", "layernorm_epsilon": "layer_norm_epsilon",
            "init_method_std": "init_method_std", "hidden_dropout": "hidden_dropout",
            "attention_dropout": "attention_dropout"}
    preset = f" (preset {model.preset})" if model.preset else ""
    return shape, args, {d: label + k + preset for d, k in keys.items()}


def _model_states(files: dsfiles.CheckpointFiles) -> dict:
    if files.num_mp != 1:
        raise InteropError(f"{files.tag_dir}: {files.num_mp} model-parallel ranks (mp_rank_00.."
                           f"{files.num_mp - 1:02d}) and no pipeline layer files: a tensor-"
                           f"parallel HF model (DeepSpeed AutoTP), which bloomtrain does not "
                           f"import; consolidate it to one rank first")
    meta = load(files.model_file(0), mmap=True)
    if not isinstance(meta, dict) or "param_shapes" not in meta:
        raise InteropError(f"{files.model_file(0)} has no param_shapes; not a DeepSpeed model "
                           f"states file")
    frozen = list(meta.get("frozen_param_shapes") or {})  # name -> shape
    if frozen:  # they are in no optimizer partition, and were called "missing"
        raise InteropError(f"{files.tag_dir}: {len(frozen)} parameter(s) were frozen in this run "
                           f"(requires_grad=False: {', '.join(map(str, frozen[:3]))}), which "
                           f"DeepSpeed keeps apart from the optimizer's; bloomtrain trains every "
                           f"parameter: save the model unfrozen, or save_pretrained it and use "
                           f"import-hf")
    return meta


def _stage0_shapes(meta: dict, where: Path, weights_only: bool) -> list[dict]:
    """ZeRO stage 0 saves no flat partitions (param_shapes null): its module holds the weights,
    and its optimizer is a plain torch one in the same file, which is not imported. Weights
    only: the module's parameters, as one group (the tied head is the embedding)."""
    if not weights_only:
        raise InteropError(f"{where}: a DeepSpeed ZeRO stage 0 save, whose optimizer state is a "
                           f"plain torch optimizer's, which bloomtrain does not import; pass "
                           f"--weights-only to import its weights (the run then starts a new "
                           f"optimizer), or save it under ZeRO 1-3")
    module = meta.get("module")
    if not isinstance(module, dict) or not module:
        raise InteropError(f"{where}: a ZeRO stage 0 save without its module's weights")
    return [{n: tuple(t.shape) for n, t in module.items()
             if isinstance(t, torch.Tensor) and not n.endswith(LM_HEAD)}]


def read_hf_zero(files: dsfiles.CheckpointFiles, weights_only: bool,
                 model_config: Path | None = None) -> Source:
    from bloomtrain.checkpoint.hf.files import canonical_name as canonical
    from bloomtrain.model import check_state

    where, meta = files.tag_dir, _model_states(files)
    param_shapes = meta["param_shapes"]
    if param_shapes is None:
        param_shapes = _stage0_shapes(meta, where, weights_only)
    names = {canonical(n): n for g in param_shapes for n in g}  # HF name -> DeepSpeed's
    shapes = {canonical(n): tuple(s) for g in param_shapes for n, s in g.items()}
    rows = shapes.get(EMBEDDING, (None,))[0]
    shape, hf_args, labels = hf_shape(files, where, model_config, rows)
    ds_config = meta.get("ds_config") if isinstance(meta.get("ds_config"), dict) else None
    precision = precision_of(ds_config, files.optim_prefix)
    check_state(shape, shapes, files.model_file(0))
    dp = int(meta.get("dp_world_size") or 1)
    files.check_complete(dp if files.optim else None, 1)
    module = meta.get("module") or {}
    # ZeRO-3 keeps the weights only in the shards: its module holds empty placeholders.
    stage3 = bool(files.zero3_model) or zero_stage_of(ds_config) == 3
    shards = ZeroShards(files.dp_files(0), param_shapes, str(where)) if files.optim else None
    if stage3 and shards is None:
        raise InteropError(f"{where}: a ZeRO-3 checkpoint keeps its weights only in the "
                           f"optimizer shards, and none are here; copy the "
                           f"zero_pp_rank_*_optim_states.pt files")
    zero, dtype = (None if weights_only else shards), torch_dtype(precision)

    def read(name: str, kind: str) -> torch.Tensor:
        if kind != WEIGHTS:
            return zero.load(names[name], kind)
        if stage3:
            return shards.load(names[name], "fp32").to(dtype)
        if names[name] not in module:
            raise InteropError(f"{files.model_file(0)}: the module has no {names[name]}")
        return module[names[name]].detach().clone()

    stage = zero_stage_of(ds_config)
    src = Source(label=f"HF BloomForCausalLM under DeepSpeed ZeRO-{stage}"
                       f"{' (BF16_Optimizer)' if files.optim_prefix == 'bf16_' else ''}, "
                       f"{precision}, dp={dp}",
                 path=files.root, shape=shape, shapes=shapes, weight_dtype=dtype, read=read,
                 optimizer=zero is not None, optimizer_found=shards is not None,
                 layout={"tp": 1, "pp": 1, "dp": dp, "zero_stage": stage, "precision": precision},
                 ds_config=ds_config, args=hf_args, arg_labels=labels,
                 train_state=dsfiles.deepspeed_position(meta))
    if zero is not None:
        src.adam_step = zero.adam_step()
        src.param_groups = [{**g, "names": [canonical(n) for n in g["names"]]}
                            for g in zero.param_groups()]
        src.scaler = zero.loss_scale() if precision == "fp16" else None
        src.checks.append(lambda: check_decay_groups(src.param_groups, where))
    if not stage3 and LM_HEAD in module:
        src.checks.append(lambda: _check_tied(module, names, files.model_file(0)))
    if zero is not None and not stage3:
        src.checks.append(lambda: _check_weights_match(src, module, names, files, dtype))
    return src


# HF's BloomConfig field (first found) behind each Megatron-style argument of an HF import.
_HF_FIELDS = {"num_layers": ("n_layer", "num_hidden_layers"),
              "hidden_size": ("hidden_size", "n_embed"),
              "num_attention_heads": ("n_head", "num_attention_heads"),
              "padded_vocab_size": ("vocab_size",),
              "layernorm_epsilon": ("layer_norm_epsilon",),
              "init_method_std": ("initializer_range",),
              "hidden_dropout": ("hidden_dropout",),
              "attention_dropout": ("attention_dropout",)}
_HF_DEFAULTS = {"layernorm_epsilon": 1e-5, "init_method_std": 0.02, "hidden_dropout": 0.0,
                "attention_dropout": 0.0}


def _args_from_hf(cfg: dict, origin: str = "config.json") -> tuple[dict, dict]:
    """The Megatron-style arguments an HF config implies (for the imported run's config), and
    for each, the config field it came from (`config.json n_layer`), for the YAML's comments."""
    args, labels = {}, {}
    for dest, fields in _HF_FIELDS.items():
        field = next((f for f in fields if f in cfg), None)
        args[dest] = cfg[field] if field else _HF_DEFAULTS.get(dest)
        labels[dest] = f"{origin} {field}" if field else \
            f"{origin} {fields[0]} (not there: HF BloomConfig's default)"
    return args, labels


def _check_tied(module, names, where) -> list[str]:
    from bloomtrain.model.params import EMBEDDING
    head, emb = module[LM_HEAD], module.get(names.get(EMBEDDING, EMBEDDING))
    if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
        raise InteropError(f"{where}: lm_head.weight differs from the word embedding; bloomtrain's "
                           f"LM head is always the embedding (untied heads are not supported)")
    return []


def _check_weights_match(src: Source, module, names, files, dtype) -> list[str]:
    """The module's weights are its masters rounded to the run's dtype (DeepSpeed copies them
    after every step): anything else means files of different checkpoints."""
    for name in src.shapes:
        master = src.read(name, "fp32").to(dtype)
        weight = module.get(names[name])
        if weight is None or weight.shape != master.shape:
            raise InteropError(f"{files.model_file(0)}: {names[name]} is missing or has another "
                               f"shape than its fp32 master in the optimizer shards")
        if not torch.equal(weight.to(dtype), master):
            worst = float((weight.float() - master.float()).abs().max())
            shards = ", ".join(f.name for f in files.dp_files(0))
            raise InteropError(f"{files.model_file(0)}: {names[name]} differs from its fp32 "
                               f"master in the optimizer shards ({shards}) by up to {worst:.3g}: "
                               f"the files are from different checkpoints")
    return [f"the module's weights equal the fp32 masters rounded to {dtype}"]
