"""What one model step gives each scheduled sequence (vLLM's output processing): the rows of
the step's logits each sequence samples from or scores (`sampling_batch`, handed to the sampler
where the logits are: bloomtrain.serve.sampler), then, from what the sampler returns, its prompt
logprobs, the token sampled for it, that token's logprobs and text
(bloomtrain.serve.detokenize, stop strings included), and whether the sequence finished (the
end-of-text token, a stop string, max_tokens)."""
from __future__ import annotations

import time
from collections.abc import Callable

from bloomtrain.serve.interface import SeqOutput
from bloomtrain.serve.sampler import SampleRow, SamplerOutput, SamplingBatch, ScoreRows
from bloomtrain.serve.scheduler import Entry, Sequence

# emit(seq, out, finish): hand `out` to the sequence's client; `finish` ends the sequence.
Emit = Callable[[Sequence, SeqOutput, "str | None"], None]


def sampling_batch(entries: list[Entry], vocab_limit: int,
                   eos_token_id: int | None) -> SamplingBatch:
    """The sampler's work for a step: a row per entry that samples, and the prompt positions
    each entry scores (in entry order; process_step reads the results in the same order)."""
    samples, scores = [], []
    for e in entries:
        seq = e.seq
        span = _prompt_span(e)
        if span is not None:
            first, last, row = span
            scores.append(ScoreRows(row, seq.tokens[first:last + 1], seq.params.logprobs or 0))
        if e.sample:
            p = seq.params
            history = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty \
                or p.min_tokens
            samples.append(SampleRow(
                e.logit_row + e.num_logits - 1, p, seq.generator,
                seq.tokens[:seq.num_prompt] if history else [],
                seq.tokens[seq.num_prompt:] if history else []))
    return SamplingBatch(samples, scores, vocab_limit, eos_token_id)


def _prompt_span(e: Entry) -> tuple[int, int, int] | None:
    """(first, last, row): the prompt positions this entry scores, and the logit row of the
    first. Row j predicts position start + j + 1; positions already scored (before a
    preemption) are not scored twice."""
    seq = e.seq
    lps = seq.prompt_logprobs
    if lps is None or seq.prompt_logprobs_sent:
        return None
    first = max(e.start + 1, len(lps))
    last = min(e.start + e.num, seq.num_prompt - 1)
    if last < first:
        return None
    return first, last, e.logit_row + first - e.start - 1


def process_step(entries: list[Entry], result: SamplerOutput, eos_token_id: int | None,
                 metrics, emit: Emit) -> None:
    """Every entry's results from the sampler's `result` for sampling_batch(entries), emitted
    in entry order."""
    now = time.monotonic()
    sampled = scored = 0
    for e in entries:
        seq = e.seq
        out = SeqOutput(seq.id, [], "")
        if _prompt_span(e) is not None:
            seq.prompt_logprobs += result.scores[scored]
            scored += 1
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent \
                and len(seq.prompt_logprobs) == seq.num_prompt:
            out.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        if not e.sample:
            if seq.num_computed == len(seq.tokens) and seq.params.max_tokens == 0:
                emit(seq, out, "length")
            elif out.prompt_logprobs is not None:
                emit(seq, out, None)
            continue
        token = result.tokens[sampled]
        if seq.params.logprobs is not None:
            out.logprobs = result.logprobs[sampled]
        sampled += 1
        _token_metrics(seq, now, metrics)
        if token == eos_token_id and not seq.params.ignore_eos:
            # The end-of-text token is no part of the text or the token ids, but its logprob is
            # reported, as OpenAI's and vLLM's completions do: a harness scoring with echo +
            # max_tokens 1 drops the last entry as the generated token's.
            out.eos = True
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


def _token_metrics(seq: Sequence, now: float, metrics) -> None:
    if metrics is not None:
        last = seq.last_token_time
        metrics.token(now - seq.arrival, None if last is None else now - last)
    seq.last_token_time = now
