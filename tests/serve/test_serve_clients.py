"""`bloomtrain serve` driven by the programs people point at an OpenAI-compatible server, against
a live server on loopback (the CLI in a subprocess): the official `openai` client, LangChain's
`langchain_openai.OpenAI` LLM, and lm-evaluation-harness's `local-completions` model, whose
loglikelihoods must equal the harness's own HF backend on the same model.

With an API key (`BLOOMTRAIN_API_KEY`, as `--api-key`) each client is set up as its users set
it up (openai and LangChain: api_key=; lm-eval: OPENAI_API_KEY) and works; without the key, or
with another, every one of them gets the 401 (raw HTTP shows its OpenAI-shaped body), while
/health and /metrics stay open.

These clients are in the `test` extra: in CI a missing one fails here (tests/conftest.py turns
pytest.importorskip's skip into a failure); elsewhere, say a GPU machine that has torch and
transformers but no clients (bench/gpu.sh's device tests), the module is skipped with the reason.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
LangChainOpenAI = pytest.importorskip("langchain_openai").OpenAI
Instance = pytest.importorskip("lm_eval.api.instance").Instance
HFLM = pytest.importorskip("lm_eval.models.huggingface").HFLM
LocalCompletionsAPI = pytest.importorskip("lm_eval.models.openai_completions").LocalCompletionsAPI

from tests.serving import CHAT_TEMPLATE, ServerProcess

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(base URL, the served model's directory): `bloomtrain serve` with a chat template file
    and a served model name, shared by the tests of this module."""
    _, path = model_dir
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    proc = ServerProcess(["--checkpoint", str(path), "--served-model-name", "tiny",
                          "--chat-template", str(template), "--max-model-len", "512",
                          "--kv-cache-tokens", "4096"])
    try:
        port = int(proc.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
        yield f"http://127.0.0.1:{port}", path
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_openai_completions(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == choice.text and len(pieces) > 1
    two = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2,
                                    temperature=0.9, seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text != two.choices[1].text
    lp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                   logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and len(top) >= 2  # greedy: the token is the top one
        assert value == max(top.values())
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)


def test_openai_chat_completions(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    rendered = ("<|system|>Be brief.</s><|user|>Say hello</s><|assistant|>")
    plain = client.completions.create(model="tiny", prompt=rendered, max_tokens=10,
                                      temperature=0)
    assert text == plain.choices[0].text  # the template's prompt, completed
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True,
                                                 logprobs=True, top_logprobs=1))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    tokens = [t.token for c in chunks if c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert "".join(tokens) == text
    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2,
                                         temperature=1.0, seed=3, frequency_penalty=0.5)
    assert len(two.choices) == 2


def test_langchain_openai_llm(server):
    """LangChain's OpenAI LLM sends its neutral sampling fields (frequency_penalty 0,
    presence_penalty 0, n 1, logit_bias {}, seed null, ...) with every request."""
    base, _ = server
    llm = LangChainOpenAI(base_url=f"{base}/v1", api_key="unused", model="tiny",
                          temperature=0, max_tokens=12, max_retries=0)
    text = llm.invoke(PROMPT)
    assert text and text == "".join(llm.stream(PROMPT))
    direct = openai.OpenAI(base_url=f"{base}/v1", api_key="unused").completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert text == direct.choices[0].text


def test_lm_eval_local_completions_equals_its_hf_backend(server, tokenizer):
    """lm-eval's `local-completions` model scores loglikelihoods through the server (it asks
    /tokenizer_info and /tokenize at start, then sends token-id prompts with echo, logprobs 1,
    max_tokens 1); the harness's own HF backend scores the same requests on the same model.
    1e-4: the server's batched fp32 forward against HF's, rounding only."""
    base, path = server
    requests = [("The quick brown", " fox jumps over"), ("Привет,", " мир!"),
                ("def f(x):", "\n    return x + 1"), ("数据并行", "、张量并行"),
                ("The quick brown", " dog"), ("Emoji", " 🎉 party")]
    instances = [Instance("loglikelihood", {}, args, i) for i, args in enumerate(requests)]
    api = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="tiny",
                              num_concurrent=1, max_retries=1, batch_size=4)
    assert api.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    served = api.loglikelihood(instances, disable_tqdm=True)
    hf = HFLM(pretrained=str(path), backend="causal", device="cpu", dtype="float32",
              batch_size=4)
    want = hf.loglikelihood(instances, disable_tqdm=True)
    got_ll = torch.tensor([ll for ll, _ in served])
    want_ll = torch.tensor([ll for ll, _ in want])
    assert torch.allclose(got_ll, want_ll, atol=1e-4), (got_ll, want_ll)
    assert [g for _, g in served] == [g for _, g in want]
    assert len({round(v, 3) for v in got_ll.tolist()}) == len(requests)  # real, varied scores
    assert json.dumps(served)  # plain floats and bools, as the harness writes them


def test_lm_eval_generate_until_equals_its_hf_backend(server):
    """lm-eval's generate_until through the server (token-id prompts, temperature 0, its stop
    sequences with the end-of-text string added, and a generation keyword it passes on as
    is: HF's repetition_penalty, which this tiny model needs to say more than one token
    again and again) continues as its HF backend does."""
    base, path = server
    kwargs = {"until": ["\n\n", "."], "max_gen_toks": 12, "do_sample": False,
              "repetition_penalty": 2.0}
    requests = [("The quick brown fox", kwargs), ("def f(x):", kwargs), ("Привет,", kwargs)]
    instances = [Instance("generate_until", {}, args, i) for i, args in enumerate(requests)]
    api = LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="tiny",
                              num_concurrent=1, max_retries=1, batch_size=1)
    served = api.generate_until(instances, disable_tqdm=True)
    hf = HFLM(pretrained=str(path), backend="causal", device="cpu", dtype="float32",
              batch_size=1)
    assert served == hf.generate_until(instances, disable_tqdm=True)
    assert all(len(set(text)) > 3 for text in served)  # varied text, not one token repeated


