"""The serving engine's sampler (bloomtrain.serve.sampler): every row of a step chosen at once on
the logits' device. References written here, row by row: the per-row edits of
bloomtrain.serve.sampling (request_scores, warp: checked against HF's processors and OpenAI's
formula in tests/serve/test_sampling.py and tests/test_generate.py), argmax, the exponential race
drawn from a generator seeded as the request's, and log_softmax for the log-probabilities.
And what crosses to the host: a few numbers per row, never a row of the vocabulary.
"""
from __future__ import annotations

import random

import pytest
import torch

from bloomtrain.serve.sampler import (ARGMAX_BLOCK, ARGMAX_MIN, SampleRow, SamplingBatch,
                                      ScoreRows, first_argmax, sample)
from bloomtrain.serve.sampling import SamplingParams, request_scores, warp

V, LIMIT, EOS = 300, 280, 7


def random_params(rng: random.Random, sampled: bool, seed: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.6, 1.0, 1.7]) if sampled else 0.0,
        top_k=rng.choice([0, 1, 5, 40]) if sampled else 0,
        top_p=rng.choice([1.0, 0.9, 0.3]) if sampled else 1.0,
        seed=seed,
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.5]),
        presence_penalty=rng.choice([0.0, -0.4, 1.0]),
        logit_bias=tuple(sorted({rng.randrange(V): rng.uniform(-5, 5)
                                 for _ in range(rng.randrange(3))}.items())),
        min_tokens=rng.choice([0, 4]),
        logprobs=rng.choice([None, 0, 3]))


def reference_token(logits_row: torch.Tensor, s: SampleRow, seed: int | None) -> int:
    """One row as a plain loop would choose it: the reference edits, then argmax, or the
    exponential race from a generator seeded as the request's."""
    scores = request_scores(logits_row[None], s.params, s.prompt_ids, s.output_ids, LIMIT, EOS)
    if not s.params.do_sample:
        return int(scores.argmax(-1))
    probs = warp(scores, s.params.temperature, s.params.top_k, s.params.top_p).softmax(-1)[0]
    q = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((probs / q).argmax())


def make_rows(rng, n, seeds=True) -> list[tuple[SampleRow, int | None]]:
    rows = []
    for r in range(n):
        sampled = rng.random() < 0.6
        seed = 100 + r if sampled and seeds else None
        p = random_params(rng, sampled, seed)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        prompt = [rng.randrange(LIMIT) for _ in range(rng.randrange(1, 12))]
        out = [rng.randrange(LIMIT) for _ in range(rng.randrange(0, 8))]
        rows.append((SampleRow(r, p, gen, prompt, out), seed))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_every_row_is_its_reference(seed):
    # Greedy and seeded sampling mixed, with every edit: each row's token is the row-by-row
    # reference's, whatever the other rows are.
    rng = random.Random(seed)
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(seed)) * 3
    rows = make_rows(rng, 12)
    out = sample(logits, SamplingBatch([r for r, _ in rows], [], LIMIT, EOS))
    for (row, s), got in zip(rows, out.tokens):
        assert got == reference_token(logits[row.row], row, s), (row.params, got)
        assert got < LIMIT


def test_a_row_alone_and_in_a_batch_choose_alike():
    rng = random.Random(7)
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(3)) * 2
    rows = make_rows(rng, 10)
    batched = sample(logits, SamplingBatch([r for r, _ in rows], [], LIMIT, EOS)).tokens
    for k, (row, seed) in enumerate(rows):
        fresh = torch.Generator().manual_seed(seed) if seed is not None else None
        alone = SampleRow(0, row.params, fresh, row.prompt_ids, row.output_ids)
        if row.params.do_sample and seed is None:
            continue  # unseeded: no rule
        got = sample(logits[k:k + 1], SamplingBatch([alone], [], LIMIT, EOS)).tokens[0]
        assert got == batched[k], row.params


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))
    greedy = logits[:, :LIMIT].argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.3, top_k=1, seed=1),
                   SamplingParams(temperature=0.8, top_p=1e-6, seed=2)):
        rows = [SampleRow(r, params, torch.Generator().manual_seed(r)) for r in range(4)]
        assert sample(logits, SamplingBatch(rows, [], LIMIT, EOS)).tokens == greedy


