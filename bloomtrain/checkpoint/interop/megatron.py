"""Megatron-DeepSpeed's BLOOM (bigscience-workshop/Megatron-DeepSpeed's `GPTModelPipe`): its
parameter names, its tensor-parallel splits and what its `args` say about the model.

Pipeline layers are numbered as GPTModelPipe's specs: the embedding (a TiedLayerSpec 'embed',
named `tied_modules.embed.*` in the optimizer, `layer_01` on disk), then the blocks from layer 3
on, then the final LayerNorm (`{L+4}.weight` / `.bias`), then the tied head (no parameters of its
own; the last stage's copy of the embedding, kept equal by DeepSpeed). The embedding LayerNorm
sits on the first stage's VocabParallelEmbedding (`word_embeddings.norm.*`). Block parameters
already carry HF's names (HF's BLOOM converter only renumbers them).

Tensor parallelism splits as bloomtrain.model.params says (Megatron-LM's column/row/vocab
splits): each tp rank holds a block of rows or columns, so the full parameter is the
concatenation of the ranks' pieces; the fused query_key_value keeps whole heads per rank
([heads, 3, head_dim] rows), so concatenation gives HF's per-head layout too, and the embedding's
vocabulary padding (to a multiple of make_vocab_size_divisible_by x tp) lands at its end. The
parameters every tp rank holds whole (LayerNorms, row-parallel biases) can differ slightly
between the ranks' copies in bf16 runs, as BLOOM's did: they are averaged, as HF's BLOOM
converter and DeepSpeed's universal conversion do, and the largest difference is reported.
"""
from __future__ import annotations

import argparse
import enum
import re

import torch

from bloomtrain.checkpoint.interop.safe_load import InteropError
from bloomtrain.model.params import EMBEDDING, base_spec

_EMBED = re.compile(r"^(?:tied_modules\.embed|\d+)\.word_embeddings\.(weight|norm\.weight|norm\.bias)$")
_BLOCK = re.compile(r"^(\d+)\.((?:input_layernorm|self_attention|post_attention_layernorm|mlp)\..+)$")
_FINAL = re.compile(r"^(\d+)\.(weight|bias)$")
_EMBED_HF = {"weight": EMBEDDING, "norm.weight": "transformer.word_embeddings_layernorm.weight",
             "norm.bias": "transformer.word_embeddings_layernorm.bias"}
# How far apart the tp ranks' copies of a replicated parameter may be and still be one
# parameter: 5% of its largest magnitude, and of at least 0.1 (so that biases near zero are not
# judged by their own tiny scale). bf16 runs drift by a few units in bf16's last place (2^-8
# relative), BLOOM's included; copies further apart than this belong to different runs.
TP_COPY_TOLERANCE, TP_COPY_FLOOR = 0.05, 0.1


def is_pipeline_name(name: str) -> bool:
    return bool(_EMBED.match(name) or _BLOCK.match(name) or _FINAL.match(name))


def hf_names(names, where, num_layers: int | None = None) -> dict[str, str]:
    """pipeline name -> HF name for every name of the whole pipeline (all stages: blocks are
    numbered from the first block layer). Refuses what GPTModelPipe for BLOOM does not have."""
    names = list(names)
    blocks = sorted({int(m.group(1)) for n in names if (m := _BLOCK.match(n))})
    finals = sorted({int(m.group(1)) for n in names if (m := _FINAL.match(n))})
    if blocks and blocks != list(range(blocks[0], blocks[0] + len(blocks))):
        raise InteropError(f"{where}: the transformer layers are {blocks}, not consecutive; a "
                           f"stage's files are missing")
    if num_layers is not None and len(blocks) != num_layers:
        raise InteropError(f"{where}: {len(blocks)} transformer layers, but args.num_layers is "
                           f"{num_layers}; a stage's files are missing")
    if len(finals) > 1:
        raise InteropError(f"{where}: several final LayerNorms (layers {finals}); not a BLOOM "
                           f"GPTModelPipe")
    out = {}
    for n in names:
        if m := _EMBED.match(n):
            out[n] = _EMBED_HF[m.group(1)]
        elif m := _BLOCK.match(n):
            out[n] = f"transformer.h.{int(m.group(1)) - blocks[0]}.{m.group(2)}"
        elif m := _FINAL.match(n):
            out[n] = f"transformer.ln_f.{m.group(2)}"
        elif "position_embeddings" in n:
            raise InteropError(f"{where}: {n} is a learned position embedding; BLOOM uses ALiBi "
                               f"and bloomtrain trains ALiBi models only")
        else:
            raise InteropError(f"{where}: parameter {n} is not one of Megatron-DeepSpeed's BLOOM "
                               f"(GPTModelPipe with ALiBi and an embedding LayerNorm)")
    return out


