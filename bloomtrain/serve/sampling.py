"""A request's sampling parameters and the edits to a row of logits they ask for, one row at a
time: `request_scores` (the vocabulary mask, logit_bias, min_tokens, the penalties, in vLLM's
order) and `warp` (HF's temperature, top-k and top-p). The serving engine's sampler
(bloomtrain.serve.sampler) makes the same edits to every row of a step at once on the logits'
device; these per-row forms are its reference, and `bloomtrain generate`'s and the harness's
choice until they run through the engine.

The log-probabilities reported back are the model's own: log_softmax of the raw logits over the
model's whole output, padded rows included, before any edit (the distribution HF's
BloomForCausalLM defines, and vLLM's default "raw" logprobs), with the top alternatives among the
tokenizer's real tokens; the sampler computes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI parser imports generate, which imports this module
    import torch

SAMPLING_EPS = 1e-5     # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
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
        # Below SAMPLING_EPS the scores over the temperature overflow fp32 (inf, then NaN
        # probabilities): such a request is greedy, as in vLLM.
        return self.temperature >= SAMPLING_EPS

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


# ---- the vocabulary mask and HF's warpers ---------------------------------------------------

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
