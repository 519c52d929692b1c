"""Interop with HF transformers' `BloomForCausalLM` directories: config.json to and from a
BloomShape, `import-hf` and `export-hf` (bit for bit: bloomtrain's parameters have HF's names, the
tied LM head is stored once as `save_pretrained` writes it, nothing is cast), and their CLI.
transformers itself is never imported; the weight files are read by
bloomtrain.checkpoint.hf.files.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bloomtrain.checkpoint.hf.files import SAFETENSORS_FILE, WEIGHT_FILES
from bloomtrain.errors import UserError
from bloomtrain.model.presets import EMBEDDING, LM_HEAD
from bloomtrain.files import disk_full_error, fsync_dir, is_disk_full, pid_alive

if TYPE_CHECKING:  # importing bloomtrain.model loads torch; the CLI parser must not wait for it
    from bloomtrain.model import BloomShape

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# In every export: what makes a directory one (_prepare_output replaces only those).
EXPORT_MARKER = ".bloomtrain_export.json"
# The marker while an export replaces a previous one's files (_replace_dir): a directory with it
# is a previous export, unfinished, which the next export replaces as it would a finished one.
PARTIAL_MARKER = ".bloomtrain_export.partial.json"


# ---- config ------------------------------------------------------------------------------------

def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def shape_from_hf_config(cfg: dict) -> BloomShape:
    """The BloomShape of an HF Bloom config.json, or a UserError naming the setting bloomtrain's
    model does not implement."""
    from bloomtrain.model import BloomShape

    if cfg.get("model_type") != "bloom":
        raise UserError(f"config.json has model_type {cfg.get('model_type')!r}; only 'bloom' "
                        f"(BloomForCausalLM / BloomModel) checkpoints can be used")
    if cfg.get("apply_residual_connection_post_layernorm"):
        raise UserError("apply_residual_connection_post_layernorm=true is not supported: "
                        "bloomtrain's blocks take the residual before the LayerNorm, as every "
                        "released BLOOM model does")
    if cfg.get("tie_word_embeddings") is False:
        raise UserError("tie_word_embeddings=false is not supported: bloomtrain's LM head is "
                        "always the word embedding")
    # HF's BloomConfig lets the old `n_embed` key win over hidden_size; num_attention_heads and
    # num_hidden_layers are its attribute aliases.
    hidden = _first(cfg, "n_embed", "hidden_size")
    num_heads = _alias(cfg, "n_head", "num_attention_heads")
    num_layers = _alias(cfg, "n_layer", "num_hidden_layers")
    vocab = cfg.get("vocab_size")
    for key, value in (("hidden_size", hidden), ("n_head", num_heads), ("n_layer", num_layers),
                       ("vocab_size", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"config.json: {key} must be a positive integer, got {value!r}")
    if hidden % num_heads:
        raise UserError(f"config.json: hidden_size ({hidden}) must be divisible by n_head "
                        f"({num_heads})")
    # pretraining_tp alone only changes the summation order of two matmuls (HF splits them into
    # pretraining_tp slices): such checkpoints load as they are. With slow_but_exact HF's slices
    # are F.linear without the bias, so its dense and dense_4h_to_h biases drop out of the sum:
    # a model of its own that bloomtrain's blocks (and BLOOM's training) do not compute.
    if (cfg.get("pretraining_tp") or 1) > 1 and cfg.get("slow_but_exact"):
        raise UserError(f"config.json: slow_but_exact=true with pretraining_tp="
                        f"{cfg['pretraining_tp']} is not supported: transformers' slow path "
                        f"leaves out the attention and MLP output biases, which bloomtrain "
                        f"adds as BLOOM was trained; set slow_but_exact to false")
    return BloomShape(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_hidden_size=4 * hidden,  # HF's BloomMLP is always 4h wide; n_inner is ignored there
        layer_norm_epsilon=_number(cfg, "layer_norm_epsilon", 1e-5),
        hidden_dropout=_number(cfg, "hidden_dropout", 0.0, below=1.0),
        attention_dropout=_number(cfg, "attention_dropout", 0.0, below=1.0),
        init_method_std=_number(cfg, "initializer_range", 0.02),
    )


def _alias(cfg: dict, key: str, alias: str):
    """A setting config.json may spell two ways (BloomConfig's attribute_map); both, differing,
    is refused: transformers' choice between them is its attribute order's, not a rule."""
    if cfg.get(key) is not None and cfg.get(alias) is not None and cfg[key] != cfg[alias]:
        raise UserError(f"config.json sets {key}={cfg[key]!r} and {alias}={cfg[alias]!r}, two "
                        f"names of one setting; keep one")
    return _first(cfg, key, alias)


def _number(cfg: dict, key: str, default: float, below: float = math.inf) -> float:
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not math.isfinite(value) or not 0 <= value < below:
        limit = "" if below == math.inf else f" below {below:g}"
        raise UserError(f"config.json: {key} must be a non-negative number{limit}, got {value!r}")
    return float(value)


def hf_config_from_shape(shape: BloomShape, extra: dict | None = None) -> dict:
    """config.json for `shape`. `extra` adds or overrides keys: special token ids, `dtype`."""
    if shape.ffn_hidden_size != 4 * shape.hidden_size:
        raise UserError(f"ffn_hidden_size {shape.ffn_hidden_size} is not 4 * hidden_size "
                        f"({4 * shape.hidden_size}); HF's BloomForCausalLM cannot express it")
    cfg = {
        "model_type": "bloom",
        "architectures": ["BloomForCausalLM"],
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "n_layer": shape.num_layers,
        "n_head": shape.num_heads,
        "layer_norm_epsilon": shape.layer_norm_epsilon,
        "initializer_range": shape.init_method_std,
        "hidden_dropout": shape.hidden_dropout,
        "attention_dropout": shape.attention_dropout,
        "apply_residual_connection_post_layernorm": False,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        # Explicit nulls: BloomConfig would otherwise default to bos 1 / eos 2, which may be
        # ordinary tokens of a custom tokenizer.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    cfg.update(extra or {})
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]  # the key transformers 4.x reads; 5.x reads `dtype`
    return dict(sorted(cfg.items()))


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise UserError(f"{hf_dir} is a file; an HF model is a directory (config.json plus "
                        f"{' or '.join(WEIGHT_FILES)}): give its directory")
    if not hf_dir.is_dir():
        raise UserError(f"HF model directory {hf_dir} does not exist")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir} has no config.json; expected an HF Bloom model directory "
                        f"(config.json plus {' or '.join(WEIGHT_FILES)})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{path} is not a JSON object")
    return cfg


def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether `path` should be read as an HF model directory rather than a bloomtrain checkpoint.
    Missing weights are reported later, by the reader, with a message that names them."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "manifest.json").is_file()


# ---- import ------------------------------------------------------------------------------------

def collect_hf_state(hf_dir: str | os.PathLike) -> tuple[BloomShape, dict, dict]:
    """(shape, state_dict without the tied head, config) of an HF Bloom directory, validated."""
    from bloomtrain.checkpoint.hf.files import check_tied_head, iter_hf_tensors
    from bloomtrain.model import check_state

    hf_dir = Path(hf_dir)
    cfg = read_hf_config(hf_dir)
    shape = shape_from_hf_config(cfg)
    import torch

    state, head = {}, None
    for name, tensor in iter_hf_tensors(hf_dir):
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            # As the sliced reader refuses it (hf/slices.py): integer weights imported, and
            # loading the checkpoint failed in torch's load_state_dict.
            raise UserError(f"{hf_dir}: {name} is stored as "
                            f"{str(tensor.dtype).removeprefix('torch.')}; expected float32, "
                            f"bfloat16 or float16 weights")
        if name == LM_HEAD:
            head = tensor
        else:
            state[name] = tensor
    if head is not None:
        check_tied_head(head, state.get(EMBEDDING), hf_dir)
    check_state(shape, {n: tuple(t.shape) for n, t in state.items()}, hf_dir)
    return shape, state, cfg


def _load_tokenizer_or_note(path: Path, log: Callable[[str], None]):
    from bloomtrain.checkpoint.tokenizer import has_tokenizer
    from bloomtrain.data.tokenizer import load_tokenizer

    if not has_tokenizer(path):
        log(f"note: {path} has no tokenizer.json (nor Megatron's vocab.json + merges.txt); the "
            f"checkpoint gets no tokenizer")
        return None
    try:
        return load_tokenizer(path)
    except UserError as e:
        log(f"note: tokenizer not copied: {e}")
        return None


def import_hf(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
              log: Callable[[str], None] = print) -> Path:
    """Convert an HF Bloom directory into a bloomtrain checkpoint (step 0) under `output_dir`.
    Returns the step directory."""
    from bloomtrain import checkpoint

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output {output_dir} exists and is not a directory; give a new "
                        f"directory for the checkpoint")
    shape, state, cfg = collect_hf_state(input_dir)
    existing = dict(checkpoint.list_checkpoints(output_dir))
    later = [s for s in existing if s != 0]
    if later:
        raise UserError(f"{output_dir} already holds a training run (step {max(later)}); "
                        f"import into a new directory")
    if 0 in existing:
        _check_reimport(existing[0], input_dir)
    tokenizer = _load_tokenizer_or_note(input_dir, log)
    meta = {"source": "hf", "hf_dir": str(input_dir.resolve()), "hf_config": cfg}
    created = not output_dir.exists()
    try:
        path = checkpoint.save_checkpoint(output_dir, 0, state, shape, meta=meta,
                                          tokenizer=tokenizer)
    except BaseException as e:
        # A failed import (a full disk) leaves no empty root of its own making behind.
        if created and output_dir.is_dir() and not any(output_dir.iterdir()):
            output_dir.rmdir()
        if isinstance(e, OSError):
            raise UserError(f"cannot write checkpoint under {output_dir}: {e}") from e
        raise
    log(f"imported {input_dir} ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"vocab {shape.vocab_size}, {state[EMBEDDING].dtype}) -> {path}")
    return path


def _check_reimport(step0: Path, input_dir: Path) -> None:
    """A step 0 already there is replaced only by a new import of the same HF directory (a
    retry, a refresh): another model's, or an import-deepspeed --weights-only one, was
    replaced without a word."""
    from bloomtrain.checkpoint import CheckpointError, read_manifest
    try:
        manifest = read_manifest(step0)
        same = manifest.get("source") == "hf" and \
            manifest.get("hf_dir") == str(input_dir.resolve())
        was = f"imported from {manifest.get('hf_dir') or manifest.get('source') or 'elsewhere'}"
    except CheckpointError as e:
        same, was = False, f"unreadable: {e}"
    if not same:
        raise UserError(f"{step0.parent} already holds a step-0 checkpoint ({was}); import "
                        f"into a new directory, or delete {step0} first")


# ---- writing HF directories ----------------------------------------------------------------------

def special_token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids as HF resolves them (special_tokens_map.json over tokenizer_config.json,
    else BLOOM's `<s>`, `</s>`, `<pad>`, and GPT-2's <|endoftext|> for eos): the tokenizer's
    own resolution (bloomtrain.data.tokenizer), which the training data's ids came from."""
    from bloomtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    try:
        eos = tok.eod_id
    except UserError:
        eos = None
    return {"bos_token_id": tok.role_id("bos_token", "<s>"), "eos_token_id": eos,
            "pad_token_id": tok.pad_id}


def _prepare_output(output_dir: Path) -> None:
    """Refuse to replace a directory that is not a previous export."""
    if output_dir.is_symlink():  # replacing it would move the link, not write its target
        raise UserError(f"--output {output_dir} is a symbolic link; give the directory it "
                        f"points to ({os.path.realpath(output_dir)})")
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise UserError(f"--output {output_dir} exists and is not a directory")
    if not any(not p.name.startswith(".bloomtrain_export.tmp.") for p in output_dir.iterdir()):
        return  # empty (but for what a killed export left inside)
    if not any((output_dir / m).is_file() for m in (EXPORT_MARKER, PARTIAL_MARKER)):
        # A save_pretrained directory holds exactly the names an export writes: told apart by
        # the marker, it is never taken for a previous export and replaced (the HF model a
        # checkpoint was imported from, most often).
        raise UserError(f"--output {output_dir} exists and is not a previous bloomtrain export "
                        f"(it has no {EXPORT_MARKER}); choose a new or empty directory")
    # Replacing the directory removes everything in it: only what an export writes may be
    # there (an HF download or a hub clone has a README, .git, other weights).
    ours = _export_names()
    # (a staging directory a killed export left inside is ours too: it goes with this one)
    others = sorted(p.name for p in output_dir.iterdir() if p.name not in ours
                    and not p.name.startswith(".bloomtrain_export.tmp."))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5
                                         else "")
        raise UserError(f"--output {output_dir} holds files an export does not write ({shown}): "
                        f"replacing it would delete them. Choose a new or empty directory")


