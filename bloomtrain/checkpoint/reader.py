"""Reading checkpoints of any layout, one full parameter (or one tp chunk) at a time.

The reader assembles parameters from the manifest's fragment index, so it needs nothing from the
writer or from the layout that wrote the checkpoint.
"""
from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors import safe_open

from bloomtrain.checkpoint.format import (MODEL_KINDS, TIED_ALIAS, CheckpointError, SharedCheck,
                                          member_path, read_manifest, resolve, verify,
                                          verify_shared)
from bloomtrain.model.presets import BloomShape

_BLOCK = re.compile(r"transformer\.h\.(0|[1-9][0-9]*)\.(.+)")


@functools.lru_cache(maxsize=8)
def _one_block_parameters(shape: BloomShape) -> dict[str, tuple[int, ...]]:
    from bloomtrain.model import expected_parameters

    # Parameter shapes depend neither on the depth nor on the head count: one block of the
    # model stands for all of them, so a manifest claiming a million layers costs nothing.
    return expected_parameters(shape.replace(num_layers=1, num_heads=1))


def expected_shape(shape: BloomShape, name: str) -> tuple[int, ...] | None:
    """The shape of parameter `name` in a BLOOM model of `shape`; None if it has no such
    parameter. The tied LM head is stored as the embedding, so it is not one."""
    params = _one_block_parameters(shape)
    block = _BLOCK.fullmatch(name)
    if block is None:
        return params.get(name) if not name.startswith("transformer.h.") else None
    if int(block.group(1)) >= shape.num_layers:
        return None
    return params.get(f"transformer.h.0.{block.group(2)}")


