"""The HTTP front of `bloomtrain serve`: OpenAI's legacy completions API (`POST /v1/completions`,
non-streaming or as server-sent events), `GET /v1/models`, `GET /health` and `GET /metrics`
(Prometheus text), on aiohttp.

Why aiohttp rather than FastAPI + uvicorn: one dependency gives the server, the test client and
the HTTP client the load benchmark drives it with, on one event loop; the handler reads the raw
body, so bad UTF-8, malformed JSON and unknown fields get our own OpenAI-style 400 messages
rather than a framework's validation errors; `handler_cancellation` cancels a handler whose
client hangs up, even one that is not streaming, which is how a disconnect frees its sequence's
slot and KV blocks at once; and the listening socket, the in-flight count and shutdown are plain
objects we can drain in order on SIGTERM.

Errors: every 4xx/5xx answer is JSON, {"error": {"message", "type", "param", "code"}}, as
OpenAI's. A full queue is 503 with `Retry-After`, and so is a request that arrives while the
server drains.
"""
from __future__ import annotations

import asyncio
import json
import math
import signal
import time
import uuid

from aiohttp import web

from bloomtrain.serve.interface import EngineClosed, QueueFull, RequestError
from bloomtrain.serve.sampling import MAX_LOGPROBS, SamplingParams

KNOWN_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
                "stream", "stream_options", "echo", "logprobs", "n", "user"}
