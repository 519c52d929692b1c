"""The weight files of an HF Bloom directory (safetensors or torch .bin, one file or shards listed
by a `*.index.json` weight map): where they are, each refused unless it stays inside the
directory, and their tensors under our names, one at a time. Nothing but tensors is unpickled:
.bin files are read with `torch.load(weights_only=True)`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from bloomtrain.errors import UserError
from bloomtrain.model.presets import LM_HEAD
from bloomtrain.files import PathOutside, path_inside

if TYPE_CHECKING:
    import torch

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX)


def canonical_name(name: str) -> str:
    """Our (HF BloomForCausalLM's) name of a stored tensor: old `BloomModel` checkpoints
    (bigscience/bloom-560m's pytorch_model.bin, for one) store names without `transformer.`."""
    if name == LM_HEAD or name.startswith("transformer."):
        return name
    return "transformer." + name


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
                    f"(to {detail}); refusing to read a file an index names outside the "
                    f"directory: copy the files in (e.g. `cp -rL`) and give the copy")


def weight_files(hf_dir: Path) -> tuple[str, list[Path]]:
    """('safetensors' | 'bin', shard files in order)."""
    for single, index, kind in ((SAFETENSORS_FILE, SAFETENSORS_INDEX, "safetensors"),
                                (BIN_FILE, BIN_INDEX, "bin")):
        if (hf_dir / single).is_file():
            # A fixed name, not one read from a file: a symlink there is how the directory was
            # laid out (git-annex, DVC, weights on another disk), and transformers loads it.
            return kind, [hf_dir / single]
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
    tied `lm_head.weight`, when a file has one, is yielded too (check_tied_head)."""
    from safetensors import safe_open

    kind, files = weight_files(Path(hf_dir))
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
                    yield canonical_name(name), tensor
            continue
        state = load_state_dict(file)
        for name in list(state):
            # clone: detach from the mmap'd file and from storage shared with other entries
            # (a tied head saved by torch.save), which safetensors refuses to write.
            yield canonical_name(name), state.pop(name).clone()
        del state


def load_state_dict(file: Path) -> dict:
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


def check_tied_head(head: "torch.Tensor", embedding: "torch.Tensor | None", where) -> None:
    """A stored `lm_head.weight` must be the word embedding: bloomtrain's LM head is always
    tied."""
    import torch

    if embedding is None or head.dtype != embedding.dtype or not torch.equal(head, embedding):
        raise UserError(f"{where}: lm_head.weight differs from the word embedding; untied LM "
                        f"heads are not supported")
