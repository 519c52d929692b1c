"""Choosing the next tokens on the logits' device, for every row of a step at once (vLLM v1's
sampler): the vocabulary mask, `logit_bias`, `min_tokens` and the penalties, then greedy, or
temperature, top-k and top-p (HF's warpers, in HF's order) and a draw, and the log-probabilities
a request asked for, all as batched tensor operations. Only the chosen tokens and the requested
log-probabilities (O(rows x (1 + logprobs)) numbers) cross to the host, in one copy.

Batch invariance: every operation works along a row (its own edits, its own k and p, its own
draw), so a row's token never depends on the others. A seeded request draws from its own
generator with the exponential race (argmax of p / q, q ~ Exp(1) per token: a draw from p), one
row at a time, so it gives the same tokens alone and batched; unseeded rows share one draw.

bloomtrain.serve.sampling keeps the per-row reference of each edit (`request_scores`, `warp`),
which tests/serve/test_sampling.py checks against HF's processors and OpenAI's formula, and which this
module must equal row by row (tests/serve/test_sampler.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bloomtrain.serve.sampling import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    """A row that picks the next token of a sequence."""

    row: int                          # its row of the step's logits
    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own (on the logits' device)
    prompt_ids: list[int] = field(default_factory=list)   # what the penalties look at
    output_ids: list[int] = field(default_factory=list)


@dataclass
class ScoreRows:
    """Rows [row, row + len(tokens)) whose given next tokens are scored (prompt logprobs)."""

    row: int
    tokens: list[int]
    top: int


@dataclass
class SamplingBatch:
    """What a step's rows are for. Built on the scheduler's side from its entries, used where
    the full logits are (rank 0 under tensor parallelism)."""

    samples: list[SampleRow]
    scores: list[ScoreRows]
    vocab_limit: int
    eos_token_id: int | None = None


@dataclass
class SamplerOutput:
    """Host-side results: `tokens[i]`, `logprobs[i]` (None unless asked) for samples[i];
    `scores[j]`, the TokenLogprobs of scores[j]'s tokens."""

    tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]
    scores: list[list[TokenLogprob]]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Every row's choice and log-probabilities from the step's logits [rows, V] (any dtype,
    on their device)."""
    tokens = _tokens(logits, batch)
    # Log-probabilities: of each sampled token where asked, then of each scored token.
    asked = [i for i, s in enumerate(batch.samples) if s.params.logprobs is not None]
    rows = [batch.samples[i].row for i in asked]
    given, tops = [], [batch.samples[i].params.logprobs for i in asked]
    for sc in batch.scores:
        rows += range(sc.row, sc.row + len(sc.tokens))
        given += sc.tokens
        tops += [sc.top] * len(sc.tokens)
    found = []
    if rows:
        dev = logits.device
        targets = torch.cat([tokens.index_select(0, _index(asked, dev)),
                             torch.tensor(given, dtype=torch.int64, device=dev)])
        lp = torch.log_softmax(logits.index_select(0, _index(rows, dev)).float(), dim=-1)
        found.append(lp.gather(1, targets[:, None])[:, 0])
        if max(tops) > 0:
            found += reversed(lp[:, :batch.vocab_limit].topk(max(tops), dim=-1))  # ids, values
    host = _to_host([tokens] + found)
    chosen = host[0].tolist()
    entries = _entries([chosen[i] for i in asked] + given, tops, host[1:]) if rows else []
    logprobs: list[list[TokenLogprob] | None] = [None] * len(batch.samples)
    for n, i in enumerate(asked):
        logprobs[i] = [entries[n]]
    scores, at = [], len(asked)
    for sc in batch.scores:
        scores.append(entries[at:at + len(sc.tokens)])
        at += len(sc.tokens)
    return SamplerOutput(chosen, logprobs, scores)


def _tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The chosen token of every sample row [S], on the logits' device: plain greedy rows in one
    argmax, the others through their edits (`_choose_edited`)."""
    dev, samples = logits.device, batch.samples
    tokens = torch.empty(len(samples), dtype=torch.int64, device=dev)
    plain = [i for i, s in enumerate(samples)
             if not s.params.do_sample and not s.params.edits_logits]
    if plain:
        rows = _index([samples[i].row for i in plain], dev)
        # Over the tokenizer's tokens only (the padded rows come after them); bf16 -> fp32 is
        # exact, so the argmax (the first index on ties, as torch's and HF's) is fp32's.
        picked = first_argmax(logits.index_select(0, rows)[:, :batch.vocab_limit].float())
        tokens.index_copy_(0, _index(plain, dev), picked)
    edited = sorted(set(range(len(samples))) - set(plain))
    if edited:
        tokens.index_copy_(0, _index(edited, dev),
                           _choose_edited(logits, [samples[i] for i in edited], batch))
    return tokens


