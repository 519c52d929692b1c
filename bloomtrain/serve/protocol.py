"""The request and response protocol of `bloomtrain serve`: OpenAI's completions and chat
completions APIs with vLLM's extra sampling parameters, and vLLM's tokenizer endpoints. Parsing
and validation (every bad value a 400 that names the field and says what it takes), and the
shapes of the responses. No aiohttp here: the handlers (bloomtrain.serve.server) feed bodies in
and send what comes out.

Fields. A field sent with its neutral value is accepted everywhere (`n: 1`, `best_of: 1`,
penalties 0, `repetition_penalty: 1`, `logit_bias: {}`, `suffix: null`, `seed: null`, `user`),
as are OpenAI's sampling fields and vLLM's extras. A field this server does not know is ignored
and named (in the `X-Ignored-Fields` header and the log), as vLLM does; with `--strict-fields`
it is a 400. A known field asking for what the server cannot do (a `suffix`, `tools`, a JSON
`response_format`) is a 400 that says so.
"""
from __future__ import annotations

import codecs
import json
import math
import re
from dataclasses import dataclass, replace

from bloomtrain.serve.sampling import MAX_CHAT_LOGPROBS, MAX_LOGPROBS, SamplingParams

MAX_STOP = 16            # stop strings per request (OpenAI allows 4; harness tasks send more)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGIT_BIAS = 300     # entries, as OpenAI's


class BadRequest(Exception):
    """A request the server refuses: `status` (400 unless said), OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: `code` is a string or null, as OpenAI's."""
    kind = ("invalid_request_error" if status < 500 else
            "overloaded_error" if status == 503 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- bodies and fields ----------------------------------------------------------------------

def parse_body(raw: bytes) -> dict:
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


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body, key, default, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise BadRequest(f"`{key}` must be an integer, got {json.dumps(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"`{key}` must be {bounds}, got {v}", key)
    return v


def get_number(body, key, default, lo, hi, lo_open=False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise BadRequest(f"`{key}` must be a number, got {json.dumps(v)}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise BadRequest(f"`{key}` must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
                         key)
    return float(v)


def get_bool(body, key, default=False):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"`{key}` must be true or false, got {json.dumps(v)}", key)
    return v


def check_text(s: str, what: str, param: str = "prompt") -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} holds a lone surrogate (\\u{ord(s[e.start]):04x}) at "
                         f"character {e.start}, which is not valid Unicode", param) from None


def unknown_fields(body: dict, known: frozenset[str], strict: bool) -> list[str]:
    """The fields of `body` this server does not know, sorted; with `strict` the first is a
    400."""
    unknown = sorted(set(body) - known)
    if unknown and strict:
        raise BadRequest(f"unknown field `{unknown[0]}` (--strict-fields); the fields are "
                         f"{', '.join(sorted(known))}", unknown[0])
    return unknown


def check_model(body: dict, served: tuple[str, ...]) -> None:
    """A `model` other than a served name is a 404 (OpenAI's model_not_found); no `model` is
    the first served name, as vLLM takes it."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise BadRequest("`model` must be a string", "model")
    if model not in served:
        raise BadRequest(f"The model `{model}` does not exist; this server serves "
                         f"{', '.join(f'`{s}`' for s in served)} (GET /v1/models)", "model",
                         status=404, code="model_not_found")


# ---- sampling -------------------------------------------------------------------------------

SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "seed",
    # vLLM's extra sampling parameters
    "top_k", "min_tokens", "repetition_penalty", "ignore_eos"})


def _stop(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("`stop` must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise BadRequest(f"`stop` takes at most {MAX_STOP} non-empty strings", "stop")
    for s in stop:
        check_text(s, "`stop`", "stop")
    return tuple(stop)


def _logit_bias(body) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest("`logit_bias` must be an object of token id -> bias", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"`logit_bias` takes at most {MAX_LOGIT_BIAS} entries",
                         "logit_bias")
    out = []
    for key, value in bias.items():
        if not re.fullmatch(r"-?[0-9]+", key):  # str.isdigit takes "²" and "٣"
            raise BadRequest(f"`logit_bias` keys must be token ids, got {key!r}", "logit_bias")
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or not -100 <= value <= 100):
            raise BadRequest(f"`logit_bias` values must be numbers in [-100, 100], got "
                             f"{json.dumps(value)} for token {key}", "logit_bias")
        if value:
            out.append((int(key), float(value)))
    return tuple(sorted(out))


def _stream_options(body, stream: bool) -> bool:
    """include_usage of `stream_options` (vLLM's continuous_usage_stats is not offered)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("`stream_options` needs `stream: true`", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("`stream_options` must be {\"include_usage\": true|false}",
                         "stream_options")
    return get_bool(options, "include_usage")


