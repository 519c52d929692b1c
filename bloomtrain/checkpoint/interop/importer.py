"""`bloomtrain import-deepspeed`: a DeepSpeed or Megatron-DeepSpeed checkpoint in, a bloomtrain
checkpoint out, with the weights, the fp32 masters, Adam's moments and step, and the run's
position (iteration, consumed samples: the LR schedule is a function of the latter), so that
`bloomtrain train checkpoint.resume=OUT` continues the run on any layout.

Reading happens in two passes over a `Source` (source.py): first every structural and data check
(missing or truncated files, classes outside the allow-list, files of different steps or runs,
tp copies too far apart, another architecture), then the writing, one parameter at a time
(`Deferred` tensors) into the checkpoint writer's temporary directory, renamed into place only
when complete. A bad input therefore leaves nothing behind.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from bloomtrain.checkpoint.interop import files as dsfiles
from bloomtrain.checkpoint.interop.safe_load import InteropError
from bloomtrain.checkpoint.interop.source import MASTER_KINDS, WEIGHTS, Source

NOT_IMPORTED = ("RNG states (dropout continues from new generators)", "the data sampler's state "
                "(bloomtrain's loader resumes from the consumed samples)")


def read_source(path: str | Path, weights_only: bool = False,
                model_config: str | Path | None = None) -> Source:
    """The Source at `path`: a DeepSpeed universal checkpoint, a Megatron-DeepSpeed pipeline
    checkpoint or an HF model under DeepSpeed ZeRO; a save root, checkpoint-N/ or a step dir.
    `model_config`: the HF model's shape where no config.json lies beside it (an HF config or
    a bloomtrain model section)."""
    from bloomtrain.checkpoint.interop.hf_zero import read_hf_zero
    from bloomtrain.checkpoint.interop.pipeline import read_megatron
    from bloomtrain.checkpoint.interop.universal import read_universal, universal_dir

    path = Path(path)
    if not path.exists():
        raise InteropError(f"{path} does not exist")
    if model_config is not None and not Path(model_config).is_file():
        raise InteropError(f"--model-config {model_config} does not exist")
    model_config = Path(model_config) if model_config is not None else None
    root = universal_dir(path) if path.is_dir() else None
    if root is not None:
        return read_universal(root, weights_only, model_config)
    found = dsfiles.scan(path)
    if found.layers:
        return read_megatron(found, weights_only, model_config)
    return read_hf_zero(found, weights_only, model_config)


def _tokenizer(src: Source, explicit: str | None, log):
    from bloomtrain.data.tokenizer import load_tokenizer

    if explicit:
        tok = load_tokenizer(explicit)
    else:
        for d in (src.path, src.path.parent):
            if (d / "tokenizer.json").is_file():
                tok = load_tokenizer(d)
                break
        else:
            name = src.args.get("tokenizer_name_or_path") or src.args.get("vocab_file")
            log(f"note: no tokenizer found beside {src.path}"
                f"{f' (the run used {name})' if name else ''}; pass --tokenizer DIR to keep one "
                f"with the checkpoint")
            return None
    if tok.vocab_size > src.shape.vocab_size:
        raise InteropError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's "
                           f"{src.shape.vocab_size} embedding rows; it is not this model's")
    return tok


def _fragments(src: Source) -> list:
    import math

    import torch

    from bloomtrain.checkpoint import Deferred, Fragment

    out = []
    for name, shape in src.shapes.items():
        n = math.prod(shape)
        if src.optimizer:
            kinds = {"model": ("fp32", torch.float32), "exp_avg": ("exp_avg", torch.float32),
                     "exp_avg_sq": ("exp_avg_sq", torch.float32)}
        else:
            kinds = {"model": (WEIGHTS, src.weight_dtype)}
        tensors = {k: Deferred(dtype, n, lambda name=name, kind=kind: src.read(name, kind))
                   for k, (kind, dtype) in kinds.items()}
        out.append(Fragment(name=name, shape=tuple(shape), tp_dim=None, tp_rank=0, tp_size=1,
                            offset=0, numel=n, tensors=tensors))
    return out


def loss_scaler_state(s: dict | None) -> dict | None:
    """bloomtrain's DynamicLossScaler state of DeepSpeed's (fp16 runs). DeepSpeed doubles the
    scale when (cur_iter - last_overflow_iter) % scale_window == 0, counting from
    last_overflow_iter -1: the clean steps since the last overflow or growth are
    (cur_iter - last_overflow_iter - 1) % scale_window, bloomtrain's growth_tracker;
    cur_hysteresis is its hysteresis_tracker."""
    if not s or not s.get("dynamic") or s.get("scale") is None:
        return None
    window = int(s.get("window") or 1000)
    last = s.get("last_overflow")
    since = int(s.get("iter") or 0) - (-1 if last is None else int(last)) - 1
    return {"scale": float(s["scale"]), "growth_tracker": since % window,
            "hysteresis_tracker": int(s.get("hysteresis") or 2)}


def manifest_meta(src: Source, config: dict) -> dict:
    meta = {"source": {"format": src.label, "path": str(src.path.resolve()),
                       "layout": src.layout},
            "config": config}
    if src.optimizer:
        meta.update(train_state=dict(src.train_state), loss_window=[],
                    optimizer={"step_count": int(src.adam_step or 0),
                               "zero_stage": src.layout.get("zero_stage", 0),
                               "scaler": loss_scaler_state(src.scaler)},
                    topology={k: src.layout[k] for k in ("tp", "pp", "dp")})
    return meta


def import_deepspeed(input_path: str | Path, output: str | Path, tokenizer: str | None = None,
                     weights_only: bool = False, log: Callable[[str], None] = print,
                     model_config: str | Path | None = None) -> Path:
    """Import the checkpoint at `input_path` into a new bloomtrain checkpoint root `output`;
    returns the step directory written. `model_config`: see read_source."""
    from bloomtrain import checkpoint
    from bloomtrain.checkpoint.interop.config import (derive_config, render_config,
                                                     write_config)

    output = Path(output)
    if checkpoint.list_checkpoints(output):
        raise InteropError(f"{output} already holds checkpoints; import into a new directory")
    # A DeepSpeed save directory (its `latest` names a global_stepN) or the input itself: the
    # import's `latest` would replace DeepSpeed's, which could then no longer resume from it.
    inp = Path(input_path).resolve()
    if output.resolve() in (inp, *inp.parents) or any(
            (output / name).is_file() for name in ("latest", "latest_universal")):
        raise InteropError(f"--output {output} is the DeepSpeed checkpoint's own directory (or "
                           f"holds its `latest`): the import would replace DeepSpeed's "
                           f"`latest`; import into a new directory")
    src = read_source(input_path, weights_only, model_config)
    report = [f"found: {src.label}, {src.shape.num_layers} layers, hidden {src.shape.hidden_size},"
              f" {src.shape.num_heads} heads, vocabulary {src.shape.vocab_size}"]
    for check in src.checks:
        report += check()
    tok = _tokenizer(src, tokenizer, log)
    step = src.train_state["step"] if src.optimizer else 0
    tok_dir = output / checkpoint.step_dir_name(step) / "tokenizer" if tok is not None else None
    config, conversion, notes = derive_config(src, output, tok_dir)
    yaml_text = render_config(config, conversion, notes, src)
    try:
        path = checkpoint.CheckpointWriter(output, log=lambda *_: None, single_process=True).save(
            step, _fragments(src), src.shape, manifest_meta(src, config), tokenizer=tok)
    except OSError as e:
        raise InteropError(f"cannot write the checkpoint under {output}: {e}") from e
    yaml_path = write_config(yaml_text, output)
    unsupported = [f"UNSUPPORTED: {u.source}: {u.reason}" for u in conversion.unsupported]
    warnings = [f"WARNING: {w}" for w in conversion.warnings]
    said = [f"{'to choose' if kind == 'CHOOSE' else 'note'}: {text}" for kind, text in notes]
    _report(src, path, yaml_path, report + said + warnings + unsupported, log)
    return path


def _report(src: Source, path: Path, yaml_path: Path, lines: list[str], log) -> None:
    for line in lines + src.notes:
        log(f"  {line}")
    if src.optimizer:
        st = src.train_state
        log(f"imported: the weights, fp32 masters, Adam's moments (step {src.adam_step}), "
            f"iteration {st['step']}, {st['consumed_samples']} consumed samples, "
            f"{st['skipped_steps']} skipped steps")
    else:
        log("imported: the weights only. OPTIMIZER STATE NOT "
            f"{'IMPORTED (--weights-only)' if src.optimizer_found else 'FOUND'}: "
            f"a run from this checkpoint starts a new optimizer (Adam moments zero, step 0) and "
            f"its schedule at sample 0")
    log(f"not imported: {'; '.join(NOT_IMPORTED)}")
    log(f"wrote {path}")
    log(f"continue with: bloomtrain train --config {yaml_path} [--nproc N parallel.tp=.. "
        f"parallel.pp=..] (any layout; set data.paths to your data)")