def _export_config(reader, dtype: str) -> tuple[dict, Path | None]:
    """config.json of the export, and the checkpoint's tokenizer directory (if it has one),
    whose special tokens the config names."""
    manifest = reader.manifest
    tokenizer_dir = reader.path / manifest["tokenizer"] if manifest.get("tokenizer") else None
    extra: dict = {"dtype": dtype}
    source_cfg = manifest.get("hf_config") or {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source_cfg:
            extra[key] = source_cfg[key]
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        extra.update({k: v for k, v in special_token_ids(tokenizer_dir).items() if v is not None})
    return hf_config_from_shape(reader.shape, extra), tokenizer_dir


def _write_export(tmp: Path, reader, info: dict, config: dict,
                  tokenizer_dir: Path | None) -> list[str]:
    """The export's files in `tmp`; the tokenizer files copied."""
    from bloomtrain.safetensors_io import write_safetensors_streaming  # torch: not at parse time

    # One full parameter at a time, assembled from whatever layout wrote the checkpoint.
    entries = [(n, dtype, shape, (lambda n=n: reader.load(n)))
               for n, (dtype, shape) in info.items()]
    write_safetensors_streaming(tmp / SAFETENSORS_FILE, entries, {"format": "pt"})
    _write_json(tmp / "config.json", config)
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if config[k] is not None}
    if ids:
        _write_json(tmp / "generation_config.json", {"_from_model_config": True, **ids})
    _write_json(tmp / EXPORT_MARKER, {"checkpoint": str(reader.path)})
    copied = []
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, tmp / name)
                copied.append(name)
    return copied


