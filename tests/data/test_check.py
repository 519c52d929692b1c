"""bloomtrain.data.check: every dataset's token ids against the model's vocabulary, each
dataset's id range read once and cached, missing datasets and tokenizers named together."""
import json
import os

import numpy as np
import pytest

from bloomtrain.config import Config
from bloomtrain.data import check
from bloomtrain.data.check import check_data, check_token_ids, open_datasets, token_id_range
from bloomtrain.data.indexed import MMapIndexedDataset, write_dataset
from bloomtrain.errors import UserError
from bloomtrain.validate import validate

from tests.data import FIXTURES


def _megatron_range(name):
    docs = json.loads((FIXTURES / f"{name}.docs.json").read_text())
    ids = [t for doc in docs for seq in doc for t in seq]
    return min(ids), max(ids)


@pytest.mark.parametrize("chunk", [check.SCAN_CHUNK, 7], ids=["one-chunk", "chunks-of-7"])
@pytest.mark.parametrize("name", ["wide_int32", "narrow_uint16"])
def test_the_range_of_megatrons_files_is_that_of_their_documents(tmp_path, monkeypatch, name,
                                                                 chunk):
    monkeypatch.setattr(check, "SCAN_CHUNK", chunk)
    ds = MMapIndexedDataset(FIXTURES / name)
    assert token_id_range(ds, tmp_path) == _megatron_range(name)


def _write(prefix, ids, dtype=np.uint16):
    write_dataset(prefix, [[list(ids[i:i + 5])] for i in range(0, len(ids), 5)], dtype)
    return MMapIndexedDataset(prefix)


def _no_scan(ds):
    raise AssertionError(f"{ds.prefix} was read")


def test_the_range_is_cached_beside_the_sample_indices_and_follows_the_files(tmp_path,
                                                                             monkeypatch):
    prefix = tmp_path / "a_text_document"
    ds = _write(prefix, [5, 9, 700, 3, 4, 6])
    assert token_id_range(ds) == (3, 700)
    cache = tmp_path / "a_text_document_cache"
    assert [p.name for p in cache.iterdir()] == ["a_text_document_token_ids.json"]  # no temps
    with monkeypatch.context() as m:
        m.setattr(check, "_scan", _no_scan)
        assert token_id_range(MMapIndexedDataset(prefix)) == (3, 700)
    # The dataset written again (same size, other ids): the cached range no longer applies.
    ds = _write(prefix, [5, 9, 70, 3, 4, 1000])
    assert token_id_range(ds) == (3, 1000)
    # A damaged cache file is computed again, not trusted.
    (cache / "a_text_document_token_ids.json").write_text("{not json")
    assert token_id_range(ds) == (3, 1000)


def test_a_cache_that_cannot_be_written_still_gives_the_range(tmp_path):
    ds = _write(tmp_path / "a_text_document", [1, 2, 300])
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    # A directory that cannot be created (under a file: refused even to root, unlike chmod).
    assert token_id_range(ds, blocked / "cache") == (1, 300)
    assert token_id_range(ds, blocked / "cache") == (1, 300)


def test_ids_past_the_vocabulary_name_the_dataset_its_largest_id_and_the_vocabulary(tmp_path):
    fits = _write(tmp_path / "fits_text_document", [0, 4, 255, 17])
    wide = _write(tmp_path / "wide_text_document", [0, 917, 512, 3, 600])
    check_token_ids([fits], 256, "model.vocab_size=256", tmp_path / "c")  # the last row: fine
    with pytest.raises(UserError) as e:
        check_token_ids([fits, wide], 512, "model.vocab_size=512", tmp_path / "c")
    msg = str(e.value)
    assert f"dataset {wide.prefix} holds token ids up to 917, past the model's vocabulary of " \
           f"512 ids (0-511; model.vocab_size=512)" in msg
    assert "model.vocab_size=918" in msg and "fits_text_document" not in msg
    assert "\n" not in msg
    with pytest.raises(UserError, match="holds token ids up to 255, past the model's vocabulary "
                                        "of 255 ids"):
        check_token_ids([fits], 255, "", tmp_path / "c")
    with pytest.raises(UserError, match=r"datasets .*fits_text_document \(ids up to 255\), "
                                        r".*wide_text_document \(ids up to 917\) hold token ids"):
        check_token_ids([fits, wide], 128, "", tmp_path / "c")


def test_a_float_dataset_is_not_token_ids(tmp_path):
    # MMIDIDX has float codes; their values would be truncated into ids on the way to the model.
    frac = _write(tmp_path / "frac_text_document", [1.5, 299.9, 7.25], np.float64)
    with pytest.raises(UserError, match=r"frac_text_document \(float64\): floating-point "
                                        r"values, not integer token ids"):
        check_token_ids([frac], 300, "", tmp_path / "c")


def test_negative_ids_are_refused_and_a_dtype_that_cannot_overflow_is_not_read(tmp_path,
                                                                             monkeypatch):
    neg = _write(tmp_path / "neg_text_document", [4, -3, 9], np.int32)
    with pytest.raises(UserError, match=r"negative token ids in .*neg_text_document \(id -3\)"):
        check_token_ids([neg], 256, "", tmp_path / "c")
    byte_ids = _write(tmp_path / "bytes_text_document", [0, 255], np.uint8)
    monkeypatch.setattr(check, "_scan", _no_scan)
    check_token_ids([byte_ids], 256, "", tmp_path / "c")
    with pytest.raises(AssertionError, match="was read"):
        check_token_ids([byte_ids], 255, "", tmp_path / "c")


