"""Tokenize text corpora into Megatron `MMIDIDX` datasets, like Megatron-DeepSpeed's
`tools/preprocess_data.py` without sentence splitting: each input document becomes one sequence
and one document of `{output_prefix}_{json_key}_document.bin/.idx`.

Inputs are read by `bloomtrain.data.sources` (jsonl, jsonl.gz, jsonl.zst, parquet, plain text),
the same reader the tokenizer trainer uses.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bloomtrain.data.indexed import IndexedDatasetBuilder, MMapIndexedDataset, best_fitting_dtype
from bloomtrain.data.sources import (
    SkipReport,
    expand_inputs,
    iter_records,
    parse_record,
    skip_message,
)
from bloomtrain.data.tokenizer import Tokenizer, load_tokenizer
from bloomtrain.errors import UserError
from bloomtrain.files import disk_full_error, is_disk_full
from bloomtrain.progress import ProgressLine, format_duration

_BATCH_RECORDS = 256
_BATCH_BYTES = 4 << 20
_MAX_REPORTS = 20


# ----------------------------------------------------------------------------- tokenizing

# Module state (allow-listed in tests/structure.py): a pool worker's tokenizer, set by the pool's
# initializer, the one place multiprocessing gives a worker for state of its own.
_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    # A forked child must not use the parent's Rayon pool; parallelism comes from processes here.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_batch(tokenizer, batch, json_key: str, append_eod: bool, dtype):
    """Per record: (lineno, tokens) or (lineno, reason)."""
    parsed = [(lineno, *parse_record(kind, payload, json_key)) for lineno, kind, payload in batch]
    texts = [text for _, text, _ in parsed if text is not None]
    encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    eod = [tokenizer.eod_id] if append_eod else []
    results = []
    for lineno, text, reason in parsed:
        if text is None:
            results.append((lineno, reason))
            continue
        ids = next(encoded)
        if not ids:
            # Text that the tokenizer maps to nothing would be an empty sequence.
            results.append((lineno, "empty"))
            continue
        results.append((lineno, np.asarray(ids + eod, dtype=dtype)))
    return results


def _work(args):
    batch, json_key, append_eod, dtype = args
    return _encode_batch(_worker_tokenizer, batch, json_key, append_eod, dtype)


def _batches(paths: list[Path], json_key: str):
    """(path index, records) in input order; a batch never spans two files."""
    for index, path in enumerate(paths):
        batch, nbytes = [], 0
        for record in iter_records(path, json_key):
            batch.append(record)
            payload = record[2]
            nbytes += len(payload) if isinstance(payload, (bytes, str)) else 0
            if len(batch) >= _BATCH_RECORDS or nbytes >= _BATCH_BYTES:
                yield index, batch
                batch, nbytes = [], 0
        if batch:
            yield index, batch


def _start_pool(workers: int, tok: Tokenizer) -> concurrent.futures.ProcessPoolExecutor:
    # An executor, not multiprocessing.Pool: a Pool silently respawns workers whose start fails
    # and waits forever, an executor raises BrokenProcessPool.
    return concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(), initializer=_init_worker,
        initargs=(str(tok.path),))


def _encoded_batches(paths: list[Path], tok: Tokenizer, json_key: str, append_eod: bool, dtype,
                     pool, workers: int):
    """(path index, per-record results of `_encode_batch`) in input order, encoded in this
    process when `pool` is None, else by the pool. The caller shuts the pool down."""
    batches = _batches(paths, json_key)
    if pool is None:
        for path_index, batch in batches:
            yield path_index, _encode_batch(tok, batch, json_key, append_eod, dtype)
        return
    # A bounded window of submissions keeps memory flat however large the input is.
    window = collections.deque()
    for path_index, batch in batches:
        window.append((path_index, pool.submit(_work, (batch, json_key, append_eod, dtype))))
        if len(window) >= 2 * workers + 2:
            index, pending = window.popleft()
            yield index, pending.result()
    while window:
        index, pending = window.popleft()
        yield index, pending.result()


# ----------------------------------------------------------------------------- driver


@dataclasses.dataclass
class PreprocessStats:
    output_prefix: str
    files: int = 0
    docs: int = 0
    tokens: int = 0
    skips: SkipReport = dataclasses.field(default_factory=SkipReport)
    elapsed: float = 0.0

    @property
    def skipped(self) -> dict[str, int]:
        return self.skips.counts

    @property
    def reports(self) -> list[str]:
        return self.skips.reports

    @property
    def num_skipped(self) -> int:
        return self.skips.total

    def progress(self, file_index: int, seconds: float) -> list[str]:
        """The fields of the progress line, in training's style."""
        rate = 1 / max(seconds, 1e-9)
        return [f"preprocess | file {file_index + 1} of {self.files}", f"{self.docs:,} docs",
                f"{self.tokens:,} tokens", f"{self.docs * rate:,.0f} docs/s",
                f"{self.tokens * rate:,.0f} tok/s", format_duration(seconds)]


def dataset_prefix(output_prefix: str | os.PathLike, json_key: str = "text") -> str:
    return f"{os.fspath(output_prefix)}_{json_key}_document"


