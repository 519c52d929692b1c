"""Dataset construction from config, the batch-size ramp-up and Megatron's sample order,
including resume with another data-parallel or micro-batch size."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bloomtrain.config import DataConfig
from bloomtrain.data.blend import BlendableDataset, normalize_weights_and_num_samples
from bloomtrain.data.gpt_dataset import GPTDataset, split_documents
from bloomtrain.data.indexed import MMapIndexedDataset
from bloomtrain.config import TrainConfig
from bloomtrain.data.loader import DataIterator, build_train_valid_test_datasets, get_micro_batches
from bloomtrain.layout import BatchSchedule, ParallelLayout
from bloomtrain.errors import UserError

from tests.data import FIXTURES


class _Ids:
    """Sample i is seq+1 tokens all equal to i, so a batch shows which samples it holds."""

    def __init__(self, n, seq=4):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return np.full(self.seq + 1, i, dtype=np.int64)


def _ids(batches) -> list[int]:
    return [int(v) for mb in batches for v in mb["tokens"][:, 0]]


def _consume_step(dataset, consumed, gbs, mbs, dp):
    """Sample ids of one global batch gathered over dp ranks, in Megatron's order."""
    per_rank = [get_micro_batches(dataset, consumed, gbs, mbs, r, dp) for r in range(dp)]
    ordered = []
    for m in range(len(per_rank[0])):
        for r in range(dp):
            ordered.extend(_ids([per_rank[r][m]]))
    return ordered


def test_megatron_sampler_order():
    ds = _Ids(100)
    # dp rank 1 of 2, mbs 2, gbs 8: micro-step m takes samples [c+4m, c+4m+4), rank 1 the back half.
    batches = get_micro_batches(ds, 16, 8, 2, 1, 2)
    assert [_ids([b]) for b in batches] == [[18, 19], [22, 23]]
    b = batches[0]
    assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (2, 4)
    assert b["labels"].shape == (2, 4) and b["loss_mask"].dtype == torch.float32


def test_resume_with_other_dp_and_micro_batch_size_covers_epoch_once():
    epoch = 96
    ds = _Ids(epoch)
    seen, consumed = [], 0
    # (steps, global batch, micro batch, dp): the topology changes at every resume.
    for steps, gbs, mbs, dp in ((3, 8, 2, 2), (2, 8, 1, 4), (1, 16, 2, 4), (2, 12, 3, 1),
                                (1, 8, 1, 8), (1, 8, 4, 2)):
        for _ in range(steps):
            ids = _consume_step(ds, consumed, gbs, mbs, dp)
            assert ids == list(range(consumed, consumed + gbs))
            seen.extend(ids)
            consumed += gbs
    assert consumed == epoch
    assert seen == list(range(epoch))


def test_iterator_resume_across_dp_change_with_rampup():
    epoch = 120
    ds = _Ids(epoch)
    schedule_a = [BatchSizeSchedule(16, 2, 2, rampup=[4, 4, 24]) for _ in range(2)]
    iters = [DataIterator(ds, schedule_a[r], r) for r in range(2)]
    seen = []
    for _ in range(4):
        per_rank = [it.next_global_batch() for it in iters]
        for m in range(len(per_rank[0])):
            for r in range(2):
                seen.extend(_ids([per_rank[r][m]]))
    state = iters[0].state_dict()
    assert state == iters[1].state_dict() == {"consumed_samples": len(seen)}

    # Resume on dp=4 with micro-batch 1, prefetching, from the saved consumed_samples.
    schedule_b = BatchSizeSchedule(16, 1, 4, rampup=[4, 4, 24])
    iters = [DataIterator(ds, schedule_b, r, prefetch=True) for r in range(4)]
    for it in iters:
        it.load_state_dict(state)
    while iters[0].consumed_samples + schedule_b.global_batch_size_at(
            iters[0].consumed_samples) <= epoch:
        per_rank = [it.next_global_batch() for it in iters]
        for m in range(len(per_rank[0])):
            for r in range(4):
                seen.extend(_ids([per_rank[r][m]]))
    for it in iters:
        it.close()
    assert seen == list(range(len(seen)))
    assert len(seen) > epoch - 16


