"""Choosing the next token, shared by the serving engine and `bloomtrain generate`: the request's
sampling parameters, the edits to a row of logits they ask for (`request_scores`, in vLLM's
order), the choice (greedy, the first index on ties as torch and HF; or HF's warpers, then a
draw from the request's own generator), and the log-probabilities reported back
(`logprob_entries`). Every edit is made to one request's row alone, so a request's choice never
depends on the other rows of the batch (the engine's batch invariance).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI parser imports generate, which imports this module
    import torch

MAX_LOGPROBS = 5        # OpenAI's limit for the completions API
MAX_CHAT_LOGPROBS = 20  # and for the chat API's top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0         # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # top alternatives per token; None: no logprobs
    prompt_logprobs: bool = False    # also for the prompt tokens (OpenAI's echo + logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs
    min_tokens: int = 0
    ignore_eos: bool = False

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    @property
    def edits_logits(self) -> bool:
        """Whether anything but the vocabulary mask changes this request's scores."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]     # the most likely tokens, most likely first, and the chosen


# ---- the warpers and the choice (also bloomtrain generate's) ---------------------------------

def mask_vocab(logits: "torch.Tensor", vocab_limit: int | None) -> "torch.Tensor":
    """fp32 scores with the padded embedding rows beyond `vocab_limit` at -inf."""
    scores = logits.float()
    if vocab_limit is not None and vocab_limit < scores.shape[-1]:
        scores = scores.clone()
        scores[..., vocab_limit:] = float("-inf")  # padded embedding rows are not tokens
    return scores


def warp(scores: "torch.Tensor", temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0) -> "torch.Tensor":
    """HF's temperature, top-k (0 or -1: all) and top-p warpers, in HF's order, on scores
    [b, V]."""
    import torch

    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th stay, as HF
    if top_p < 1.0:
        # HF's TopPLogitsWarper: drop the low tail whose total mass is <= 1 - top_p, so what is
        # kept is the smallest set whose mass reaches top_p; the top token always stays.
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def process_logits(logits: "torch.Tensor", temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0, vocab_limit: int | None = None,
                   do_sample: bool = True) -> "torch.Tensor":
    """Next-token scores [b, V] (fp32) with -inf wherever a token may not be chosen."""
    scores = mask_vocab(logits, vocab_limit)
    return warp(scores, temperature, top_k, top_p) if do_sample else scores


def choose(scores: "torch.Tensor", do_sample: bool, generator=None) -> "torch.Tensor":
    """The next token [b] from scores [b, V]: argmax, or a draw from their softmax."""
    import torch

    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]
    return scores.argmax(dim=-1)


def next_tokens(logits: "torch.Tensor", do_sample: bool, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None,
                generator: "torch.Generator | None" = None) -> "torch.Tensor":
    """The next token [b] for each row of `logits` [b, V]: argmax of the scores (greedy), or a
    draw from their softmax with `generator`."""
    return choose(process_logits(logits, temperature, top_k, top_p, vocab_limit, do_sample),
                  do_sample, generator)


# ---- a request's own edits ------------------------------------------------------------------

