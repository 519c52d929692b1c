"""The data of a run, checked before any process starts: every dataset of `data.paths` is there
and readable, `data.tokenizer` loads, and every token id of every dataset has a row in the
model's embedding. `bloomtrain train` runs this in the process that launches the workers, before
torch is imported; the Trainer runs it again in each worker (under torchrun there is no
launcher), before any process group.

An id past the embedding is never an error of its own at training time: the vocab-parallel
embedding (tp > 1) gives it a zero row on every rank and trains on, and tp = 1 stops with an
IndexError. Megatron's MMIDIDX `.idx` records the ids' dtype but no vocabulary, and the tokenizer
of data.tokenizer need not be the one a dataset was written with, so each dataset's own range of
ids is the check: one pass over its memory-mapped `.bin`, in chunks, cached as a small JSON file
in the dataset's cache directory (where its sample indices go: data.cache_dir, else
`PREFIX_cache/`), keyed by both files' size, modification time and inode. A dataset whose dtype
cannot hold an id past the embedding (uint16 ids for 65,536 rows or more) is not read at all.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from bloomtrain.config import parse_data_paths
from bloomtrain.data.indexed import MMapIndexedDataset, bin_path, idx_path
from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output
from bloomtrain.progress import ProgressLine

log = logging.getLogger(__name__)

# Bump when the cached file's content changes, so that old files are not trusted.
ID_RANGE_FORMAT = 1
# Tokens reduced at a time: 32 MiB of a uint16 .bin, 64 MiB of an int32 one.
SCAN_CHUNK = 1 << 24


def open_datasets(paths) -> list[MMapIndexedDataset]:
    """The datasets of `data.paths`, opened (which checks that each .idx describes its .bin).
    Every missing one is named in one error."""
    entries = parse_data_paths(paths)
    if not entries:
        raise UserError("data.paths is empty: preprocess a dataset with `bloomtrain preprocess` "
                        "and set data.paths=[PREFIX_text_document]")
    missing = []
    for _, prefix in entries:
        absent = [p.suffix for p in (idx_path(prefix), bin_path(prefix)) if not p.is_file()]
        if absent:
            missing.append(f"{prefix} ({' and '.join(absent)} missing)")
    if missing:
        raise UserError(f"data.paths: no dataset at {', '.join(missing)}; give each dataset's "
                        f"prefix as `bloomtrain preprocess` printed it (PREFIX_text_document, "
                        f"without .bin/.idx)")
    return [MMapIndexedDataset(prefix) for _, prefix in entries]


def _stamp(prefix: str) -> dict:
    """What the cached range is valid for: a rewritten or replaced file changes it."""
    out: dict = {"format": ID_RANGE_FORMAT}
    for path in (bin_path(prefix), idx_path(prefix)):
        st = path.stat()
        out[path.suffix[1:]] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def cache_file(ds: MMapIndexedDataset, cache_dir: str | os.PathLike | None = None) -> Path:
    from bloomtrain.data.gpt_dataset import default_cache_dir
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir(ds)
    return directory / f"{Path(ds.prefix).name}_token_ids.json"


def _scan(ds: MMapIndexedDataset) -> tuple[int, int] | None:
    path = bin_path(ds.prefix)
    n = path.stat().st_size // ds.dtype.itemsize
    if n == 0:
        return None
    tokens = np.memmap(path, dtype=ds.dtype, mode="r", shape=(n,))
    lo, hi = None, None
    bar = ProgressLine()
    try:
        for start in range(0, n, SCAN_CHUNK):
            chunk = tokens[start:start + SCAN_CHUNK]
            c_lo, c_hi = chunk.min(), chunk.max()
            lo = c_lo if lo is None else min(lo, c_lo)
            hi = c_hi if hi is None else max(hi, c_hi)
            bar.update(f"token ids of {ds.prefix}", bar.elapsed(),
                       f"{min(start + SCAN_CHUNK, n) / n:.0%} of {n:,} tokens")
    finally:
        bar.close()
        del tokens
    return int(lo), int(hi)


def token_id_range(ds: MMapIndexedDataset,
                   cache_dir: str | os.PathLike | None = None) -> tuple[int, int] | None:
    """(smallest, largest) token id of `ds`, None when it holds no tokens. Read from the cache
    when it matches the files, else computed and cached; a cache that cannot be written (a
    read-only data directory without data.cache_dir) only costs the pass again next time."""
    file = cache_file(ds, cache_dir)
    stamp = _stamp(ds.prefix)
    try:
        cached = json.loads(file.read_text(encoding="utf-8"))
        if cached.get("stamp") == stamp:
            ids = cached["ids"]
            if ids is None:
                return None
            lo, hi = ids
            if isinstance(lo, int) and isinstance(hi, int):
                return lo, hi
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # absent, unreadable or another version: computed again below
    start = time.perf_counter()
    ids = _scan(ds)
    log.info("token ids of %s: %s in %.2fs", ds.prefix, ids, time.perf_counter() - start)
    try:
        with atomic_output(file, "w") as f:
            json.dump({"stamp": stamp, "ids": ids}, f)
    except OSError as e:
        log.info("cannot cache the token ids of %s in %s (%s); they are read again next run",
                 ds.prefix, file, e)
    return ids


def _fits_by_dtype(ds: MMapIndexedDataset, vocab_size: int) -> bool:
    """True when no id the dtype holds can be negative or reach `vocab_size`."""
    if not np.issubdtype(ds.dtype, np.unsignedinteger):
        return False
    return int(np.iinfo(ds.dtype).max) < vocab_size


def check_token_ids(datasets: list[MMapIndexedDataset], vocab_size: int, vocab_source: str,
                    cache_dir: str | os.PathLike | None = None) -> None:
    """Every id of every dataset in [0, vocab_size): the model's embedding has `vocab_size`
    rows (`vocab_source` says where that number comes from). All offenders in one error."""
    too_large, negative = [], []
    floats = [f"{ds.prefix} ({ds.dtype})" for ds in datasets
              if not np.issubdtype(ds.dtype, np.integer)]
    if floats:
        # MMIDIDX has float codes (Megatron's table), but token ids are integers: a float
        # dataset's ids would be truncated on the way to the embedding.
        raise UserError(f"data.paths: {', '.join(floats)}: floating-point values, not integer "
                        f"token ids; preprocess the text with `bloomtrain preprocess`")
    for ds in datasets:
        if _fits_by_dtype(ds, vocab_size):
            continue
        ids = token_id_range(ds, cache_dir)
        if ids is None:
            continue
        lo, hi = ids
        if hi >= vocab_size:
            too_large.append((ds.prefix, hi))
        if lo < 0:
            negative.append((ds.prefix, lo))
    if negative:
        listed = ", ".join(f"{p} (id {lo})" for p, lo in negative)
        raise UserError(f"data.paths: negative token ids in {listed}; the dataset is corrupt or "
                        f"not token ids, preprocess it again with `bloomtrain preprocess`")
    if too_large:
        largest = max(hi for _, hi in too_large)
        if len(too_large) == 1:
            what = f"dataset {too_large[0][0]} holds token ids up to {largest}"
        else:
            listed = ", ".join(f"{p} (ids up to {hi})" for p, hi in too_large)
            what = f"datasets {listed} hold token ids"
        raise UserError(f"data.paths: {what}, past the model's vocabulary of {vocab_size} ids "
                        f"(0-{vocab_size - 1}; {vocab_source}): the data was tokenized with a "
                        f"larger vocabulary than the model's. Preprocess it again with the "
                        f"model's tokenizer, or give the model at least {largest + 1} ids "
                        f"(model.vocab_size={largest + 1})")


def vocab_source(model_cfg, tokenizer, padded: int) -> str:
    """Where the model's `padded` rows come from, in the config's words."""
    if model_cfg.vocab_size:
        source, unpadded = f"model.vocab_size={model_cfg.vocab_size}", model_cfg.vocab_size
    elif tokenizer is not None:
        source, unpadded = f"data.tokenizer's {tokenizer.vocab_size} tokens", tokenizer.vocab_size
    elif model_cfg.preset:
        return f"model.preset {model_cfg.preset}'s vocabulary, with no model.vocab_size or " \
               f"data.tokenizer set"
    else:
        return "with no model.vocab_size or data.tokenizer set"
    if padded != unpadded:
        source += f" padded to {padded}"
    return source


def split_problems(cfg, datasets) -> list[str]:
    """What data.split leaves empty that the run needs, from each dataset's sequence count (the
    loader's split, Megatron's): every dataset's training split (Megatron's blend asserts one
    per weight; a lone dataset crashed on the first step), and some validation split when
    train.eval_interval asks for evaluations. Said here, in the launcher, before any worker
    or directory exists."""
    from bloomtrain.data.gpt_dataset import split_documents
    out, no_valid = [], []
    entries = parse_data_paths(cfg.data.paths)
    for (_, prefix), ds in zip(entries, datasets):
        n = len(ds.sizes)
        bounds = split_documents(cfg.data.split, n)
        if bounds[1] <= bounds[0]:
            out.append(f"data.split {cfg.data.split!r} gives the training split of {prefix} "
                       f"no documents (of its {n} sequences); give training a larger share")
        if bounds[2] <= bounds[1]:
            no_valid.append(f"{prefix} (of its {n} sequences)")
    if not cfg.train.eval_interval or not no_valid:
        return out
    if len(no_valid) == len(entries):
        out.append(f"train.eval_interval is {cfg.train.eval_interval}, but data.split "
                   f"{cfg.data.split!r} gives the validation split no documents: give it a "
                   f"share (e.g. data.split=949,50,1) or unset train.eval_interval")
    else:
        # Megatron's validation blend asserts a dataset per weight; leaving one out would
        # evaluate on another mix than the weights say, and on fewer samples than asked for.
        out.append(f"train.eval_interval is {cfg.train.eval_interval}, but data.split "
                   f"{cfg.data.split!r} gives the validation split of {', '.join(no_valid)} no "
                   f"documents, and the validation blend needs every dataset of data.paths: "
                   f"give validation a larger share or unset train.eval_interval")
    return out


def check_data(cfg, run):
    """Load data.tokenizer, give `run` (what bloomtrain.validate.validate returned) its
    vocabulary, and check the datasets against it. Returns (tokenizer or None, run). A missing tokenizer and
    missing datasets are named in one error."""
    from bloomtrain.data.tokenizer import load_tokenizer
    problems, tokenizer, datasets = [], None, None
    if cfg.data.tokenizer:
        try:
            tokenizer = load_tokenizer(cfg.data.tokenizer)
        except UserError as e:
            problems.append(f"data.tokenizer: {e}")
    try:
        datasets = open_datasets(cfg.data.paths)
    except UserError as e:
        problems.append(str(e))
    if problems:
        raise UserError("; ".join(problems))
    problems = split_problems(cfg, datasets)
    if problems:
        raise UserError("; ".join(problems))
    if tokenizer is not None:  # the model's vocabulary follows the tokenizer's
        run = run.with_vocab(cfg, tokenizer.vocab_size)
    padded = run.shape.vocab_size
    check_token_ids(datasets, padded, vocab_source(cfg.model, tokenizer, padded),
                    cfg.data.cache_dir)
    return tokenizer, run