def sampling_params(body, max_tokens_key: str = "max_tokens",
                    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                    logprobs: int | None = None, prompt_logprobs: bool = False
                    ) -> SamplingParams:
    """The SamplingParams of a completions or chat request (`max_tokens_key`: the field that
    holds the limit, None when absent and `default_max_tokens` is None: the handler fills in
    the room the prompt leaves; `logprobs`: the top alternatives asked for, as each API spells
    it)."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("`user` must be a string", "user")
    top_k = get_int(body, "top_k", 0, -1)
    max_tokens = get_int(body, max_tokens_key, default_max_tokens, 0)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=get_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        seed=get_int(body, "seed", None, -(2 ** 63), 2 ** 64 - 1),
        stop=_stop(body), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=get_number(body, "repetition_penalty", 1.0, 0.0, math.inf,
                                      lo_open=True),
        logit_bias=_logit_bias(body),
        min_tokens=get_int(body, "min_tokens", 0, 0, max_tokens),
        ignore_eos=get_bool(body, "ignore_eos"))


@dataclass(frozen=True)
class Sampling:
    """What a request asks to be generated for each prompt, as the engine's sequences. Each
    prompt is sampled `best_of` times (default `n`); sample j of a request with `seed` s draws
    from a generator seeded s + j (vLLM's child requests), so `n: 4, seed: s` gives the samples
    of four requests with seeds s..s+3. With `best_of` > `n` the `n` samples of highest
    cumulative log-probability (the model's own: bloomtrain.serve.sampler)
    are returned, best first; choice i*n + j is prompt i's j-th."""

    params: SamplingParams
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    want_logprobs: bool      # the client asked for logprobs (best_of > n needs them anyway)

    def sample_params(self, j: int) -> SamplingParams:
        """Sample j's parameters: seed + j (module doc), and the chosen tokens' logprobs
        when best_of has to rank by them."""
        p = self.params
        if p.seed is not None:
            p = replace(p, seed=(p.seed + j) % 2 ** 64)
        if self.best_of > self.n and p.logprobs is None:
            p = replace(p, logprobs=0)
        return p


def parse_sampling(body, params: SamplingParams, max_sequences: int,
                   has_best_of: bool = True) -> Sampling:
    """`n`, `best_of` (the completions API's only: `has_best_of`), `stream` and
    `stream_options` around `params`."""
    stream = get_bool(body, "stream")
    include_usage = _stream_options(body, stream)
    n = get_int(body, "n", 1, 1)
    best_of = get_int(body, "best_of", n, 1) if has_best_of else n
    if best_of < n:
        raise BadRequest(f"`best_of` ({best_of}) must be at least `n` ({n})", "best_of")
    if stream and best_of > n:
        raise BadRequest("`best_of` greater than `n` cannot stream (the best are known only "
                         "at the end); drop `stream` or `best_of`", "best_of")
    if best_of > max_sequences:
        raise BadRequest(f"`n` and `best_of` ask for {best_of} sequences per prompt; this "
                         f"server queues at most {max_sequences} (--max-queue)", "best_of")
    return Sampling(params, n, best_of, stream, include_usage, params.logprobs is not None)


# ---- completions ----------------------------------------------------------------------------

COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "suffix", "echo", "logprobs", "best_of"}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[tuple[list[int], str | None]]   # (token ids, text or None) per prompt
    sampling: Sampling
    echo: bool
    ignored: list[str]


def _prompts(body, tokenizer, max_prompts: int) -> list[tuple[list[int], str | None]]:
    """[(token ids, text or None)] of `prompt`: a string, a list of strings, a list of token
    ids, or a list of such lists."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("`prompt` is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(is_int(t) for t in p):
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
            check_text(item, where)
            ids = tokenizer.encode(item)
            if not ids:
                raise BadRequest(f"{where} encodes to no tokens", "prompt")
            out.append((ids, item))
        else:
            if not item or not all(is_int(t) for t in item):
                raise BadRequest(f"{where} must be a non-empty list of token ids", "prompt")
            out.append((list(item), None))
    return out


def parse_completion(body: dict, tokenizer, max_queue: int, strict: bool) -> CompletionRequest:
    ignored = unknown_fields(body, COMPLETION_FIELDS, strict)
    if body.get("suffix") not in (None, ""):
        raise BadRequest("`suffix` is not supported (a BLOOM model has no fill-in-the-middle "
                         "training); drop it or send null", "suffix")
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo")
    params = sampling_params(body, logprobs=logprobs,
                             prompt_logprobs=echo and logprobs is not None)
    s = parse_sampling(body, params, max_queue)
    prompts = _prompts(body, tokenizer, max_queue)
    if len(prompts) * s.best_of > max_queue:
        raise BadRequest(f"{len(prompts)} prompts x {s.best_of} samples is more sequences "
                         f"than this server queues ({max_queue}, --max-queue)", "prompt")
    return CompletionRequest(prompts, s, echo, ignored)


def token_name(tokenizer, token_id: int) -> str:
    """A token as the completions API's logprobs name it, a string of its own (the keys of
    `top_logprobs`): its text; or, for a byte-level token holding part of a character, whose
    text alone is U+FFFD like every other such token's (one key for several alternatives, the
    last one's logprob under it), OpenAI's `bytes:\\xNN` spelling of its bytes; a special
    token that decodes to nothing, its name."""
    raw = tokenizer.token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text or tokenizer.id_to_token(token_id) or ""


class CompletionChoice:
    """One sample of one prompt as it accumulates, in the completions API's shape."""

    def __init__(self, prompt_ids: list[int], prompt_text: str | None, echo: bool, tokenizer,
                 want_logprobs: bool):
        self.echo, self.tokenizer = echo, tokenizer
        self.prompt_ids = prompt_ids
        self.prompt_text = (prompt_text if prompt_text is not None
                            else tokenizer.decode(prompt_ids)) if echo else ""
        self.want_logprobs = want_logprobs
        self.text = ""
        self.num_tokens = 0
        self.cumulative_logprob = 0.0
        self.finish_reason = None
        self.error = None
        # Characters of the text (echoed prompt included) the logprobs cover, counted from
        # the tokens' bytes as the text is decoded: a token ending inside a character adds
        # none, and the next one's offset is that character's (decoding each token alone gave
        # such a token a U+FFFD of its own, and every later offset drifted by one).
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._no_text = tokenizer.special_ids() if want_logprobs else frozenset()
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.echoed = False

    def _token_str(self, token_id: int) -> str:
        return token_name(self.tokenizer, token_id)

    def _add_logprobs(self, lp: dict, entries, token_ids) -> None:
        for entry, tid in zip(entries, token_ids):
            lp["tokens"].append(self._token_str(tid))
            lp["text_offset"].append(self.offset)
            if tid not in self._no_text:  # special tokens are left out of the text
                self.offset += len(self._utf8.decode(self.tokenizer.token_bytes(tid)))
            if entry is None:  # the first prompt token has nothing to be predicted from
                lp["token_logprobs"].append(None)
                lp["top_logprobs"].append(None)
            else:
                lp["token_logprobs"].append(entry.logprob)
                lp["top_logprobs"].append({self._token_str(t): v for t, v in entry.top})

    def update(self, out) -> dict:
        """Fold a SeqOutput in; returns its stream chunk's choice (without the index)."""
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if out.prompt_logprobs is not None and self.echo:
            self._add_logprobs(lp, out.prompt_logprobs, self.prompt_ids)
        self._add_logprobs(lp, out.logprobs, [e.token_id for e in out.logprobs])
        self.cumulative_logprob += sum(e.logprob for e in out.logprobs)
        for k in lp:
            self.lp[k] += lp[k]
        text = out.text
        if self.echo and not self.echoed:  # the prompt opens the choice's first chunk
            self.echoed = True
            text = self.prompt_text + text
        self.text += out.text
        self.num_tokens += len(out.token_ids) + out.eos
        self.finish_reason, self.error = out.finish_reason, out.error
        return {"text": text, "logprobs": lp if self.want_logprobs else None,
                "finish_reason": public_reason(out.finish_reason)}

    def final(self, index: int) -> dict:
        return {"index": index, "text": self.prompt_text + self.text,
                "logprobs": self.lp if self.want_logprobs else None,
                "finish_reason": public_reason(self.finish_reason)}


