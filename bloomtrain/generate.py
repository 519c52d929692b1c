"""Autoregressive generation following HF transformers' `generate` semantics for greedy search
and for temperature / top-k / top-p (nucleus, arXiv 1904.09751) sampling, applied in that order
as HF's logits warpers are. It runs through the serving engine (bloomtrain.serve.offline: its
scheduler, paged KV cache, runner and on-device sampler), the one decode path bloomtrain has.

ALiBi has no position embeddings, so the cache needs no position bookkeeping and prompts longer
than the training sequence length work as they are.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bloomtrain.errors import UserError

if TYPE_CHECKING:  # the CLI parser imports this module and must not wait for torch
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

def _main(args) -> int:
    import torch

    from bloomtrain import load_model
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer
    from bloomtrain.devices import resolve_device

    sampling_flags = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                     ("--top-p", args.top_p)) if v is not None]
    if args.greedy and sampling_flags:
        raise UserError(f"--greedy conflicts with {', '.join(sampling_flags)}")
    do_sample = bool(sampling_flags)
    temperature = 1.0 if args.temperature is None else args.temperature
    top_p = 1.0 if args.top_p is None else args.top_p
    if do_sample and temperature <= 0:
        raise UserError(f"--temperature must be positive, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not Path(args.checkpoint).exists():
        raise UserError(f"--checkpoint {args.checkpoint} does not exist")

    tokenizer = load_tokenizer(checkpoint_tokenizer(args.checkpoint, args.tokenizer))
    device = resolve_device(args.device)
    model = load_model(args.checkpoint, device=device)
    if args.quantize:
        from bloomtrain.serve.quantize import quantize_model
        quantize_model(model, args.quantize)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise UserError("--prompt encodes to no tokens")
    if tokenizer.vocab_size > model.shape.vocab_size:
        raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.shape.vocab_size}; pass the tokenizer the model was trained with")
    try:
        eos = tokenizer.eod_id
    except UserError:
        eos = None
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        if args.seed is not None:
            generator.manual_seed(args.seed)
        else:
            generator.seed()
    ids = generate(model, torch.tensor([prompt_ids], device=device), args.max_new_tokens,
                   do_sample=do_sample, temperature=temperature, top_k=args.top_k or 0,
                   top_p=top_p, eos_token_id=eos, generator=generator,
                   vocab_limit=tokenizer.vocab_size)[0].tolist()
    new = ids[len(prompt_ids):]
    if eos is not None and eos in new:
        new = new[:new.index(eos)]
    # Decoding the whole sequence, not prompt + decode(new), keeps a multi-byte character that
    # straddles the boundary intact.
    sys.stdout.write(tokenizer.decode(prompt_ids + new) + "\n")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        description="Print the prompt and its continuation. Decoding is greedy unless "
        "--temperature, --top-k or --top-p is given, which switches to sampling (HF order: "
        "temperature, then top-k, then top-p). Generation stops at the tokenizer's end-of-"
        "document token. Tokens beyond the tokenizer's vocabulary (embedding padding) are "
        "never produced.")
    p.add_argument("--checkpoint", required=True, metavar="DIR_OR_HF",
                   help="a bloomtrain checkpoint (step dir or root) or an HF Bloom directory")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample with this temperature")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens (0: no limit)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens with total probability >= P")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed for sampling (default: a fresh random seed)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding (the default when no sampling option is given)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or a directory holding one (default: the checkpoint's)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: per-output-channel int8 weights for the linear layers and the "
                   "tied embedding, dequantized in the matmul (a quarter of fp32's bytes)")
    p.set_defaults(func=_main)