class CheckpointReader:
    """Reads full parameters (and optimizer moments) out of a checkpoint of any layout, one
    parameter at a time: `load(name, kind)` assembles the fragments of `name`."""

    def __init__(self, path: str | os.PathLike, kinds: tuple[str, ...] = MODEL_KINDS,
                 check_sums: bool = True, shared: SharedCheck | None = None):
        self.path = resolve(path)
        self.manifest = read_manifest(self.path)  # checked: types, fragments tile, file names
        self.shape = BloomShape(**self.manifest["model_shape"])
        self.tensors: dict[str, dict] = self.manifest["tensors"]
        for name, t in self.tensors.items():
            want = expected_shape(self.shape, name)
            if want is None:
                raise CheckpointError(f"{self.path}: tensor {name} is not a parameter of a "
                                      f"{self.shape.num_layers}-layer BLOOM (the manifest's "
                                      f"model_shape); the manifest is corrupt")
            if tuple(t["shape"]) != want:
                raise CheckpointError(f"{self.path}: tensor {name} has shape {t['shape']}, but "
                                      f"the manifest's model_shape implies {list(want)}; the "
                                      f"manifest is corrupt")
        needed = {fr["files"][k] for t in self.tensors.values() for fr in t["fragments"]
                  for k in kinds if k in fr.get("files", {})}
        # With `shared` (a job's ranks opening it together: every rank calls this) each file is
        # hashed by one rank, and all agree.
        verify_shared(self.path, shared, check_sums, files=sorted(needed),
                      manifest=self.manifest)
        self._handles: dict[str, Any] = {}

    def check_complete(self) -> None:
        """Refuse a checkpoint that lacks some parameter of its model_shape. The reader itself
        also reads partial ones; loading a model, exporting or resuming needs them all."""
        params = _one_block_parameters(self.shape)
        per_block = sum(n.startswith("transformer.h.") for n in params)
        want = len(params) - per_block + per_block * self.shape.num_layers
        # Every name was checked to be a parameter of the shape, and names are distinct.
        if len(self.tensors) != want:
            raise CheckpointError(f"{self.path}: holds {len(self.tensors)} of the {want} "
                                  f"parameters of its {self.shape.num_layers}-layer BLOOM "
                                  f"(model_shape); the checkpoint is incomplete")

    def has(self, kind: str) -> bool:
        return any(kind in fr["keys"] for t in self.tensors.values() for fr in t["fragments"])

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str, kind: str = "model") -> torch.dtype:
        # Every fragment of a tensor holds the same kinds in the same dtypes (check_manifest).
        dtypes = self.tensors[name]["fragments"][0]["dtypes"]
        if kind not in dtypes:
            raise CheckpointError(f"{self.path}: {name} has no {kind} state")
        return getattr(torch, dtypes[kind])

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def _file(self, fname: str):
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(str(member_path(self.path, fname)),
                                                 framework="pt")
            except CheckpointError:
                raise
            except Exception as e:  # OSError, or safetensors' own SafetensorError
                raise CheckpointError(f"{self.path}: cannot open {fname} as safetensors: "
                                      f"{e}") from None
        return self._handles[fname]

    def _read(self, name: str, fr: dict, kind: str) -> torch.Tensor:
        """One fragment's flat tensor, checked against what the manifest says it is: the
        checksums cover the files, but not a manifest rewritten to match altered ones."""
        fname, key = fr["files"][kind], fr["keys"][kind]
        try:
            data = self._file(fname).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read {key} from {fname}: {e}") from None
        want = getattr(torch, fr["dtypes"][kind])
        if tuple(data.shape) != (fr["numel"],) or data.dtype != want:
            raise CheckpointError(f"{self.path}: {key} in {fname} is {data.dtype} "
                                  f"{list(data.shape)}, the manifest says {want} "
                                  f"[{fr['numel']}] for {name}; the checkpoint is corrupt")
        return data

    def _fragments(self, name: str, kind: str) -> tuple[dict, list[dict]]:
        name = TIED_ALIAS.get(name, name)
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        for fr in t["fragments"]:
            if kind not in fr["keys"]:
                raise CheckpointError(f"{self.path}: {name} has no {kind} state")
        return t, t["fragments"]

    def _fill(self, name: str, kind: str, frags: list[dict], out: torch.Tensor, lo: int = 0
              ) -> None:
        """Copy the parts of `frags` (offsets into one flat tp-local tensor) that fall in
        [lo, lo + out.numel()) into the flat, contiguous `out`."""
        hi = lo + out.numel()
        for fr in frags:
            a, b = max(lo, fr["offset"]), min(hi, fr["offset"] + fr["numel"])
            if a < b:
                data = self._read(name, fr, kind)  # a file mapping: slicing reads only [a, b)
                out[a - lo:b - lo].copy_(data[a - fr["offset"]:b - fr["offset"]])

    def load(self, name: str, kind: str = "model") -> torch.Tensor:
        """The full tensor `name`: the one allocation it returns, filled straight from the
        fragments (a tp-split checkpoint's chunks along dim 0 in place; along another dim one
        chunk-sized buffer at a time). At BLOOM-176B's embedding, 14.4 GB in fp32, per rank."""
        t, frags = self._fragments(name, kind)
        full = torch.empty(tuple(t["shape"]), dtype=self.dtype(name, kind))
        tp_size, dim = frags[0]["tp_size"], frags[0]["tp_dim"]
        if tp_size == 1:
            self._fill(name, kind, frags, full.view(-1))
            return full
        for r, chunk in enumerate(full.chunk(tp_size, dim)):
            mine = [fr for fr in frags if fr["tp_rank"] == r]
            if chunk.is_contiguous():
                self._fill(name, kind, mine, chunk.view(-1))
            else:
                local = torch.empty(chunk.numel(), dtype=full.dtype)
                self._fill(name, kind, mine, local)
                chunk.copy_(local.view(chunk.shape))
                del local  # before the next chunk's: one at a time
        return full

    def load_tp_shard(self, name: str, kind: str, tp_rank: int, tp_size: int,
                      tp_dim: int | None) -> torch.Tensor:
        """This tp rank's chunk of `name` along `tp_dim`, allocated once. When the checkpoint was
        written with the same split, only that chunk's fragments are read; from an unsplit one
        cut along dim 0 (every import's, and a tp change from 1), only the chunk's rows;
        otherwise the full parameter is assembled once and cut."""
        if tp_dim is None or tp_size == 1:
            return self.load(name, kind)
        t, frags = self._fragments(name, kind)
        shape = list(t["shape"])
        if frags[0]["tp_size"] == tp_size and frags[0]["tp_dim"] == tp_dim:
            shape[tp_dim] //= tp_size
            flat = torch.empty(math.prod(shape), dtype=self.dtype(name, kind))
            self._fill(name, kind, [fr for fr in frags if fr["tp_rank"] == tp_rank], flat)
            return flat.view(shape)
        if frags[0]["tp_size"] == 1 and tp_dim == 0 and shape[0] % tp_size == 0:
            rows = shape[0] // tp_size
            shape[0] = rows
            flat = torch.empty(math.prod(shape), dtype=self.dtype(name, kind))
            self._fill(name, kind, frags, flat, lo=tp_rank * flat.numel())
            return flat.view(shape)
        return self.load(name, kind).chunk(tp_size, tp_dim)[tp_rank].clone()

    def load_tp_range(self, name: str, kind: str, tp_rank: int, tp_size: int,
                      tp_dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of this tp rank's chunk of `name` flattened (what
        `load_tp_shard(...).view(-1)[start:stop]` holds), reading only the fragments' parts that
        hold them where this split is the checkpoint's or a row cut of an unsplit one: a ZeRO
        rank resuming takes its own range of each moment, not the whole (1/dp of the bytes).
        Other splits assemble the chunk and cut it."""
        t, frags = self._fragments(name, kind)
        out = torch.empty(stop - start, dtype=self.dtype(name, kind))
        saved_tp, saved_dim = frags[0]["tp_size"], frags[0]["tp_dim"]
        if (tp_dim is None or tp_size == 1) and saved_tp == 1:
            self._fill(name, kind, frags, out, lo=start)
        elif tp_size > 1 and saved_tp == tp_size and saved_dim == tp_dim:
            self._fill(name, kind, [fr for fr in frags if fr["tp_rank"] == tp_rank], out,
                       lo=start)
        elif tp_size > 1 and saved_tp == 1 and tp_dim == 0 and t["shape"][0] % tp_size == 0:
            chunk = math.prod(t["shape"]) // tp_size
            self._fill(name, kind, frags, out, lo=tp_rank * chunk + start)
        else:
            out.copy_(self.load_tp_shard(name, kind, tp_rank, tp_size, tp_dim)
                      .reshape(-1)[start:stop])
        return out

    def close(self) -> None:
        self._handles.clear()


def open_model(path: str | os.PathLike, shared: SharedCheck | None = None) -> CheckpointReader:
    """A reader of the model weights of the checkpoint at `path` (any layout), with the model and
    tokenizer files verified against their checksums (by the ranks of `shared` together, when
    every rank of a job opens it). Optimizer state is not read: for a large model it is most of
    the bytes, and a model's users (inference, export) need none of it."""
    reader = CheckpointReader(path, kinds=MODEL_KINDS, shared=shared)
    reader.check_complete()  # before anything builds the model its manifest describes
    tok = [k for k in reader.manifest["files"] if k.startswith("tokenizer/")]
    verify(reader.path, reader.manifest, files=tok)
    return reader