def _entries(targets: list[int], tops: list[int], found: list[torch.Tensor]
             ) -> list[TokenLogprob]:
    """TokenLogprobs from the host copies of the targets' log-probabilities and the top
    alternatives: each row's own `top` of them, the target appended when not among them (vLLM's
    top_logprobs: `logprobs: 0` still names the token and its logprob)."""
    picked = found[0].tolist()
    ids = found[1].tolist() if len(found) > 1 else [[] for _ in targets]
    values = found[2].tolist() if len(found) > 1 else [[] for _ in targets]
    out = []
    for t, p, k, i, v in zip(targets, picked, tops, ids, values):
        alternatives = list(zip(i[:k], v[:k]))
        if all(t != a for a, _ in alternatives):
            alternatives.append((t, p))
        out.append(TokenLogprob(t, p, alternatives))
    return out


# Elements per block of first_argmax's first pass, and the elements below which torch's own
# argmax is as fast (first_argmax's few kernel calls cost what its scalar loop takes over that
# many).
ARGMAX_BLOCK = 64
ARGMAX_MIN = 32768


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-d fp32 `x` (the first index of each row's maximum; NaN
    counts as the maximum): the same indices, faster on CPU. There torch's argmax is a scalar
    loop, ~1.7 ns an element at one thread (16 rows of a 4096-token vocabulary: 110 us, 7 ms at
    bloom's 250,880) where a max is vectorized (6 us). So: the maximum of every block of
    ARGMAX_BLOCK elements, the first block holding the row's maximum, then the first maximum
    inside it; a short last block is padded with -inf, which no maximum can be in unless the
    whole row is -inf, and then both give 0."""
    rows, n = x.shape
    if x.device.type != "cpu" or rows * n < ARGMAX_MIN:
        return x.argmax(dim=-1)
    k = ARGMAX_BLOCK
    full = n // k * k
    block_max = x[:, :full].view(rows, full // k, k).amax(dim=-1)  # [rows, n // k]
    if full < n:  # the tail, as one more block
        block_max = torch.cat([block_max, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    first = block_max.argmax(dim=-1)  # [rows]
    cols = first[:, None] * k + torch.arange(k, device=x.device)  # [rows, k]
    inside = x.gather(1, cols.clamp(max=n - 1))
    if full < n:
        inside = inside.masked_fill(cols >= n, float("-inf"))
    return first * k + inside.argmax(dim=-1)


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The step's small results on the host: one non-blocking copy into pinned memory per
    tensor, one wait (on the CPU, the tensors themselves)."""
    if tensors[0].device.type == "cpu":
        return tensors
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


# ---- the edited and sampled rows ----------------------------------------------------------------

def _choose_edited(logits: torch.Tensor, samples: list[SampleRow], batch: SamplingBatch
                   ) -> torch.Tensor:
    """The tokens of rows with edits or sampling: request_scores' edits, warp, then argmax or a
    draw, batched."""
    dev, limit = logits.device, batch.vocab_limit
    vocab = logits.shape[-1]
    scores = logits.index_select(0, _index([s.row for s in samples], dev)).float()
    if limit < vocab:
        scores[:, limit:] = float("-inf")  # padded embedding rows are not tokens
    _logit_bias_and_min_tokens(scores, samples, batch.eos_token_id)
    _penalties(scores, samples)
    sampled = [i for i, s in enumerate(samples) if s.params.do_sample]
    tokens = first_argmax(scores)
    if sampled:
        idx = _index(sampled, dev)
        warped = _warp(scores.index_select(0, idx), [samples[i].params for i in sampled])
        tokens.index_copy_(0, idx, _draw(warped, [samples[i].generator for i in sampled]))
    return tokens


def _logit_bias_and_min_tokens(scores: torch.Tensor, samples: list[SampleRow],
                               eos: int | None) -> None:
    rows, toks, vals = [], [], []
    banned = []
    for r, s in enumerate(samples):
        p = s.params
        for t, b in p.logit_bias:
            rows.append(r)
            toks.append(t)
            vals.append(b)
        if len(s.output_ids) < p.min_tokens and eos is not None and not p.ignore_eos:
            banned.append(r)
    dev = scores.device
    if rows:
        scores.index_put_((_index(rows, dev), _index(toks, dev)),
                          torch.tensor(vals, dtype=scores.dtype, device=dev), accumulate=True)
    if banned:
        scores[_index(banned, dev), eos] = float("-inf")


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64,
                        device=device).view(len(lists), width)