def test_missing_datasets_and_tokenizer_are_named_in_one_error(tmp_path):
    real = _write(tmp_path / "real_text_document", [1, 2, 3]).prefix
    os.remove(f"{real}.bin")
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "train": {"train_iters": 1},
                            "data": {"paths": [f"0.5 {tmp_path}/nope_text_document",
                                               f"0.5 {real}"],
                                     "tokenizer": str(tmp_path / "no_tok")}})
    with pytest.raises(UserError) as e:
        check_data(cfg, validate(cfg, 1))
    msg = str(e.value)
    assert msg.startswith(f"data.tokenizer: tokenizer {tmp_path}/no_tok not found; ")
    assert (f"; data.paths: no dataset at {tmp_path}/nope_text_document (.idx and .bin "
            f"missing), {real} (.bin missing); ") in msg
    with pytest.raises(UserError, match="data.paths is empty"):
        open_datasets([])


def test_the_vocabulary_checked_is_the_models_padded_one(tmp_path):
    prefix = _write(tmp_path / "d_text_document", [0, 300, 383]).prefix
    cfg = Config.from_dict({"model": {"preset": "tiny", "vocab_size": 300},
                            "train": {"train_iters": 1}, "data": {"paths": [prefix]}})
    # 300 padded to 384 (a multiple of 128): id 383 has its row.
    tokenizer, run = check_data(cfg, validate(cfg, 1))
    assert tokenizer is None and run.shape.vocab_size == 384
    cfg.model.make_vocab_size_divisible_by = 4
    with pytest.raises(UserError, match=r"up to 383, past the model's vocabulary of 300 ids "
                                        r"\(0-299; model.vocab_size=300\)"):
        check_data(cfg, validate(cfg, 1))
    cfg.model.vocab_size = None  # the preset's 256, padded to a multiple of 4
    with pytest.raises(UserError, match=r"of 256 ids \(0-255; model.preset tiny's vocabulary"):
        check_data(cfg, validate(cfg, 1))


def test_the_tokenizer_gives_the_model_its_vocabulary(tmp_path, tiny_tokenizer_dir):
    from bloomtrain.data.tokenizer import load_tokenizer
    size = load_tokenizer(tiny_tokenizer_dir).vocab_size
    assert 256 < size <= 500  # the model gets 512 rows from it, not the preset's 256
    fits = _write(tmp_path / "fits_text_document", [0, 300, 511]).prefix
    # Written with another, larger tokenizer than data.tokenizer: its own ids are the check.
    other = _write(tmp_path / "other_text_document", [0, 300, 600]).prefix
    cfg = Config.from_dict({"model": {"preset": "tiny"}, "train": {"train_iters": 1},
                            "data": {"paths": [fits], "tokenizer": str(tiny_tokenizer_dir)}})
    tokenizer, run = check_data(cfg, validate(cfg, 1))
    assert tokenizer.vocab_size == size and run.shape.vocab_size == 512
    cfg.data.paths = [f"0.3 {fits}", f"0.7 {other}"]
    with pytest.raises(UserError, match=rf"dataset {other} holds token ids up to 600, past the "
                                        rf"model's vocabulary of 512 ids \(0-511; "
                                        rf"data.tokenizer's {size} tokens padded to 512\)"):
        check_data(cfg, validate(cfg, 1))


def test_a_blend_whose_dataset_has_no_validation_documents_is_refused_under_eval(tmp_path):
    """Megatron's validation blend asserts a dataset per weight. Dropping the one without
    validation documents evaluated on the other alone, on fewer samples than asked for, and
    the later evaluations were skipped without a word."""
    from types import SimpleNamespace
    write_dataset(tmp_path / "A", [[[i % 50 + 1] * 8] for i in range(200)], np.uint16)
    write_dataset(tmp_path / "B", [[[7] * 8] for _ in range(4)], np.uint16)
    paths = [f"0.5 {tmp_path}/A", f"0.5 {tmp_path}/B"]

    def problems(split, eval_interval, paths=paths):
        cfg = SimpleNamespace(data=SimpleNamespace(paths=paths, split=split),
                              train=SimpleNamespace(eval_interval=eval_interval))
        return check.split_problems(cfg, open_datasets(paths))
    # Megatron's split of 4 documents by 90,10,0 gives validation none, of 200 it gives 20.
    said = problems("90,10,0", 10)
    assert len(said) == 1 and f"validation split of {tmp_path}/B (of its 4 sequences)" in said[0] \
        and "every dataset of data.paths" in said[0], said
    assert problems("90,10,0", 0) == []      # no evaluations: nothing missing
    assert problems("50,50,0", 10) == []     # both have validation documents
    assert "gives the validation split no documents" in problems("100,0,0", 10)[0]


def test_blend_weights_whose_sum_overflows_are_one_line(tmp_path):
    from bloomtrain.config import parse_data_paths
    with pytest.raises(UserError, match="sum past the largest float"):
        parse_data_paths(["1e308 a", "1e308 b"])
    assert parse_data_paths(["1e307 a", "1e307 b"]) == [(1e307, "a"), (1e307, "b")]
