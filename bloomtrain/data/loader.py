"""Training data in Megatron-DeepSpeed's order: train/valid/test datasets built as its
`build_train_valid_test_datasets` (gpt_dataset.py), global batches taken as its
`MegatronPretrainingSampler` (data_samplers.py) does, following the batch-size schedule of
bloomtrain.layout (Megatron's ramp-up).

The order of samples depends only on `consumed_samples`: global batch k is the dataset samples
`[consumed, consumed + global_batch_size)`; micro-step m takes the next `micro_batch_size * dp`
of them and dp rank r gets slice `[r * mbs, (r + 1) * mbs)` of those. So a run resumed with
another data-parallel size or micro-batch size neither repeats nor skips a sample.

A loss-spike rollback takes sample ranges out of the order (bloomtrain.train.spikes): the
iterator jumps over a skipped range when it reaches it, so `consumed_samples` counts the skipped
samples too (the learning rate, which follows consumed samples, moves on past them).
"""
from __future__ import annotations

import concurrent.futures

import numpy as np
import torch

from bloomtrain.config import data_paths_weighted, parse_data_paths
from bloomtrain.data.blend import BlendableDataset, normalize_weights_and_num_samples
from bloomtrain.data.gpt_dataset import GPTDataset, split_documents
from bloomtrain.data.indexed import MMapIndexedDataset
from bloomtrain.errors import UserError

_SPLIT_NAMES = ("train", "valid", "test")


def build_train_valid_test_datasets(data_cfg, tokenizer, train_valid_test_num_samples,
                                    seq_length: int):
    """(train, valid, test) for `data_cfg.paths`; a split with no documents gives None.

    One bare path: GPTDatasets over its document split. "WEIGHT PREFIX" paths (one or more, as
    Megatron blends a weighted --data-path even alone): each dataset
    is split and built with ceil(n * w * 1.005) samples per split, then the splits are blended by
    weight. `tokenizer` (optional) is checked against each dataset's token dtype."""
    entries = parse_data_paths(data_cfg.paths)
    if not entries:
        raise UserError("data.paths is empty; give the prefix of a dataset written by "
                        "`bloomtrain preprocess`")
    num_samples = [int(n) for n in train_valid_test_num_samples]
    if len(num_samples) != 3:
        raise ValueError("train_valid_test_num_samples must hold three counts")
    if len(entries) == 1 and not data_paths_weighted(data_cfg.paths):
        # Megatron takes this branch only for a bare prefix (len(data_prefix) == 1): `--data-path
        # 1.0 X` is blended, over ceil(n * 1.005) samples, which shuffles differently.
        return _build_splits(entries[0][1], data_cfg, tokenizer, num_samples, seq_length)

    weights, per_dataset = normalize_weights_and_num_samples([w for w, _ in entries], num_samples)
    splits = [_build_splits(prefix, data_cfg, tokenizer, counts, seq_length)
              for (_, prefix), counts in zip(entries, per_dataset)]
    out = []
    for s in range(3):
        present = [(ds[s], w) for ds, w in zip(splits, weights) if ds[s] is not None]
        if not present:
            out.append(None)
        else:
            out.append(BlendableDataset([d for d, _ in present], [w for _, w in present]))
    return tuple(out)


def _build_splits(prefix: str, data_cfg, tokenizer, num_samples: list[int], seq_length: int):
    indexed = MMapIndexedDataset(prefix)
    _check_tokenizer(indexed, tokenizer)
    bounds = split_documents(data_cfg.split, len(indexed.sizes))
    out = []
    for s, name in enumerate(_SPLIT_NAMES):
        if bounds[s + 1] <= bounds[s]:
            out.append(None)
            continue
        documents = np.arange(bounds[s], bounds[s + 1], dtype=np.int32)
        out.append(GPTDataset(name, indexed, documents, num_samples[s], seq_length,
                              data_cfg.seed, cache_dir=data_cfg.cache_dir))
    return tuple(out)


def _check_tokenizer(indexed, tokenizer) -> None:
    if tokenizer is None:
        return
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is None and hasattr(tokenizer, "get_vocab_size"):
        vocab = tokenizer.get_vocab_size()
    if vocab is None or not np.issubdtype(indexed.dtype, np.integer):
        return
    if int(vocab) - 1 > np.iinfo(indexed.dtype).max:
        raise UserError(f"dataset {indexed.prefix} stores token ids as {indexed.dtype.name}, "
                        f"too narrow for the tokenizer's {vocab} tokens; it was written with "
                        f"another tokenizer, so preprocess it again with data.tokenizer")


