"""`bloomtrain serve`: an OpenAI- and vLLM-compatible server for the models bloomtrain trains,
split along vLLM's lines.

    config.py     EngineConfig: the engine's limits (torch-free, for the CLI parser)
    protocol.py   the request and response protocol: parsing, validation, response shapes
    chat.py       chat templates (Jinja, as HF tokenizers carry them)
    server.py     the aiohttp app: the handlers, streaming, the drain on SIGTERM
    interface.py  what the front end and the engine exchange; the EngineClient protocol
    remote.py     the front end in its own process: RemoteEngine over a pipe, the engine loop
    engine.py     the engine loop: requests in, one model step at a time, results out
    scheduler.py  continuous batching, chunked prefill, preemption
    sampling.py   sampling parameters, logits edits (penalties, logit_bias), the choice,
                  logprobs (bloomtrain generate uses it too)
    detokenize.py incremental detokenization and stop strings
    kv_cache.py   the block pool (free list) and the paged key/value storage
    runner.py     one step through the model's own forward (paged attention), batch-invariant
    quantize.py   int8 per-output-channel weights (also `bloomtrain generate --quantize int8`)
    tp.py         tensor-parallel inference: the training split, rank 0 broadcasting each step
    metrics.py    Prometheus text metrics
    cli.py        the subcommand

Importing this package loads nothing heavy; the modules import torch and aiohttp themselves.
"""