def test_logprobs_are_log_softmax_of_the_raw_logits():
    # The sampled token's and the scored prompt tokens' log-probabilities: log_softmax over the
    # whole output (padded rows included), the top alternatives among real tokens, the chosen
    # token appended when it is not among them.
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(8, V, generator=g).to(torch.bfloat16)
    rows = [SampleRow(0, SamplingParams(temperature=0, logprobs=3), None),
            SampleRow(1, SamplingParams(temperature=0, logprobs=0), None),
            SampleRow(2, SamplingParams(temperature=0), None)]
    scores = [ScoreRows(3, [5, LIMIT + 3, 11], 2), ScoreRows(6, [1, 2], 0)]
    out = sample(logits, SamplingBatch(rows, scores, LIMIT, EOS))
    lp = torch.log_softmax(logits.float(), dim=-1)

    def check(entry, row, token, k):
        assert entry.token_id == token and entry.logprob == lp[row, token].item()
        top = lp[row, :LIMIT].topk(k) if k else None
        want = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
        if token not in [i for i, _ in want]:
            want.append((token, lp[row, token].item()))
        assert entry.top == want

    check(out.logprobs[0][0], 0, out.tokens[0], 3)
    check(out.logprobs[1][0], 1, out.tokens[1], 0)
    assert out.logprobs[2] is None
    for sc, entries in zip(scores, out.scores):
        assert len(entries) == len(sc.tokens)
        for j, (token, e) in enumerate(zip(sc.tokens, entries)):
            check(e, sc.row + j, token, sc.top)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the elements of every tensor read out to Python or copied to the CPU."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tolist", "item", "cpu", "numpy") or (
                name == "to" and any(str(a) == "cpu" for a in args[1:])):
            self.elements += args[0].numel()
        return func(*args, **kwargs)


def test_a_step_reads_a_few_numbers_per_row_not_the_vocabulary():
    # 16 rows of a 300-token vocabulary, logprobs of 2 alternatives: what leaves the logits
    # for Python is per row the token, its log-probability and the 2 alternatives with theirs
    # (rows x (2 + 2 x 2)), never a row of logits (300 numbers).
    rng = random.Random(1)
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(r, SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=r, logprobs=2,
                                        top_k=10, repetition_penalty=1.2),
                      torch.Generator().manual_seed(r), [1, 2, 3], [4, 5])
            for r in range(16)]
    with HostReads() as reads:
        out = sample(logits, SamplingBatch(rows, [], LIMIT, EOS))
    assert len(out.tokens) == 16
    assert 0 < reads.elements <= 16 * (2 + 2 * 2), reads.elements  # 96 of 16 x 300
    # And the counting sees a row of logits when one is read.
    with HostReads() as reads:
        logits[0].tolist()
    assert reads.elements == V


def _first_max_loop(row: list[float]) -> int:
    """A plain loop's argmax: the first NaN if there is one, else the first maximum."""
    for i, v in enumerate(row):
        if v != v:
            return i
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


@pytest.mark.parametrize("seed", range(4))
def test_first_argmax_is_torchs_argmax(seed):
    """first_argmax (the blocked CPU argmax greedy rows go through) against torch.argmax and a
    plain loop: rows long enough to take the blocked path, with and without a short last
    block, on a vocabulary-limited view of wider rows (the sampler's own input), with ties
    (few distinct values: a maximum in several blocks and twice in one), NaN, +inf and rows
    that are all -inf."""
    g = torch.Generator().manual_seed(seed)
    for rows, width, limit in [(16, 4096, 4096), (12, 4096, 4000), (3, 40000, 39999),
                               (1, 250, 250), (2, ARGMAX_MIN, ARGMAX_MIN - ARGMAX_BLOCK - 1)]:
        x = torch.randint(-3, 4, (rows, width), generator=g).float()  # many ties
        x[0, torch.randint(0, limit, (1,), generator=g)] = float("nan")
        if rows > 2:
            x[1] = float("-inf")
            x[2, limit - 1] = float("inf")  # in the short last block when there is one
        view = x[:, :limit]
        assert view.shape[0] * view.shape[1] >= ARGMAX_MIN or rows == 1
        got = first_argmax(view)
        assert torch.equal(got, view.argmax(dim=-1)), (rows, width, limit)
        assert got.tolist() == [_first_max_loop(r) for r in view.tolist()]
