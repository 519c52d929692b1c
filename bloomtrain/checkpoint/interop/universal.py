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
from bloomtrain.checkpoint.interop.files import deepspeed_position
from bloomtrain.checkpoint.interop.hf_zero import precision_of, zero_stage_of
from bloomtrain.checkpoint.interop.safe_load import InteropError, load
from bloomtrain.checkpoint.interop.source import WEIGHTS, Source
from bloomtrain.checkpoint.interop.zero import ds_scaler_fields
from bloomtrain.devices import torch_dtype
from bloomtrain.model.params import EMBEDDING, LM_HEAD



def universal_dir(path: Path) -> Path | None:
    """The universal step directory at `path` (itself, or what `latest_universal` names)."""
    if (path / "zero").is_dir() and not any(path.glob("*_optim_states.pt")):
        return path
    latest = path / "latest_universal"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        _refuse_two_latests(path, tag)
        if tag and "/" not in tag and (path / tag / "zero").is_dir():
            return path / tag
        raise InteropError(f"{latest} names {tag!r}, which is not a universal checkpoint "
                           f"directory under {path}")
    return None


def _refuse_two_latests(path: Path, universal_tag: str) -> None:
    """DeepSpeed's documented conversion writes into the save directory, so it may hold both
    `latest` (what DeepSpeed resumes from) and `latest_universal`. When they name different
    saves, neither is the obvious one: taking the universal one imported an older step
    without a word."""
    plain = path / "latest"
    if not plain.is_file():
        return
    tag = plain.read_text(encoding="utf-8", errors="replace").strip()
    if tag and tag != universal_tag.removesuffix("_universal"):
        raise InteropError(f"{path} holds both latest ({tag}) and latest_universal "
                           f"({universal_tag}), two different saves; give the one to import as "
                           f"--input: {path / tag} or {path / universal_tag}")


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


def _shape_and_names(root: Path, names: list[str], meta: dict, model_config: Path | None):
    """(BloomShape, universal name -> HF name, Megatron-style args, their labels) of the
    model."""
    from bloomtrain.checkpoint.hf.files import canonical_name
    from bloomtrain.checkpoint.interop.files import CheckpointFiles
    from bloomtrain.checkpoint.interop.hf_zero import hf_shape

    if any(megatron.is_pipeline_name(n) for n in names):
        megatron.refuse_model_config(model_config, root)
        if "args" not in meta:
            raise InteropError(f"{root}: Megatron-DeepSpeed parameter names but no `args` in its "
                               f"model-states files; copy the source's mp_rank_*_model_states.pt "
                               f"into it")
        args = megatron.args_dict(meta["args"], root)
        shape = megatron.shape_from_args(args, root)
        return shape, megatron.hf_names(names, root, shape.num_layers), args, {}
    files = CheckpointFiles(root=root.parent, tag_dir=root)
    shape, args, labels = hf_shape(files, root, model_config)
    return shape, {n: canonical_name(n) for n in names}, args, labels


