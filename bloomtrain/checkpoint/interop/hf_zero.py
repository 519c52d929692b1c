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

import torch

from bloomtrain.checkpoint.interop import files as dsfiles
from bloomtrain.checkpoint.interop.safe_load import InteropError, load
from bloomtrain.checkpoint.interop.source import WEIGHTS, Source, check_decay_groups
from bloomtrain.checkpoint.interop.zero import ZeroShards
from bloomtrain.runtime import torch_dtype
from bloomtrain.model.params import LM_HEAD



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


def _hf_shape(files, where):
    from bloomtrain.hf import shape_from_hf_config
    from bloomtrain.errors import UserError

    path = dsfiles.find_config_json(files)
    if path is None:
        raise InteropError(f"{where}: no config.json beside the checkpoint; a model trained under "
                           f"DeepSpeed is read with its HF config (HF's Trainer saves it in "
                           f"checkpoint-N/): copy the model's config.json into {files.root}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        return shape_from_hf_config(cfg), cfg
    except (OSError, ValueError) as e:
        raise InteropError(f"cannot read {path}: {e}") from None
    except UserError as e:  # another architecture, or a setting bloomtrain's model lacks
        raise InteropError(f"{path}: {e}") from None


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
    return meta


def read_hf_zero(files: dsfiles.CheckpointFiles, weights_only: bool) -> Source:
    from bloomtrain.checkpoint.hf_files import canonical_name as canonical
    from bloomtrain.model import check_state

    where, meta = files.tag_dir, _model_states(files)
    shape, hf_cfg = _hf_shape(files, where)
    ds_config = meta.get("ds_config") if isinstance(meta.get("ds_config"), dict) else None
    precision = precision_of(ds_config, files.optim_prefix)
    param_shapes = meta["param_shapes"]
    names = {canonical(n): n for g in param_shapes for n in g}  # HF name -> DeepSpeed's
    shapes = {canonical(n): tuple(s) for g in param_shapes for n, s in g.items()}
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
                 ds_config=ds_config, args=_args_from_hf(hf_cfg),
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


def _args_from_hf(cfg: dict) -> dict:
    """The Megatron-style arguments an HF config implies (for the imported run's config)."""
    return {"num_layers": cfg.get("n_layer", cfg.get("num_hidden_layers")),
            "hidden_size": cfg.get("hidden_size", cfg.get("n_embed")),
            "num_attention_heads": cfg.get("n_head", cfg.get("num_attention_heads")),
            "padded_vocab_size": cfg.get("vocab_size"),
            "layernorm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
            "init_method_std": cfg.get("initializer_range", 0.02),
            "hidden_dropout": cfg.get("hidden_dropout", 0.0),
            "attention_dropout": cfg.get("attention_dropout", 0.0)}


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
