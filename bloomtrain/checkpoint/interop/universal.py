"""DeepSpeed universal checkpoints: what `ds_to_universal` writes (and how BLOOM's optimizer
states were published, bigscience/bloom-optimizer-states).

    STEP_universal/
      mp_rank_*_model_states.pt     the source's model-states files, copied (args, iteration, ...)
      zero/optimizer_state.pt       the optimizer's hyperparameters (param_groups)
      zero/NAME/fp32.pt             the full fp32 master of parameter NAME (tp pieces merged,
      zero/NAME/exp_avg.pt          averaged where replicated), Adam's moments,
      zero/NAME/exp_avg_sq.pt
      zero/NAME/step.pt             and Adam's step (newer DeepSpeed only)

Each `.pt` holds `{"param": tensor, "cat_dim": ..., ...}` or, from ZeRO-3, the flat tensor
alone. NAME is the source model's name: HF's for an HF model, GPTModelPipe's for
Megatron-DeepSpeed (megatron.py maps them). A converter given a vocabulary pattern strips the
embedding's padding rows (`vocab_tensor`); they come back as zeros, as DeepSpeed's own loader
pads them.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from bloomtrain.checkpoint.interop import megatron
from bloomtrain.checkpoint.interop.hf_zero import precision_of, zero_stage_of
from bloomtrain.checkpoint.interop.safe_load import InteropError, load
from bloomtrain.checkpoint.interop.source import MASTER_KINDS, WEIGHTS, Source
from bloomtrain.runtime import torch_dtype
from bloomtrain.model.params import EMBEDDING, LM_HEAD



def universal_dir(path: Path) -> Path | None:
    """The universal step directory at `path` (itself, or what `latest_universal` names)."""
    if (path / "zero").is_dir() and not any(path.glob("*_optim_states.pt")):
        return path
    latest = path / "latest_universal"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        if tag and "/" not in tag and (path / tag / "zero").is_dir():
            return path / tag
        raise InteropError(f"{latest} names {tag!r}, which is not a universal checkpoint "
                           f"directory under {path}")
    return None


def _unwrap(obj, file: Path) -> tuple[torch.Tensor, bool]:
    if isinstance(obj, torch.Tensor):
        return obj.detach(), False
    if isinstance(obj, dict) and isinstance(obj.get("param"), torch.Tensor):
        return obj["param"].detach(), bool(obj.get("vocab_tensor", False))
    raise InteropError(f"{file} holds neither a tensor nor {{'param': tensor}}; not a universal "
                       f"checkpoint file")


def _scalar(obj, file: Path) -> int:
    try:
        return int(obj.item() if isinstance(obj, torch.Tensor) else obj)
    except (TypeError, ValueError, RuntimeError):
        raise InteropError(f"{file} does not hold Adam's step count") from None


def _shape_and_names(root: Path, names: list[str], meta: dict):
    """(BloomShape, universal name -> HF name, Megatron-style args) of the model."""
    from bloomtrain.checkpoint.interop.hf_zero import _args_from_hf, _hf_shape
    from bloomtrain.checkpoint.interop.files import CheckpointFiles
    from bloomtrain.hf import _canonical_name

    if any(megatron.is_pipeline_name(n) for n in names):
        if "args" not in meta:
            raise InteropError(f"{root}: Megatron-DeepSpeed parameter names but no `args` in its "
                               f"model-states files; copy the source's mp_rank_*_model_states.pt "
                               f"into it")
        args = megatron.args_dict(meta["args"], root)
        shape = megatron.shape_from_args(args, root)
        return shape, megatron.hf_names(names, root, shape.num_layers), args
    files = CheckpointFiles(root=root.parent, tag_dir=root)
    shape, cfg = _hf_shape(files, root)
    return shape, {n: _canonical_name(n) for n in names}, _args_from_hf(cfg)


def read_universal(root: Path, weights_only: bool) -> Source:
    from bloomtrain.hf import check_state
    from bloomtrain.model import expected_parameters

    zero = root / "zero"
    names = sorted(d.name for d in zero.iterdir() if d.is_dir())
    models = sorted(root.glob("*_model_states.pt"))
    if not names or not models:
        raise InteropError(f"{root}: a universal checkpoint has zero/NAME/fp32.pt for every "
                           f"parameter and the source's *_model_states.pt; "
                           f"{'no parameters' if not names else 'no model-states file'} here")
    meta = load(models[0], mmap=True)
    # The converter copies an HF model's tied lm_head.weight too (its fp32 value only): it is the
    # embedding, stored once here, and checked to be equal to it.
    head = zero / LM_HEAD if LM_HEAD in names else None
    names = [n for n in names if n != LM_HEAD]
    shape, to_hf, args = _shape_and_names(root, names, meta)
    want = expected_parameters(shape)
    file_of = {to_hf[n]: zero / n for n in names}
    check_state(shape, {hf: want.get(hf, ()) for hf in file_of}, root)
    ds_config = meta.get("ds_config") if isinstance(meta.get("ds_config"), dict) else None
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else \
        precision_of(ds_config)
    padded: list[str] = []

    def read(name: str, kind: str) -> torch.Tensor:
        file = file_of[name] / f"{'fp32' if kind == WEIGHTS else kind}.pt"
        tensor, stripped = _unwrap(load(file, mmap=True), file)
        shape_ = want[name]
        if stripped and name == EMBEDDING and tensor.dim() == 2 and tensor.shape[0] < shape_[0]:
            # The converter cut the vocabulary padding; DeepSpeed's loader pads with zeros too.
            tensor = torch.cat([tensor, tensor.new_zeros(shape_[0] - tensor.shape[0],
                                                         tensor.shape[1])])
            if name not in padded:
                padded.append(name)
        if tensor.numel() != math.prod(shape_):
            raise InteropError(f"{file} holds {tensor.numel()} elements, a "
                               f"{shape.num_layers}-layer BLOOM's {name} has {math.prod(shape_)}")
        tensor = tensor.reshape(shape_).float()
        return tensor.to(torch_dtype(precision)) if kind == WEIGHTS else tensor.clone()

    have = {k: all((file_of[h] / f"{k}.pt").is_file() for h in file_of) for k in MASTER_KINDS}
    missing = [f"{file_of[h] / 'fp32.pt'}" for h in file_of if not (file_of[h] / "fp32.pt").is_file()]
    if missing:
        raise InteropError(f"{missing[0]} is missing")
    optimizer = not weights_only and have["exp_avg"] and have["exp_avg_sq"]
    src = Source(label=f"DeepSpeed universal checkpoint ({precision}, from tp="
                       f"{args.get('tensor_model_parallel_size', 1)} "
                       f"pp={args.get('pipeline_model_parallel_size', 1)})",
                 path=root, shape=shape, shapes={h: want[h] for h in sorted(file_of)},
                 weight_dtype=torch_dtype(precision), read=read, optimizer=optimizer,
                 optimizer_found=have["exp_avg"] and have["exp_avg_sq"],
                 layout={"tp": int(args.get("tensor_model_parallel_size") or 1),
                         "pp": int(args.get("pipeline_model_parallel_size") or 1),
                         "dp": int(meta.get("dp_world_size") or 1), "precision": precision,
                         "zero_stage": zero_stage_of(ds_config)},
                 args=args, ds_config=ds_config)
    if "args" in meta:
        src.train_state = megatron.train_position(args, meta)
    else:
        src.train_state = {"step": int(meta.get("global_steps") or 0),
                           "consumed_samples": int(meta.get("global_samples") or 0),
                           "skipped_steps": int(meta.get("skipped_steps") or 0)}
    if optimizer:
        src.adam_step, note = _adam_step(root, file_of, src.train_state)
        src.notes += [note] if note else []
        src.param_groups = _param_groups(zero)
    if head is not None:
        src.checks.append(lambda: _check_head(head, read(EMBEDDING, "fp32"), src.weight_dtype))
    src.checks.append(lambda: [f"the embedding's vocabulary padding was cut by the converter; "
                               f"its rows are zeros here, as DeepSpeed pads them"]
                      if padded else [])
    return src


def _check_head(head: Path, embedding: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """The copied head is the module's weight (the embedding rounded to the run's dtype)."""
    tensor, _ = _unwrap(load(head / "fp32.pt", mmap=True), head / "fp32.pt")
    if tensor.numel() != embedding.numel() or \
            not torch.equal(tensor.reshape(embedding.shape).float(),
                            embedding.to(dtype).float()):
        raise InteropError(f"{head / 'fp32.pt'} differs from the word embedding; bloomtrain's LM "
                           f"head is always the embedding (untied heads are not supported)")
    return []


def _adam_step(root, file_of, train_state) -> tuple[int, str | None]:
    steps = {_scalar(load(d / "step.pt"), d / "step.pt") for d in file_of.values()
             if (d / "step.pt").is_file()}
    if len(steps) > 1:
        raise InteropError(f"{root}: the parameters' step.pt files disagree ({sorted(steps)})")
    if steps:
        return steps.pop(), None
    opt = root / "zero" / "optimizer_state.pt"
    if opt.is_file():
        groups = (load(opt) or {}).get("param_groups") or []
        found = {_scalar(g["step"], opt) for g in groups if isinstance(g, dict) and "step" in g}
        if len(found) == 1:
            return found.pop(), None
    step = train_state["step"] - train_state.get("skipped_steps", 0)
    return step, (f"no Adam step recorded (a converter older than step.pt); taken as the "
                  f"iteration less skipped steps, {step}")


def _param_groups(zero: Path) -> list[dict]:
    opt = zero / "optimizer_state.pt"
    if not opt.is_file():
        return []
    groups = (load(opt) or {}).get("param_groups") or []
    # A universal checkpoint does not say which parameters each group held.
    return [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