def test_dataset_too_short_is_an_error():
    with pytest.raises(UserError, match="samples"):
        get_micro_batches(_Ids(10), 8, 4, 1, 0, 1)
    with pytest.raises(ValueError, match="divisible"):  # validated before: a caller's bug
        get_micro_batches(_Ids(10), 0, 6, 4, 0, 1)


def test_eod_mask_follows_megatron():
    class Seq:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return np.array([5, 0, 7, 8, 0, 9], dtype=np.int64)

    (b,) = get_micro_batches(Seq(), 0, 1, 1, 0, 1, eod_id=0, eod_mask_loss=True)
    assert b["tokens"].tolist() == [[5, 0, 7, 8, 0]]
    assert b["labels"].tolist() == [[0, 7, 8, 0, 9]]
    # Megatron zeroes positions whose input token is the end of document.
    assert b["loss_mask"].tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]
    (plain,) = get_micro_batches(Seq(), 0, 1, 1, 0, 1, eod_id=0)
    assert plain["loss_mask"].tolist() == [[1.0] * 5]


def _megatron_rampup(start, inc, ramp, gbs, consumed):
    num_increments = (gbs - start) // inc
    per_increment = ramp / num_increments
    if consumed > ramp:
        return gbs
    return start + int(consumed / per_increment) * inc


def BatchSizeSchedule(gbs, mbs, dp, rampup=None):
    """The trainer's batch schedule for these sizes, checked as the trainer checks it."""
    t = TrainConfig(global_batch_size=gbs, micro_batch_size=mbs, rampup_batch_size=rampup,
                    train_iters=None if rampup else 1, train_samples=10 ** 9 if rampup else None)
    return BatchSchedule.from_config(t, ParallelLayout(dp=dp))


@pytest.mark.parametrize("rampup,gbs", [([16, 16, 1000], 64), ([32, 32, 6_000_000], 2048),
                                        ([8, 8, 100], 16)])
def test_rampup_matches_megatron(rampup, gbs):
    s = BatchSizeSchedule(gbs, 1, 8, rampup)
    ramp = rampup[2]
    for consumed in (0, 1, ramp // 7, ramp // 3, ramp // 3 + 1, ramp // 2, ramp - 1, ramp,
                     ramp + 1, 10 * ramp):
        expected = _megatron_rampup(*rampup, gbs, consumed)
        assert s.global_batch_size_at(consumed) == expected
        assert s.layout.num_micro_batches(s.global_batch_size_at(consumed), s.micro_batch_size) == expected // 8


def test_rampup_values_bloom_like():
    # BLOOM-176B: --rampup-batch-size 192 16 9_765_625, global batch 2048.
    s = BatchSizeSchedule(2048, 2, 8, [192, 16, 9_765_625])
    per_increment = 9_765_625 / 116
    assert s.global_batch_size_at(0) == 192
    assert s.global_batch_size_at(int(per_increment)) == 192
    assert s.global_batch_size_at(math.ceil(per_increment)) == 208
    assert s.global_batch_size_at(9_765_625) == 2048
    assert s.layout.num_micro_batches(s.global_batch_size_at(0), s.micro_batch_size) == 12
    assert BatchSizeSchedule(64, 2, 2).global_batch_size_at(12345) == 64
    assert BatchSizeSchedule(64, 2, 2, [64, 8, 100]).global_batch_size_at(0) == 64
    with pytest.raises(UserError, match="divisible by the increment"):
        BatchSizeSchedule(64, 2, 2, [16, 10, 100])


# ---- building from config ------------------------------------------------------------------

@pytest.fixture
def fixture_copies(tmp_path):
    out = {}
    for name in ("wide_int32", "narrow_uint16"):
        for ext in (".bin", ".idx"):
            shutil.copy(FIXTURES / f"{name}{ext}", tmp_path / f"{name}{ext}")
        out[name] = str(tmp_path / name)
    return out


