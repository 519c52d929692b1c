"""Autoregressive generation following HF transformers' `generate` semantics for greedy search
and for temperature / top-k / top-p (nucleus, arXiv 1904.09751) sampling, applied in that order
as HF's logits warpers are. It runs through the serving engine (bloomtrain.serve.offline: its
scheduler, paged KV cache, runner and on-device sampler), the one decode path bloomtrain has.

ALiBi has no position embeddings, so the cache needs no position bookkeeping and prompts longer
than the training sequence length work as they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def generate(model, input_ids: "torch.Tensor", max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | list[int] | None = None,
             generator: "torch.Generator | None" = None, vocab_limit: int | None = None,
             use_cache: bool = True) -> "torch.Tensor":
    """Continue `input_ids` [b, s] by up to `max_new_tokens` tokens; returns [b, s + new].

    Greedy picks `argmax` (first index on ties, like torch.argmax and HF). Sampling draws each
    row from its own generator, seeded from `generator` (so a seeded `generator` gives the same
    tokens every time). A sequence that emits `eos_token_id` is filled with it afterwards (HF's
    default when no pad id is set), and generation stops once every sequence has finished.
    `vocab_limit` masks the padded embedding rows beyond the tokenizer's vocabulary.
    `use_cache=False` recomputes the whole sequence each step with the model's plain forward
    (a reference for the engine's cache), greedy only.
    """
    import torch

    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, "
                         f"got {list(input_ids.shape)}")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if len(eos) > 1:
        raise ValueError(f"one end-of-text token id, got {eos}")
    if not use_cache and do_sample:
        raise ValueError("use_cache=False is the greedy reference; sample with the cache")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if not use_cache:
                return _recompute(model, input_ids, max_new_tokens, eos, vocab_limit)
            return _through_engine(model, input_ids, max_new_tokens, do_sample, temperature,
                                   top_k, top_p, eos, generator, vocab_limit)
    finally:
        model.train(was_training)


def _through_engine(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                    eos, generator, vocab_limit):
    import torch

    from bloomtrain.serve.offline import offline_engine
    from bloomtrain.serve.sampling import SamplingParams

    b, s = input_ids.shape
    if max_new_tokens <= 0:
        return input_ids
    engine = offline_engine(model, num_seqs=b, max_len=s + max_new_tokens, longest_prompt=s,
                            vocab_limit=vocab_limit, eos_token_id=eos[0] if eos else None)
    seeds = [None] * b
    if do_sample:
        if generator is None:
            generator = torch.Generator(device=input_ids.device)
            generator.seed()
        seeds = torch.randint(0, 2 ** 62, (b,), generator=generator,
                              device=generator.device).tolist()
    params = [SamplingParams(max_tokens=max_new_tokens,
                             temperature=temperature if do_sample else 0.0,
                             top_k=top_k or 0, top_p=top_p, seed=seed) for seed in seeds]
    from bloomtrain.serve.interface import RequestError
    try:
        results = engine.generate(input_ids.tolist(), params)
    except RequestError as e:
        raise ValueError(str(e)) from None
    # HF's shape: as many steps as the longest row took (its end-of-text token counted), the
    # rows that ended earlier filled with the end-of-text token.
    taken = [len(r["token_ids"]) + (r["finish_reason"] == "stop") for r in results]
    width = max(taken)
    new = [r["token_ids"] + [eos[0] if eos else 0] * (width - len(r["token_ids"]))
           for r in results]
    return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype,
                                              device=input_ids.device)], dim=1)


def _recompute(model, input_ids, max_new_tokens, eos, vocab_limit):
    """Greedy decoding by a full forward over the whole sequence at every step."""
    import torch

    out = input_ids
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(out)[:, -1, :vocab_limit].float()
        next_tok = logits.argmax(dim=-1)
        if eos:
            next_tok = torch.where(finished, torch.full_like(next_tok, eos[0]), next_tok)
            finished |= next_tok == eos[0]
        out = torch.cat([out, next_tok[:, None]], dim=1)
        if eos and bool(finished.all()):
            break
    return out


# ---- CLI -----------------------------------------------------------------------------------------