def _export_names() -> set[str]:
    """Every name an export writes (_prepare_output allows only these in a directory it
    replaces)."""
    return {"config.json", "generation_config.json", SAFETENSORS_FILE, EXPORT_MARKER,
            PARTIAL_MARKER, *TOKENIZER_FILES}


def _staging_dir(output_dir: Path) -> Path:
    """Where the export is assembled: beside a new `output_dir` (then renamed into place), or
    inside one that exists (an empty directory, a previous export), whose files are then
    renamed into it one by one. The directory itself is never renamed: an empty mount point (a
    container's volume, a fresh disk) cannot be (EBUSY), its parent may be another filesystem
    (EXDEV), and a shell inside `--output .` would be left in a deleted directory."""
    if output_dir.exists():
        return output_dir / f".bloomtrain_export.tmp.{os.getpid()}"
    return output_dir.with_name(f".{output_dir.name}.tmp.{os.getpid()}")


def _replace_dir(tmp: Path, output_dir: Path) -> None:
    """The export assembled in `tmp` (_staging_dir) put in place at `output_dir`. Into an
    existing directory: the marker becomes the partial one first (the directory is no finished
    export until every file is in, and a retry after a kill here still knows it for an export),
    each file is renamed over its old self, a previous export's files the new one lacks (a
    tokenizer file) are removed, and the marker comes back last."""
    if tmp.parent != output_dir:
        os.replace(tmp, output_dir)
        return
    if (output_dir / EXPORT_MARKER).is_file():
        os.replace(output_dir / EXPORT_MARKER, output_dir / PARTIAL_MARKER)
    new = {p.name for p in tmp.iterdir()}
    for name in sorted(new - {EXPORT_MARKER}):
        os.replace(tmp / name, output_dir / name)
    for name in sorted(_export_names() - new - {PARTIAL_MARKER}):
        (output_dir / name).unlink(missing_ok=True)
    os.replace(tmp / EXPORT_MARKER, output_dir / EXPORT_MARKER)
    (output_dir / PARTIAL_MARKER).unlink(missing_ok=True)
    tmp.rmdir()