def merge_tp(name: str, pieces: list[torch.Tensor], drift: dict | None = None,
             where: str = "") -> torch.Tensor:
    """The full parameter `name` (HF name) from its tp ranks' pieces, in rank order."""
    if len(pieces) == 1:
        return pieces[0]
    dim = base_spec(name).tp_dim
    if dim is not None:
        return torch.cat(pieces, dim=dim)
    first = pieces[0].float()
    diff = max(float((p.float() - first).abs().max()) for p in pieces[1:])
    scale = float(first.abs().max())
    if diff > TP_COPY_TOLERANCE * max(scale, TP_COPY_FLOOR):
        raise InteropError(f"{where}: the tp ranks' copies of {name} differ by up to {diff:.3g} "
                           f"(the parameter's largest magnitude is {scale:.3g}); copies of a "
                           f"replicated parameter differ by rounding at most, so these tp files "
                           f"come from different runs or steps")
    if drift is not None:
        drift[name] = max(drift.get(name, (0.0, 0.0)), (diff, diff / max(scale, TP_COPY_FLOOR)))
    return (sum(p.float() for p in pieces) / len(pieces)).to(pieces[0].dtype)


def refuse_model_config(model_config, where) -> None:
    if model_config is not None:
        raise InteropError(f"{where} is a Megatron-DeepSpeed checkpoint: its saved args give the "
                           f"model's shape; drop --model-config {model_config}")


def args_dict(args, where) -> dict:
    """Megatron's `args` Namespace as a plain dict, enums by their names."""
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if not isinstance(args, dict):
        raise InteropError(f"{where}: `args` is {type(args).__name__}, not Megatron's Namespace")
    return {k: (v.name if isinstance(v, enum.Enum) else v) for k, v in args.items()}


def check_architecture(args: dict, where) -> None:
    """Refuse a Megatron model that is not BLOOM's architecture, naming the argument."""
    pos = args.get("position_embedding_type", "absolute")
    if str(pos).lower().split(".")[-1] != "alibi":
        raise InteropError(f"{where}: args.position_embedding_type is {pos}: a GPT with "
                           f"{str(pos).lower()} position embeddings, not BLOOM's ALiBi; bloomtrain "
                           f"imports BLOOM-architecture checkpoints only")
    if not args.get("embed_layernorm", False):
        raise InteropError(f"{where}: args.embed_layernorm is off: BLOOM has a LayerNorm after "
                           f"the word embedding and bloomtrain's model always does")
    for key, bloom in (("glu_activation", None), ("untie_embeddings", False),
                       ("apply_residual_connection_post_layernorm", False)):
        if args.get(key) not in (None, bloom):
            raise InteropError(f"{where}: args.{key} is {args[key]!r}; BLOOM's is {bloom!r} and "
                               f"bloomtrain's model has no other")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if not isinstance(args.get(key), int) or args[key] <= 0:
            raise InteropError(f"{where}: args.{key} is {args.get(key)!r}; a Megatron-DeepSpeed "
                               f"checkpoint records it as a positive integer")


def shape_from_args(args: dict, where):
    from bloomtrain.model import BloomShape

    check_architecture(args, where)
    h = args["hidden_size"]
    if h % args["num_attention_heads"]:
        raise InteropError(f"{where}: hidden_size {h} is not divisible by num_attention_heads "
                           f"{args['num_attention_heads']}")
    return BloomShape(vocab_size=args["padded_vocab_size"], hidden_size=h,
                      num_layers=args["num_layers"], num_heads=args["num_attention_heads"],
                      ffn_hidden_size=args.get("ffn_hidden_size") or 4 * h,
                      layer_norm_epsilon=float(args.get("layernorm_epsilon", 1e-5)),
                      hidden_dropout=float(args.get("hidden_dropout", 0.0) or 0.0),
                      attention_dropout=float(args.get("attention_dropout", 0.0) or 0.0),
                      init_method_std=float(args.get("init_method_std", 0.02)))


def train_position(args: dict, meta: dict) -> dict:
    """iteration, consumed samples and skipped steps of the run: Megatron's own counters, else
    DeepSpeed's."""
    step = next((v for v in (meta.get("iteration"), args.get("iteration"),
                             meta.get("global_steps")) if v is not None), 0)
    consumed = args.get("consumed_train_samples")
    sched = meta.get("lr_scheduler") or {}
    scheduled = sched.get("num_steps") if isinstance(sched, dict) else None
    if consumed is None:
        consumed = scheduled if scheduled is not None else meta.get("global_samples")
    out = {"step": int(step or 0), "consumed_samples": int(consumed or 0),
           "skipped_steps": int(meta.get("skipped_steps") or 0)}
    if scheduled is not None:
        # AnnealingLR's position: the samples of applied steps only (Megatron steps it when
        # the update was applied), behind consumed_samples after skipped ones.
        out["lr_samples"] = int(scheduled)
    return out
