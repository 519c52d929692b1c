"""The HTTP front of `bloomtrain serve`, on aiohttp: OpenAI's `POST /v1/completions` and
`POST /v1/chat/completions` (whole or as server-sent events), `GET /v1/models`, vLLM's
`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, `GET /health` and
`GET /metrics` (Prometheus text). What a request may hold and what a response looks like is
bloomtrain.serve.protocol's; this module runs the requests on the engine (any
bloomtrain.serve.interface.EngineClient) and shuts down in order. Every 4xx/5xx answer is JSON,
{"error": {"message", "type", "param", "code"}}, as OpenAI's. With an API key (vLLM's
--api-key), every /v1/ route and the tokenizer routes need `Authorization: Bearer KEY`; /health
and /metrics stay open, as vLLM's.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import signal
import time
import uuid
from dataclasses import replace

# aiohttp rather than FastAPI + uvicorn: one dependency gives the server, the test client and
# the load benchmark's HTTP client, on one event loop; the handler reads the raw body, so bad
# UTF-8, malformed JSON and bad fields get our own OpenAI-style 400s rather than a framework's
# validation errors; `handler_cancellation` cancels a handler whose client hangs up, even one
# not streaming, which frees its sequences' slots and KV blocks at once; and the listening
# socket, the in-flight count and shutdown are plain objects we drain in order on SIGTERM.
from aiohttp import web

from bloomtrain.serve import protocol as proto
from bloomtrain.serve.chat import ChatTemplate, TemplateError
from bloomtrain.serve.interface import EngineClosed, QueueFull, RequestError
from bloomtrain.serve.protocol import BadRequest

RETRY_AFTER_S = 1
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
             "/detokenize", "/tokenizer_info", "/health", "/metrics"}
IGNORED_HEADER = "X-Ignored-Fields"
_DRAINED = object()  # put in a request's queue when the drain timed out


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> web.Response:
    return web.json_response(proto.error_body(status, message, param, code), status=status,
                             headers=headers)


def _retry_later(message: str) -> web.Response:
    """A full queue, or a request that arrives while the server drains: the listener stays open
    during the drain, so probes and clients read this 503 rather than a refused connection."""
    return error_response(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


class ServerState:
    """What the handlers share: the engine, the tokenizer, the metrics, the served names, the
    chat template, and the drain state."""

    def __init__(self, engine, tokenizer, metrics, served: tuple[str, ...],
                 chat: ChatTemplate | None, strict_fields: bool, max_body_bytes: int, log):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.served, self.chat, self.strict = served, chat, strict_fields
        self.max_body_bytes, self.log = max_body_bytes, log
        self.created = int(time.time())
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.cancels: set = set()       # each running request's way to end it (drain timeout)
        self.logged_ignored: set = set()

    def ignored(self, path: str, fields: list[str]) -> dict:
        """The header naming the unknown fields a request held; logged once per set."""
        if not fields:
            return {}
        names = ", ".join(json.dumps(f, ensure_ascii=True)[1:-1] for f in fields)[:1000]
        key = (path, names)
        if key not in self.logged_ignored and len(self.logged_ignored) < 1000:
            self.logged_ignored.add(key)
            self.log(f"[serve] {path}: ignored unknown field(s) {names} (--strict-fields "
                     f"refuses them)", flush=True)
        return {IGNORED_HEADER: names}


STATE = web.AppKey("state", ServerState)


# ---- running a request's sequences ----------------------------------------------------------

class Generation:
    """The engine sequences of one request: `seqs` [(prompt ids, SamplingParams)] submitted
    together; their SeqOutputs arrive on `queue` as (k, out); whatever ends the handler, the
    ones still running are aborted (`close`)."""

    def __init__(self, state: ServerState, seqs: list[tuple[list[int], object]]):
        self.state, self.seqs = state, seqs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq_ids: dict[int, int] = {}
        self.open: set[int] = set()
        self.cancel = lambda: self.queue.put_nowait((None, _DRAINED))

    def submit(self) -> web.Response | None:
        """Submit every sequence; an error response when the engine refuses one."""
        engine = self.state.engine
        try:
            for k, (ids, params) in enumerate(self.seqs):
                def sink(out, k=k):  # runs on the event loop (see _dispatch_to_loop)
                    self.queue.put_nowait((k, out))
                self.seq_ids[k] = engine.submit(ids, params, sink)
                self.open.add(k)
        except QueueFull as e:
            self.close()
            return _retry_later(f"the server is overloaded: {e}; retry later")
        except EngineClosed as e:
            self.close()
            return _retry_later(str(e))
        except RequestError as e:  # checked before; kept for one the engine still refuses
            self.close()
            return error_response(400, str(e), e.param or "prompt", e.code)
        self.state.cancels.add(self.cancel)
        return None

    async def next(self):
        """(k, SeqOutput) of the next output; (None, _DRAINED) when the drain timed out."""
        k, out = await self.queue.get()
        if out is not _DRAINED and out.finish_reason is not None:
            self.open.discard(k)
        return k, out

    def close(self) -> None:
        self.state.cancels.discard(self.cancel)
        for k in self.open:
            self.state.engine.abort(self.seq_ids[k])
        self.open.clear()


def _ended_early(out) -> str:
    if out is _DRAINED:
        return "the server shut down before the completion ended (--drain-timeout)"
    return f"generation ended early ({out.finish_reason})" + (f": {out.error}"
                                                               if out.error else "")


async def _respond(request, gen: Generation, choices: list, head: dict, chunk_object: str,
                   prompt_lengths: list[int], sampling: proto.Sampling,
                   headers: dict) -> web.StreamResponse:
    """Run `gen` to its end and answer: as events (one per output of each choice) or, once
    every sequence ended, as one body with the best `n` of each prompt's samples."""
    if error := gen.submit():
        return error
    try:
        if sampling.stream:
            return await _stream(request, gen, choices, {**head, "object": chunk_object},
                                 prompt_lengths, sampling.include_usage, headers)
        while gen.open:
            k, out = await gen.next()
            if out is _DRAINED:
                return _retry_later(_ended_early(out))
            if out.finish_reason not in (None, "stop", "length"):
                # Ended early: an engine error is a 500; anything else (the engine's queue
                # was full, a drain) is a 503 to retry, with Retry-After as the front end's
                # own refusal has it. The request's other samples are dropped now (close),
                # not run to their end first.
                if out.finish_reason == "error":
                    return error_response(500, _ended_early(out))
                return _retry_later(_ended_early(out))
            choices[k].update(out)
        best = proto.best_samples(choices, sampling.n, sampling.best_of)
        return web.json_response({**head, "choices": [c.final(i) for i, c in enumerate(best)],
                                  "usage": proto.usage(prompt_lengths, best)}, headers=headers)
    finally:
        # Whatever ended the handler (a finished response, a disconnect that cancelled it, a
        # failed write, the drain), sequences still running are dropped and their blocks freed.
        gen.close()