def _penalties(scores: torch.Tensor, samples: list[SampleRow]) -> None:
    """apply_penalties' two edits for the rows that ask: the repetition penalty on every token
    seen (prompt or output), then OpenAI's frequency and presence penalties on the output's
    counts. Token lists are padded with an extra column V, cut off after the scatter."""
    dev, vocab = scores.device, scores.shape[-1]
    rep = [r for r, s in enumerate(samples) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = torch.zeros((len(rep), vocab + 1), dtype=torch.bool, device=dev)
        ids = _padded([samples[r].prompt_ids + samples[r].output_ids for r in rep], vocab, dev)
        seen.scatter_(1, ids, True)
        seen = seen[:, :vocab]
        idx = _index(rep, dev)
        s = scores.index_select(0, idx)
        penalty = torch.tensor([samples[r].params.repetition_penalty for r in rep],
                               dtype=scores.dtype, device=dev)[:, None]
        edited = torch.where(s < 0, s * penalty, s / penalty)
        scores.index_copy_(0, idx, torch.where(seen, edited, s))
    freq = [r for r, s in enumerate(samples)
            if (s.params.frequency_penalty or s.params.presence_penalty) and s.output_ids]
    if freq:
        ids = _padded([samples[r].output_ids for r in freq], vocab, dev)
        counts = torch.zeros((len(freq), vocab + 1), dtype=scores.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=scores.dtype, device=dev))
        counts = counts[:, :vocab]
        f = torch.tensor([samples[r].params.frequency_penalty for r in freq],
                         dtype=scores.dtype, device=dev)[:, None]
        p = torch.tensor([samples[r].params.presence_penalty for r in freq],
                         dtype=scores.dtype, device=dev)[:, None]
        idx = _index(freq, dev)
        scores.index_copy_(0, idx, scores.index_select(0, idx)
                           - (counts * f + (counts > 0).to(scores.dtype) * p))


def _warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """sampling.warp with each row's own temperature, top-k and top-p."""
    dev, vocab = scores.device, scores.shape[-1]
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        scores = scores / torch.tensor(temps, dtype=scores.dtype, device=dev)[:, None]
    ks = [min(p.top_k, vocab) if p.top_k and p.top_k > 0 else 0 for p in params]
    if any(ks):
        top = torch.topk(scores, max(ks), dim=-1).values
        # The k-th largest of each row that has a k (its first k of the largest are its own
        # top-k); -inf keeps every token of a row without one. Ties with the k-th stay, as HF.
        kth = top.gather(1, _index([max(k, 1) - 1 for k in ks], dev)[:, None])
        kth = torch.where(_index(ks, dev)[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    ps = [p.top_p for p in params]
    if any(p < 1.0 for p in ps):
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        keep_all = torch.tensor([p >= 1.0 for p in ps], device=dev)[:, None]
        # 1 - top_p in double, then rounded to the scores' dtype, as warp's Python scalar is.
        tails = torch.tensor([1 - p for p in ps], dtype=cum.dtype, device=dev)[:, None]
        remove_sorted = (cum <= tails) & ~keep_all
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def _draw(scores: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """A token per row from softmax(scores): argmax of p / q with q ~ Exp(1), drawn from each
    seeded row's own generator, one row at a time, the unseeded rows together."""
    probs = scores.softmax(dim=-1)
    q = torch.empty_like(probs)
    free = [i for i, g in enumerate(generators) if g is None]
    if free:
        idx = _index(free, probs.device)
        q.index_copy_(0, idx, torch.empty((len(free), probs.shape[-1]), dtype=probs.dtype,
                                          device=probs.device).exponential_())
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return first_argmax(probs / q)
