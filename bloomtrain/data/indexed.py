"""Megatron's memory-mapped indexed dataset, format `MMIDIDX` version 1 (`.bin` + `.idx`).

`.bin` is the token ids of every sequence concatenated, in one dtype. `.idx` is, little-endian:
magic `b"MMIDIDX\\x00\\x00"`, `<Q` version 1, `<B` dtype code, `<Q` number of sequences N,
`<Q` length D of doc_idx, then `sizes` int32[N], `pointers` int64[N] (byte offset of each
sequence in `.bin`) and `doc_idx` int64[D] (the sequence each document starts at, beginning with 0
and ending with N). Files written here are byte-identical to those of
bigscience-workshop/Megatron-DeepSpeed's `MMapIndexedDatasetBuilder` for the same documents.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
from array import array
from pathlib import Path
from typing import Iterable

import numpy as np

from bloomtrain.errors import UserError
from bloomtrain.files import fsync_dir, tmp_name

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes
_CHECK_CHUNK = 1 << 22  # index entries validated at a time on open

# Megatron-DeepSpeed's codes. Its 6 and 7 are `np.float` and `np.double`, both float64;
# Megatron-Core later redefined 7 as float32, so a code-7 file from Megatron-Core reads wrong here.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float64,
    8: np.uint16,
}


class IndexedDatasetError(UserError):
    """A `.bin`/`.idx` pair that is truncated, corrupt or not MMIDIDX; the message names the
    file and what is wrong with it."""


def _code_of(dtype) -> int:
    dtype = np.dtype(dtype)
    # First match, like Megatron's code(): float64 is written as 6.
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise UserError(f"dtype {dtype} cannot be stored in an MMIDIDX dataset; "
                    f"use one of {sorted({np.dtype(d).name for d in DTYPE_CODES.values()})}")


def best_fitting_dtype(vocab_size: int | None = None) -> type:
    # Megatron's threshold leaves headroom under 65535 for added tokens.
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def strip_suffix(prefix: str | os.PathLike) -> str:
    """Users often pass `data.bin` or `data.idx` where a prefix is asked for."""
    prefix = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


class MMapIndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair; both files are memory-mapped, nothing is loaded."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self._identity: str | None = None
        self._num_tokens: int | None = None
        self._open()

    def _open(self) -> None:
        idx_file, bin_file = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx_file, bin_file):
            if not path.is_file():
                kept = [_previous(p) for p in (bin_file, idx_file)]
                if all(p.is_file() for p in kept):
                    raise UserError(
                        f"indexed dataset file {path} not found: a rewrite of this dataset "
                        f"(`bloomtrain preprocess`) was interrupted while it renamed its files; "
                        f"the dataset it replaced is whole as {kept[0].name} and {kept[1].name} "
                        f"(rename them to {bin_file.name} and {idx_file.name}), or run the "
                        f"rewrite again")
                raise UserError(f"indexed dataset file {path} not found; pass the prefix without "
                                f".bin/.idx (e.g. out/corpus_text_document) and run "
                                f"`bloomtrain preprocess` to create it")
        # Everything the header claims is checked against the file sizes before anything is
        # mapped or read through it: the files may come from anywhere, and numpy trusts offsets.
        idx_size = idx_file.stat().st_size
        if idx_size < _HEADER.size:
            raise IndexedDatasetError(f"{idx_file} is {idx_size} bytes, shorter than the "
                                      f"{_HEADER.size}-byte MMIDIDX header; the file is "
                                      f"truncated, rebuild it with `bloomtrain preprocess`")
        with open(idx_file, "rb") as f:
            magic, version, code, num_seqs, num_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            hint = (" (this is Megatron's legacy TNTIDX 'cached' format; convert it with "
                    "Megatron's --dataset-impl mmap)") if magic.startswith(b"TNTIDX") else ""
            raise IndexedDatasetError(f"{idx_file} is not an MMIDIDX index: magic "
                                      f"{magic!r}{hint}")
        if version != _VERSION:
            raise IndexedDatasetError(f"{idx_file} has MMIDIDX version {version}; only version "
                                      f"{_VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_file} has unknown dtype code {code}; known codes "
                                      f"are {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected_idx = _HEADER.size + num_seqs * 12 + num_doc_idx * 8
        if idx_size != expected_idx:
            raise IndexedDatasetError(f"{idx_file} is {idx_size} bytes but its header describes "
                                      f"{expected_idx} ({num_seqs} sequences, {num_doc_idx} "
                                      f"doc_idx entries); the file is truncated or corrupt, "
                                      f"rebuild it")
        if num_doc_idx == 0:
            raise IndexedDatasetError(f"{idx_file} has an empty doc_idx (it always starts with "
                                      f"0); the index is corrupt, rebuild it")
        self._idx_mmap = np.memmap(idx_file, mode="r", order="C")
        offset = _HEADER.size
        self._sizes = np.frombuffer(self._idx_mmap, np.int32, num_seqs, offset)
        offset += self._sizes.nbytes
        self._pointers = np.frombuffer(self._idx_mmap, np.int64, num_seqs, offset)
        offset += self._pointers.nbytes
        self._doc_idx = np.frombuffer(self._idx_mmap, np.int64, num_doc_idx, offset)
        bin_size = bin_file.stat().st_size
        self._check_arrays(idx_file, bin_file, bin_size)
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        self._bin_mmap = np.memmap(bin_file, mode="r", order="C") if bin_size else b""

    def _check_arrays(self, idx_file: Path, bin_file: Path, bin_size: int) -> None:
        """Every sequence lies inside .bin, right after the previous one (as every MMIDIDX
        writer lays them out), and doc_idx runs from 0 to the number of sequences without going
        back. Checked in chunks so that a large index needs no more than a few MiB extra."""
        itemsize, n = self.dtype.itemsize, len(self._sizes)
        end = 0  # where the sequences checked so far end in .bin, in bytes
        for lo in range(0, n, _CHECK_CHUNK):
            sizes = self._sizes[lo:lo + _CHECK_CHUNK]
            if sizes.min() < 0:
                i = lo + int(np.argmax(sizes < 0))
                raise IndexedDatasetError(f"{idx_file}: sequence {i} has negative size "
                                          f"{int(self._sizes[i])}; the index is corrupt, "
                                          f"rebuild it")
            nbytes = sizes.astype(np.int64) * itemsize
            # The chunk holds at most 2**22 sizes below 2**31 each: no int64 overflow.
            starts = np.empty_like(nbytes)
            starts[0] = end
            np.cumsum(nbytes[:-1], out=starts[1:])
            starts[1:] += end
            bad = np.flatnonzero(self._pointers[lo:lo + len(sizes)] != starts)
            if bad.size:
                i = lo + int(bad[0])
                raise IndexedDatasetError(f"{idx_file}: sequence {i} starts at byte "
                                          f"{int(self._pointers[i])} of {bin_file.name} but the "
                                          f"sequences before it end at byte "
                                          f"{int(starts[bad[0]])}; the index is corrupt, "
                                          f"rebuild it")
            end = int(starts[-1]) + int(nbytes[-1])
            if end > bin_size:
                break  # reported below; the rest cannot fit either
        if end != bin_size:
            # Also catches a .bin replaced while an old .idx stayed (a kill between the renames).
            raise IndexedDatasetError(f"{bin_file} is {bin_size} bytes but {idx_file} describes "
                                      f"{end if end <= bin_size else f'more than {end}'}; the "
                                      f"dataset is truncated or its two files do not belong "
                                      f"together, rebuild it with `bloomtrain preprocess`")
        doc_idx = self._doc_idx
        for lo in range(0, len(doc_idx), _CHECK_CHUNK):
            # One element of overlap so that the step between chunks is checked too.
            chunk = doc_idx[max(lo - 1, 0):lo + _CHECK_CHUNK]
            if chunk.min() < 0 or chunk.max() > n or (np.diff(chunk) < 0).any():
                raise IndexedDatasetError(f"{idx_file}: doc_idx must rise from 0 to the number "
                                          f"of sequences ({n}) and holds values outside that or "
                                          f"out of order; the index is corrupt, rebuild it")
        if doc_idx[0] != 0:
            raise IndexedDatasetError(f"{idx_file}: doc_idx starts at {int(doc_idx[0])}, not 0; "
                                      f"the index is corrupt, rebuild it")
        if doc_idx[-1] != n:
            # Sequences after the last document's end belong to no document: a merge would
            # join them to the next dataset's first document.
            raise IndexedDatasetError(f"{idx_file}: doc_idx ends at {int(doc_idx[-1])}, not at "
                                      f"the number of sequences ({n}); the index is corrupt, "
                                      f"rebuild it")

    # Memory maps must not travel through pickle (DataLoader workers, spawn): reopen by prefix.
    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._identity = None
        self._num_tokens = None
        self._open()

    @staticmethod
    def is_index(path: str | os.PathLike) -> bool:
        """Whether the file at `path` begins as an MMIDIDX index does."""
        try:
            with open(path, "rb") as f:
                return f.read(len(_MAGIC)) == _MAGIC
        except OSError:
            return False

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        return idx_path(prefix).is_file() and bin_path(prefix).is_file()

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def num_docs(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        if self._num_tokens is None:
            self._num_tokens = int(self._sizes.sum(dtype=np.int64))
        return self._num_tokens

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset:offset+length` of sequence `idx`, as a read-only view of the map."""
        n = len(self._sizes)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for a dataset of {n} sequences")
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for sequence {idx} "
                             f"of {size} tokens")
        start = int(self._pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_mmap, self.dtype, length, start)

    def file_identity(self) -> str:
        """Changes whenever either file's content changes. Hashing the .idx (12 bytes a sequence)
        pins every size and offset; the .bin's size and dtype complete it without reading tokens,
        so sample-index caches can key on this cheaply."""
        if self._identity is None:
            h = hashlib.sha1(memoryview(self._idx_mmap))
            bin_size = bin_path(self.prefix).stat().st_size
            h.update(f"|{bin_size}|{self.dtype.str}".encode())
            self._identity = h.hexdigest()
        return self._identity

    def __repr__(self) -> str:
        return (f"MMapIndexedDataset({self.prefix!r}, documents={self.num_docs}, "
                f"sequences={len(self)}, dtype={self.dtype.name})")


