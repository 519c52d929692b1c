import json
import os
import pickle
import struct

import numpy as np
import pytest

from bloomtrain.data.indexed import (
    DTYPE_CODES,
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    best_fitting_dtype,
    write_dataset,
)
from bloomtrain.errors import UserError

from tests.data import FIXTURES
CASES = [("wide_int32", np.int32), ("narrow_uint16", np.uint16)]


def _docs(name):
    return json.loads((FIXTURES / f"{name}.docs.json").read_text())


@pytest.mark.parametrize("name,dtype", CASES)
def test_writer_is_byte_identical_to_megatron(tmp_path, name, dtype):
    prefix = tmp_path / name
    write_dataset(prefix, _docs(name), dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"{name}{suffix}").read_bytes() == (FIXTURES / f"{name}{suffix}").read_bytes()
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.parametrize("name,dtype", CASES)
def test_reader_matches_megatron_fixture(name, dtype):
    docs = _docs(name)
    ds = MMapIndexedDataset(FIXTURES / name)
    sequences = [seq for doc in docs for seq in doc]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(sequences) and ds.num_docs == len(docs)
    assert ds.sizes.dtype == np.int32 and ds.pointers.dtype == np.int64 and ds.doc_idx.dtype == np.int64
    assert ds.sizes.tolist() == [len(s) for s in sequences]
    assert ds.doc_idx.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    assert ds.num_tokens == sum(len(s) for s in sequences)
    for i, seq in enumerate(sequences):
        assert ds[i].tolist() == seq
    assert ds[-1].tolist() == sequences[-1]
    assert [a.tolist() for a in ds[2:5]] == sequences[2:5]
    assert ds.get(3, offset=2, length=4).tolist() == sequences[3][2:6]
    assert ds.get(3, offset=1).tolist() == sequences[3][1:]
    with pytest.raises(IndexError):
        ds.get(len(ds))
    assert MMapIndexedDataset.exists(FIXTURES / name)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[7].tolist() == sequences[7] and clone.file_identity() == ds.file_identity()


def test_dtype_table():
    assert DTYPE_CODES[4] is np.int32 and DTYPE_CODES[8] is np.uint16
    assert DTYPE_CODES[6] is np.float64 and DTYPE_CODES[7] is np.float64
    assert best_fitting_dtype(50000) is np.uint16
    assert best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(250880) is np.int32


def test_round_trip_merge_and_identity(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(25)]
    write_dataset(tmp_path / "all", docs, np.uint16)
    write_dataset(tmp_path / "a", docs[:10], np.uint16)
    with IndexedDatasetBuilder(tmp_path / "b", np.uint16) as b:
        for doc in docs[10:]:
            for seq in doc:
                b.add_item(np.array(seq))
            b.end_document()
    with IndexedDatasetBuilder(tmp_path / "merged", np.uint16) as m:
        m.add_index(tmp_path / "a")
        m.add_index(tmp_path / "b")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"all{suffix}").read_bytes()
    ds = MMapIndexedDataset(tmp_path / "all")
    assert [ds[i].tolist() for i in range(len(ds))] == [s for d in docs for s in d]
    assert ds.file_identity() == MMapIndexedDataset(tmp_path / "merged").file_identity()
    assert ds.file_identity() != MMapIndexedDataset(tmp_path / "a").file_identity()
    with IndexedDatasetBuilder(tmp_path / "wide", np.int32) as w, pytest.raises(UserError, match="dtype"):
        w.add_index(tmp_path / "a")


def test_add_documents_equals_add_item(tmp_path):
    lengths = [3, 1, 5]
    tokens = np.arange(9, dtype=np.int32)
    with IndexedDatasetBuilder(tmp_path / "bulk", np.int32) as b:
        b.add_documents(tokens, lengths)
    write_dataset(tmp_path / "one", [[[0, 1, 2]], [[3]], [[4, 5, 6, 7, 8]]], np.int32)
    assert (tmp_path / "bulk.idx").read_bytes() == (tmp_path / "one.idx").read_bytes()
    assert (tmp_path / "bulk.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()


def test_token_out_of_dtype_range(tmp_path):
    with pytest.raises(UserError, match="int32"):
        with IndexedDatasetBuilder(tmp_path / "x", np.uint16) as b:
            b.add_item([70000])
    assert os.listdir(tmp_path) == []


def test_abort_and_exception_leave_nothing(tmp_path):
    write_dataset(tmp_path / "d", [[[1, 2, 3]]], np.uint16)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "d", np.uint16) as b:
            b.add_item([9, 9])
            b.end_document()
            raise RuntimeError("killed")
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before


