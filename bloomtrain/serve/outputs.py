"""What one model step gives each scheduled sequence (vLLM's output processing): its prompt
logprobs, the token sampled for it (bloomtrain.serve.sampling), that token's logprobs and text
(bloomtrain.serve.detokenize, stop strings included), and whether the sequence finished (the
end-of-text token, a stop string, max_tokens)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bloomtrain.serve.interface import SeqOutput
from bloomtrain.serve.sampling import logprob_entries, sample_next
from bloomtrain.serve.scheduler import Entry, Sequence

# emit(seq, out, finish): hand `out` to the sequence's client; `finish` ends the sequence.
Emit = Callable[[Sequence, SeqOutput, "str | None"], None]


def process_step(entries: list[Entry], logits: torch.Tensor, vocab_limit: int,
                 eos_token_id: int | None, metrics, emit: Emit) -> None:
    """Every entry's results from the step's `logits` [rows, vocab], emitted in entry order."""
    logits = logits.cpu()
    new_tokens = sample_next(entries, logits, vocab_limit, eos_token_id)
    now = time.monotonic()
    for e in entries:
        seq = e.seq
        out = SeqOutput(seq.id, [], "")
        _prompt_logprobs(e, logits, vocab_limit, out)
        if not e.sample:
            if seq.num_computed == len(seq.tokens) and seq.params.max_tokens == 0:
                emit(seq, out, "length")
            elif out.prompt_logprobs is not None:
                emit(seq, out, None)
            continue
        token = new_tokens[seq.id]
        if seq.params.logprobs is not None:
            row = e.logit_row + e.num_logits - 1
            out.logprobs = logprob_entries(vocab_limit, logits[row:row + 1], [token],
                                           seq.params.logprobs)
        _token_metrics(seq, now, metrics)
        if token == eos_token_id and not seq.params.ignore_eos:
            # The end-of-text token is no part of the text or the token ids, but its logprob is
            # reported, as OpenAI's and vLLM's completions do: a harness scoring with echo +
            # max_tokens 1 drops the last entry as the generated token's.
            emit(seq, out, "stop")
            continue
        seq.tokens.append(token)
        out.token_ids = [token]
        finish = None
        if seq.text is not None:
            # Stop strings count from min_tokens on, as vLLM's.
            out.text = seq.text.push(token, seq.num_output >= seq.params.min_tokens)
            if seq.text.stopped:
                finish = "stop"
        if finish is None and seq.num_output >= seq.params.max_tokens:
            finish = "length"
        emit(seq, out, finish)


def _prompt_logprobs(e: Entry, logits: torch.Tensor, vocab_limit: int, out: SeqOutput) -> None:
    """The prompt positions this entry scores; `out` carries them once all are scored."""
    seq = e.seq
    lps = seq.prompt_logprobs
    if lps is None or seq.prompt_logprobs_sent:
        return
    # Row j predicts position start + j + 1. Positions already scored (before a preemption)
    # are not scored twice.
    first = max(e.start + 1, len(lps))
    last = min(e.start + e.num, seq.num_prompt - 1)
    if last >= first:
        row = e.logit_row + first - e.start - 1
        lps += logprob_entries(vocab_limit, logits[row:row + last - first + 1],
                               seq.tokens[first:last + 1], seq.params.logprobs or 0)
    if len(lps) == seq.num_prompt:
        out.prompt_logprobs = lps
        seq.prompt_logprobs_sent = True


def _token_metrics(seq: Sequence, now: float, metrics) -> None:
    if metrics is not None:
        last = seq.last_token_time
        metrics.token(now - seq.arrival, None if last is None else now - last)
    seq.last_token_time = now