class LazyState(Mapping):
    """A read-only mapping name -> tensor computed on access, so a consumer that walks the
    parameters one by one never holds more than one full parameter from the checkpoint. With
    `load_range`, `range(name, start, stop)` gives elements [start, stop) of the flattened
    tensor, read alone (a ZeRO rank's own part)."""

    def __init__(self, names: list[str], load: Callable[[str], torch.Tensor],
                 load_range: Callable[[str, int, int], torch.Tensor] | None = None):
        self._names, self._load = set(names), load
        self._load_range = load_range
        self._last: tuple[str, torch.Tensor] | None = None  # consumers often read a name twice

    @property
    def ranged(self) -> bool:
        return self._load_range is not None

    def range(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._load_range(name, start, stop)

    def __getitem__(self, name):
        if name not in self._names:
            raise KeyError(name)
        if self._last is None or self._last[0] != name:
            self._last = None  # not held while the next one loads: one full tensor at a time
            self._last = (name, self._load(name))
        return self._last[1]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def __contains__(self, name):  # Mapping's would load the tensor to answer
        return name in self._names


def load_model_state(path: str | os.PathLike, verify_files: bool = True):
    """(shape, state_dict of full tensors, manifest) of the checkpoint at `path`."""
    reader = CheckpointReader(path, check_sums=verify_files)
    state = {n: reader.load(n) for n in reader.names()}
    return reader.shape, state, reader.manifest