def test_reader_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        MMapIndexedDataset(tmp_path / "missing")
    write_dataset(tmp_path / "d", [[[1, 2, 3], [4]], [[5, 6]]], np.int32)
    bin_file, idx_file = tmp_path / "d.bin", tmp_path / "d.idx"
    good_bin, good_idx = bin_file.read_bytes(), idx_file.read_bytes()

    bin_file.write_bytes(good_bin[:-4])
    with pytest.raises(UserError, match="truncated"):
        MMapIndexedDataset(tmp_path / "d")
    bin_file.write_bytes(good_bin)

    idx_file.write_bytes(b"TNTIDX\x00\x00" + good_idx[8:])
    with pytest.raises(UserError, match="magic"):
        MMapIndexedDataset(tmp_path / "d")
    idx_file.write_bytes(good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:])
    with pytest.raises(UserError, match="version 2"):
        MMapIndexedDataset(tmp_path / "d")
    idx_file.write_bytes(good_idx[:-8])
    with pytest.raises(UserError, match="truncated"):
        MMapIndexedDataset(tmp_path / "d")
    # doc_idx [0, 2, 2] over 3 sequences: the last sequence is in no document (Megatron's
    # writer ends doc_idx at the sequence count), and a merge would join it to the next
    # dataset's first document.
    idx_file.write_bytes(good_idx[:-8] + struct.pack("<q", 2))
    with pytest.raises(UserError, match=r"doc_idx ends at 2, not at the number of sequences \(3\)"):
        MMapIndexedDataset(tmp_path / "d")


def test_empty_dataset(tmp_path):
    write_dataset(tmp_path / "e", [], np.int32)
    ds = MMapIndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_docs == 0 and ds.num_tokens == 0


def test_a_rewrite_killed_between_its_renames_leaves_no_dataset_that_opens(tmp_path, monkeypatch):
    # The same token count, other document boundaries: an old .idx over the new .bin would open
    # and cut the new tokens at the old boundaries.
    prefix = tmp_path / "d"
    write_dataset(prefix, [[[1, 2, 3]], [[4, 5, 6]]], np.uint16)
    import bloomtrain.data.indexed as indexed
    real = os.replace

    def replace_then_interrupt(src, dst):
        real(src, dst)
        raise KeyboardInterrupt  # Ctrl-C right after the first rename
    monkeypatch.setattr(indexed.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(prefix, [[[7]], [[8, 9, 10, 11, 12]]], np.uint16)
    monkeypatch.setattr(indexed.os, "replace", real)
    assert not MMapIndexedDataset.exists(prefix)
    with pytest.raises(UserError, match=r"interrupted.*d\.bin\.previous and d\.idx\.previous"):
        MMapIndexedDataset(prefix)
    # Nothing written before is lost: the replaced dataset is whole under the names the error
    # gives, and opens with its own documents once renamed back.
    os.replace(tmp_path / "d.bin.previous", tmp_path / "d.bin")
    os.replace(tmp_path / "d.idx.previous", tmp_path / "d.idx")
    old = MMapIndexedDataset(prefix)
    assert [old[i].tolist() for i in range(len(old))] == [[1, 2, 3], [4, 5, 6]]
    del old
    # A rewrite that completes replaces it and leaves no previous pair behind.
    write_dataset(prefix, [[[7]], [[8, 9, 10, 11, 12]]], np.uint16)
    new = MMapIndexedDataset(prefix)
    assert [new[i].tolist() for i in range(len(new))] == [[7], [8, 9, 10, 11, 12]]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_a_rewrite_killed_after_dropping_the_old_index_keeps_the_old_pair(tmp_path, monkeypatch):
    # A kill right after the old .idx is unlinked, before the new .bin is renamed over the old.
    prefix = tmp_path / "d"
    write_dataset(prefix, [[[1, 2, 3]], [[4, 5, 6]]], np.uint16)
    import bloomtrain.data.indexed as indexed
    real = os.unlink

    def unlink_then_interrupt(path, *a, **k):
        real(path, *a, **k)
        if str(path).endswith("d.idx"):
            raise KeyboardInterrupt
    monkeypatch.setattr(indexed.os, "unlink", unlink_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(prefix, [[[7, 8, 9, 10, 11, 12]]], np.uint16)
    monkeypatch.setattr(indexed.os, "unlink", real)
    with pytest.raises(UserError, match="interrupted"):
        MMapIndexedDataset(prefix)
    assert (tmp_path / "d.bin.previous").read_bytes() == np.arange(1, 7, dtype=np.uint16).tobytes()
    # Where the previous pair is the only copy, a rewrite that is interrupted again keeps it.
    monkeypatch.setattr(indexed.os, "replace", lambda s, d: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_dataset(prefix, [[[9]]], np.uint16)
    assert (tmp_path / "d.bin.previous").read_bytes() == np.arange(1, 7, dtype=np.uint16).tobytes()
    assert (tmp_path / "d.idx.previous").is_file()


def test_a_rewrite_without_hard_links_still_replaces_the_dataset(tmp_path, monkeypatch):
    prefix = tmp_path / "d"
    write_dataset(prefix, [[[1, 2, 3]]], np.uint16)
    import bloomtrain.data.indexed as indexed

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")  # a filesystem without hard links
    monkeypatch.setattr(indexed.os, "link", no_links)
    write_dataset(prefix, [[[4, 5]]], np.uint16)
    assert MMapIndexedDataset(prefix)[0].tolist() == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