# ---- an API key ----------------------------------------------------------------------------------

KEY = "sk-bloomtrain-test-key"


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    """The base URL of `bloomtrain serve` given its key in BLOOMTRAIN_API_KEY."""
    _, path = model_dir
    saved = os.environ.get("BLOOMTRAIN_API_KEY")
    os.environ["BLOOMTRAIN_API_KEY"] = KEY  # the server process copies the environment
    try:
        proc = ServerProcess(["--checkpoint", str(path), "--served-model-name", "tiny",
                              "--max-model-len", "512", "--kv-cache-tokens", "4096"])
    finally:
        if saved is None:
            os.environ.pop("BLOOMTRAIN_API_KEY")
        else:
            os.environ["BLOOMTRAIN_API_KEY"] = saved
    try:
        port = int(proc.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def _http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, str]:
    """(status, headers, body text) of a GET, or of a POST of `body`, with `key` as Bearer."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_routes_ask_for_the_key_and_health_and_metrics_do_not(keyed_server):
    base = keyed_server
    routes = [("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}),
              ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]}),
              ("/v1/models", None), ("/tokenize", {"prompt": PROMPT}),
              ("/detokenize", {"tokens": [5, 6]}), ("/tokenizer_info", None)]
    for path, body in routes:
        status, headers, text = _http(base + path, body)
        assert status == 401, (path, status, text)
        assert headers.get("WWW-Authenticate") == "Bearer"
        assert json.loads(text) == {"error": {
            "message": "no API key: this server needs the header 'Authorization: Bearer KEY' "
                       "with the key it was started with (--api-key or BLOOMTRAIN_API_KEY)",
            "type": "invalid_request_error", "param": None, "code": None}}, path
        status, _, text = _http(base + path, body, key=KEY[:-1] + "x")  # same length, not it
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", path
        assert _http(base + path, body, key=KEY + "x")[0] == 401, path
        assert _http(base + path, body, key="")[0] == 401, path
    status, _, text = _http(base + "/tokenize", {"prompt": PROMPT}, key=KEY)
    assert status == 200 and json.loads(text)["tokens"], text
    status, _, text = _http(base + "/v1/models", key=KEY)
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    assert _http(base + "/health")[0] == 200
    status, _, text = _http(base + "/metrics")
    # Refused requests are counted like any other response.
    assert status == 200 and 'code="401"' in text, text[-2000:]


def test_openai_client_with_and_without_the_key(keyed_server):
    base = f"{keyed_server}/v1"
    good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    reply = good.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 6
    assert [m.id for m in good.models.list()] == ["tiny"]
    bad = openai.OpenAI(base_url=base, api_key="sk-not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])


def test_langchain_with_and_without_the_key(keyed_server, server):
    base = f"{keyed_server}/v1"
    llm = LangChainOpenAI(base_url=base, api_key=KEY, model="tiny", temperature=0,
                          max_tokens=12, max_retries=0)
    open_llm = LangChainOpenAI(base_url=f"{server[0]}/v1", api_key="unused", model="tiny",
                               temperature=0, max_tokens=12, max_retries=0)
    assert llm.invoke(PROMPT) == open_llm.invoke(PROMPT)  # the same model behind both
    wrong = LangChainOpenAI(base_url=base, api_key="sk-not-the-key", model="tiny",
                            max_tokens=12, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.invoke(PROMPT)


def _chain(error: BaseException) -> str:
    """An error and its causes, as text."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


def test_lm_eval_local_completions_with_and_without_the_key(keyed_server, server, monkeypatch):
    """lm-eval's local-completions sends OPENAI_API_KEY as the Bearer key of its completions
    and its `auth_token` model argument as the remote tokenizer's."""
    requests = [("The quick brown", " fox jumps over"), ("def f(x):", "\n    return x + 1")]
    instances = [Instance("loglikelihood", {}, args, i) for i, args in enumerate(requests)]

    def api(base, auth_token=None, backend="auto"):
        return LocalCompletionsAPI(base_url=f"{base}/v1/completions", model="tiny",
                                   num_concurrent=1, max_retries=1, batch_size=2,
                                   auth_token=auth_token, tokenizer_backend=backend)

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    keyed = api(keyed_server, auth_token=KEY)
    assert keyed.tokenizer_backend == "remote"  # /tokenizer_info and /tokenize answered
    scores = keyed.loglikelihood(instances, disable_tqdm=True)
    assert scores == api(server[0]).loglikelihood(instances, disable_tqdm=True)
    # Without the key the tokenizer routes refuse it...
    with pytest.raises(Exception) as e:
        api(keyed_server, backend="remote")
    assert "401" in _chain(e.value), _chain(e.value)
    # ...and so do the completions.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-the-key")
    with pytest.raises(Exception) as e:
        api(keyed_server, auth_token=KEY).loglikelihood(instances, disable_tqdm=True)
    assert "401" in _chain(e.value), _chain(e.value)