def export_hf(checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike,
              log: Callable[[str], None] = print) -> Path:
    """Write an HF `BloomForCausalLM` directory from a bloomtrain checkpoint (a step directory or
    a root with `latest`). The directory is assembled under a temporary name and renamed into
    place, so a failure leaves any previous export untouched."""
    from bloomtrain.checkpoint.reader import open_model
    from bloomtrain.model import check_state

    reader = open_model(checkpoint_path)
    ckpt = reader.path
    output_dir = Path(output_dir).absolute()  # "." has no name to put a temporary beside
    _prepare_output(output_dir)
    names = sorted(n for n in reader.names() if n != LM_HEAD)
    info = {n: (str(reader.dtype(n)).removeprefix("torch."), reader.full_shape(n)) for n in names}
    check_state(reader.shape, {n: s for n, (_, s) in info.items()}, ckpt)
    dtype = info[EMBEDDING][0]
    config, tokenizer_dir = _export_config(reader, dtype)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staging_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    for stale in output_dir.glob(".bloomtrain_export.tmp.*") if output_dir.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)  # a killed export's
    for stale in output_dir.parent.glob(f".{glob.escape(output_dir.name)}.tmp.*"):
        if not pid_alive(stale.name.rsplit(".", 1)[-1]):  # a killed export's, not a running one
            shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir()
        copied = _write_export(tmp, reader, info, config, tokenizer_dir)
        fsync_dir(tmp)
        _replace_dir(tmp, output_dir)
        fsync_dir(output_dir.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            # Only a write runs out of space; the temporary directory is gone by now.
            raise disk_full_error(
                f"exporting {ckpt} to {output_dir}", e, output_dir.parent,
                "nothing was written under that name, and an export already there is "
                "unchanged. Free disk space or choose another --output") from e
        if isinstance(e, OSError):  # EFBIG (a FAT32 drive, ulimit -f), EPERM, EROFS, EIO
            raise UserError(f"exporting {ckpt} to {output_dir} failed: {e.strerror or e}; "
                            f"nothing was written under that name, and an export already "
                            f"there is unchanged. Choose an --output on a filesystem that "
                            f"can take the files") from e
        raise
    log(f"exported {ckpt} -> {output_dir} ({len(names)} tensors, {dtype}"
        f"{', tokenizer' if copied else ', no tokenizer'})")
    return output_dir


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