def apply_penalties(scores: "torch.Tensor", prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> "torch.Tensor":
    """The penalties on one row of scores [1, V] (a new tensor):
    - `repetition_penalty` (CTRL, Keskar et al., arXiv 1909.05858, as HF's
      RepetitionPenaltyLogitsProcessor): the score of every token already in the prompt or the
      output is divided by the penalty when positive and multiplied by it when negative;
    - `frequency_penalty` and `presence_penalty` (OpenAI's formula): the score of token j drops
      by c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c[j] being how often j has
      been generated so far (the prompt does not count)."""
    import torch

    scores = scores.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        s = scores[0, seen]
        scores[0, seen] = torch.where(s < 0, s * params.repetition_penalty,
                                      s / params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=scores.shape[-1])[:scores.shape[-1]].float()
        scores[0] -= (counts * params.frequency_penalty
                      + (counts > 0).float() * params.presence_penalty)
    return scores


def request_scores(logits: "torch.Tensor", params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int], vocab_limit: int | None,
                   eos_token_id: int | None) -> "torch.Tensor":
    """The scores [1, V] a request chooses its next token from, before the temperature and the
    truncations (which only sampling applies, `warp`), edited in this order (vLLM's):
    1. the padded embedding rows beyond the tokenizer's vocabulary are masked (-inf);
    2. `logit_bias` is added to the tokens it names (OpenAI: "added to the logits generated by
       the model prior to sampling"), and while fewer than `min_tokens` tokens are out the
       end-of-text token is masked (unless `ignore_eos`, when it ends nothing);
    3. and 4. the penalties (`apply_penalties`)."""
    scores = mask_vocab(logits, vocab_limit)
    if params.logit_bias or (params.min_tokens and len(output_ids) < params.min_tokens):
        scores = scores.clone()
        for token_id, bias in params.logit_bias:
            scores[0, token_id] += bias
        if (len(output_ids) < params.min_tokens and eos_token_id is not None
                and not params.ignore_eos):
            scores[0, eos_token_id] = float("-inf")
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        scores = apply_penalties(scores, prompt_ids, output_ids, params)
    return scores


def sample_next(entries, logits: "torch.Tensor", vocab_limit: int,
                eos_token_id: int | None = None) -> dict[int, int]:
    """{sequence id: next token} for the scheduled entries that sample (scheduler.Entry), each
    from the last of its logit rows: plain greedy rows in one argmax, the others each with its
    own edits (`request_scores`) and generator."""
    samplers = [e for e in entries if e.sample]
    rows = [e.logit_row + e.num_logits - 1 for e in samplers]
    out: dict[int, int] = {}
    plain = [k for k, e in enumerate(samplers)
             if not e.seq.params.do_sample and not e.seq.params.edits_logits]
    if plain:
        sel = [rows[k] for k in plain]
        # The argmax over the tokenizer's tokens is mask_vocab's (the padded rows it masks
        # come after them), without copying the rows: every step has these, one per decode.
        if sel == list(range(sel[0], sel[0] + len(sel))):
            greedy = logits[sel[0]:sel[0] + len(sel)]
        else:
            greedy = logits[sel]
        picked = greedy[:, :vocab_limit].float().argmax(dim=-1)
        for k, t in zip(plain, picked.tolist()):
            out[samplers[k].seq.id] = t
    for k, e in enumerate(samplers):
        seq, p = e.seq, e.seq.params
        if seq.id in out:
            continue
        scores = request_scores(logits[rows[k]:rows[k] + 1], p, seq.tokens[:seq.num_prompt],
                                seq.tokens[seq.num_prompt:], vocab_limit, eos_token_id)
        if p.do_sample:
            scores = warp(scores, p.temperature, p.top_k, p.top_p)
        out[seq.id] = int(choose(scores, p.do_sample, seq.generator)[0])
    return out


def logprob_entries(vocab_limit: int, rows: "torch.Tensor", chosen: list[int], top: int
                    ) -> list[TokenLogprob]:
    """Log-probabilities of `chosen` [n] under `rows` [n, V], each with the `top` most likely
    tokens of the tokenizer's `vocab_limit`, and the chosen one after them when it is not among
    them (vLLM's top_logprobs: `logprobs: 0` still names the token and its logprob).

    They are the model's own, as is the cumulative log-probability `best_of` ranks by:
    log_softmax of the raw logits over the model's whole output, padded rows included, before
    any edit of request_scores. That is the distribution HF's BloomForCausalLM defines (so a
    harness scores the same numbers through the server as through HF) and vLLM's default
    ("raw" logprobs): they score the text, not the sampler. The alternatives named beside each
    token are real tokens only."""
    import torch

    lp = torch.log_softmax(rows.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if top > 0:
        values, indices = lp[:, :vocab_limit].topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    for t, p, alternatives in zip(chosen, picked, tops):
        if all(t != i for i, _ in alternatives):
            alternatives.append((t, p))
    return [TokenLogprob(t, p, alternatives) for t, p, alternatives in zip(chosen, picked, tops)]