def public_reason(reason):
    return reason if reason in (None, "stop", "length") else None


def best_samples(choices: list, n: int, best_of: int) -> list:
    """Per prompt, the `n` of its `best_of` samples (consecutive in `choices`) to return: all
    of them in sample order when best_of == n, else the highest cumulative logprob first."""
    out = []
    for i in range(0, len(choices), best_of):
        group = choices[i:i + best_of]
        if best_of > n:
            group = sorted(group, key=lambda c: -c.cumulative_logprob)[:n]
        out += group
    return out


def usage(prompt_lengths: list[int], choices) -> dict:
    prompt = sum(prompt_lengths)
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ---- chat completions -----------------------------------------------------------------------

CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "functions", "function_call", "parallel_tool_calls", "response_format",
    # vLLM's extras for chat
    "add_generation_prompt"}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    sampling: Sampling
    top_logprobs: int | None       # None: no logprobs
    add_generation_prompt: bool
    ignored: list[str]


def parse_messages(messages) -> list[dict]:
    """OpenAI's messages as the chat template takes them: role and text content (a list of
    text parts is joined; other parts are refused)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"`messages[{i}]`"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"{where} must be an object with a string `role`", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"{where}.content: only text parts ({{\"type\": \"text\", "
                                 f"\"text\": ...}}) are supported", "messages")
            content = "\n".join(p["text"] for p in content)  # vLLM's join of text parts
        if content is not None and not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string, a list of text parts or "
                             f"null", "messages")
        check_text(content or "", f"{where}.content", "messages")
        out.append({**{k: v for k, v in m.items() if k != "content"}, "content": content or ""})
    return out


def _refuse_tools(body) -> None:
    for key in ("tools", "functions"):
        if body.get(key):
            raise BadRequest(f"`{key}` is not supported by this server (no tool calling)", key)
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise BadRequest("`tool_choice` is not supported by this server (no tool calling)",
                         "tool_choice")
    if body.get("function_call") not in (None, "none", "auto"):
        raise BadRequest("`function_call` is not supported by this server", "function_call")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("`response_format` other than {\"type\": \"text\"} is not supported "
                         "(no constrained decoding)", "response_format")


def parse_chat(body: dict, max_queue: int, strict: bool) -> ChatRequest:
    ignored = unknown_fields(body, CHAT_FIELDS, strict)
    _refuse_tools(body)
    messages = parse_messages(body.get("messages"))
    want = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, 0, MAX_CHAT_LOGPROBS)
    if top is not None and not want:
        raise BadRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    get_int(body, "max_tokens", None, 0)  # checked even where the other one wins
    # No limit given: the room the prompt leaves, as vLLM's chat API.
    params = sampling_params(body, key, None, logprobs=(top or 0) if want else None)
    s = parse_sampling(body, params, max_queue, has_best_of=False)
    return ChatRequest(messages, s, (top or 0) if want else None,
                       get_bool(body, "add_generation_prompt", True), ignored)


class ChatChoice:
    """One sample of a chat completion as it accumulates, in the chat API's shape."""

    def __init__(self, tokenizer, top_logprobs: int | None, role: str = "assistant"):
        """`role`: the answer's; without a generation prompt the last message's (vLLM's
        rule: the model continues that message)."""
        self.tokenizer, self.top_logprobs, self.role = tokenizer, top_logprobs, role
        self.text = ""
        self.num_tokens = 0
        self.cumulative_logprob = 0.0
        self.finish_reason = self.error = None
        self.content: list[dict] = []
        self.started = False

    def _entry(self, token_id: int, logprob: float) -> dict:
        s = self.tokenizer.decode([token_id])
        return {"token": s, "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprobs(self, entries) -> list[dict]:
        out = []
        for e in entries:
            item = self._entry(e.token_id, e.logprob)
            item["top_logprobs"] = [self._entry(t, v) for t, v in e.top[:self.top_logprobs]]
            out.append(item)
        return out

    def update(self, out) -> dict:
        """Fold a SeqOutput in; returns its stream chunk's choice (without the index)."""
        content = self._logprobs(out.logprobs) if self.top_logprobs is not None else []
        self.content += content
        self.cumulative_logprob += sum(e.logprob for e in out.logprobs)
        self.text += out.text
        self.num_tokens += len(out.token_ids) + out.eos
        self.finish_reason, self.error = out.finish_reason, out.error
        delta = {"content": out.text} if out.text else {}
        if not self.started:  # the first chunk names the role, as OpenAI's
            self.started = True
            delta = {"role": self.role, "content": out.text}
        return {"delta": delta,
                "logprobs": {"content": content} if self.top_logprobs is not None else None,
                "finish_reason": public_reason(out.finish_reason)}

    def final(self, index: int) -> dict:
        return {"index": index, "message": {"role": self.role, "content": self.text},
                "logprobs": ({"content": self.content} if self.top_logprobs is not None
                             else None),
                "finish_reason": public_reason(self.finish_reason)}


# ---- tokenizer endpoints (vLLM's) -----------------------------------------------------------

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "return_token_strs", "add_generation_prompt"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
