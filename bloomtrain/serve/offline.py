"""The serving engine over an in-memory single-device model, for offline work: `offline_engine`
sizes its KV cache for the batch at hand, and its `generate` (engine.generate_offline) serves
prompts to completion on the caller's thread. `bloomtrain generate` decodes through it: the one
decode path (the engine's scheduler, paged KV cache, runner and sampler) serves the HTTP server,
generation and tests alike.
"""
from __future__ import annotations

from bloomtrain.serve.config import EngineConfig, blocks_for
from bloomtrain.serve.engine import Engine

BLOCK = 16
# Prompt tokens per step when a batch is prefilled: whole prompts in one step up to this, so
# that the batch's first step is one forward; larger prompts go in chunks of PREFILL_CHUNK.
MAX_STEP_TOKENS = 8192
PREFILL_CHUNK = 512


def offline_engine(model, *, num_seqs: int, max_len: int, longest_prompt: int,
                   vocab_limit: int | None = None, eos_token_id: int | None = None,
                   tokenizer=None, enforce_eager: bool = False) -> Engine:
    """An engine over `model` (a single-device BloomForCausalLM, possibly int8) with a KV cache
    for `num_seqs` sequences of up to `max_len` tokens, all admitted at once, their prompts
    (up to `longest_prompt` tokens) prefilled together where the step budget allows. Matmuls are
    not padded for batch invariance (min_rows 1): an offline batch is served once, as it is.
    Decode steps from CUDA graphs on CUDA unless `enforce_eager` (bloomtrain.serve.graphs)."""
    from bloomtrain.serve.graphs import use_decode_graphs
    from bloomtrain.serve.kv_cache import PagedKVCache
    from bloomtrain.serve.runner import ModelRunner

    chunk = max(1, min(longest_prompt, PREFILL_CHUNK))
    # One free block per running sequence is kept back at admission (scheduler.py): room for
    # every sequence's longest table plus that.
    blocks = num_seqs * (blocks_for(max_len, BLOCK) + 1)
    config = EngineConfig(max_model_len=max_len, block_size=BLOCK,
                          kv_cache_tokens=blocks * BLOCK, max_num_seqs=num_seqs,
                          max_batched_tokens=max(chunk * num_seqs, chunk + num_seqs)
                          if chunk * num_seqs <= MAX_STEP_TOKENS else chunk + num_seqs,
                          prefill_chunk=chunk, max_queue=num_seqs, enforce_eager=enforce_eager)
    shape, weight = model.shape, model.transformer.word_embeddings_layernorm.weight
    dtype, device = weight.dtype, weight.device
    _check_cache_fits(shape, config.num_blocks * BLOCK, dtype, device, num_seqs, max_len)
    cache = PagedKVCache(shape.num_layers, config.num_blocks, BLOCK, shape.num_heads,
                         shape.head_dim, dtype, device)
    runner = ModelRunner(model, cache, min_rows=1)
    use_decode_graphs(runner, num_seqs, max_len, enforce_eager)
    return Engine(runner.forward, config, vocab_size=shape.vocab_size, vocab_limit=vocab_limit,
                  eos_token_id=eos_token_id, tokenizer=tokenizer, device=device)


def _check_cache_fits(shape, tokens: int, dtype, device, num_seqs: int, max_len: int) -> None:
    """The cache is allocated whole, for every sequence's longest run: one that cannot fit is
    refused in a line before anything is allocated (a huge --max-new-tokens was an allocator's
    traceback after the model had loaded)."""
    import torch

    from bloomtrain.errors import UserError
    from bloomtrain.planner.host import available_host_memory

    need = 2 * shape.num_layers * tokens * shape.num_heads * shape.head_dim * dtype.itemsize
    if device.type == "cuda":
        have, source = torch.cuda.mem_get_info(device)[0], "free CUDA memory"
    else:
        have, source = available_host_memory()
    if need > have:
        raise UserError(f"the KV cache for {num_seqs} sequence(s) of up to {max_len:,} tokens "
                        f"takes {need / 2 ** 30:,.1f} GiB, more than the {have / 2 ** 30:,.1f} "
                        f"GiB of {source}: ask for fewer new tokens (--max-new-tokens) or fewer "
                        f"prompts at once")