def _failed_status(out) -> int:
    """An output that ends a sequence early: 500 for an engine error, else 503 (the engine
    turned it away, or the drain ended it): retry later."""
    return 500 if out is not _DRAINED and out.finish_reason == "error" else 503


async def _stream(request, gen: Generation, choices, head, prompt_lengths, include_usage,
                  headers):
    # The headers wait for the first output: an engine that turns the request away (its exact
    # --max-queue, past the front end's estimate) is then a 503 with Retry-After like the front
    # end's own refusal, not a 200 whose only event is an error.
    first = await gen.next()
    if first[1] is _DRAINED or first[1].finish_reason not in (None, "stop", "length"):
        if _failed_status(first[1]) == 503:
            return _retry_later(_ended_early(first[1]))
        return error_response(500, _ended_early(first[1]))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    while first is not None or gen.open:
        (k, out), first = first or await gen.next(), None
        if out is not _DRAINED:
            piece = choices[k].update(out)
        if out is _DRAINED or out.finish_reason not in (None, "stop", "length"):
            # OpenAI's clients raise on an event holding "error".
            await send(proto.error_body(_failed_status(out), _ended_early(out)))
            if out is _DRAINED:
                break
            continue
        if (piece.get("text") or piece.get("delta") or piece["finish_reason"]
                or (piece["logprobs"] and any(piece["logprobs"].values()))):
            await send({**head, "choices": [{"index": k, **piece}]})
    if include_usage:
        await send({**head, "choices": [], "usage": proto.usage(prompt_lengths, choices)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


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
    state.metrics.http_response(request.path if request.path in ENDPOINTS else "other",
                                resp.status)
    return resp


# The routes an API key guards besides /v1/*: the tokenizer's, which hand out the vocabulary.
TOKENIZER_ROUTES = {"/tokenize", "/detokenize", "/tokenizer_info"}


def _key_check(api_key: str):
    """The middleware that asks for `Authorization: Bearer KEY` on /v1/* and the tokenizer
    routes: a 401 in OpenAI's shape without it (code null, as OpenAI's) or with another key
    (code invalid_api_key)."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler):
        path = request.path
        if path.startswith("/v1/") or path in TOKENIZER_ROUTES:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            challenge = {"WWW-Authenticate": "Bearer"}
            if scheme.lower() != "bearer" or not given.strip():
                return error_response(401, "no API key: this server needs the header "
                                           "'Authorization: Bearer KEY' with the key it was "
                                           "started with (--api-key or BLOOMTRAIN_API_KEY)",
                                      headers=challenge)
            # hmac.compare_digest: the time taken does not depend on where the keys differ.
            if not hmac.compare_digest(given.strip().encode(), expected):
                return error_response(401, "incorrect API key provided", code="invalid_api_key",
                                      headers=challenge)
        return await handler(request)
    return check


def _guarded(handler):
    """A generating handler: 503 while draining, counted in flight otherwise."""
    async def run(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        if state.draining:
            return _retry_later("the server is shutting down")
        state.inflight += 1
        state.idle.clear()
        try:
            return await handler(request, state)
        finally:
            state.inflight -= 1
            if state.inflight == 0:
                state.idle.set()
    return run


async def _read(request, state: ServerState) -> dict:
    body = proto.parse_body(await request.read())
    proto.check_model(body, state.served)
    return body


async def completions(request: web.Request, state: ServerState) -> web.StreamResponse:
    engine = state.engine
    try:
        req = proto.parse_completion(await _read(request, state), state.tokenizer,
                                     engine.config.max_queue, state.strict)
        for ids, _ in req.prompts:
            engine.check_request(ids, req.sampling.params)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param, e.code)
    except RequestError as e:
        return error_response(400, str(e), e.param or "prompt", e.code)
    s = req.sampling
    seqs = [(ids, s.sample_params(j)) for ids, _ in req.prompts for j in range(s.best_of)]
    choices = [proto.CompletionChoice(ids, text, req.echo, state.tokenizer, s.want_logprobs)
               for ids, text in req.prompts for _ in range(s.best_of)]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": state.served[0]}
    return await _respond(request, Generation(state, seqs), choices, head, "text_completion",
                          [len(ids) for ids, _ in req.prompts], s,
                          state.ignored(request.path, req.ignored))


def _no_template() -> BadRequest:
    return BadRequest("this model has no chat template: its tokenizer_config.json has no "
                      "`chat_template`; start the server with --chat-template FILE (a Jinja "
                      "template, as HF tokenizers carry), or use /v1/completions", "messages")


def _chat_prompt(state: ServerState, messages, add_generation_prompt: bool) -> list[int]:
    if state.chat is None:
        raise _no_template()
    try:
        text = state.chat.render(messages, add_generation_prompt)
    except TemplateError as e:
        raise BadRequest(str(e), "messages") from None
    # A field the template writes besides the content (a role, a name) holding a lone
    # surrogate: a 400 naming the messages, not the tokenizer's error as a 500.
    proto.check_text(text, "the chat the template renders from `messages`", "messages")
    ids = state.tokenizer.encode_with_specials(text)
    if not ids:
        raise BadRequest("the chat template renders these messages as no tokens", "messages")
    return ids


async def chat_completions(request: web.Request, state: ServerState) -> web.StreamResponse:
    engine = state.engine
    try:
        req = proto.parse_chat(await _read(request, state), engine.config.max_queue,
                               state.strict)
        ids = _chat_prompt(state, req.messages, req.add_generation_prompt)
        s = req.sampling
        if s.params.max_tokens is None:  # the room the prompt leaves
            room = engine.config.max_model_len - len(ids)
            if room < 1:  # not an empty answer cut for "length"
                return error_response(
                    400, f"the conversation takes {len(ids)} tokens of the model's "
                         f"{engine.config.max_model_len} (--max-model-len): no room is left to "
                         f"answer; shorten the messages", "messages", "context_length_exceeded")
            s = replace(s, params=replace(s.params, max_tokens=room))
        engine.check_request(ids, s.params)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param, e.code)
    except RequestError as e:
        return error_response(400, str(e), e.param or "messages", e.code)
    seqs = [(ids, s.sample_params(j)) for j in range(s.best_of)]
    role = "assistant" if req.add_generation_prompt else req.messages[-1]["role"]
    choices = [proto.ChatChoice(state.tokenizer, req.top_logprobs, role)
               for _ in range(s.best_of)]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": state.served[0]}
    return await _respond(request, Generation(state, seqs), choices, head,
                          "chat.completion.chunk", [len(ids)], s,
                          state.ignored(request.path, req.ignored))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    state = request.app[STATE]
    try:
        body = await _read(request, state)
        ignored = proto.unknown_fields(body, proto.TOKENIZE_FIELDS, state.strict)
        proto.get_bool(body, "add_special_tokens", True)  # checked; BLOOM tokenizers add none
        if body.get("messages") is not None:
            ids = _chat_prompt(state, proto.parse_messages(body["messages"]),
                               proto.get_bool(body, "add_generation_prompt", True))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise BadRequest("give `prompt` (a string) or `messages`", "prompt")
            proto.check_text(prompt, "`prompt`")
            ids = state.tokenizer.encode(prompt)
        strs = ([state.tokenizer.id_to_token(t) for t in ids]
                if proto.get_bool(body, "return_token_strs") else None)
    except BadRequest as e:
        return error_response(e.status, e.message, e.param, e.code)
    return web.json_response({"count": len(ids), "max_model_len":
                              state.engine.config.max_model_len, "tokens": ids,
                              "token_strs": strs}, headers=state.ignored(request.path, ignored))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await _read(request, state)
        ignored = proto.unknown_fields(body, proto.DETOKENIZE_FIELDS, state.strict)
        tokens = body.get("tokens")
        limit = state.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(proto.is_int(t) for t in tokens):
            raise BadRequest("`tokens` must be a list of token ids", "tokens")
        bad = [t for t in tokens if not 0 <= t < limit]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {limit})",
                             "tokens")
    except BadRequest as e:
        return error_response(e.status, e.message, e.param, e.code)
    return web.json_response({"prompt": state.tokenizer.decode(tokens)},
                             headers=state.ignored(request.path, ignored))


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's plain
    values), its special tokens as strings, and the chat template the server uses."""
    state = request.app[STATE]
    tok = state.tokenizer
    info = {k: v for k, v in tok.config.items()
            if isinstance(v, (str, int, float, bool)) or v is None}
    specials = tok.special_tokens()
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        info[name] = specials.get(name)
    if info["eos_token"] is None:
        try:
            info["eos_token"] = tok.id_to_token(tok.eod_id)
        except Exception:  # a tokenizer without an end-of-text token
            pass
    info.update(tokenizer_class=info.get("tokenizer_class") or "PreTrainedTokenizerFast",
                chat_template=state.chat.source if state.chat is not None else None,
                model_max_length=state.engine.config.max_model_len,
                vocab_size=tok.vocab_size)
    return web.json_response(info)


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
    snapshot = await state.engine.metrics_snapshot()
    if snapshot is not None:  # the engine runs in another process (bloomtrain.serve.remote)
        state.metrics.absorb(snapshot)
    return web.Response(text=state.metrics.render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")


def _model_entry(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "bloomtrain",
            "root": state.served[0], "parent": None,
            "max_model_len": state.engine.config.max_model_len}


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list",
                              "data": [_model_entry(state, name) for name in state.served]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}, which the openai client's models.retrieve() calls."""
    state, name = request.app[STATE], request.match_info["name"]
    if name not in state.served:
        return error_response(404, f"The model `{name}` does not exist.", "model",
                              "model_not_found")
    return web.json_response(_model_entry(state, name))


# ---- the app and its shutdown ---------------------------------------------------------------

def _run_sinks(pairs) -> None:
    for sink, out in pairs:
        sink(out)


async def _dispatch_to_loop(app: web.Application) -> None:
    """The engine's results of a step reach the handlers' queues on this event loop, in one
    thread-safe call per step."""
    loop = asyncio.get_running_loop()
    app[STATE].engine.dispatch = lambda pairs: loop.call_soon_threadsafe(_run_sinks, pairs)


def create_app(engine, tokenizer, metrics, served_names: tuple[str, ...] = ("bloomtrain",),
               chat_template: str | None = None, strict_fields: bool = False,
               max_body_bytes: int = 1 << 20, log=print,
               api_key: str | None = None) -> web.Application:
    """The app over `engine` (an EngineClient). `served_names`: the `model` names requests
    may give, the first one reported; `chat_template`: the Jinja source for chat (None: chat
    requests get 400); `strict_fields`: unknown fields are 400s instead of ignored; `api_key`:
    the Bearer key /v1/* and the tokenizer routes need (None: open)."""
    chat = ChatTemplate(chat_template, tokenizer) if chat_template is not None else None
    middlewares = [_errors_and_counts] + ([_key_check(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app.on_startup.append(_dispatch_to_loop)
    app[STATE] = ServerState(engine, tokenizer, metrics, tuple(served_names), chat,
                             strict_fields, max_body_bytes, log)
    app.router.add_post("/v1/completions", _guarded(completions))
    app.router.add_post("/v1/chat/completions", _guarded(chat_completions))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


async def drain(app: web.Application, timeout: float) -> bool:
    """Refuse new completions (503, still listening) and wait up to `timeout` seconds for the
    ones in flight; then end those left (a stream gets an error event and [DONE], a whole
    response a 503) and wait for their handlers to answer. Returns whether all finished."""
    state = app[STATE]
    state.draining = True
    state.engine.stop_accepting()
    try:
        await asyncio.wait_for(state.idle.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        for cancel in list(state.cancels):
            cancel()
        try:
            await asyncio.wait_for(state.idle.wait(), 5.0)
        except asyncio.TimeoutError:
            pass  # a client that reads nothing: runner.cleanup closes its connection
        return False


def base_url(host: str, port: int) -> str:
    """The URL clients use: an IPv6 address in brackets (http://::1:8000 is no URL to curl)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def run_server(app: web.Application, host: str, port: int, drain_timeout: float,
                     log=print) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see `drain`; the listener stays open, so a
    request meanwhile gets 503), stop listening, and return."""
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
    log(f"[serve] listening on {base_url(host, bound)} (POST /v1/completions, "
        f"/v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /tokenizer_info, "
        f"/health, /metrics)", flush=True)
    try:
        await stop.wait()
        state = app[STATE]
        state.draining = True
        log(f"[serve] draining {state.inflight} request(s) in flight (up to {drain_timeout:g} s)",
            flush=True)
        if not await drain(app, drain_timeout):
            log("[serve] drain timed out; the requests left were ended with an error",
                flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