def _check_output_dir(prefix: str) -> None:
    parent = Path(prefix).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {parent}: {e}") from e
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory {parent} is not writable; choose another --output-prefix")


def _check_inputs_are_text(paths: list[Path], prefix: str) -> None:
    """No input is this run's own output, nor any tokenized dataset (a .bin/.idx pair, from a
    run into the input directory): read as text, its index would become a document of the new
    dataset, and its .bin be replaced while read."""
    outputs = {os.path.realpath(prefix + ext) for ext in (".bin", ".idx")}
    for path in paths:
        if os.path.realpath(path) in outputs:
            raise UserError(f"input {path} is also this run's output (--output-prefix "
                            f"{prefix}); write the dataset outside its inputs")
        if path.suffix in (".bin", ".idx") and MMapIndexedDataset.is_index(path.with_suffix(".idx")):
            raise UserError(f"input {path} is a tokenized dataset (.bin/.idx), not text: "
                            f"leave it out of --input (a directory input takes every file in "
                            f"it), or merge datasets with `bloomtrain data merge`")


def preprocess(
    inputs: list[str | os.PathLike],
    tokenizer,
    output_prefix: str | os.PathLike,
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    strict: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> PreprocessStats:
    """Tokenize `inputs` into `{output_prefix}_{json_key}_document.bin/.idx`.

    `tokenizer` is a path (tokenizer.json or an HF tokenizer directory) or a loaded Tokenizer.
    Unusable documents (SKIP_REASONS) are skipped and reported by file and line, or with
    `strict` the first one raises and nothing is written. The output is the same for any
    number of workers."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if append_eod:
        tok.eod_id  # fail before reading anything if the tokenizer has no end-of-document token
    paths = expand_inputs(inputs)
    prefix = dataset_prefix(output_prefix, json_key)
    _check_output_dir(prefix)
    _check_inputs_are_text(paths, prefix)
    dtype = np.dtype(best_fitting_dtype(tok.vocab_size))
    stats = PreprocessStats(output_prefix=prefix, files=len(paths),
                            skips=SkipReport(json_key, _MAX_REPORTS))
    bar = ProgressLine(enabled=progress)
    start = time.monotonic()
    builder = IndexedDatasetBuilder(prefix, dtype)
    pool = None
    try:
        if workers > 1:
            pool = _start_pool(workers, tok)
        for path_index, results in _encoded_batches(paths, tok, json_key, append_eod, dtype,
                                                    pool, workers):
            _add_documents(builder, stats, paths[path_index], results, strict, json_key)
            bar.update(*stats.progress(path_index, time.monotonic() - start))
        # The totals, whenever the last redraw was.
        bar.update(*stats.progress(len(paths) - 1, time.monotonic() - start), force=True)
        if stats.docs == 0:
            raise UserError(f"no usable documents in {len(paths)} input file(s); nothing written"
                            + stats.skips.first_problem())
        builder.finalize()
    except BaseException as e:
        builder.abort()
        told = _told(e, prefix, workers)
        if told is not None:
            raise told from e
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    stats.elapsed = time.monotonic() - start
    _log_summary(stats, dtype, log)
    return stats


def _told(e: BaseException, prefix, workers: int) -> UserError | None:
    """The one-line error a failed run reports instead of `e`, where there is one (the
    temporaries are gone by now)."""
    if is_disk_full(e):  # only a write runs out of space
        return _disk_full(prefix, e)
    if isinstance(e, concurrent.futures.BrokenExecutor):  # BrokenProcessPool
        return UserError(f"a tokenizer worker died ({e}); nothing was written to "
                         f"{prefix}.bin/.idx. A worker killed for memory (very long "
                         f"documents, most often) wants fewer --workers (now {workers})")
    return None


def _add_documents(builder, stats: PreprocessStats, path, results, strict: bool,
                   json_key: str) -> None:
    """One batch of a file's (line number, tokens or skip reason) into the dataset."""
    for lineno, result in results:
        if isinstance(result, str):
            if strict:
                message = skip_message(path, lineno, result, json_key)
                raise UserError(f"{message} (run without --strict to skip such documents)")
            stats.skips.add(path, lineno, result)
            continue
        builder.add_item(result)
        builder.end_document()
        stats.docs += 1
        stats.tokens += int(result.size)


def _disk_full(prefix: str, e: OSError) -> UserError:
    return disk_full_error(
        f"writing dataset {prefix}.bin/.idx", e, Path(prefix).parent,
        "nothing was written under those names, and a dataset already there is unchanged. Free "
        "disk space or choose another --output-prefix")


def _log_summary(stats: PreprocessStats, dtype: np.dtype, log: Callable[[str], None]) -> None:
    for line in stats.skips.lines():
        log(line)
    log(f"wrote {stats.output_prefix}.bin/.idx: {stats.docs:,} documents, "
        f"{stats.tokens:,} tokens ({dtype.name}) from {stats.files} file(s) "
        f"in {stats.elapsed:.1f}s; skipped: {stats.skips.summary()}")
