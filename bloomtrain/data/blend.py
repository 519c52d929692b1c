"""Weighted blending of datasets, as Megatron-DeepSpeed's `BlendableDataset`
(megatron/data/blendable_dataset.py) and the C++ `build_blending_indices` (helpers.cpp).

Blending is deterministic, not random: blended sample i comes from the dataset whose share lags
its weight the most, `argmax_k(w_k * max(i, 1) - taken_k)` (first maximum on ties), and is that
dataset's next unused sample.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math

import numpy as np

# Steps simulated per vectorized block; grown while the proposals hold, shrunk when they fail.
_MIN_BLOCK, _MAX_BLOCK = 64, 1 << 16
# Passes of the rule over a block's guess before the block is cut at its first disagreement.
_REFINE = 4


def normalize_weights_and_num_samples(weights, num_samples):
    """Megatron's get_datasets_weights_and_num_samples: weights normalized to sum 1 and each
    dataset asked for `ceil(n * w * 1.005)` samples (0.5% slack because the greedy blend does not
    take exactly n*w). `num_samples` is one count or a list (e.g. train/valid/test); the per-dataset
    result has the same form."""
    weights = [float(w) for w in weights]
    total = 0.0
    for w in weights:  # a Python loop, as Megatron, so the float sum is bit-identical
        total += w
    if not weights or total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"blend weights {weights} must be non-negative with a positive sum")
    weights = [w / total for w in weights]
    if isinstance(num_samples, (list, tuple)):
        per_dataset = [[int(math.ceil(n * w * 1.005)) for n in num_samples] for w in weights]
    else:
        per_dataset = [int(math.ceil(num_samples * w * 1.005)) for w in weights]
    return weights, per_dataset


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8 [size], dataset_sample_index int64 [size]), identical to helpers.cpp.

    The rule is sequential, but for two datasets it equals a merge of each dataset's samples by
    due time j / w_k (dataset 0 is chosen iff c_0 <= w_0 * i, i.e. c_0 / w_0 <= c_1 / w_1), which
    numpy does in bulk. Each merged block is then checked: the rule is recomputed for every step
    from the counts the block implies, and the block is kept up to its first disagreement (where
    the recomputed choice is right, since every earlier step was), so float rounding can never
    make it differ from the C++ loop. With more datasets the merge is a poor guess (the rule's
    order depends on i, not only on due times) and a plain loop is faster.
    """
    w = np.array(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or not np.sum(w) > 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    if len(w) >= 255:
        raise ValueError(f"at most 254 datasets can be blended (uint8 index), got {len(w)}")
    w = w / np.sum(w)
    num = len(w)
    if num > 2:
        return _blend_loop(w, size)
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(num, dtype=np.int64)
    kinds = np.arange(num)
    t, block = 0, 1024
    while t < size:
        n = min(block, size - t)
        proposal = _propose(w, counts, n)
        steps = np.maximum(np.arange(t, t + n, dtype=np.float64), 1.0)
        for _ in range(_REFINE):
            onehot = proposal[:, None] == kinds[None, :]  # [n, num]
            before = counts[None, :] + np.cumsum(onehot, axis=0) - onehot  # counts before each
            chosen = np.argmax(w[None, :] * steps[:, None] - before, axis=1)
            wrong = np.flatnonzero(chosen != proposal)
            if not len(wrong):
                break
            # The due-time merge orders near-ties by its own rounding, not the rule's (weights
            # like 0.7/0.3 tie exactly every 10 steps): at such a step it has the right two
            # choices in the wrong order. Swapping each with the next step's fixes them all in a
            # pass; the rule's choices taken wholesale would not (one flipped choice shifts the
            # counts of every later step). Each pass is checked again, as the first.
            proposal = _swap_ties(proposal, wrong)
        good = int(wrong[0]) + 1 if len(wrong) else n
        taken = chosen[:good]
        dataset_index[t:t + good] = taken
        sample_index[t:t + good] = before[np.arange(good), taken]
        counts += np.bincount(taken, minlength=num)
        t += good
        block = min(block * 2, _MAX_BLOCK) if good == n else max(_MIN_BLOCK, 2 * good)
    return dataset_index, sample_index


def _swap_ties(proposal: np.ndarray, wrong: np.ndarray) -> np.ndarray:
    """`proposal` with each wrong step's choice swapped with the next step's, where they differ
    and that step is not itself swapped already."""
    out = proposal.copy()
    wrong = wrong[wrong + 1 < len(out)]
    wrong = wrong[out[wrong] != out[wrong + 1]]
    if len(wrong) > 1:  # from a run of neighbouring wrong steps, swap every other one
        keep = np.ones(len(wrong), dtype=bool)
        for j in range(1, len(wrong)):
            keep[j] = not (keep[j - 1] and wrong[j] == wrong[j - 1] + 1)
        wrong = wrong[keep]
    out[wrong], out[wrong + 1] = proposal[wrong + 1], proposal[wrong]
    return out


def _blend_loop(w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    weights = [float(x) for x in w]
    counts = [0] * len(weights)
    rest = list(enumerate(weights))[1:]
    w0 = weights[0]
    chosen = [0] * size
    taken = [0] * size
    for i in range(size):
        s = float(i) if i > 1 else 1.0
        best, best_err = 0, w0 * s - counts[0]
        for k, wk in rest:
            err = wk * s - counts[k]
            if err > best_err:
                best, best_err = k, err
        chosen[i] = best
        taken[i] = counts[best]
        counts[best] += 1
    return np.array(chosen, dtype=np.uint8), np.array(taken, dtype=np.int64)


def _propose(w: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """The next n dataset choices, merging each dataset's next samples by due time j / w_k."""
    ids, due = [], []
    for k, wk in enumerate(w):
        if wk <= 0:
            continue
        j = counts[k] + np.arange(int(math.ceil(wk * n)) + 2, dtype=np.float64)
        ids.append(np.full(len(j), k, dtype=np.int64))
        due.append(j / wk)
    ids, due = np.concatenate(ids), np.concatenate(due)
    # Stable sort keeps the lower dataset first on equal due times, as the greedy's first max.
    order = np.argsort(due, kind="stable")[:n]
    out = ids[order]
    if len(out) < n:
        out = np.concatenate((out, np.zeros(n - len(out), dtype=np.int64)))
    return out


class BlendableDataset:
    """Samples of several datasets interleaved by weight. Its size is the sum of the datasets'
    lengths, as Megatron's; the datasets are built with ceil(n*w*1.005) samples each, so the first
    n blended samples never run past a dataset's end."""

    def __init__(self, datasets, weights):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = np.array(weights, dtype=np.float64)
        self.size = sum(len(d) for d in self.datasets)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, self.size)

    def __len__(self) -> int:
        return self.size

    @functools.cached_property
    def order(self) -> dict:
        """What fixes the order of the blend's samples (as GPTDataset.order): its datasets'
        keys and the weights. The blending rule picks each sample from the counts before it,
        so a prefix of the blend does not depend on its size."""
        parts = [d.order for d in self.datasets]
        weights = (self.weights / np.sum(self.weights)).tolist()
        key = hashlib.sha256(json.dumps({"weights": weights, "datasets": [
            p["key"] for p in parts]}).encode()).hexdigest()
        return {"key": key, "epochs": [e for p in parts for e in p["epochs"]]}

    def __getitem__(self, idx: int):
        idx = int(idx)
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[idx])
        i = int(self.dataset_sample_index[idx])
        if i >= len(self.datasets[d]):
            raise IndexError(f"blended sample {idx} needs sample {i} of dataset {d}, which has "
                             f"only {len(self.datasets[d])}; build the datasets with more samples")
        return self.datasets[d][i]

    def __repr__(self) -> str:
        return f"BlendableDataset({len(self.datasets)} datasets, size={self.size})"
