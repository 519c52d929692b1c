"""`bloomtrain data inspect|merge`: look into and concatenate Megatron `MMIDIDX` datasets
(merge does what Megatron's `tools/merge_datasets.py` does)."""
from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from bloomtrain.data.indexed import IndexedDatasetBuilder, MMapIndexedDataset, strip_suffix
from bloomtrain.errors import UserError
from bloomtrain.files import disk_full_as

_BAR_WIDTH = 40
_SAMPLE_CHARS = 200


def document_lengths(ds: MMapIndexedDataset) -> np.ndarray:
    """Tokens per document (a document may hold several sequences)."""
    ends = np.concatenate([[0], np.cumsum(ds.sizes, dtype=np.int64)])
    return ends[ds.doc_idx[1:]] - ends[ds.doc_idx[:-1]]


def length_histogram(lengths: np.ndarray) -> list[str]:
    """Power-of-two buckets, because document lengths span several orders of magnitude."""
    if lengths.size == 0:
        return []
    top = max(int(lengths.max()), 1)
    edges = [0, 1] + [2 ** k for k in range(1, int(math.log2(top)) + 2)]
    counts, _ = np.histogram(lengths, bins=edges)
    peak = max(int(counts.max()), 1)
    nonzero = np.flatnonzero(counts)
    lines = []
    for b in range(nonzero[0], nonzero[-1] + 1):
        lo, hi, count = edges[b], edges[b + 1], counts[b]
        label = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
        bar = "#" * math.ceil(_BAR_WIDTH * int(count) / peak)
        lines.append(f"  {label:>15} | {int(count):>10,} {bar}")
    return lines


def inspect_dataset(prefix: str, tokenizer: str | None = None, samples: int = 3,
                    log: Callable[[str], None] = print) -> MMapIndexedDataset:
    ds = MMapIndexedDataset(strip_suffix(prefix))
    lengths = document_lengths(ds)
    log(f"dataset    {ds.prefix}")
    log(f"documents  {ds.num_docs:,}")
    log(f"sequences  {len(ds):,}")
    log(f"tokens     {ds.num_tokens:,}")
    log(f"dtype      {ds.dtype.name}")
    if lengths.size:
        log(f"doc length min {int(lengths.min()):,}  mean {float(lengths.mean()):,.1f}  "
            f"max {int(lengths.max()):,} tokens")
        log("doc length histogram (tokens | documents):")
        for line in length_histogram(lengths):
            log(line)
    if tokenizer and samples > 0 and ds.num_docs:
        from bloomtrain.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        # Evenly spaced documents show more of the corpus than the first few.
        picks = np.unique(np.linspace(0, ds.num_docs - 1, num=min(samples, ds.num_docs)).astype(int))
        for doc in picks:
            first, last = int(ds.doc_idx[doc]), int(ds.doc_idx[doc + 1])
            # Enough tokens for 200 characters without decoding a whole long document.
            ids = _first_tokens(ds, first, last, 800)
            text = tok.decode(ids.tolist())[:_SAMPLE_CHARS]
            log(f"--- document {doc} ({int(lengths[doc]):,} tokens)")
            log(repr(text))
    return ds


def _first_tokens(ds, first: int, last: int, count: int) -> np.ndarray:
    """The first `count` tokens of sequences first..last-1, reading no more of them than that (a
    plain-text file is one document, which can be gigabytes)."""
    parts = []
    for i in range(first, last):
        if count <= 0:
            break
        part = ds.get(i, 0, min(int(ds.sizes[i]), count))
        parts.append(part)
        count -= len(part)
    return np.concatenate(parts) if parts else np.zeros(0, ds.dtype)


def merge_datasets(inputs: list[str], output_prefix: str) -> MMapIndexedDataset:
    prefixes = [strip_suffix(p) for p in inputs]
    output_prefix = strip_suffix(output_prefix)
    if not prefixes:
        raise UserError("merge needs at least one --inputs prefix")
    # realpath: an input reached through a symlinked directory is the same files.
    if os.path.realpath(output_prefix) in {os.path.realpath(p) for p in prefixes}:
        raise UserError(f"--output-prefix {output_prefix} is also an input; choose a new prefix")
    if not os.path.basename(output_prefix):  # "outdir/" would write outdir/.bin, hidden
        raise UserError(f"--output-prefix {output_prefix} names a directory; give a prefix in it, "
                        f"e.g. {os.path.join(output_prefix, 'merged_text_document')}")
    datasets = [MMapIndexedDataset(p) for p in prefixes]
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{ds.prefix} ({ds.dtype.name})" for ds in datasets)
        raise UserError(f"inputs have different dtypes: {listing}; re-run preprocess with one "
                        f"tokenizer so they share one")
    with disk_full_as(f"merging into {output_prefix}.bin/.idx",
                      os.path.dirname(os.path.abspath(output_prefix)),
                      "nothing was written under those names; free disk space or choose "
                      "another --output-prefix"), \
            IndexedDatasetBuilder(output_prefix, datasets[0].dtype) as builder:
        for ds in datasets:
            builder.add_index(ds.prefix)
    return MMapIndexedDataset(output_prefix)
