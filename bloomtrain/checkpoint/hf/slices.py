"""The tensors of an HF Bloom directory read in part: one tensor-parallel rank's rows or columns
of each, so that a rank serving (or evaluating) a split model never holds the whole of it.
Safetensors are read by slices; torch .bin files in the zip format (torch >= 1.6) are
memory-mapped and each slice copied out, so only the pages under it are read."""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open

from bloomtrain.checkpoint.hf.files import (canonical_name, check_tied_head, load_state_dict,
                                            weight_files)
from bloomtrain.errors import UserError
from bloomtrain.checkpoint.hf.convert import read_hf_config, shape_from_hf_config
from bloomtrain.model import check_state
from bloomtrain.model.presets import EMBEDDING, LM_HEAD
from bloomtrain.devices import DTYPE_NAMES, torch_dtype
from bloomtrain.safetensors_io import DTYPES


class HFSliceReader:
    """The interface of CheckpointReader that bloomtrain.serve.tp and bloomtrain.eval.model use
    (`shape`, `names`, `full_shape`, `dtype`, `load_tp_shard`, `close`). Use `sliceable(hf_dir)`
    first: .bin files of the older pickle format can only be read whole."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.path = Path(hf_dir)
        self.shape = shape_from_hf_config(read_hf_config(self.path))
        kind, files = weight_files(self.path)
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
                        name = canonical_name(key)
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
        for key, tensor in load_state_dict(file).items():  # sliceable(): memory-mapped
            name = canonical_name(key)
            torch_name = str(tensor.dtype).removeprefix("torch.")
            self._where[name] = (file, key)
            self._meta[name] = (tuple(tensor.shape), DTYPES.get(torch_name, (torch_name,))[0])
            self._mapped[name] = tensor

    def names(self) -> list[str]:
        return [n for n in self._where if n != LM_HEAD]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        stored = self._meta[name][1]
        torch_name = next((n for n, (tag, _) in DTYPES.items() if tag == stored), stored)
        try:
            return torch_dtype(torch_name)
        except UserError:
            tags = [DTYPES[str(torch_dtype(n)).removeprefix("torch.")][0] for n in DTYPE_NAMES]
            raise UserError(f"{self.path}: {name} is stored as {stored}; expected "
                            f"{', '.join(tags[:-1])} or {tags[-1]}") from None

    def _read(self, name: str, index):
        file, key = self._where[name]
        if name in self._mapped:  # a copy of the slice: only its pages of the file are read
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
        shape = self.full_shape(name)
        index = [slice(None)] * len(shape)
        if tp_dim is not None and tp_size > 1:
            size = shape[tp_dim] // tp_size
            index[tp_dim] = slice(tp_rank * size, (tp_rank + 1) * size)
        out = self._read(name, tuple(index))
        if name == EMBEDDING and self.tied_head:
            # Each rank compares its own rows, so together the ranks compare all of them.
            check_tied_head(self._read(LM_HEAD, tuple(index)), out, self.path)
        return out

    def close(self) -> None:
        self._mapped.clear()  # the last references to the .bin memory maps


def sliceable(hf_dir: str | os.PathLike) -> bool:
    """Whether HFSliceReader can read `hf_dir` in part: its weights are safetensors, or torch
    .bin files in the zip format (which torch.load can memory-map)."""
    try:
        kind, files = weight_files(Path(hf_dir))
    except UserError:
        return False
    return kind == "safetensors" or all(zipfile.is_zipfile(f) for f in files)
