"""GPTDataset index building, samples and cache against Megatron-DeepSpeed's fixtures and a
line-by-line port of its reference loops."""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from bloomtrain.data import gpt_dataset as gd
from bloomtrain.data.gpt_dataset import GPTDataset, parse_split, split_documents
from bloomtrain.data.indexed import MMapIndexedDataset, write_dataset
from bloomtrain.errors import UserError

from tests.data import FIXTURES
CASES = json.loads((FIXTURES / "cases.json").read_text())


def _all_sequences(ds) -> np.ndarray:
    return np.arange(len(ds.sizes), dtype=np.int32)


@pytest.mark.parametrize("case", CASES["gpt_cases"], ids=lambda c: c["file"])
def test_samples_equal_megatron_fixtures(case, tmp_path):
    ds = MMapIndexedDataset(FIXTURES / case["dataset"])
    g = GPTDataset("train", ds, _all_sequences(ds), case["num_samples"], case["seq_length"],
                   case["seed"], cache_dir=tmp_path)
    expected = np.load(FIXTURES / case["file"])
    got = np.stack([g[i] for i in range(case["num_samples"])])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)
    assert len(g) >= case["num_samples"]


# ---- splits --------------------------------------------------------------------------------

def test_split_matches_megatron():
    assert split_documents("969,30,1", 1000) == CASES["split_969_30_1_of_1000"]
    assert split_documents("98,2", 160) == [0, 157, 160, 160]
    assert split_documents("1", 7) == [0, 7, 7, 7]
    assert split_documents("98/2/0", 10) == [0, 10, 10, 10]
    # Each part rounds to 3 (sum 9); Megatron shifts every boundary after 0 by the deficit.
    assert split_documents("1,1,1", 10) == [0, 4, 7, 10]


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("", "a,b", "1,-1,0", "0,0,0", "1,2,3,4", "1,,2", "nan"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


# ---- index building against a port of Megatron's loops ------------------------------------

def _ref_num_epochs(tokens_per_epoch, seq_length, num_samples):
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return num_epochs


def _ref_doc_idx(documents, num_epochs, rng, separate_last_epoch):
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.mgrid[0:num_epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _ref_doc_idx(documents, num_epochs - 1, rng, False)
    last = _ref_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def _ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    # helpers.cpp build_sample_idx, statement by statement.
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int32)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[doc_idx[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def _ref_shuffle_idx(num_samples, total_size, rng):
    dtype = np.uint32
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _ref_index_mappings(documents, sizes, num_samples, seq_length, seed):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = _ref_num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate = False
    if num_epochs > 1:
        from_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last = num_samples - from_minus_one
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = last < int(0.95 * per_epoch)  # the bigscience fork's cutoff_last_epoch
    doc_idx = _ref_doc_idx(documents, num_epochs, rng, separate)
    sample_idx = _ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    first = from_minus_one if separate else sample_idx.shape[0] - 1
    shuffle_idx = _ref_shuffle_idx(first, sample_idx.shape[0] - 1, rng)
    return doc_idx, sample_idx, shuffle_idx, separate


def test_index_build_equals_reference_loops():
    rng = np.random.default_rng(0)
    seen_separate = set()
    for trial in range(60):
        num_seqs = int(rng.integers(1, 60))
        sizes = rng.integers(0 if trial % 3 == 0 else 1, 40, size=num_seqs).astype(np.int32)
        if sizes.sum() < 2:
            sizes[0] = 2
        lo = int(rng.integers(0, num_seqs))
        documents = np.arange(lo, num_seqs, dtype=np.int32)
        if sizes[documents].sum() < 2:
            continue
        seq_length = int(rng.integers(1, 50))
        per_epoch = (int(sizes[documents].sum()) - 1) // seq_length
        num_samples = int(rng.integers(0, max(1, per_epoch) * int(rng.integers(1, 6)) + 3))
        seed = int(rng.integers(0, 2**31))
        *ref, separate = _ref_index_mappings(documents, sizes, num_samples, seq_length, seed)
        got = gd.build_index_mappings(documents, sizes, num_samples, seq_length, seed)
        for r, g in zip(ref, got):
            np.testing.assert_array_equal(g, r)
            assert g.dtype == r.dtype
        seen_separate.add(separate)
    assert seen_separate == {True, False}
    # A last epoch of 0.80-0.95 of one is separate in the fork BLOOM used (its fixture:
    # test_samples_equal_megatron_fixtures[...ns395]); Megatron-LM's 0.80 cutoff would not be.
    sizes = np.full(100, 33, dtype=np.int32)  # 103 samples of 32 an epoch
    documents = np.arange(100, dtype=np.int32)
    for extra, separate in ((82, True), (90, True), (97, False)):
        *ref, want = _ref_index_mappings(documents, sizes, 103 + extra, 32, 7)
        assert want is separate
        for r, g in zip(ref, gd.build_index_mappings(documents, sizes, 103 + extra, 32, 7)):
            np.testing.assert_array_equal(g, r)


def test_num_epochs_closed_form():
    for t in (2, 3, 17, 1000):
        for s in (1, 2, 7, 64):
            for n in (0, 1, 5, 99, 1234):
                assert gd.num_epochs_needed(t, s, n) == _ref_num_epochs(t, s, n)


def test_empty_first_document_keeps_megatron_row_zero():
    sizes = np.array([0, 5, 0, 7, 3], dtype=np.int32)
    doc_idx = np.array([0, 1, 2, 3, 4], dtype=np.int32)
    got = gd.build_sample_idx(sizes, doc_idx, 4, 1, int(sizes.sum()))
    np.testing.assert_array_equal(got, _ref_sample_idx(sizes, doc_idx, 4, 1, int(sizes.sum())))


# ---- cache -----------------------------------------------------------------------------------

@pytest.fixture
def small_dataset(tmp_path):
    rng = np.random.default_rng(1)
    docs = [[list(rng.integers(1, 1000, size=int(rng.integers(1, 30))))] for _ in range(40)]
    prefix = tmp_path / "data" / "small_text_document"
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def _counting(monkeypatch):
    calls = []
    real = gd.build_index_mappings

    def counted(*args, **kwargs):
        calls.append(args[2:])
        return real(*args, **kwargs)

    monkeypatch.setattr(gd, "build_index_mappings", counted)
    return calls


def test_cache_reused_and_keyed(small_dataset, monkeypatch):
    calls = _counting(monkeypatch)
    ds = MMapIndexedDataset(small_dataset)
    docs = _all_sequences(ds)
    a = GPTDataset("train", ds, docs, 50, 8, 3)
    # Default cache directory sits next to the dataset.
    assert a.paths["doc"].parent == Path(f"{small_dataset}_cache")
    b = GPTDataset("train", ds, docs, 50, 8, 3)
    assert len(calls) == 1
    assert isinstance(b.sample_idx, np.memmap)
    np.testing.assert_array_equal(np.stack([a[i] for i in range(50)]),
                                  np.stack([b[i] for i in range(50)]))
    keys = {a.key}
    for args in ((docs, 50, 8, 4), (docs, 50, 9, 3), (docs, 51, 8, 3), (docs[:-1], 50, 8, 3)):
        keys.add(GPTDataset("train", ds, *args).key)
    assert len(keys) == 5 and len(calls) == 5

    # Rewriting the dataset files changes their identity, so the old index is not reused.
    write_dataset(small_dataset, [[[1, 2, 3] * 10]] * 40, dtype=np.uint16)
    changed = GPTDataset("train", MMapIndexedDataset(small_dataset), docs, 50, 8, 3)
    assert changed.key != a.key and len(calls) == 6


@pytest.mark.parametrize("kind", ["doc", "sample", "shuffle"])
def test_truncated_cache_file_is_rebuilt(small_dataset, tmp_path, monkeypatch, kind):
    ds = MMapIndexedDataset(small_dataset)
    a = GPTDataset("train", ds, _all_sequences(ds), 30, 8, 5, cache_dir=tmp_path / "c")
    expected = np.stack([a[i] for i in range(30)])
    path = a.paths[kind]
    del a
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 9])
    calls = _counting(monkeypatch)
    b = GPTDataset("train", ds, _all_sequences(ds), 30, 8, 5, cache_dir=tmp_path / "c")
    assert len(calls) == 1
    np.testing.assert_array_equal(np.stack([b[i] for i in range(30)]), expected)


def test_unwritable_cache_dir_is_a_clear_error(small_dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ds = MMapIndexedDataset(small_dataset)
    with pytest.raises(UserError, match="data.cache_dir"):
        GPTDataset("train", ds, _all_sequences(ds), 10, 8, 5, cache_dir=blocker / "sub")


def test_out_of_range_sample_raises(small_dataset, tmp_path):
    ds = MMapIndexedDataset(small_dataset)
    g = GPTDataset("train", ds, _all_sequences(ds), 10, 8, 5, cache_dir=tmp_path)
    with pytest.raises(IndexError):
        g[len(g)]


def _build_on_rank(rank, world_size, prefix, cache_dir):
    calls = []
    real = gd.build_index_mappings

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    gd.build_index_mappings = counted
    ds = MMapIndexedDataset(prefix)
    g = GPTDataset("train", ds, np.arange(len(ds.sizes), dtype=np.int32), 40, 8, 11,
                   cache_dir=cache_dir)
    return len(calls), np.stack([g[i] for i in range(40)])


def test_two_ranks_rank0_builds_other_loads(small_dataset, tmp_path):
    from tests.dist import run_ranks

    out = run_ranks(2, _build_on_rank, str(small_dataset), str(tmp_path / "cache"))
    assert [n for n, _ in out] == [1, 0]
    np.testing.assert_array_equal(out[0][1], out[1][1])
    assert len(os.listdir(tmp_path / "cache")) == 3


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_index_build_progress_on_a_terminal_only(small_dataset, tmp_path, monkeypatch, terminal):
    # The line of each phase is redrawn in place ("\r" + clear line), fields joined by " | " as
    # training's progress line; a pipe or a log file gets none of it.
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("COLUMNS", "300")  # the terminal's width: lines are cut to it
    ds = MMapIndexedDataset(small_dataset)
    GPTDataset("train", ds, _all_sequences(ds), 50, 8, 3, cache_dir=tmp_path / "c")
    if not terminal:
        assert stream.getvalue() == ""
        return
    draws = stream.getvalue().split("\r\x1b[2K")
    assert draws[0] == "" and draws[-1].endswith("\n")
    head = "sample index train | 50 samples of 8 tokens | 0:00:00 | "
    tokens = int(ds.sizes.sum())  # one epoch holds the 50 samples
    assert [d.rstrip("\n") for d in draws[1:]] == [
        head + "document order: 40 documents x 1 epoch(s)",
        head + f"sample positions: {tokens:,} tokens",
        head + f"sample order: {(tokens - 1) // 8:,} samples",
        head + f"writing {tmp_path / 'c'}",
        head + "built"]
