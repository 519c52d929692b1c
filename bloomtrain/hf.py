"""Interop with HF transformers' `BloomForCausalLM` directories (config.json + safetensors or
pytorch_model.bin, single file or sharded with a `*.index.json` weight map).

bloomtrain's model uses HF's parameter names, so conversion is a renaming at most: old `BloomModel`
checkpoints (bigscience/bloom-560m's pytorch_model.bin, for one) store bare names without the
`transformer.` prefix, and the tied LM head is stored once, as `transformer.word_embeddings.weight`,
the way `save_pretrained` writes it. Every tensor keeps its dtype and bits; nothing is cast.

transformers itself is never imported here: config.json is plain JSON, weights are read with
safetensors, and `.bin` files only through `torch.load(weights_only=True)`, which unpickles
nothing but tensors and containers.

Weights travel as (name, tensor) pairs so that a converter holds one tensor at a time where the
formats allow: export writes its safetensors file tensor by tensor (`write_safetensors_streaming`),
and reading follows the shard files one after the other.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from bloomtrain.model.presets import EMBEDDING, LM_HEAD
from bloomtrain.utils import (PathOutside, UserError, disk_full_error, fsync_dir, is_disk_full,
                             path_inside)

if TYPE_CHECKING:  # importing bloomtrain.model loads torch; the CLI parser must not wait for it
    import torch

    from bloomtrain.model import BloomShape

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")



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
    num_heads = _first(cfg, "n_head", "num_attention_heads")
    num_layers = _first(cfg, "n_layer", "num_hidden_layers")
    vocab = cfg.get("vocab_size")
    for key, value in (("hidden_size", hidden), ("n_head", num_heads), ("n_layer", num_layers),
                       ("vocab_size", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"config.json: {key} must be a positive integer, got {value!r}")
    if hidden % num_heads:
        raise UserError(f"config.json: hidden_size ({hidden}) must be divisible by n_head "
                        f"({num_heads})")
    # pretraining_tp / slow_but_exact only change the summation order of two matmuls (HF splits
    # them into pretraining_tp slices); the math is the same, so such checkpoints load as they are.
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


# ---- reading HF weights --------------------------------------------------------------------------

def _canonical_name(name: str) -> str:
    if name == LM_HEAD or name.startswith("transformer."):
        return name
    return "transformer." + name  # a BloomModel checkpoint saved without the prefix


def _weight_file(hf_dir: Path, name, source: str) -> Path:
    """`hf_dir / name` for a weight file that `source` names, refused unless it stays inside the
    directory: no absolute path, no `..`, no symlink leading elsewhere. One exception: the
    snapshots of the HF hub cache (`models--ORG--NAME/snapshots/REV/`) link every file to
    `../../blobs/`, so there the repository's cache directory is the boundary."""
    root = hf_dir
    if hf_dir.resolve().parent.name == "snapshots" and \
            (hf_dir.resolve().parent.parent / "blobs").is_dir():
        root = hf_dir.resolve().parent.parent
    try:
        return path_inside(hf_dir, name, boundary=root)
    except PathOutside as e:
        reason, detail = e.reason, e.detail
    if reason == "not_a_name":
        raise UserError(f"{source} names weight file {name!r}, which is not a file name")
    if reason == "outside":
        raise UserError(f"{source} names weight file {name!r}, a path outside {hf_dir}; "
                        f"refusing to read it (shards are file names inside the directory)")
    if reason == "unresolvable":
        raise UserError(f"{source}: weight file {name!r} cannot be resolved: {detail}")
    raise UserError(f"{source}: weight file {name!r} is a symlink leading out of {hf_dir} "
                    f"(to {detail}); refusing to read it")