class IndexedDatasetBuilder:
    """Streams sequences to a temporary `.bin` and writes the `.idx` in `finalize()`.

    Nothing appears under the real names until `finalize()` renames `.bin` and then `.idx` into
    place, so a crash never leaves a readable partial dataset and never replaces an existing one
    with a partial one. Used as a context manager it finalizes on success and aborts (deleting the
    temporaries) on an exception."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _code_of(self.dtype)
        self._bin_final, self._idx_final = bin_path(self.prefix), idx_path(self.prefix)
        self._bin_tmp, self._idx_tmp = tmp_name(self._bin_final), tmp_name(self._idx_final)
        # array('i'/'q') keeps 4/8 bytes per entry, a tenth of a Python list of ints.
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self._num_bytes = 0
        self._closed = False
        try:
            self._bin_final.parent.mkdir(parents=True, exist_ok=True)
            self._bin = open(self._bin_tmp, "wb")
        except OSError as e:
            raise UserError(f"cannot write dataset {self.prefix}: {e}; choose a writable "
                            f"output prefix") from e

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"builder for {self.prefix} is already finalized or aborted")

    def _as_array(self, tokens) -> np.ndarray:
        if isinstance(tokens, np.ndarray) and tokens.dtype == self.dtype:
            return np.ascontiguousarray(tokens).reshape(-1)
        raw = np.asarray(tokens).reshape(-1)
        if raw.size and np.issubdtype(raw.dtype, np.integer) and \
                np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            if raw.min() < info.min or raw.max() > info.max:
                raise UserError(f"token id {raw.max() if raw.max() > info.max else raw.min()} "
                                f"does not fit dtype {self.dtype.name}; build with a wider dtype "
                                f"(vocabularies of 65500 or more need int32)")
        return raw.astype(self.dtype)

    def add_item(self, tokens) -> None:
        """Append one sequence (a list, numpy array or torch tensor of token ids)."""
        self._check_open()
        if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
            tokens = tokens.numpy()
        arr = self._as_array(tokens)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)
        self._num_bytes += arr.nbytes

    def end_document(self) -> None:
        self._check_open()
        self._doc_idx.append(len(self._sizes))

    def add_documents(self, tokens: np.ndarray, lengths: Iterable[int]) -> None:
        """Append many one-sequence documents from a flat token array at once; the same bytes as
        add_item + end_document per document, for large synthetic datasets and benchmarks."""
        self._check_open()
        arr = self._as_array(tokens)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != arr.size or (lengths < 0).any():
            raise ValueError(f"document lengths sum to {int(lengths.sum())} but there are "
                             f"{arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        start = len(self._sizes)
        self._sizes.frombytes(lengths.astype(np.int32).tobytes())
        self._doc_idx.frombytes((start + np.arange(1, lengths.size + 1, dtype=np.int64)).tobytes())
        self._num_bytes += arr.nbytes

    def add_index(self, other_prefix: str | os.PathLike) -> None:
        """Append every document of another dataset (Megatron's merge_file_)."""
        self._check_open()
        other = MMapIndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise UserError(f"cannot merge {other.prefix} (dtype {other.dtype.name}) into a "
                            f"{self.dtype.name} dataset; all inputs must share one dtype")
        offset = len(self._sizes)
        self._sizes.frombytes(np.ascontiguousarray(other.sizes, dtype=np.int32).tobytes())
        self._doc_idx.frombytes((offset + other.doc_idx[1:].astype(np.int64)).tobytes())
        with open(bin_path(other.prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)
        self._num_bytes += bin_path(other.prefix).stat().st_size

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    @property
    def num_docs(self) -> int:
        return len(self._doc_idx) - 1

    def finalize(self) -> None:
        self._check_open()
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = (np.frombuffer(self._sizes, dtype=np.int32) if self._sizes
                     else np.zeros(0, np.int32))
            pointers = np.zeros(len(sizes), dtype=np.int64)
            if len(sizes) > 1:
                np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
            with open(self._idx_tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, len(sizes), len(doc_idx)))
                f.write(sizes.tobytes(order="C"))
                f.write(pointers.tobytes(order="C"))
                f.write(doc_idx.tobytes(order="C"))
                f.flush()
                os.fsync(f.fileno())
            # Neither name may be a directory: os.replace would fail on the second after
            # replacing the first, and leave a new .bin beside the old .idx.
            for final in (self._bin_final, self._idx_final):
                if final.is_dir():
                    raise UserError(f"{final} is a directory; remove it or choose another "
                                    f"output prefix")
            # The old .idx goes first, then the .bin, then the new .idx: a kill between any two
            # steps leaves no pair that opens (an old .idx over a new .bin of the same size
            # would: its documents over the new tokens), and a new .idx never appears before
            # the data it describes. The old pair stays whole under PREVIOUS names until the
            # new one is in place, so such a kill loses nothing (the reader's error names it).
            kept = _keep_previous(self._bin_final, self._idx_final)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._idx_final)
            os.replace(self._bin_tmp, self._bin_final)
            os.replace(self._idx_tmp, self._idx_final)
            fsync_dir(self._bin_final.parent)
            if kept:
                _drop_previous(self._bin_final, self._idx_final)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Drop everything written so far; the real file names are never touched."""
        self._closed = True
        with contextlib.suppress(Exception):
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


PREVIOUS = ".previous"  # suffix of the dataset a rewrite replaces, while it replaces it


def _previous(path: Path) -> Path:
    return path.with_name(path.name + PREVIOUS)


def _drop_previous(*finals: Path) -> None:
    for final in finals:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_previous(final))


def _keep_previous(bin_final: Path, idx_final: Path) -> bool:
    """Hard-link an existing .bin/.idx pair to its PREVIOUS names before a rewrite replaces it
    (no bytes are copied); True when it did. Nothing is kept where there is no whole pair (a
    PREVIOUS pair left by an interrupted rewrite is then the only copy, and stays) or where the
    filesystem has no hard links (the rewrite goes on as before)."""
    if not (bin_final.is_file() and idx_final.is_file()):
        return False
    _drop_previous(bin_final, idx_final)
    try:
        os.link(bin_final, _previous(bin_final))
        os.link(idx_final, _previous(idx_final))
    except OSError:
        _drop_previous(bin_final, idx_final)
        return False
    fsync_dir(bin_final.parent)
    return True


def write_dataset(prefix: str | os.PathLike, documents: Iterable[Iterable], dtype=np.int32) -> None:
    """Write documents given as lists of sequences (the layout of the fixtures' docs.json)."""
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()