# Fields of OpenAI's completions API this server does not implement: named as such, not as
# unknown, so that a client sees what to drop.
UNSUPPORTED_FIELDS = {"suffix", "best_of", "presence_penalty", "frequency_penalty", "logit_bias"}
MAX_STOP = 4  # OpenAI's limit
RETRY_AFTER_S = 1
DEFAULT_MAX_TOKENS = 16  # OpenAI's default


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> web.Response:
    kind = ("invalid_request_error" if status < 500 else
            "overloaded_error" if status == 503 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class ServerState:
    """What the handlers share: the engine, the tokenizer, the metrics, and the drain state."""

    def __init__(self, engine, tokenizer, model_name: str, metrics, max_body_bytes: int):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name, self.max_body_bytes = model_name, max_body_bytes
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()


STATE = web.AppKey("state", ServerState)


# ---- request parsing ------------------------------------------------------------------------

def _parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {e.start}: "
                         f"{raw[e.start:e.start + 1]!r})") from None

    def no_constant(name):
        raise BadRequest(f"malformed JSON: {name} is not a JSON number")

    try:
        body = json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got "
                         f"{type(body).__name__}")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get_int(body, key, default, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise BadRequest(f"`{key}` must be an integer, got {json.dumps(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"`{key}` must be {bounds}, got {v}", key)
    return v


def _get_number(body, key, default, lo, hi, lo_open=False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise BadRequest(f"`{key}` must be a number, got {json.dumps(v)}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise BadRequest(f"`{key}` must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                         key)
    return float(v)


def _get_bool(body, key, default=False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"`{key}` must be true or false, got {json.dumps(v)}", key)
    return v


def _check_text(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} holds a lone surrogate (\\u{ord(s[e.start]):04x}) at "
                         f"character {e.start}, which is not valid Unicode", "prompt") from None


def _prompts(body, tokenizer, max_prompts: int) -> list[tuple[list[int], str | None]]:
    """[(token ids, text or None)] of `prompt`: a string, a list of strings, a list of token
    ids, or a list of such lists."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("`prompt` is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        items = [p]
    elif isinstance(p, list) and p and (all(isinstance(t, str) for t in p)
                                        or all(isinstance(t, list) for t in p)):
        items = p
    elif isinstance(p, list) and not p:
        raise BadRequest("`prompt` is an empty list; give at least one prompt", "prompt")
    else:
        raise BadRequest("`prompt` must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids", "prompt")
    if len(items) > max_prompts:
        raise BadRequest(f"at most {max_prompts} prompts per request, got {len(items)}",
                         "prompt")
    out = []
    for i, item in enumerate(items):
        where = "`prompt`" if len(items) == 1 else f"`prompt[{i}]`"
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"{where} is empty; give some text to continue", "prompt")
            _check_text(item, where)
            ids = tokenizer.encode(item)
            if not ids:
                raise BadRequest(f"{where} encodes to no tokens", "prompt")
            out.append((ids, item))
        else:
            if not item or not all(_is_int(t) for t in item):
                raise BadRequest(f"{where} must be a non-empty list of token ids", "prompt")
            out.append((list(item), None))
    return out


def _sampling(body) -> tuple[SamplingParams, bool, bool, bool]:
    """(params, stream, echo, include_usage) of a request."""
    unsupported = sorted(set(body) & UNSUPPORTED_FIELDS)
    if unsupported:
        raise BadRequest(f"`{unsupported[0]}` is not supported by this server", unsupported[0])
    unknown = sorted(set(body) - KNOWN_FIELDS - UNSUPPORTED_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field `{unknown[0]}`; the fields are "
                         f"{', '.join(sorted(KNOWN_FIELDS))}", unknown[0])
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"`{key}` must be a string", key)
    n = _get_int(body, "n", 1, 1)
    if n != 1:
        raise BadRequest("`n` > 1 is not supported; send the prompt n times (with different "
                         "seeds)", "n")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("`stop` must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise BadRequest(f"`stop` takes at most {MAX_STOP} non-empty strings", "stop")
    for s in stop:
        _check_text(s, "`stop`")
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("`stream_options` needs `stream: true`", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest("`stream_options` must be {\"include_usage\": true|false}",
                             "stream_options")
        include_usage = _get_bool(options, "include_usage")
    logprobs = _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _get_bool(body, "echo")
    params = SamplingParams(
        max_tokens=_get_int(body, "max_tokens", DEFAULT_MAX_TOKENS, 0),
        temperature=_get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_get_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_get_int(body, "top_k", 0, 0),
        seed=_get_int(body, "seed", None, 0, 2 ** 63 - 1),
        stop=stop, logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)
    return params, stream, echo, include_usage


# ---- responses ------------------------------------------------------------------------------

class _Choice:
    """One prompt's completion as it accumulates, in OpenAI's shape."""

    def __init__(self, index: int, prompt_ids: list[int], prompt_text: str | None, echo: bool,
                 tokenizer, logprobs: int | None):
        self.index, self.echo, self.tokenizer = index, echo, tokenizer
        self.prompt_ids = prompt_ids
        self.prompt_text = (prompt_text if prompt_text is not None
                            else tokenizer.decode(prompt_ids)) if echo else ""
        self.want_logprobs = logprobs is not None
        self.text = ""
        self.num_tokens = 0
        self.finish_reason = None
        self.error = None
        self.offset = 0  # characters of text (echoed prompt included) the logprobs cover
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _add_logprobs(self, lp: dict, entries, token_ids) -> None:
        for entry, tid in zip(entries, token_ids):
            s = self._token_str(tid)
            lp["tokens"].append(s)
            lp["text_offset"].append(self.offset)
            self.offset += len(s)
            if entry is None:  # the first prompt token has nothing to be predicted from
                lp["token_logprobs"].append(None)
                lp["top_logprobs"].append(None)
            else:
                lp["token_logprobs"].append(entry.logprob)
                lp["top_logprobs"].append({self._token_str(t): v for t, v in entry.top})

    def update(self, out) -> dict:
        """Fold a SeqOutput in; returns the stream chunk's choice for it."""
        text = out.text
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if out.prompt_logprobs is not None and self.echo:
            self._add_logprobs(lp, out.prompt_logprobs, self.prompt_ids)
        if self.want_logprobs:
            self._add_logprobs(lp, out.logprobs, [e.token_id for e in out.logprobs])
        for k in lp:
            self.lp[k] += lp[k]
        self.text += text
        self.num_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason
        self.error = out.error
        return {"index": self.index, "text": text,
                "logprobs": lp if self.want_logprobs else None,
                "finish_reason": _public_reason(out.finish_reason)}

    def final(self) -> dict:
        return {"index": self.index, "text": self.prompt_text + self.text,
                "logprobs": self.lp if self.want_logprobs else None,
                "finish_reason": _public_reason(self.finish_reason)}


def _public_reason(reason):
    return reason if reason in (None, "stop", "length") else None


# ---- handlers -------------------------------------------------------------------------------

@web.middleware
async def _errors_and_counts(request: web.Request, handler):
    """JSON bodies for aiohttp's own errors (404, 405, 413), a 500 instead of a traceback, and
    a count of every response by endpoint and code."""
    state = request.app[STATE]
    try:
        resp = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = error_response(e.status, e.reason if e.status != 413 else
                              f"the request body is larger than the limit "
                              f"({state.max_body_bytes} bytes)")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # never a dropped connection for a server bug
        resp = error_response(500, f"internal error: {e!r}")
    endpoint = request.path if request.path in ENDPOINTS else "other"
    with state.metrics.lock:
        state.metrics.http.inc(1, endpoint, str(resp.status))
    return resp


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.error is not None:
        return web.json_response({"status": "failed", "error": repr(state.engine.error)},
                                 status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503,
                                 headers={"Retry-After": str(RETRY_AFTER_S)})
    return web.json_response({"status": "ok"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    fetch = getattr(state.engine, "metrics_snapshot", None)
    if fetch is not None:  # the engine runs in another process (bloomtrain.serve.remote)
        snapshot = await fetch()
        if snapshot is not None:
            state.metrics.absorb(snapshot)
    text = state.metrics.render()
    return web.Response(text=text, content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "owned_by": "bloomtrain",
        "max_model_len": state.engine.config.max_model_len}]})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        return error_response(503, "the server is shutting down",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    state.inflight += 1
    state.idle.clear()
    try:
        return await _complete(request, state)
    finally:
        state.inflight -= 1
        if state.inflight == 0:
            state.idle.set()


async def _complete(request: web.Request, state: ServerState) -> web.StreamResponse:
    engine = state.engine
    try:
        body = _parse_body(await request.read())
        params, stream, echo, include_usage = _sampling(body)
        prompts = _prompts(body, state.tokenizer, engine.config.max_queue)
        for ids, _ in prompts:
            engine.check_request(ids, params)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param)
    except RequestError as e:
        return error_response(400, str(e), "prompt")

    queue: asyncio.Queue = asyncio.Queue()
    choices = [_Choice(i, ids, text, echo, state.tokenizer, params.logprobs)
               for i, (ids, text) in enumerate(prompts)]
    seq_ids: dict[int, int] = {}
    open_ids: set[int] = set()
    try:
        for i, (ids, _) in enumerate(prompts):
            def sink(out, i=i):  # runs on the event loop (see _dispatch_to)
                queue.put_nowait((i, out))
            seq_ids[i] = engine.submit(ids, params, sink)
            open_ids.add(i)
    except QueueFull as e:
        for i in open_ids:
            engine.abort(seq_ids[i])
        return error_response(503, f"the server is overloaded: {e}; retry later",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
    except EngineClosed as e:
        for i in open_ids:
            engine.abort(seq_ids[i])
        return error_response(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
    except RequestError as e:  # checked above; kept for a request the engine still refuses
        for i in open_ids:
            engine.abort(seq_ids[i])
        return error_response(400, str(e), "prompt")

    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": state.model_name}
    try:
        if stream:
            return await _stream(request, head, choices, queue, open_ids, include_usage)
        while open_ids:
            i, out = await queue.get()
            choices[i].update(out)
            if out.finish_reason is not None:
                open_ids.discard(i)
        failed = [c for c in choices if c.finish_reason not in ("stop", "length")]
        if failed:
            c = failed[0]
            return error_response(500 if c.finish_reason == "error" else 503,
                                  f"generation ended early ({c.finish_reason})"
                                  + (f": {c.error}" if c.error else ""))
        return web.json_response({**head, "choices": [c.final() for c in choices],
                                  "usage": _usage(choices)})
    finally:
        # Whatever ended the handler (a finished response, a disconnect that cancelled it, a
        # failed write), sequences still running are dropped and their blocks freed.
        for i in open_ids:
            engine.abort(seq_ids[i])


def _usage(choices) -> dict:
    prompt = sum(len(c.prompt_ids) for c in choices)
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _stream(request, head, choices, queue, open_ids, include_usage):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    echoed = set()
    while open_ids:
        i, out = await queue.get()
        c = choices[i]
        piece = c.update(out)
        if c.echo and i not in echoed:  # the prompt opens the choice's first chunk
            echoed.add(i)
            piece["text"] = c.prompt_text + piece["text"]
        if out.finish_reason is not None:
            open_ids.discard(i)
            if out.finish_reason not in ("stop", "length"):
                await send({"error": {"message": f"generation ended early "
                                                 f"({out.finish_reason})"
                                                 + (f": {out.error}" if out.error else ""),
                                      "type": "server_error", "param": None, "code": 500}})
                continue
        if piece["text"] or piece["finish_reason"] or piece["logprobs"]:
            await send({**head, "choices": [piece]})
    if include_usage:
        await send({**head, "choices": [], "usage": _usage(choices)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


ENDPOINTS = {"/v1/completions", "/v1/models", "/health", "/metrics"}


def _run_sinks(pairs) -> None:
    for sink, out in pairs:
        sink(out)


async def _dispatch_to_loop(app: web.Application) -> None:
    """The engine's results of a step reach the handlers' queues on this event loop, in one
    thread-safe call per step."""
    loop = asyncio.get_running_loop()
    app[STATE].engine.dispatch = lambda pairs: loop.call_soon_threadsafe(_run_sinks, pairs)


def create_app(engine, tokenizer, metrics, model_name: str = "bloomtrain",
               max_body_bytes: int = 1 << 20) -> web.Application:
    app = web.Application(middlewares=[_errors_and_counts], client_max_size=max_body_bytes)
    app.on_startup.append(_dispatch_to_loop)
    app[STATE] = ServerState(engine, tokenizer, model_name, metrics, max_body_bytes)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


async def drain(app: web.Application, timeout: float) -> bool:
    """Refuse new completions (503) and wait up to `timeout` seconds for the ones in flight.
    Returns whether they all finished."""
    state = app[STATE]
    state.draining = True
    state.engine.stop_accepting()
    try:
        await asyncio.wait_for(state.idle.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


async def run_server(app: web.Application, host: str, port: int, drain_timeout: float,
                     log=print) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop listening, let the requests in flight
    finish (up to `drain_timeout` seconds; what is left is aborted), and return."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log(f"[serve] listening on http://{host}:{bound} (POST /v1/completions, GET /health, "
        f"GET /metrics)", flush=True)
    try:
        await stop.wait()
        state = app[STATE]
        state.draining = True  # a request that beats the listener's close gets 503
        log(f"[serve] draining {state.inflight} request(s) in flight (up to {drain_timeout:g} s)",
            flush=True)
        await site.stop()  # no new connections
        done = await drain(app, drain_timeout)
        if not done:
            log(f"[serve] drain timed out; aborting {state.inflight} request(s)", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
