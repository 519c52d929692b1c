"""Megatron-DeepSpeed's `GPTDataset` (megatron/data/gpt_dataset.py): fixed-length causal-LM
samples cut from a shuffled stream of documents, with the same train/valid/test split, the same
three index arrays and therefore the same samples, in the same order, as the code that trained
BLOOM.

- `doc_idx`: the documents repeated once per epoch and shuffled with `RandomState(seed)`; when the
  last epoch is needed only in small part it is shuffled on its own, so the partial epoch still
  draws from every document.
- `sample_idx` `[num_samples + 1, 2]`: (position in doc_idx, token offset) where each sample
  starts. Sample `i` is the `seq_length + 1` tokens from row `i` to row `i + 1` inclusive, so
  consecutive samples share one token. Megatron builds it with a C++ loop (helpers.cpp
  `build_sample_idx`); here it is a cumulative sum and a binary search, with the same result.
- `shuffle_idx`: a permutation of the samples (the separate last epoch again on its own).

As in Megatron, each *sequence* of the indexed dataset (each entry of `sizes`) is a document.
The arrays are cached as .npy files keyed by a hash of everything that determines them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from bloomtrain.config import parse_split  # noqa: F401  (the one parser of data.split)
from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output, fsync_dir
from bloomtrain.progress import ProgressLine

log = logging.getLogger(__name__)

# Bump when the content or layout of the cached arrays changes, so old caches are not reused.
INDEX_FORMAT_VERSION = 1

# Megatron's rule: a last epoch needing fewer than this fraction of an epoch's samples is shuffled
# separately (gpt_dataset.py `_build_index_mappings`). 0.95 is the bigscience fork's
# `cutoff_last_epoch`, which BLOOM trained with; NVIDIA Megatron-LM's is 0.80.
SEPARATE_LAST_EPOCH_FRACTION = 0.95


# ---- splits --------------------------------------------------------------------------------

def split_documents(split_str: str, num_docs: int) -> list[int]:
    """Boundaries `[0, a, b, num_docs]` of the train/valid/test document ranges, rounded exactly
    like Megatron's get_train_valid_test_split_ (each part rounded, the rounding excess taken
    from every boundary)."""
    fractions = parse_split(split_str)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num_docs))))
    excess = bounds[-1] - num_docs
    return [bounds[0]] + [b - excess for b in bounds[1:]]


# ---- index building (pure functions) -----------------------------------------------------------

def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest e >= 1 with (e * tokens_per_epoch - 1) // seq_length >= num_samples: the last
    token of a sample is the first of the next, so e epochs hold that many samples."""
    if tokens_per_epoch <= 0:
        raise UserError("the documents selected for a dataset hold no tokens; check the data "
                        "files and data.split")
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                        num_epochs: int) -> bool:
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - from_full_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last: bool) -> np.ndarray:
    # RandomState.shuffle's permutation depends only on length and state, not dtype, so
    # shuffling the int32 array directly reproduces Megatron's draws.
    if not separate_last or num_epochs == 1:
        dtype = np.int32 if len(documents) == 0 or int(np.max(documents)) < 2**31 else np.int64
        doc_idx = np.tile(np.asarray(documents, dtype=dtype), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """Row k is where token k*seq_length of the doc_idx-ordered stream lies: the index of the
    document holding it and the offset within. helpers.cpp walks document by document; its rows
    are exactly these positions (a sample ending on a document's last token stays in that
    document at offset size-1, and empty documents never hold a position)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    ends = np.cumsum(np.asarray(sizes)[doc_idx], dtype=np.int64)  # exclusive end of each doc
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, positions, side="right")
    offset = positions - (ends[doc] - np.asarray(sizes)[doc_idx[doc]].astype(np.int64))
    # helpers.cpp writes (0, 0) first without looking, even if doc_idx[0] is an empty document.
    doc[0], offset[0] = 0, 0
    fits32 = len(doc_idx) < 2**31 and (len(offset) == 0 or int(offset.max()) < 2**31)
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if fits32 else np.int64)
    out[:, 0] = doc
    out[:, 1] = offset
    return out


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) followed by a separate permutation of
    [num_samples, total_size), as Megatron's _build_shuffle_idx (uint32 unless too large)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def epoch_plan(documents: np.ndarray, sizes: np.ndarray, num_samples: int,
               seq_length: int) -> tuple[int, int, bool]:
    """(tokens per epoch, epochs, whether the last is shuffled on its own) of Megatron's index
    for `num_samples` samples: all that num_samples decides about the index arrays."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[np.asarray(documents)], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    return tokens_per_epoch, num_epochs, separate


def build_index_mappings(documents: np.ndarray, sizes: np.ndarray, num_samples: int,
                         seq_length: int, seed: int, phase=lambda what: None,
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) exactly as Megatron's _build_index_mappings.
    `phase(what)` is told each step as it starts (a progress line)."""
    documents = np.asarray(documents)
    tokens_per_epoch, num_epochs, separate = epoch_plan(documents, sizes, num_samples, seq_length)
    rng = np.random.RandomState(seed=seed)
    phase(f"document order: {len(documents):,} documents x {num_epochs} epoch(s)")
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate)
    phase(f"sample positions: {num_epochs * tokens_per_epoch:,} tokens")
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    phase(f"sample order: {total:,} samples")
    shuffle_idx = build_shuffle_idx(first, total, rng)
    return doc_idx, sample_idx, shuffle_idx


def expected_shapes(documents: np.ndarray, sizes: np.ndarray, num_samples: int,
                    seq_length: int) -> dict[str, tuple[int, ...]]:
    tokens_per_epoch, num_epochs, _ = epoch_plan(documents, sizes, num_samples, seq_length)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    return {"doc": (num_epochs * len(documents),), "sample": (total + 1, 2), "shuffle": (total,)}


# ---- cache -----------------------------------------------------------------------------------

def cache_key(indexed_dataset, documents: np.ndarray, num_samples: int, seq_length: int,
              seed: int) -> str:
    return _index_key(indexed_dataset, documents, seq_length, seed, num_samples=int(num_samples))


def _index_key(indexed_dataset, documents: np.ndarray, seq_length: int, seed: int,
               **length) -> str:
    """A hash of everything the index arrays are built from, the run's length as `length`
    gives it (num_samples for the cache; what it decides for the order: GPTDataset.order)."""
    docs = np.ascontiguousarray(np.asarray(documents, dtype=np.int64))
    description = {
        "format": INDEX_FORMAT_VERSION,
        "separate_last_epoch_fraction": SEPARATE_LAST_EPOCH_FRACTION,
        "dataset": indexed_dataset.file_identity(),
        "documents": hashlib.sha256(docs.tobytes()).hexdigest(),
        "seq_length": int(seq_length),
        "seed": int(seed),
        **length,
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def default_cache_dir(indexed_dataset) -> Path:
    return Path(f"{os.fspath(indexed_dataset.prefix)}_cache")


def _dist_rank() -> int | None:
    """The global rank when torch.distributed is initialized, else None. torch is imported only
    if already loaded: a single process that never touched torch needs no barrier."""
    import sys
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def _barrier() -> None:
    from bloomtrain.parallel import comm
    comm.barrier(comm.world_group(), "data")


class GPTDataset:
    """Samples of `seq_length + 1` tokens from `indexed_dataset`'s sequences listed in
    `documents`; `dataset[i]` is sample i as int64, equal to Megatron's `dataset[i]['text']`.

    Its length is the number of samples in all the epochs it had to build, so it can exceed
    `num_samples`, as in Megatron.

    Index caching: files `{name}_{ns}ns_{sl}sl_{seed}s_{key}_{doc,sample,shuffle}_idx.npy` in
    `cache_dir` (default `{prefix}_cache/` next to the dataset), where `key` hashes the dataset
    files' identity, the documents, num_samples, seq_length, seed and the index format version.
    Each file is written under a temporary name and renamed, so readers never see a partial file,
    and a file that fails to load or has the wrong shape is rebuilt. Under torch.distributed,
    global rank 0 builds while the others wait at a barrier (every rank must construct its
    datasets in the same order), then all memory-map the files. A rank that cannot read them
    afterwards (a node-local cache_dir on another node) builds them itself: the arrays are
    deterministic, so every rank still sees the same samples.
    """

    def __init__(self, name: str, indexed_dataset, documents, num_samples: int, seq_length: int,
                 seed: int, cache_dir: str | os.PathLike | None = None):
        documents = np.asarray(documents)
        sizes = indexed_dataset.sizes
        if documents.ndim != 1 or len(documents) == 0:
            raise ValueError(f"dataset {name!r}: documents must be a non-empty 1-D array")
        if documents.min() < 0 or documents.max() >= len(sizes):
            raise ValueError(f"dataset {name!r}: document indices must lie in [0, {len(sizes)})")
        if seq_length < 1 or num_samples < 0:
            raise ValueError(f"dataset {name!r}: need seq_length >= 1 and num_samples >= 0")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.documents = documents
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.cache_dir = (Path(cache_dir) if cache_dir is not None
                          else default_cache_dir(indexed_dataset))
        self.key = cache_key(indexed_dataset, documents, num_samples, seq_length, seed)
        stem = f"{name}_{self.num_samples}ns_{self.seq_length}sl_{self.seed}s_{self.key[:16]}"
        self.paths = {kind: self.cache_dir / f"{stem}_{kind}_idx.npy"
                      for kind in ("doc", "sample", "shuffle")}
        self._shapes = expected_shapes(documents, sizes, num_samples, seq_length)
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build()

    @functools.cached_property
    def order(self) -> dict:
        """What fixes the order of this dataset's samples: {"key": a hash of everything its
        index arrays are built from, num_samples replaced by what it decides, "epochs":
        [[epochs, whether the last is shuffled on its own]]}. Equal keys, the same samples in
        the same order, whatever num_samples (a checkpoint's record of its data order)."""
        _, epochs, separate = epoch_plan(self.documents, self.indexed_dataset.sizes,
                                         self.num_samples, self.seq_length)
        key = _index_key(self.indexed_dataset, self.documents, self.seq_length, self.seed,
                         epochs=epochs, separate_last_epoch=separate)
        return {"key": key, "epochs": [[epochs, separate]]}

    # ---- cache handling ----------------------------------------------------------------------
    def _try_load(self):
        arrays = []
        for kind, path in self.paths.items():
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                return None
            except (OSError, ValueError, EOFError) as e:
                log.warning("index cache %s is unreadable (%s); rebuilding it", path, e)
                return None
            if arr.shape != self._shapes[kind] or arr.dtype.kind not in "iu":
                log.warning("index cache %s has shape %s, expected %s; rebuilding it", path,
                            arr.shape, self._shapes[kind])
                return None
            arrays.append(arr)
        return tuple(arrays)

    def _build_and_save(self) -> None:
        start = time.perf_counter()
        bar = ProgressLine()

        def phase(what: str) -> None:
            bar.update(f"sample index {self.name} | {self.num_samples:,} samples of "
                       f"{self.seq_length} tokens", bar.elapsed(), what, force=True)

        try:
            arrays = build_index_mappings(self.documents, self.indexed_dataset.sizes,
                                          self.num_samples, self.seq_length, self.seed,
                                          phase=phase)
            phase(f"writing {self.cache_dir}")
            self._save(arrays)
            phase("built")
        finally:
            bar.close()
        log.info("built %s sample index (%d samples) in %.2fs -> %s", self.name,
                 len(arrays[2]), time.perf_counter() - start, self.cache_dir)

    def _save(self, arrays) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            for path, arr in zip(self.paths.values(), arrays):
                with atomic_output(path) as f:
                    np.save(f, arr, allow_pickle=False)
            fsync_dir(self.cache_dir)
        except OSError as e:
            raise UserError(f"cannot write the sample-index cache of dataset "
                            f"{self.indexed_dataset.prefix} to {self.cache_dir} ({e}); set "
                            f"data.cache_dir to a writable directory") from None

    def _load_or_build(self):
        rank = _dist_rank()
        failure = None
        if rank is None or rank == 0:
            try:
                if self._try_load() is None:
                    self._build_and_save()
            except UserError as e:
                if rank is None:
                    raise
                # Still reach the barrier, so the other ranks fail with the same message
                # (they cannot load, try to build and hit it too) instead of hanging.
                failure = e
        if rank is not None:
            _barrier()
        if failure is not None:
            raise failure
        arrays = self._try_load()
        if arrays is None:
            self._build_and_save()
            arrays = self._try_load()
            if arrays is None:
                raise UserError(f"sample-index cache in {self.cache_dir} cannot be read back "
                                f"after writing it; check the file system or set data.cache_dir")
        return arrays

    # ---- samples -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.shuffle_idx.shape[0]

    def __getitem__(self, idx: int) -> np.ndarray:
        n = len(self)
        idx = int(idx)
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {n} samples")
        # The index arrays come from cache files that anyone could have replaced; their shapes
        # are checked on load, their values here, where each is used (a pass over all of them
        # would read gigabytes at every start of a large run).
        i = int(self.shuffle_idx[idx])
        if not 0 <= i < len(self.sample_idx) - 1:
            raise self._corrupt(f"shuffle_idx[{idx}] = {i} is not a sample")
        doc_f, offset_f = (int(v) for v in self.sample_idx[i])
        doc_l, offset_l = (int(v) for v in self.sample_idx[i + 1])
        if not 0 <= doc_f <= doc_l < len(self.doc_idx):
            raise self._corrupt(f"sample_idx rows {i}, {i + 1} point at doc_idx entries "
                                f"{doc_f}, {doc_l} of {len(self.doc_idx)}")
        get = self.indexed_dataset.get
        try:
            if doc_f == doc_l:
                tokens = get(self.doc_idx[doc_f], offset=offset_f,
                             length=offset_l - offset_f + 1)
                return np.array(tokens, dtype=np.int64)
            parts = [get(self.doc_idx[doc_f], offset=offset_f)]
            parts.extend(get(self.doc_idx[d]) for d in range(doc_f + 1, doc_l))
            parts.append(get(self.doc_idx[doc_l], length=offset_l + 1))
        except IndexError as e:  # a document or token range outside the dataset
            raise self._corrupt(f"sample {idx}: {e}") from None
        return np.concatenate(parts).astype(np.int64)

    def _corrupt(self, detail: str) -> UserError:
        stem = self.paths["doc"].name.removesuffix("_doc_idx.npy")
        return UserError(f"the sample-index cache {self.cache_dir / stem}_*_idx.npy of dataset "
                         f"{self.indexed_dataset.prefix} is corrupt ({detail}); delete those "
                         f"files and they are rebuilt")

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, {self.indexed_dataset.prefix!r}, samples={len(self)}, "
                f"seq_length={self.seq_length}, seed={self.seed})")