class UniversalCheckpoint:
    """The files of one universal step by HF name; `read(name, kind)` gives a full tensor."""

    def __init__(self, root: Path, model_config: Path | None = None):
        from bloomtrain.model import check_state, expected_parameters

        self.root, zero = root, root / "zero"
        names = sorted(d.name for d in zero.iterdir() if d.is_dir())
        models = sorted(root.glob("*_model_states.pt"))
        if not names or not models:
            raise InteropError(f"{root}: a universal checkpoint has zero/NAME/fp32.pt for every "
                               f"parameter and the source's *_model_states.pt; "
                               f"{'no parameters' if not names else 'no model-states file'} here")
        self.meta = load(models[0], mmap=True)
        # The converter copies an HF model's tied lm_head.weight too (its fp32 value only): it
        # is the embedding, stored once here, and checked to be equal to it.
        self.head = zero / LM_HEAD if LM_HEAD in names else None
        names = [n for n in names if n != LM_HEAD]
        self.shape, to_hf, self.args, self.arg_labels = _shape_and_names(root, names, self.meta,
                                                                         model_config)
        self.want = expected_parameters(self.shape)
        self.file_of = {to_hf[n]: zero / n for n in names}
        check_state(self.shape, {hf: self.want.get(hf, ()) for hf in self.file_of}, root)
        for d in self.file_of.values():
            if not (d / "fp32.pt").is_file():
                raise InteropError(f"{d / 'fp32.pt'} is missing")
        ds = self.meta.get("ds_config")
        self.ds_config = ds if isinstance(ds, dict) else None
        self.precision = "bf16" if self.args.get("bf16") else \
            "fp16" if self.args.get("fp16") else precision_of(self.ds_config)
        self.has_moments = all((d / f"{k}.pt").is_file() for d in self.file_of.values()
                               for k in ("exp_avg", "exp_avg_sq"))

    def _tensor(self, name: str, kind: str) -> tuple[torch.Tensor, bool, Path]:
        file = self.file_of[name] / f"{kind}.pt"
        tensor, stripped = _unwrap(load(file, mmap=True), file)
        return tensor, stripped, file

    def read(self, name: str, kind: str) -> torch.Tensor:
        tensor, stripped, file = self._tensor(name, "fp32" if kind == WEIGHTS else kind)
        want = self.want[name]
        if stripped and name == EMBEDDING and tensor.dim() == 2 and tensor.shape[0] < want[0]:
            # The converter cut the vocabulary padding; DeepSpeed's loader pads with zeros too.
            tensor = torch.cat([tensor, tensor.new_zeros(want[0] - tensor.shape[0],
                                                         tensor.shape[1])])
        self._check_shape(name, tensor, file)
        tensor = tensor.reshape(want).float()
        return tensor.to(torch_dtype(self.precision)) if kind == WEIGHTS else tensor.clone()

    def _check_shape(self, name: str, tensor: torch.Tensor, file: Path,
                     rows: bool = True) -> None:
        """A file's parameter has the model's shape for it, or is flat (as ZeRO-3 keeps
        it): the same count of elements in another shape is a converter's wrong merge (tp
        pieces joined on the wrong dimension, a transposed matrix), which a reshape would
        scramble silently. `rows` False: the vocabulary was cut, the rest must match."""
        want, shape = tuple(self.want[name]), tuple(tensor.shape)
        ok = (shape[1:] == want[1:] if not rows else shape == want or (
            tensor.dim() == 1 and tensor.numel() == math.prod(want)))
        if not ok:
            raise InteropError(f"{file} holds a {list(shape)} tensor, a "
                               f"{self.shape.num_layers}-layer BLOOM's {name} is "
                               f"{list(want)}: converted with another merge of its tensor-"
                               f"parallel pieces, or not this model's")

    def check_sizes(self, kinds) -> list[str]:
        """Every file holds its parameter's elements (memory-mapped: no data is read); says
        when the converter cut the embedding's vocabulary padding."""
        cut = False
        for name in self.file_of:
            for kind in kinds:
                tensor, stripped, file = self._tensor(name, kind)
                short = stripped and name == EMBEDDING and \
                    tensor.shape[0] < self.want[name][0]
                cut |= short
                if short:
                    self._check_shape(name, tensor, file, rows=False)
                else:
                    self._check_shape(name, tensor, file)
        return ["the embedding's vocabulary padding was cut by the converter; its rows are "
                "zeros here, as DeepSpeed pads them"] if cut else []


def read_universal(root: Path, weights_only: bool, model_config: Path | None = None) -> Source:
    u = UniversalCheckpoint(root, model_config)
    args, meta = u.args, u.meta
    optimizer = not weights_only and u.has_moments
    src = Source(label=f"DeepSpeed universal checkpoint ({u.precision}, from tp="
                       f"{args.get('tensor_model_parallel_size', 1)} "
                       f"pp={args.get('pipeline_model_parallel_size', 1)})",
                 path=root, shape=u.shape, shapes={h: u.want[h] for h in sorted(u.file_of)},
                 weight_dtype=torch_dtype(u.precision), read=u.read, optimizer=optimizer,
                 optimizer_found=u.has_moments,
                 layout={"tp": int(args.get("tensor_model_parallel_size") or 1),
                         "pp": int(args.get("pipeline_model_parallel_size") or 1),
                         "dp": int(meta.get("dp_world_size") or 1), "precision": u.precision,
                         "zero_stage": zero_stage_of(u.ds_config)},
                 args=args, arg_labels=u.arg_labels, ds_config=u.ds_config)
    src.train_state = megatron.train_position(args, meta) if "args" in meta else \
        deepspeed_position(meta)
    if optimizer:
        src.adam_step, note = _adam_step(root, u.file_of, src.train_state)
        src.notes += [note] if note else []
        src.param_groups = _param_groups(root / "zero")
        if u.precision == "fp16":  # the scale DeepSpeed's own resume restores
            opt = root / "zero" / "optimizer_state.pt"
            src.scaler = ds_scaler_fields((load(opt) or {}).get("loss_scaler")) \
                if opt.is_file() else None
    kinds = ("fp32",) + (("exp_avg", "exp_avg_sq") if optimizer else ())
    src.checks.append(lambda: u.check_sizes(kinds))
    if u.head is not None:
        src.checks.append(lambda: _check_head(u.head, u.read(EMBEDDING, "fp32"),
                                              src.weight_dtype))
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
