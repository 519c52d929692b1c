"""Reading checkpoints of any layout, one full parameter (or one tp chunk) at a time.

The reader assembles parameters from the manifest's fragment index, so it needs nothing from the
writer or from the layout that wrote the checkpoint.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors import safe_open

from bloomtrain.checkpoint.format import (MODEL_KINDS, TIED_ALIAS, CheckpointError, read_manifest,
                                          resolve, verify)
from bloomtrain.model.presets import BloomShape


class CheckpointReader:
    """Reads full parameters (and optimizer moments) out of a checkpoint of any layout, one
    parameter at a time: `load(name, kind)` assembles the fragments of `name`."""

    def __init__(self, path: str | os.PathLike, kinds: tuple[str, ...] = MODEL_KINDS,
                 check_sums: bool = True):
        self.path = resolve(path)
        self.manifest = read_manifest(self.path)
        self.shape = BloomShape(**self.manifest["model_shape"])
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        needed = {fr["files"][k] for t in self.tensors.values() for fr in t["fragments"]
                  for k in kinds if k in fr.get("files", {})}
        verify(self.path, self.manifest, check_sums=check_sums, files=sorted(needed))
        self._handles: dict[str, Any] = {}

    def has(self, kind: str) -> bool:
        return any(kind in fr["keys"] for t in self.tensors.values() for fr in t["fragments"])

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str, kind: str = "model") -> torch.dtype:
        return getattr(torch, self.tensors[name]["fragments"][0]["dtypes"][kind])

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def _file(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
        return self._handles[fname]

    def load(self, name: str, kind: str = "model") -> torch.Tensor:
        name = TIED_ALIAS.get(name, name)
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        t = self.tensors[name]
        shape = tuple(t["shape"])
        full = torch.empty(shape, dtype=self.dtype(name, kind))
        frags = t["fragments"]
        tp_size = frags[0]["tp_size"]
        dim = frags[0]["tp_dim"]
        chunks = (full.chunk(tp_size, dim) if tp_size > 1 else (full,))
        locals_ = [torch.empty(c.numel(), dtype=full.dtype) for c in chunks]
        for fr in frags:
            if kind not in fr["keys"]:
                raise CheckpointError(f"{self.path}: {name} has no {kind} state")
            data = self._file(fr["files"][kind]).get_tensor(fr["keys"][kind])
            locals_[fr["tp_rank"]][fr["offset"]:fr["offset"] + fr["numel"]].copy_(data)
        for c, loc in zip(chunks, locals_):
            c.copy_(loc.view(c.shape))
        return full

    def load_tp_shard(self, name: str, kind: str, tp_rank: int, tp_size: int,
                      tp_dim: int | None) -> torch.Tensor:
        """This tp rank's chunk of `name` along `tp_dim`. When the checkpoint was written with
        the same split, only that chunk's fragments are read; otherwise the full parameter is
        assembled once and cut."""
        name = TIED_ALIAS.get(name, name)
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        if tp_dim is None or tp_size == 1:
            return self.load(name, kind)
        frags = t["fragments"]
        if frags[0]["tp_size"] == tp_size and frags[0]["tp_dim"] == tp_dim:
            shape = list(t["shape"])
            shape[tp_dim] //= tp_size
            flat = torch.empty(math.prod(shape), dtype=self.dtype(name, kind))
            for fr in frags:
                if fr["tp_rank"] == tp_rank:
                    data = self._file(fr["files"][kind]).get_tensor(fr["keys"][kind])
                    flat[fr["offset"]:fr["offset"] + fr["numel"]].copy_(data)
            return flat.view(shape)
        return self.load(name, kind).chunk(tp_size, tp_dim)[tp_rank].clone()

    def close(self) -> None:
        self._handles.clear()


class LazyState(Mapping):
    """A read-only mapping name -> tensor computed on access, so a consumer that walks the
    parameters one by one never holds more than one full parameter from the checkpoint."""

    def __init__(self, names: list[str], load: Callable[[str], torch.Tensor]):
        self._names, self._load = set(names), load
        self._last: tuple[str, torch.Tensor] | None = None  # consumers often read a name twice

    def __getitem__(self, name):
        if name not in self._names:
            raise KeyError(name)
        if self._last is None or self._last[0] != name:
            self._last = (name, self._load(name))
        return self._last[1]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def load_model_state(path: str | os.PathLike, verify_files: bool = True):
    """(shape, state_dict of full tensors, manifest) of the checkpoint at `path`."""
    reader = CheckpointReader(path, check_sums=verify_files)
    state = {n: reader.load(n) for n in reader.names()}
    return reader.shape, state, reader.manifest
