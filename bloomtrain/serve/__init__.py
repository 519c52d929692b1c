"""`bloomtrain serve`: an OpenAI-compatible completions server for the models bloomtrain trains.

    config.py     EngineConfig: the engine's limits (torch-free, for the CLI parser)
    kv_cache.py   the block pool (free list) and the paged key/value storage
    runner.py     one forward step over a packed batch: per-sequence ALiBi attention over paged
                  blocks, batch-invariant numerics
    engine.py     the scheduler: continuous batching, chunked prefill under a token budget,
                  preemption, sampling, incremental detokenization and stop strings
    quantize.py   int8 per-output-channel weights (also `bloomtrain generate --quantize int8`)
    tp.py         tensor-parallel inference: the training split, rank 0 broadcasting each step
    metrics.py    Prometheus text metrics
    server.py     the aiohttp app: /v1/completions (SSE streaming), /v1/models, /health,
                  /metrics, drain on SIGTERM
    cli.py        the subcommand

Importing this package loads nothing heavy; the modules import torch and aiohttp themselves.
"""
