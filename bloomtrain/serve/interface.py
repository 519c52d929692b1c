"""What the HTTP front end and the engine exchange, and the interface the front end drives: the
`EngineClient` protocol, which the in-process engine (bloomtrain.serve.engine.Engine) and the
pipe client to an engine in another process (bloomtrain.serve.remote.RemoteEngine) both
implement, so that the handlers never ask which one they hold.

Threads: `check_request`, `submit`, `abort` and `stop_accepting` are called on the front end's
event loop; the results of each engine step reach `dispatch` (set by the server, once, to hand
them to its loop) as [(sink, SeqOutput)], and each `sink` is then called on the loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.sampling import MAX_CHAT_LOGPROBS, SamplingParams, TokenLogprob

__all__ = ["EngineClient", "EngineClosed", "QueueFull", "RequestError", "SeqOutput",
           "check_request"]


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the HTTP layer answers 400); `code` is
    OpenAI's error code, where it has one; `param` the request field at fault (None: the
    prompt or messages, as the endpoint names them)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class QueueFull(RuntimeError):
    """The waiting queue is full (the HTTP layer answers 503 with Retry-After)."""


class EngineClosed(RuntimeError):
    """The engine no longer takes requests (shutting down, or failed)."""


@dataclass
class SeqOutput:
    """What a step produced for one sequence."""

    seq_id: int
    token_ids: list[int]                           # new tokens (an end-of-text token excluded)
    text: str                                      # new text (stop strings cut)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list | None = None            # once: [None, TokenLogprob, ...]
    finish_reason: str | None = None               # stop | length | abort | error
    error: str | None = None
    # The step's token was the end-of-text token: in no text and no token ids, but generated,
    # so counted in usage.completion_tokens as OpenAI and vLLM count it.
    eos: bool = False


Dispatch = Callable[[list], None]


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP handlers drive it."""

    config: EngineConfig
    error: BaseException | None          # set once the engine failed; it takes no more
    dispatch: Dispatch | None            # receives each step's [(sink, SeqOutput)]
    # Gauges for /metrics, read from the front end's thread (approximate while a step runs).
    num_waiting: int
    num_running: int
    blocks_used: int
    blocks_total: int

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError saying why the engine cannot serve this request."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink) -> int:
        """Queue a sequence; its SeqOutputs go to `sink`. Returns its id. Raises RequestError,
        QueueFull or EngineClosed."""

    def abort(self, seq_id: int) -> None:
        """Drop a sequence (its client went away): its blocks go back to the pool."""

    def stop_accepting(self) -> None:
        """Refuse every later submit with EngineClosed (the server drains)."""

    async def metrics_snapshot(self) -> dict | None:
        """The engine-side metrics (ServeMetrics.snapshot) when they live in another process;
        None when the front end's own metrics are the engine's."""


def check_request(cfg: EngineConfig, prompt_ids: list[int], params: SamplingParams,
                  vocab_limit: int, has_tokenizer: bool) -> None:
    """Raise RequestError saying why an engine of `cfg` cannot serve the request."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_limit]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab_limit})")
    if params.max_tokens < 0:
        raise RequestError(f"max_tokens must be >= 0, got {params.max_tokens}",
                           param="max_tokens")
    total = len(prompt_ids) + params.max_tokens
    if total > cfg.max_model_len:
        raise RequestError(
            f"this model's maximum context length is {cfg.max_model_len} tokens; the "
            f"prompt has {len(prompt_ids)} and max_tokens asks for {params.max_tokens} "
            f"more ({total}); shorten the prompt or lower max_tokens",
            "context_length_exceeded")
    if params.stop and not has_tokenizer:
        raise RequestError("stop strings need a tokenizer", param="stop")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_CHAT_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_CHAT_LOGPROBS}], got "
                           f"{params.logprobs}", param="logprobs")
    if params.min_tokens > params.max_tokens:
        raise RequestError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                           f"({params.max_tokens})", param="min_tokens")
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_limit]
    if bad:
        raise RequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                           f"[0, {vocab_limit})", param="logit_bias")
