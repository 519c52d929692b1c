"""Data-pipeline speed: GPTDataset index build and preprocess throughput.

(1) Sample-index build for a synthetic dataset (sizes only; 10^6 documents, ~10^9 tokens by
default) at seq_length 2048 and about one epoch of samples: doc_idx, sample_idx and shuffle_idx
build times, the cached construction (build + atomic save) and the reload from the cache.
(2) `bloomtrain preprocess` throughput on the built-in demo corpus with 1 and 2 workers, in
tokens/s per worker.

Prints its figures, then one JSON line. Measures; asserts nothing.

    python bench/index_build.py
    python bench/index_build.py --docs 100000 --tokens 100000000 --corpus-docs 500
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bloomtrain.data import gpt_dataset as gd


class SizesOnlyDataset:
    """What index building reads from an indexed dataset: sizes, a prefix and an identity."""

    def __init__(self, sizes: np.ndarray, prefix: str):
        self.sizes = sizes
        self.prefix = prefix

    def file_identity(self) -> str:
        return f"synthetic-{len(self.sizes)}-{int(self.sizes.sum(dtype=np.int64))}"


def bench_index(num_docs: int, num_tokens: int, seq_length: int, seed: int, workdir: Path) -> dict:
    rng = np.random.default_rng(seed)
    mean = num_tokens / num_docs
    sizes = rng.integers(1, int(2 * mean), size=num_docs, dtype=np.int32)
    documents = np.arange(num_docs, dtype=np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    num_samples = (tokens_per_epoch - 1) // seq_length  # exactly one epoch
    print(f"index build: {num_docs:,} documents, {tokens_per_epoch:,} tokens, seq {seq_length}, "
          f"{num_samples:,} samples")

    num_epochs = gd.num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = gd.separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    rs = np.random.RandomState(seed)
    t0 = time.perf_counter()
    doc_idx = gd.build_doc_idx(documents, num_epochs, rs, separate)
    t1 = time.perf_counter()
    sample_idx = gd.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    t2 = time.perf_counter()
    gd.build_shuffle_idx(sample_idx.shape[0] - 1, sample_idx.shape[0] - 1, rs)
    t3 = time.perf_counter()
    out = {"docs": num_docs, "tokens": tokens_per_epoch, "seq_length": seq_length,
           "num_samples": num_samples, "doc_idx_s": t1 - t0, "sample_idx_s": t2 - t1,
           "shuffle_idx_s": t3 - t2, "build_total_s": t3 - t0}

    fake = SizesOnlyDataset(sizes, str(workdir / "synthetic_text_document"))
    t4 = time.perf_counter()
    gd.GPTDataset("train", fake, documents, num_samples, seq_length, seed)
    t5 = time.perf_counter()
    gd.GPTDataset("train", fake, documents, num_samples, seq_length, seed)
    t6 = time.perf_counter()
    out.update(cached_build_s=t5 - t4, cache_load_s=t6 - t5)
    for key in ("doc_idx_s", "sample_idx_s", "shuffle_idx_s", "build_total_s", "cached_build_s",
                "cache_load_s"):
        print(f"  {key:<16} {out[key]:8.3f} s")
    return out


def bench_preprocess(corpus_docs: int | None, vocab_size: int, workdir: Path) -> dict:
    from bloomtrain.data.corpus import build_demo_corpus
    from bloomtrain.data.preprocess import preprocess
    from bloomtrain.data.tokenizer import train_tokenizer

    corpus = build_demo_corpus(workdir / "corpus.jsonl", max_docs=corpus_docs)
    tok_json = train_tokenizer([corpus], vocab_size, workdir / "tok")
    out = {"vocab_size": vocab_size, "corpus_bytes": corpus.stat().st_size}
    print(f"preprocess: demo corpus ({out['corpus_bytes'] / 1e6:.1f} MB), vocab {vocab_size}")
    for workers in (1, 2):
        stats = preprocess([corpus], Path(tok_json).parent, workdir / f"w{workers}",
                           workers=workers, progress=False, log=lambda *_: None)
        per_worker = stats.tokens / stats.elapsed / workers
        out[f"workers{workers}"] = {"docs": stats.docs, "tokens": stats.tokens,
                                    "elapsed_s": stats.elapsed,
                                    "tokens_per_s": stats.tokens / stats.elapsed,
                                    "tokens_per_s_per_worker": per_worker}
        print(f"  workers={workers}: {stats.tokens:,} tokens in {stats.elapsed:.2f} s = "
              f"{stats.tokens / stats.elapsed:,.0f} tokens/s ({per_worker:,.0f} per worker)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--tokens", type=int, default=1_000_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-docs", type=int, default=None,
                   help="cap on demo-corpus documents (default: the whole corpus)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--skip-preprocess", action="store_true")
    args = p.parse_args()

    result = {"bench": "index_build", "machine": platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench_index_") as tmp:
        tmp = Path(tmp)
        result["index"] = bench_index(args.docs, args.tokens, args.seq_length, args.seed, tmp)
        if not args.skip_preprocess:
            result["preprocess"] = bench_preprocess(args.corpus_docs, args.vocab_size, tmp)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