def test_build_single_dataset_from_config(fixture_copies):
    prefix = fixture_copies["wide_int32"]
    cfg = DataConfig(paths=[prefix], split="90,10,0", seed=7)
    train, valid, test = build_train_valid_test_datasets(cfg, None, [100, 20, 0], 16)
    assert test is None
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset)
    ds = MMapIndexedDataset(prefix)
    bounds = split_documents("90,10,0", len(ds.sizes))
    direct = GPTDataset("train", ds, np.arange(bounds[0], bounds[1], dtype=np.int32), 100, 16, 7)
    np.testing.assert_array_equal(train[42], direct[42])
    np.testing.assert_array_equal(valid.documents, np.arange(bounds[1], bounds[2]))
    assert len(valid) >= 20
    assert Path(f"{prefix}_cache").is_dir()


def test_build_blend_from_config(fixture_copies, tmp_path):
    cfg = DataConfig(paths=[f"0.3 {fixture_copies['wide_int32']}",
                            f"0.7 {fixture_copies['narrow_uint16']}"],
                     split="98,2,0", seed=5, cache_dir=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, None, [200, 10, 0], 16)
    assert test is None
    assert isinstance(train, BlendableDataset) and isinstance(valid, BlendableDataset)
    _, counts = normalize_weights_and_num_samples([0.3, 0.7], [200, 10, 0])
    assert [d.num_samples for d in train.datasets] == [counts[0][0], counts[1][0]]
    assert [d.num_samples for d in valid.datasets] == [counts[0][1], counts[1][1]]
    assert len(train) == sum(len(d) for d in train.datasets)
    # The first n blended samples stay inside every dataset (the 0.5% slack).
    for i in range(200):
        assert train[i].shape == (17,)
    batches = get_micro_batches(train, 0, 8, 2, 1, 2)
    assert len(batches) == 2 and batches[0]["tokens"].shape == (2, 16)


def test_tokenizer_dtype_check(fixture_copies):
    class BigVocab:
        vocab_size = 250880

    cfg = DataConfig(paths=[fixture_copies["narrow_uint16"]], split="1")
    with pytest.raises(UserError, match="tokenizer"):
        build_train_valid_test_datasets(cfg, BigVocab(), [10, 0, 0], 16)


def test_one_weighted_path_is_blended_as_megatron_blends_it(tmp_path):
    """Megatron takes its single-dataset branch only for a bare prefix (len(data_prefix) == 1):
    `--data-path 1.0 X` is blended, the dataset built with ceil(n * 1.005) samples, and that
    shuffles differently (here 213 of the first 214 samples). A bare prefix stays plain."""
    for ext in ("bin", "idx"):
        shutil.copy(FIXTURES / f"wide_int32.{ext}", tmp_path / f"wide.{ext}")
    prefix, n, seq = str(tmp_path / "wide"), 214, 32
    cfg = DataConfig(paths=[f"1.0 {prefix}"], split="100,0,0", seq_length=seq, seed=1234,
                     cache_dir=str(tmp_path / "ours"))
    ours, _, _ = build_train_valid_test_datasets(cfg, None, [n, 0, 0], seq)
    weights, per = normalize_weights_and_num_samples([1.0], [n, 0, 0])
    assert per[0][0] == math.ceil(n * 1.005)
    indexed = MMapIndexedDataset(prefix)
    alone = GPTDataset("train", indexed, np.arange(len(indexed.sizes), dtype=np.int32),
                       per[0][0], seq, 1234, cache_dir=str(tmp_path / "ref"))
    megatron = BlendableDataset([alone], weights)
    assert isinstance(ours, BlendableDataset) and len(ours) == len(megatron)
    assert all(np.array_equal(ours[i], megatron[i]) for i in range(n))
    bare, _, _ = build_train_valid_test_datasets(
        DataConfig(paths=[prefix], split="100,0,0", seq_length=seq, seed=1234,
                   cache_dir=str(tmp_path / "bare")), None, [n, 0, 0], seq)
    assert isinstance(bare, GPTDataset)
    assert sum(not np.array_equal(bare[i], ours[i]) for i in range(n)) > n // 2