def _weight_files(hf_dir: Path) -> tuple[str, list[Path]]:
    """('safetensors' | 'bin', shard files in order)."""
    for single, index, kind in ((SAFETENSORS_FILE, SAFETENSORS_INDEX, "safetensors"),
                                (BIN_FILE, BIN_INDEX, "bin")):
        if (hf_dir / single).is_file():
            return kind, [_weight_file(hf_dir, single, str(hf_dir))]
        if (hf_dir / index).is_file():
            try:
                weight_map = json.loads((hf_dir / index).read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise UserError(f"cannot read the weight map of {hf_dir / index}: {e}") from e
            if not isinstance(weight_map, dict) or \
                    not all(isinstance(f, str) for f in weight_map.values()):
                raise UserError(f"{hf_dir / index}: weight_map must map tensor names to shard "
                                f"file names")
            shards = [_weight_file(hf_dir, f, str(hf_dir / index))
                      for f in dict.fromkeys(sorted(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise UserError(f"{hf_dir}: shard(s) {', '.join(missing)} listed in {index} "
                                f"are missing")
            return kind, shards
    raise UserError(f"{hf_dir} has no weights: expected one of {', '.join(WEIGHT_FILES)}")


def iter_hf_tensors(hf_dir: str | os.PathLike) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(canonical name, tensor) for every tensor of an HF Bloom directory, shard by shard. A
    tied `lm_head.weight`, when a file has one, is yielded too; `collect_hf_state` checks it."""
    from safetensors import safe_open

    kind, files = _weight_files(Path(hf_dir))
    for file in files:
        if kind == "safetensors":
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors' SafetensorError for a damaged header
                raise UserError(f"cannot read {file} as safetensors: {e}") from None
            with handle as f:
                for name in f.keys():
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:
                        raise UserError(f"cannot read {name} from {file}: {e}") from None
                    yield _canonical_name(name), tensor
            continue
        state = _load_state_dict(file)
        for name in list(state):
            # clone: detach from the mmap'd file and from storage shared with other entries
            # (a tied head saved by torch.save), which safetensors refuses to write.
            yield _canonical_name(name), state.pop(name).clone()
        del state


def _load_state_dict(file: Path) -> dict:
    """A .bin file's tensors by name, memory-mapped (nothing read until used) when the file
    is in the zip format of torch>=1.6; older files are read whole."""
    import torch

    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot load {file} with torch.load(weights_only=True): {e}") from e
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{file} does not hold a state dict (tensors by name)")
    return state


def check_state(shape: BloomShape, names_shapes: dict[str, tuple[int, ...]], where) -> None:
    from bloomtrain.model import expected_parameters

    expected = expected_parameters(shape)
    missing = [n for n in expected if n not in names_shapes]
    unexpected = [n for n in names_shapes if n not in expected]
    if missing:
        raise UserError(f"{where}: {len(missing)} parameter(s) missing for a "
                        f"{shape.num_layers}-layer BLOOM, e.g. {', '.join(missing[:4])}")
    if unexpected:
        raise UserError(f"{where}: unexpected tensor(s) {', '.join(unexpected[:4])}"
                        f"{' ...' if len(unexpected) > 4 else ''}")
    for name, want in expected.items():
        got = tuple(names_shapes[name])
        if got != want:
            raise UserError(f"{where}: {name} has shape {list(got)}, the config implies "
                            f"{list(want)}")


def open_checkpoint(path: str | os.PathLike):
    """A CheckpointReader for the model weights of a bloomtrain checkpoint (any layout), with the
    model and tokenizer files verified against their checksums. Optimizer state is not read: for
    a large model it is most of the bytes, and nothing here uses it."""
    from bloomtrain import checkpoint

    reader = checkpoint.CheckpointReader(path, kinds=checkpoint.MODEL_KINDS)
    reader.check_complete()  # before anything builds the model its manifest describes
    tok = [k for k in reader.manifest["files"] if k.startswith("tokenizer/")]
    checkpoint.verify(reader.path, reader.manifest, files=tok)
    return reader


class HFSliceReader:
    """The tensors of an HF Bloom directory, read in part: `load_tp_shard` reads only one
    tensor-parallel rank's rows or columns, so that a rank serving a split model never holds
    the whole of it. Safetensors are read by slices; torch .bin files (the zip format torch has
    written since 1.6) are memory-mapped by `torch.load(mmap=True)` and each slice copied out,
    so only the pages under it are read. The interface of CheckpointReader that
    bloomtrain.serve.tp uses (`shape`, `names`, `full_shape`, `dtype`, `load_tp_shard`,
    `close`). Use `sliceable(hf_dir)` first: .bin files of the older pickle format can only be
    read whole."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(hf_dir)
        self.shape = shape_from_hf_config(read_hf_config(self.path))
        kind, files = _weight_files(self.path)
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, key)
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}  # -> (shape, dtype name)
        self._mapped: dict = {}  # canonical name -> tensor on a .bin file's memory map
        for file in files:
            if kind == "bin":
                self._map_bin(file)
                continue
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        name = _canonical_name(key)
                        self._where[name] = (file, key)
                        self._meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
            except UserError:
                raise
            except Exception as e:  # safetensors' SafetensorError for a damaged header
                raise UserError(f"cannot read {file} as safetensors: {e}") from None
        check_state(self.shape, {n: m[0] for n, m in self._meta.items() if n != LM_HEAD},
                    self.path)
        self.tied_head = LM_HEAD in self._meta

    def _map_bin(self, file: Path) -> None:
        import torch

        names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        for key, tensor in _load_state_dict(file).items():  # sliceable(): memory-mapped
            name = _canonical_name(key)
            self._where[name] = (file, key)
            self._meta[name] = (tuple(tensor.shape), names.get(tensor.dtype, str(tensor.dtype)))
            self._mapped[name] = tensor

    def names(self) -> list[str]:
        return [n for n in self._where if n != LM_HEAD]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str):
        import torch
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        stored = self._meta[name][1]
        if stored not in dtypes:
            raise UserError(f"{self.path}: {name} is stored as {stored}; expected F32, BF16 "
                            f"or F16")
        return dtypes[stored]

    def _read(self, name: str, index):
        from safetensors import safe_open

        file, key = self._where[name]
        if name in self._mapped:  # a copy of the slice: only its pages of the file are read
            import torch
            return self._mapped[name][index].clone(memory_format=torch.contiguous_format)
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_slice(key)[index]
        except Exception as e:
            raise UserError(f"cannot read {name} from {file}: {e}") from None

    def load_tp_shard(self, name: str, kind: str, tp_rank: int, tp_size: int,
                      tp_dim: int | None):
        """This rank's chunk of `name` along `tp_dim` (all of it when None); `kind` is
        "model" (an HF directory holds nothing else)."""
        import torch

        shape = self.full_shape(name)
        index = [slice(None)] * len(shape)
        if tp_dim is not None and tp_size > 1:
            size = shape[tp_dim] // tp_size
            index[tp_dim] = slice(tp_rank * size, (tp_rank + 1) * size)
        out = self._read(name, tuple(index))
        if name == EMBEDDING and self.tied_head:
            # The head must be the embedding (untied heads are not supported): each rank
            # compares its own rows, so together the ranks compare all of them.
            head = self._read(LM_HEAD, tuple(index))
            if head.dtype != out.dtype or not torch.equal(head, out):
                raise UserError(f"{self.path}: lm_head.weight differs from the word "
                                f"embedding; untied LM heads are not supported")
        return out

    def close(self) -> None:
        self._mapped.clear()  # the last references to the .bin memory maps


def sliceable(hf_dir: str | os.PathLike) -> bool:
    """Whether HFSliceReader can read `hf_dir` in part: its weights are safetensors, or torch
    .bin files in the zip format (which torch.load can memory-map)."""
    import zipfile

    try:
        kind, files = _weight_files(Path(hf_dir))
    except UserError:
        return False
    return kind == "safetensors" or all(zipfile.is_zipfile(f) for f in files)


def collect_hf_state(hf_dir: str | os.PathLike) -> tuple[BloomShape, dict, dict]:
    """(shape, state_dict without the tied head, config) of an HF Bloom directory, validated."""
    import torch

    hf_dir = Path(hf_dir)
    cfg = read_hf_config(hf_dir)
    shape = shape_from_hf_config(cfg)
    state, head = {}, None
    for name, tensor in iter_hf_tensors(hf_dir):
        if name == LM_HEAD:
            head = tensor
        else:
            state[name] = tensor
    if head is not None:
        emb = state.get(EMBEDDING)
        if emb is None or head.dtype != emb.dtype or not torch.equal(head, emb):
            raise UserError(f"{hf_dir}: lm_head.weight differs from the word embedding; "
                            f"untied LM heads are not supported")
    check_state(shape, {n: tuple(t.shape) for n, t in state.items()}, hf_dir)
    return shape, state, cfg


def _load_tokenizer_or_note(path: Path, log: Callable[[str], None]):
    from bloomtrain.data.tokenizer import load_tokenizer

    if not (path / "tokenizer.json").is_file():
        log(f"note: {path} has no tokenizer.json; the checkpoint gets no tokenizer")
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
    shape, state, cfg = collect_hf_state(input_dir)
    later = [s for s, _ in checkpoint.list_checkpoints(output_dir) if s != 0]
    if later:
        raise UserError(f"{output_dir} already holds a training run (step {max(later)}); "
                        f"import into a new directory")
    tokenizer = _load_tokenizer_or_note(input_dir, log)
    meta = {"source": "hf", "hf_dir": str(input_dir.resolve()), "hf_config": cfg}
    try:
        path = checkpoint.save_checkpoint(output_dir, 0, state, shape, meta=meta,
                                          tokenizer=tokenizer)
    except OSError as e:
        raise UserError(f"cannot write checkpoint under {output_dir}: {e}") from e
    log(f"imported {input_dir} ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"vocab {shape.vocab_size}, {state[EMBEDDING].dtype}) -> {path}")
    return path


# ---- writing HF directories ----------------------------------------------------------------------

def special_token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids as HF resolves them: tokenizer_config.json's tokens, else BLOOM's
    `<s>`, `</s>`, `<pad>`."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config = {}
    if (tokenizer_dir / "tokenizer_config.json").is_file():
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    out = {}
    for key, default in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")):
        token = config.get(f"{key}_token", default)
        if isinstance(token, dict):  # an AddedToken
            token = token.get("content")
        out[f"{key}_token_id"] = tok.token_to_id(token) if isinstance(token, str) else None
    return out


def _prepare_output(output_dir: Path) -> None:
    """Refuse to replace a directory that is not a previous export."""
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise UserError(f"--output {output_dir} exists and is not a directory")
    if not any(output_dir.iterdir()):
        return
    try:
        previous = json.loads((output_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous != "bloom":
        raise UserError(f"--output {output_dir} exists and is not an HF Bloom export; choose a "
                        f"new or empty directory")


def export_hf(checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike,
              log: Callable[[str], None] = print) -> Path:
    """Write an HF `BloomForCausalLM` directory from a bloomtrain checkpoint (a step directory or
    a root with `latest`). The directory is assembled under a temporary name and renamed into
    place, so a failure leaves any previous export untouched."""
    from bloomtrain.safetensors_io import write_safetensors_streaming  # torch: not at parse time

    reader = open_checkpoint(checkpoint_path)
    ckpt, manifest, shape = reader.path, reader.manifest, reader.shape
    output_dir = Path(output_dir)
    _prepare_output(output_dir)

    names = sorted(n for n in reader.names() if n != LM_HEAD)
    info = {n: (str(reader.dtype(n)).removeprefix("torch."), reader.full_shape(n)) for n in names}
    check_state(shape, {n: s for n, (_, s) in info.items()}, ckpt)
    dtype = info[EMBEDDING][0]

    tokenizer_dir = ckpt / manifest["tokenizer"] if manifest.get("tokenizer") else None
    extra: dict = {"dtype": dtype}
    source_cfg = manifest.get("hf_config") or {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source_cfg:
            extra[key] = source_cfg[key]
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        extra.update({k: v for k, v in special_token_ids(tokenizer_dir).items() if v is not None})
    config = hf_config_from_shape(shape, extra)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.with_name(f".{output_dir.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # One full parameter at a time, assembled from whatever layout wrote the checkpoint.
        entries = [(n, info[n][0], info[n][1], (lambda n=n: reader.load(n))) for n in names]
        write_safetensors_streaming(tmp / SAFETENSORS_FILE, entries, {"format": "pt"})
        _write_json(tmp / "config.json", config)
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if config[k] is not None}
        if ids:
            _write_json(tmp / "generation_config.json", {"_from_model_config": True, **ids})
        copied = []
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copyfile(tokenizer_dir / name, tmp / name)
                    copied.append(name)
        fsync_dir(tmp)
        if output_dir.exists():
            old = output_dir.with_name(f".{output_dir.name}.old.{os.getpid()}")
            os.replace(output_dir, old)
            try:
                os.replace(tmp, output_dir)
            except BaseException:
                os.replace(old, output_dir)  # the previous export back under its name
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output_dir)
        fsync_dir(output_dir.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            # Only a write runs out of space; the temporary directory is gone by now.
            raise disk_full_error(
                f"exporting {ckpt} to {output_dir}", e, output_dir.parent,
                "nothing was written under that name, and an export already there is "
                "unchanged. Free disk space or choose another --output") from e
        raise
    log(f"exported {ckpt} -> {output_dir} ({len(names)} tensors, {dtype}"
        f"{', tokenizer' if copied else ', no tokenizer'})")
    return output_dir


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---- CLI -----------------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "import-hf",
        description="Read an HF BloomForCausalLM/BloomModel directory (config.json plus "
        "model.safetensors, pytorch_model.bin, or their sharded *.index.json) and write a "
        "bloomtrain checkpoint (step 0) with the same tensors, bit for bit, and its tokenizer.")
    p.add_argument("--input", required=True, metavar="HF_DIR")
    p.add_argument("--output", required=True, metavar="DIR", help="checkpoint root to create")
    p.set_defaults(func=lambda args: _run(import_hf, args.input, args.output))

    p = subparsers.add_parser(
        "export-hf",
        description="Write config.json, model.safetensors (tied head stored once), "
        "generation_config.json and the tokenizer files of a bloomtrain checkpoint, loadable "
        "with transformers' BloomForCausalLM.from_pretrained.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a checkpoint step directory or a root holding `latest`")
    p.add_argument("--output", required=True, metavar="DIR")
    p.set_defaults(func=lambda args: _run(export_hf, args.checkpoint, args.output))


def _run(convert, source, output) -> int:
    convert(source, output)
    return 0