def get_micro_batches(dataset, consumed_samples: int, global_batch_size: int,
                      micro_batch_size: int, dp_rank: int, dp_size: int, eod_id: int | None = None,
                      eod_mask_loss: bool = False) -> list[dict]:
    """This dp rank's micro-batches of the global batch starting at `consumed_samples`.

    Each is `tokens` and `labels` (int64 [mbs, seq], labels shifted by one) and `loss_mask`
    (float32 [mbs, seq]). With `eod_mask_loss`, positions whose *input* token is `eod_id` get
    mask 0, as Megatron's get_ltor_masks_and_position_ids (`loss_mask[tokens == eod] = 0`): the
    token after an end of document starts an unrelated document and cannot be predicted."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:  # bloomtrain.layout tells the user; this is a caller's bug
        raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                         f"micro_batch_size * dp ({micro_batch_size} * {dp_size})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if eod_mask_loss and eod_id is None:
        raise UserError("data.eod_mask_loss needs the tokenizer's end-of-document id")
    end = consumed_samples + global_batch_size
    if end > len(dataset):
        raise UserError(f"the training dataset has {len(dataset)} samples but the batch at "
                        f"{consumed_samples} consumed samples needs {end}; build the datasets "
                        f"with enough samples (train_samples or train_iters too large for them)")
    batches = []
    for m in range(global_batch_size // per_step):
        first = consumed_samples + m * per_step + dp_rank * micro_batch_size
        samples = np.stack([dataset[i] for i in range(first, first + micro_batch_size)])
        data = torch.from_numpy(samples.astype(np.int64, copy=False))  # [mbs, seq + 1]
        tokens = data[:, :-1].contiguous()
        labels = data[:, 1:].contiguous()
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        if eod_mask_loss:
            loss_mask[tokens == eod_id] = 0.0
        batches.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask})
    return batches


def skip_past(schedule, consumed: int, skipped: list[tuple[int, int]]) -> int:
    """Where the global batch at `consumed` really starts: past every skipped range [start, end)
    it would overlap. A range recorded by this order starts and ends on batch boundaries; under
    another batch-size schedule a batch that would straddle its start begins at its end instead
    (the few samples before it are skipped too, never a skipped one trained on)."""
    moved = True
    while moved:
        moved = False
        end = consumed + schedule.global_batch_size_at(consumed)
        for a, b in skipped:
            if a < end and consumed < b:
                consumed, moved = b, True
                break
    return consumed


def batches_between(schedule, start: int, end: int) -> int:
    """The number of global batches the order takes from `start` to reach `end`."""
    n = 0
    while start < end:
        start += schedule.global_batch_size_at(start)
        n += 1
    return n


class DataIterator:
    """One dp rank's stream of global batches, resumable from `consumed_samples`.

    With `prefetch=True` the next global batch is read in a background thread while the current
    one trains; it is keyed by the consumed_samples it was started for, so a load_state_dict in
    between simply discards it.

    `skipped`: sample ranges [start, end) never to read (set_skipped); a batch that reaches one
    starts at its end (skip_past)."""

    def __init__(self, dataset, schedule, dp_rank: int,
                 consumed_samples: int = 0, eod_id: int | None = None,
                 eod_mask_loss: bool = False, prefetch: bool = False):
        self.dataset = dataset
        self.schedule = schedule
        self.dp_rank = dp_rank
        self.consumed_samples = int(consumed_samples)
        self.eod_id = eod_id
        self.eod_mask_loss = eod_mask_loss
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
                      if prefetch else None)
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self.skipped: list[tuple[int, int]] = []

    def set_skipped(self, ranges) -> None:
        self.skipped = sorted((int(a), int(b)) for a, b in ranges)

    def next_start(self) -> int:
        """Where the next global batch starts: consumed_samples, or past a skipped range."""
        return skip_past(self.schedule, self.consumed_samples, self.skipped)

    def _read(self, consumed: int) -> list[dict]:
        s = self.schedule
        return get_micro_batches(self.dataset, consumed, s.global_batch_size_at(consumed),
                                 s.micro_batch_size, self.dp_rank, s.layout.dp, self.eod_id,
                                 self.eod_mask_loss)

    def next_global_batch(self) -> list[dict]:
        """This rank's micro-batches of the next global batch; advances consumed_samples by the
        global batch size in effect (first past a skipped range it has reached)."""
        consumed = self.next_start()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == consumed:
            batches = pending[1].result()
        else:
            batches = self._read(consumed)
        self.consumed_samples = consumed + self.schedule.global_batch_size_at(consumed)
        if self._pool is not None:
            nxt = self.next_start()
            if nxt + self.schedule.global_batch_size_at(nxt) <= len(self.dataset):
                self._pending = (nxt, self._pool.submit(self._read, nxt))
        return batches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self._pending = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
