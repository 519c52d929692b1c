"""The harness's `generate_until` on rank 0: continue prompts until a stop sequence, the
end-of-text token or the token limit, with the serving engine's token choice
(bloomtrain.serve.sampler: greedy, or temperature, top-k and top-p in HF's order; HF's
repetition penalty), its paged KV cache (eval.forward.EvalCache) and its incremental
detokenizer (bloomtrain.serve.detokenize: special tokens give no text, a stop sequence ends the
text before it, as the harness's HF backend cuts it).

The model takes no padding mask, so a batch holds prompts of one length; a sequence that
finishes leaves the batch (and the KV cache) at once. Sampling draws from torch's global
generator on rank 0, which the harness seeds (its --seed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bloomtrain.errors import UserValueError
from bloomtrain.serve.detokenize import TextStream
from bloomtrain.serve.sampler import SampleRow, SamplingBatch, sample
from bloomtrain.serve.sampling import SamplingParams

# The generation keywords a task's generation_kwargs may set (the harness's max-token aliases
# included); anything else is refused rather than silently ignored.
SUPPORTED = ("until", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
             "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# transformers' GenerationConfig default: sampling keeps the 50 most likely tokens.
HF_DEFAULT_TOP_K = 50


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    stops: tuple[str, ...]
    sampling: SamplingParams  # temperature 0: greedy

    @classmethod
    def from_gen_kwargs(cls, gen_kwargs: dict, default_max: int, eos_text: str | None
                        ) -> "GenerationSettings":
        """A task's generation_kwargs, read as the harness's HF backend reads them: greedy
        unless do_sample (or a positive temperature alone); the end-of-text string joins the
        stop sequences."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        unknown = sorted(set(gen_kwargs) - set(SUPPORTED))
        if unknown:
            raise UserValueError(f"generation kwargs {unknown} are not supported by bloomtrain eval; "
                             f"it takes {', '.join(SUPPORTED)}")
        kw = normalize_gen_kwargs(gen_kwargs, default_max)
        stops = handle_stop_sequences(kw.get("until"), eos=eos_text)
        if kw["do_sample"] and gen_kwargs.get("temperature") is None:
            # The backend passes temperature 0.0 when none is given, which transformers
            # refuses with do_sample; sampling at 1.0 instead would be a number it never gives.
            raise UserValueError(f"generation kwargs {gen_kwargs}: do_sample needs a temperature "
                             f"(the harness's HF backend refuses it without one too); give "
                             f"temperature > 0, or drop do_sample for greedy")
        temperature = float(gen_kwargs["temperature"]) if kw["do_sample"] else 0.0
        # transformers' generate, which the HF backend calls without top_k, samples from the
        # 50 most likely tokens unless told otherwise (GenerationConfig's default top_k).
        top_k = kw.get("top_k", HF_DEFAULT_TOP_K)
        top_p = kw.get("top_p")
        params = SamplingParams(
            max_tokens=kw["max_gen_toks"], temperature=temperature,
            top_k=0 if top_k is None else int(top_k), top_p=1.0 if top_p is None else float(top_p),
            repetition_penalty=float(kw.get("repetition_penalty") or 1.0))
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < -1 \
                or params.repetition_penalty <= 0 or params.max_tokens < 1:
            raise UserValueError(f"generation kwargs out of range: {gen_kwargs} (temperature >= 0, "
                             f"0 < top_p <= 1, top_k >= 0, repetition_penalty > 0, "
                             f"max_gen_toks >= 1)")
        return cls(params.max_tokens, tuple(s for s in stops if s), params)


class Generator:
    """Batches of prompts through an Executor, decoded into the harness's strings."""

    def __init__(self, executor, tokenizer, *, batch_size: int, eos_id: int | None,
                 skip_ids: frozenset[int]):
        self.executor, self.tokenizer = executor, tokenizer
        self.batch_size, self.eos_id, self.skip_ids = batch_size, eos_id, skip_ids
        self.vocab_limit = tokenizer.vocab_size

    def generate(self, prompts: list[list[int]], settings: GenerationSettings,
                 done=lambda n: None) -> list[str]:
        """The text after each prompt, in order; `done(n)` after each batch of n."""
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        out: list[str] = [""] * len(prompts)
        start = 0
        while start < len(order):
            length = len(prompts[order[start]])
            end = start
            while (end < len(order) and end - start < self.batch_size
                   and len(prompts[order[end]]) == length):
                end += 1
            batch = order[start:end]
            for i, text in zip(batch, self._batch([prompts[i] for i in batch], settings)):
                out[i] = text
            done(len(batch))
            start = end
        return out

    def _batch(self, prompts: list[list[int]], settings: GenerationSettings) -> list[str]:
        """Prompts of one length, generated together; each row leaves when it finishes."""
        streams = [TextStream(self.tokenizer, settings.stops, self.skip_ids) for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        logits = self.executor.prefill(prompts, len(prompts[0]) + settings.max_new_tokens)
        for step in range(settings.max_new_tokens):
            tokens = self._choose(logits, settings.sampling, [prompts[i] for i in active],
                                  [outputs[i] for i in active])
            going = []
            for j, (i, token) in enumerate(zip(active, tokens)):
                if token == self.eos_id:
                    continue
                outputs[i].append(token)
                streams[i].push(token)
                if not streams[i].stopped:
                    going.append(j)
            if not going or step == settings.max_new_tokens - 1:
                break
            logits = self.executor.decode([outputs[active[j]][-1] for j in going], going)
            active = [active[j] for j in going]
        for s in streams:
            s.finish()
        return [s.text for s in streams]

    def _choose(self, logits: torch.Tensor, params: SamplingParams, prompts, outputs
                ) -> list[int]:
        """The next token of each row [n, V], by the serving engine's sampler (greedy, or
        temperature, top-k and top-p in HF's order; the repetition penalty on each row's own
        tokens); sampled rows draw from torch's global generator, which the harness seeds."""
        rows = [SampleRow(r, params, None, prompts[r], outputs[r])
                for r in range(logits.shape[0])]
        return sample(logits, SamplingBatch(rows, [], self.vocab_limit, self.eos_id)).tokens
