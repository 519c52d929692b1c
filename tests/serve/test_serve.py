"""`bloomtrain serve`: continuous batching that never changes a request's tokens (against the
request served alone and against HF `generate`), scheduling (join, leave, chunked prefill beside
decodes, preemption), the HTTP API (bad requests, streaming, disconnects, overload, /metrics),
the OpenAI/vLLM request surface (neutral and unknown fields, model names, n and best_of against
separately seeded requests, chat completions, the tokenizer endpoints, the drain timeout), the
structure (one model code path, no training imports, the EngineClient protocol), and the CLI
end to end: tensor parallelism (tp=2 equals tp=1) and the drain on SIGTERM. Real clients:
tests/serve/test_serve_clients.py; the sampling edits against references: tests/serve/test_sampling.py.

Models: an HF BloomForCausalLM (hidden 64, 4 heads, 2 layers, vocab 512) with weights widened
as in tests/test_generate.py, so that greedy paths are not decided by 1e-6 differences between
near-equal logits; the session's tiny BPE tokenizer sits in the same directory.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.detokenize import TextStream
from bloomtrain.serve.sampling import SamplingParams
from bloomtrain.serve.metrics import ServeMetrics
from bloomtrain.serve import runner as runner_module
from bloomtrain.serve.runner import (DECODE_BUCKET, DECODE_GROUP_COST, DECODE_GROUPS,
                                     decode_groups)
from bloomtrain.serve.tp import build_runner
from tests.serving import CFG, CHAT_TEMPLATE, VOCAB, ServerProcess, make_engine, random_prompts

transformers = pytest.importorskip("transformers")
aiohttp = pytest.importorskip("aiohttp")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]


def hf_greedy(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           do_sample=False)
    return out[0, len(prompt):].tolist()


def lp_values(result):
    return [(e.token_id, e.logprob, e.top) for e in result["logprobs"]]


# ---- the engine: batch invariance, HF parity, scheduling -----------------------------------

def test_a_vanishing_temperature_is_greedy(model_dir):
    """Scores over a temperature of 1e-38 overflow fp32 to inf, then NaN probabilities, and
    the draw took token 0 at every step (an empty text, "length"): below vLLM's 1e-5 a request
    is greedy."""
    _, path = model_dir
    prompts = random_prompts([5, 9])
    engine = make_engine(path)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for t in (1e-38, 1e-300, 1e-6):
        assert not SamplingParams(temperature=t).do_sample
        tiny = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=t, seed=3))
        assert [r["token_ids"] for r in tiny] == [r["token_ids"] for r in greedy]
    assert SamplingParams(temperature=1e-5).do_sample


def test_batched_equals_alone_and_hf(model_dir, monkeypatch):
    """8 prompts of different lengths (1 to 70 tokens: one to five chunks) arriving at
    different steps, greedy and seeded sampling mixed: every request gets exactly the tokens,
    and bitwise the logprobs, it gets alone; the greedy ones equal HF generate. Decodes are
    cut into length groups wherever that saves a padded key (at these short contexts the
    default cost would keep them together), so a sequence moves between groups as the
    others come and go."""
    monkeypatch.setattr(runner_module, "DECODE_GROUP_COST", 0)
    ref, path = model_dir
    lengths = [1, 5, 16, 17, 33, 40, 64, 70]
    prompts = random_prompts(lengths)
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    params = [greedy if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=i,
                             logprobs=2) for i in range(len(prompts))]
    batches = []
    engine = make_engine(path, wrap=lambda f: lambda b, s: (batches.append(b), f(b, s))[1])
    batched = engine.generate(prompts, params, arrival_steps=[0, 0, 1, 2, 4, 7, 9, 12])
    # The batch really mixed prefill chunks and decodes of several sequences, and decodes of
    # very different lengths were attended in separate groups (runner.decode_groups).
    assert max(len(b.seqs) for b in batches) >= 6
    bucket = math.lcm(DECODE_BUCKET, CFG.block_size)
    assert any(len(decode_groups([s for s in b.seqs if s.q_len == 1], bucket)) > 1
               for b in batches if sum(s.q_len == 1 for s in b.seqs) > 1)
    assert any(any(s.q_len > 1 for s in b.seqs) and any(s.q_len == 1 for s in b.seqs)
               for b in batches)
    assert engine.pool.num_used == 0
    for prompt, p, got in zip(prompts, params, batched):
        alone = make_engine(path).generate([prompt], p)[0]
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == 24
        assert got["token_ids"] == alone["token_ids"]
        assert lp_values(got) == lp_values(alone)  # bitwise: the batch changed no number
        if not p.do_sample:
            assert got["token_ids"] == hf_greedy(ref, prompt, 24)


def test_decode_groups_cut_only_where_padding_is_saved():
    """decode_groups against the one padded group it replaces, on random steps: every sequence
    in exactly one group, each group padded by whole buckets to its own longest, at most
    DECODE_GROUPS groups, and each extra group saving more than DECODE_GROUP_COST padded keys
    (so never more keys than one group)."""
    import random

    from bloomtrain.serve.batch import SeqStep
    rng, bucket = random.Random(0), 32
    cut = 0
    for _ in range(300):
        seqs = [SeqStep(row=i, q_len=1, ctx_len=rng.randint(1, rng.choice([40, 300, 2000])),
                        blocks=[]) for i in range(rng.randint(1, 24))]
        groups = decode_groups(seqs, bucket)
        assert sorted(s.row for g, _ in groups for s in g) == list(range(len(seqs)))
        assert 1 <= len(groups) <= DECODE_GROUPS
        for g, padded in groups:
            assert padded % bucket == 0 and padded - bucket < max(s.ctx_len for s in g) <= padded
        one = len(seqs) * -(-max(s.ctx_len for s in seqs) // bucket) * bucket
        keys = sum(len(g) * padded for g, padded in groups)
        assert keys <= one - (len(groups) - 1) * DECODE_GROUP_COST - (len(groups) > 1)
        cut += len(groups) > 1
    assert cut > 50  # the random steps did get cut


def test_preemption_recomputes_the_same_tokens(model_dir):
    """A pool too small for all sequences at once: the youngest are preempted (blocks freed)
    and recomputed later, with the same tokens and logprobs as alone."""
    ref, path = model_dir
    cfg = EngineConfig(max_model_len=64, block_size=8, kv_cache_tokens=96, max_num_seqs=4,
                       max_batched_tokens=40, prefill_chunk=16, max_queue=8)
    prompts = random_prompts([20, 11, 25, 14], seed=2)
    params = SamplingParams(max_tokens=30, temperature=0, logprobs=0)
    metrics = ServeMetrics()
    engine = make_engine(path, cfg, metrics=metrics)
    batched = engine.generate(prompts, params)
    assert metrics.preemptions.values[()] > 0
    assert engine.pool.num_used == 0
    for prompt, got in zip(prompts, batched):
        alone = make_engine(path, cfg).generate([prompt], params)[0]
        assert lp_values(got) == lp_values(alone)
        assert got["token_ids"] == hf_greedy(ref, prompt, 30)


def test_the_queue_gauge_counts_preempted_sequences_waiting_again(model_dir):
    """bloomtrain_queue_depth ("sequences waiting to be admitted") counted only sequences never
    admitted: under cache pressure it read 0 while three of four live sequences waited to run
    again (vLLM's num_requests_waiting counts preempted requests, which go back on its waiting
    queue). --max-queue still counts new requests only."""
    _, path = model_dir
    cfg = EngineConfig(max_model_len=64, block_size=8, kv_cache_tokens=64, max_num_seqs=8,
                       max_batched_tokens=40, prefill_chunk=16, max_queue=4)
    metrics = ServeMetrics()
    engine = make_engine(path, cfg, metrics=metrics)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.submit([i + 1] * 8, params, lambda out: None)
    seen = []
    while engine.num_live:
        engine.step()
        waiting = len(engine.scheduler.waiting)
        assert engine.num_waiting == waiting  # the inbox is empty between steps
        seen.append(waiting)
    assert metrics.preemptions.values[()] > 0 and max(seen) >= 2
    assert engine.num_waiting == 0
    # An abort of a preempted sequence while it waits leaves the count right.
    for i in range(4):
        engine.submit([i + 1] * 8, params, lambda out: None)
    while not any(s.requeued for s in engine.scheduler.waiting):
        engine.step()
    victim = next(s for s in engine.scheduler.waiting if s.requeued)
    engine.abort(victim.id)
    while engine.num_live:
        engine.step()
        assert engine.num_waiting == len(engine.scheduler.waiting)
    assert engine.num_waiting == 0 and engine.pool.num_used == 0


def test_scheduler_joins_leaves_and_chunks_beside_decodes(model_dir):
    """A request joins the batch at the step after it arrives; a long prompt is prefilled in
    chunks at fixed positions while the running sequence decodes every step; a finished
    sequence leaves, blocks returned, in the step it finishes."""
    _, path = model_dir
    log, pool = [], []
    engine = None

    def record(forward):
        def execute(batch, sampling):
            by_block = {s.blocks[0]: s.id for s in engine.running if s.blocks}
            log.append([(by_block[s.blocks[0]], s.q_len, s.ctx_len) for s in batch.seqs])
            pool.append((engine.pool.num_used, {s.id: len(s.blocks) for s in engine.running}))
            return forward(batch, sampling)
        return execute

    engine = make_engine(path, wrap=record)
    short, long_ = random_prompts([4, 100], seed=3)
    out = engine.generate([short, long_], [SamplingParams(max_tokens=12, temperature=0),
                                           SamplingParams(max_tokens=10, temperature=0)],
                          arrival_steps=[0, 3])
    assert [len(r["token_ids"]) for r in out] == [12, 10]
    a, b = 0, 1  # sequence ids, in submission order
    a_steps = [i for i, step in enumerate(log) if any(s == a for s, _, _ in step)]
    b_steps = [i for i, step in enumerate(log) if any(s == b for s, _, _ in step)]
    # A decodes in every step until its 12th token, B's prefill chunks beside it.
    assert a_steps == list(range(12))
    # B joined at the step after its arrival, and its 100-token prompt went in chunks cut at
    # multiples of 16, one per step.
    assert b_steps[:7] == list(range(3, 10))
    prefill = [(q, ctx) for step in log for s, q, ctx in step if s == b and ctx <= 100]
    assert [ctx - q for q, ctx in prefill] == [0, 16, 32, 48, 64, 80, 96]
    # A left in the step it finished: B runs alone after it, and A's blocks are free.
    assert len(log) > 12
    for i in range(12, len(log)):
        used, held = pool[i]
        assert [s for s, _, _ in log[i]] == [b] and list(held) == [b] and used == held[b]
    assert engine.pool.num_used == 0


def test_batch_invariant_rows_finds_where_rows_stop_depending_on_the_count(model_dir):
    """The padding a step's matmuls get is measured: the fewest rows from which each row's
    result no longer depends on how many rows there are. Checked with matmuls that change a
    row's rounding below a given count, and on the real model's distinct matmuls (int8 too),
    whose rows at that padding really are the same for every count a step can have."""
    import torch.nn.functional as F

    from bloomtrain.serve.quantize import quantize_model
    from bloomtrain.serve.runner import PROBE_ROWS, _matmuls, batch_invariant_rows

    _, path = model_dir
    runner = build_runner(path, CFG)
    model = runner.model

    def differs_below(n, also=()):
        def matmul(x, w, b):  # a kernel whose rounding changes for fewer than n rows
            y = torch.cat([F.linear(row, w, b) for row in x.split(1)])  # row by row: exact
            return y * (1 + 2 ** -20) if x.shape[0] < n or x.shape[0] in also else y
        return matmul

    assert batch_invariant_rows(model, 40, torch.float32, differs_below(0)) == 1
    assert batch_invariant_rows(model, 40, torch.float32, differs_below(3)) == 4
    assert batch_invariant_rows(model, 40, torch.float32, differs_below(9)) == 16
    # Differing at a count past every candidate: no padding helps.
    assert batch_invariant_rows(model, 300, torch.float32, differs_below(0, also=(129,))) is None
    assert batch_invariant_rows(model, 40, torch.float32, differs_below(17)) is None

    # The distinct matmuls: query_key_value, dense, dense_h_to_4h, dense_4h_to_h with and
    # without bias (a row-parallel layer adds its bias after the reduction), and the LM head.
    shapes = sorted((tuple(w.shape), b is not None) for w, b in _matmuls(model))
    h = model.shape.hidden_size
    assert shapes == sorted([((3 * h, h), False), ((3 * h, h), True), ((h, h), False),
                             ((h, h), True), ((4 * h, h), False), ((4 * h, h), True),
                             ((h, 4 * h), False), ((h, 4 * h), True),
                             ((model.shape.vocab_size, h), False)])
    quantized = build_runner(path, CFG).model
    quantize_model(quantized, "int8")
    assert sorted(tuple(w.shape) for w, _ in _matmuls(quantized)) == sorted(
        {s for s, _ in shapes})
    assert all(w.dtype == torch.int8 for w, _ in _matmuls(quantized))

    # What the runner pads to holds for the real weights at every count a step can have.
    rows = runner.min_rows
    assert rows == batch_invariant_rows(model, CFG.max_batched_tokens, torch.float32)
    for w, b in _matmuls(model) + _matmuls(quantized):
        x = torch.randn(CFG.max_batched_tokens, w.shape[1])
        w = w.float()
        full = F.linear(x, w, b)
        for m in range(rows, CFG.max_batched_tokens + 1):
            assert torch.equal(F.linear(x[:m], w, b), full[:m])
    assert set(range(1, 34)) <= set(PROBE_ROWS)


def test_text_stream_stop_strings_and_utf8(tokenizer):
    text = "数据并行 and Привет! stop here, not there"
    ids = tokenizer.encode(text)
    for stop, want in ((("stop",), text[:text.index("stop")]),
                       (("not", "here"), text[:text.index("here")]),
                       ((), text)):
        stream = TextStream(tokenizer, stop)
        pieces = []
        for t in ids:
            pieces.append(stream.push(t))
            assert "\ufffd" not in pieces[-1]  # half a character is never released
            if stream.stopped:
                break
        pieces.append(stream.finish())
        assert "".join(pieces) == want


def test_a_stop_string_let_pass_before_min_tokens_is_not_found_again(tokenizer):
    """A stop string whole in the text before min_tokens passes (vLLM's rule) and is not
    looked for again: each stop string is looked for only where it would end in new text.
    The longest one's window ("oxen!") used to find the earlier "ox" a token later and cut
    the text back before it."""
    ids = tokenizer.encode(" fox fox fox")
    first = next(k for k in range(1, len(ids) + 1) if "ox" in tokenizer.decode(ids[:k]))
    full, passed = tokenizer.decode(ids), len(tokenizer.decode(ids[:first]))
    want = full[:full.index("ox", passed - 1)]  # the first "ox" ending after min_tokens
    for stop in (("ox",), ("ox", "oxen!")):
        stream = TextStream(tokenizer, stop)
        pieces = [stream.push(t, check_stop=i >= first) for i, t in enumerate(ids)
                  if not stream.stopped]
        assert stream.stopped and "".join(pieces) + stream.finish() == want, stop


def test_a_stop_string_in_text_held_to_the_end_finishes_with_stop(model_dir, tokenizer):
    """Text that never decodes cleanly (a token ending inside a character) is held back and
    only decoded when the sequence ends, where a stop string in it cut the text: the reason
    said "length" while the text had been stopped. It now says "stop"."""
    _, path = model_dir
    # A token of a space and the first byte of a two-byte character: decoded alone, or twice
    # in a row, it never ends a character, so its text waits for the sequence's end.
    token = next(t for t in range(tokenizer.vocab_size)
                 if (b := tokenizer.token_bytes(t)).startswith(b" ") and len(b) == 2
                 and 0xC2 <= b[1] <= 0xDF)
    engine = make_engine(path, tokenizer=tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    for stop, text, reason in (((), " \ufffd \ufffd", "length"), ((" ",), "", "stop")):
        out = engine.generate([prompt], SamplingParams(
            max_tokens=2, temperature=0, logit_bias=((token, 100.0),), stop=stop))[0]
        assert (out["token_ids"], out["text"], out["finish_reason"]) == (
            [token, token], text, reason)


# ---- HTTP ------------------------------------------------------------------------------------

class Gate:
    """Wraps the engine's execute so a test can hold the engine before its next step."""

    def __init__(self, execute):
        self.execute = execute
        self.open = threading.Event()
        self.open.set()

    def __call__(self, batch, sampling):
        self.open.wait()
        return self.execute(batch, sampling)


@contextlib.asynccontextmanager
async def serving(engine, tokenizer, metrics, start=True, split=False, **app_options):
    """The HTTP app over `engine`: on an engine thread in this process, or (`split`) as
    `bloomtrain serve` runs it, through an EngineClient and a pipe to `serve_engine`, which
    runs the engine on its own thread here in place of the engine process. The app's metrics
    are then the front end's own, filled from the engine's `metrics` when scraped."""
    from aiohttp import web

    from bloomtrain.serve.remote import RemoteEngine, serve_engine
    from bloomtrain.serve.server import create_app

    front, loop_thread = engine, None
    if split:
        import dataclasses
        import multiprocessing

        here, there = multiprocessing.Pipe()
        # `front_max_queue`: the front end's queue limit, to let through what the engine's
        # exact one then refuses (the front end's count is an estimate between gauges).
        limit = app_options.pop("front_max_queue", engine.config.max_queue)
        front = RemoteEngine(there, dataclasses.replace(engine.config, max_queue=limit),
                             vocab_limit=engine.vocab_limit,
                             has_tokenizer=engine.tokenizer is not None)
        metrics = ServeMetrics()
        metrics.engine = front
        loop_thread = threading.Thread(target=serve_engine, args=(engine, here),
                                       kwargs={"log": lambda *a, **k: None}, daemon=True)
    app_options.setdefault("chat_template", CHAT_TEMPLATE)
    app = create_app(front, tokenizer, metrics, served_names=("tiny",), max_body_bytes=1 << 16,
                     log=lambda *a, **k: None, **app_options)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if start:
        loop_thread.start() if split else engine.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield app, session
    finally:
        gate = engine.execute
        if isinstance(gate, Gate):
            gate.open.set()
        await runner.cleanup()
        if split:
            front.close()  # "bye": serve_engine returns
            loop_thread.join(timeout=60)
            assert not loop_thread.is_alive()
        engine.close()


async def wait_for(predicate, timeout=60.0):
    """Poll until `predicate()`; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def sse_events(resp):
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        if line == "data: [DONE]":
            return events, True
        events.append(json.loads(line[len("data: "):]))
    return events, False


def test_bad_requests_get_4xx_and_server_survives(model_dir, tokenizer):
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    ok = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    cases = [  # (body bytes or JSON object, status, words the message must hold)
        (b'{"prompt": "x", ', 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "x", "max_tokens": NaN}', 400, "NaN"),
        (b'{"prompt": "caf\xe9"}', 400, "not valid UTF-8"),
        ({**ok, "prompt": "\ud800 lone"}, 400, "lone surrogate"),
        ({**ok, "suffix": "x"}, 400, "`suffix` is not supported"),
        ({**ok, "n": 2, "best_of": 1}, 400, "`best_of` (1) must be at least `n` (2)"),
        ({**ok, "n": 2, "best_of": 3, "stream": True}, 400, "cannot stream"),
        ({**ok, "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
        ({**ok, "model": 4}, 400, "`model` must be a string"),
        ({**ok, "presence_penalty": 2.5}, 400, "`presence_penalty` must be in [-2.0, 2.0]"),
        ({**ok, "repetition_penalty": 0}, 400, "`repetition_penalty` must be in (0.0, inf]"),
        ({**ok, "logit_bias": {"x": 1}}, 400, "`logit_bias` keys must be token ids"),
        # Not ASCII digits: "²" and "--5" were a 500 from int(), "٣" read as token 3.
        ({**ok, "logit_bias": {"²": 1}}, 400, "`logit_bias` keys must be token ids"),
        ({**ok, "logit_bias": {"--5": 1}}, 400, "`logit_bias` keys must be token ids"),
        ({**ok, "logit_bias": {"٣": 1}}, 400, "`logit_bias` keys must be token ids"),
        ({**ok, "logit_bias": {"5": 101}}, 400, "values must be numbers in [-100, 100]"),
        ({**ok, "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
        ({**ok, "min_tokens": 5}, 400, "`min_tokens` must be in [0, 4]"),
        ({**ok, "top_k": -2}, 400, "`top_k` must be >= -1"),
        ({**ok, "max_tokens": -1}, 400, "`max_tokens` must be >= 0"),
        ({**ok, "max_tokens": 10 ** 12}, 400, "maximum context length is 128"),
        ({**ok, "max_tokens": 2.5}, 400, "`max_tokens` must be an integer"),
        ({**ok, "prompt": "word " * 200}, 400, "maximum context length is 128"),
        ({**ok, "prompt": ""}, 400, "empty"),
        ({**ok, "prompt": []}, 400, "empty list"),
        ({**ok, "prompt": [1, "a"]}, 400, "`prompt` must be"),
        ({**ok, "prompt": [5, 99999]}, 400, "outside the vocabulary"),
        ({"max_tokens": 3}, 400, "`prompt` is required"),
        ({**ok, "temperature": "hot"}, 400, "`temperature` must be a number"),
        ({**ok, "temperature": 3}, 400, "`temperature` must be in [0.0, 2.0]"),
        ({**ok, "top_p": 0}, 400, "`top_p` must be in (0.0, 1.0]"),
        ({**ok, "logprobs": 9}, 400, "`logprobs` must be in [0, 5]"),
        ({**ok, "stream": "yes"}, 400, "`stream` must be true or false"),
        ({**ok, "n": 0}, 400, "`n` must be >= 1"),
        ({**ok, "stop": ["s"] * 17}, 400, "at most 16"),
        ({**ok, "stream_options": {"include_usage": True}}, 400, "needs `stream: true`"),
        (b"x" * (1 << 17), 413, "larger than the limit"),
    ]

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            for body, status, words in cases:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with session.post("/v1/completions", data=data) as resp:
                    err = (await resp.json())["error"]
                    assert (resp.status, words in err["message"]) == (status, True), \
                        (body if isinstance(body, dict) else body[:40], err)
                    # The field at fault, also where the engine refuses it (it said "prompt"
                    # for every one).
                    for field in ("logit_bias", "min_tokens"):
                        if isinstance(body, dict) and words.startswith(("`" + field, "outside")) \
                                and field in body:
                            assert err["param"] == field, (body, err)
                    # OpenAI's shape: `code` is a string or null, never a number.
                    assert set(err) == {"message", "type", "param", "code"}
                    assert err["code"] is None or isinstance(err["code"], str)
            async with session.get("/v1/completions") as resp:
                assert resp.status == 405 and "error" in await resp.json()
            async with session.get("/nope") as resp:
                assert resp.status == 404 and "error" in await resp.json()
            async with session.post("/v1/completions", json=ok) as resp:
                body = await resp.json()
                assert resp.status == 200 and body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 4
            async with session.get("/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"

    asyncio.run(main())
    assert engine.pool.num_used == 0 and engine.error is None


@pytest.mark.parametrize("split", [False, True], ids=["thread", "process"])
def test_streaming_equals_non_streaming(model_dir, tokenizer, split):
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    prompts = ["The quick brown fox", "Привет, мир!", "def f(x):"]

    async def main():
        async with serving(engine, tokenizer, metrics, split=split) as (_, session):
            req = {"prompt": prompts, "max_tokens": 20, "temperature": 0, "logprobs": 1,
                   "echo": True}
            async with session.post("/v1/completions", json=req) as resp:
                whole = await resp.json()
            async with session.post("/v1/completions", json={**req, "stream": True,
                                    "stream_options": {"include_usage": True}}) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events, done = await sse_events(resp)
            return whole, events, done

    whole, events, done = asyncio.run(main())
    assert done and len(events) > 20  # token by token, not one chunk at the end
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for c in whole["choices"]:
        i = c["index"]
        mine = [ch for e in events[:-1] for ch in e["choices"] if ch["index"] == i]
        assert "".join(ch["text"] for ch in mine) == c["text"]
        assert c["text"].startswith(prompts[i])  # echo
        assert [ch["finish_reason"] for ch in mine][-1] == c["finish_reason"] == "length"
        tokens = [t for ch in mine for t in ch["logprobs"]["tokens"]]
        assert tokens == c["logprobs"]["tokens"]
        lps = c["logprobs"]["token_logprobs"]
        n_prompt = len(tokenizer.encode(prompts[i]))
        assert lps[0] is None and len(lps) == n_prompt + 20  # prompt scored too (echo)
        assert all(lp <= 0 for lp in lps[1:])


def test_prompt_logprobs_match_hf(model_dir, tokenizer):
    """echo + logprobs + max_tokens 0 scores a prompt (how evaluation harnesses use the API);
    the scores are HF's log-softmax over the model's whole output (512 rows; the tokenizer has
    fewer tokens). 1e-4: batched rows vs HF's, fp32 rounding only."""
    ref, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    prompt = random_prompts([40], seed=5, high=tokenizer.vocab_size)[0]

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}) as resp:
                return await resp.json()

    body = asyncio.run(main())
    got = body["choices"][0]["logprobs"]["token_logprobs"]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0]
    assert logits.shape[-1] > tokenizer.vocab_size
    want = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(prompt[1:])]
    assert got[0] is None
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-4)
    assert body["usage"]["completion_tokens"] == 0


def test_text_offsets_count_characters_of_tokens_split_inside_one(model_dir, tokenizer):
    """Completions' logprobs.text_offset is each token's character position in the text
    returned (OpenAI's legacy API; harnesses find where a continuation starts with it). It
    added len(decode([token])) per token, and a token ending inside a character decodes to a
    U+FFFD of its own: every offset after a split character drifted, past the text's end.
    Now a token that starts inside a character has that character's position."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    prompt = "The ü fox 数据 and more"
    ids = tokenizer.encode(prompt)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert any(len(p) and not _whole_utf8(p) for p in pieces)  # the premise: split characters

    async def request(session, stream):
        async with session.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True,
                "logprobs": 0, "stream": stream}) as resp:
            assert resp.status == 200
            if not stream:
                choice = (await resp.json())["choices"][0]
                return choice["text"], choice["logprobs"]
            text, lp = "", {"tokens": [], "text_offset": []}
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    for key in lp:
                        lp[key] += choice["logprobs"][key]
            return text, lp

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            return [await request(session, stream) for stream in (False, True)]

    for stream, (text, lp) in zip((False, True), asyncio.run(main())):
        assert text.startswith(prompt) and len(lp["text_offset"]) >= len(ids)
        whole = b""
        for i, offset in enumerate(lp["text_offset"][:len(ids)]):
            # The characters of the bytes before token i that are whole.
            assert offset == len(whole.decode("utf-8", "ignore")), (stream, i, lp)
            whole += pieces[i]
        assert all(0 <= o <= len(text) for o in lp["text_offset"])
        assert lp["text_offset"] == sorted(lp["text_offset"])


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_the_end_of_text_token_counts_in_completion_tokens(model_dir, tokenizer):
    """A completion that ends on the end-of-text token generated it: not in the text, but
    counted in usage.completion_tokens and given a logprob, as OpenAI's and vLLM's (whose
    output token ids hold it). It was left out of the count: 2 tokens generated, 1 billed."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    prompt = random_prompts([8], seed=2, high=tokenizer.vocab_size)[0]
    bias = {str(tokenizer.eod_id): 100}

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            out = []
            for stream in (False, True):
                usage = {"stream_options": {"include_usage": True}} if stream else {}
                async with session.post("/v1/completions", json={
                        "prompt": prompt, "max_tokens": 5, "logit_bias": bias, "logprobs": 0,
                        "stream": stream, **usage}) as r:
                    out.append(await r.json() if not stream else
                               [json.loads(line[6:]) for line in (await r.text()).split("\n")
                                if line.startswith("data: {")])
            return out

    whole, events = asyncio.run(main())
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    assert len(choice["logprobs"]["tokens"]) == 1
    assert whole["usage"]["completion_tokens"] == 1
    assert events[-1]["usage"]["completion_tokens"] == 1


def test_top_logprobs_keep_every_alternative_of_tokens_that_split_a_character(model_dir,
                                                                              tokenizer):
    """Byte-level tokens holding part of a character all decode to U+FFFD alone: keyed by that
    text, `top_logprobs` kept one of them (the last one's logprob), so lm-eval's greedy check
    (the token's logprob against the best of top_logprobs) went wrong on CJK and emoji. Each
    is named by its bytes (OpenAI's `bytes:\\xNN`), so the k alternatives are k keys, the
    best one is HF's argmax, and the token's own key holds its own logprob."""
    ref, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    partial = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) >= 10, "the tokenizer splits no character: this test tests nothing"
    prompt = [partial[(7 * i) % len(partial)] for i in range(16)]

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5}) as resp:
                return await resp.json()

    lp = asyncio.run(main())["choices"][0]["logprobs"]
    with torch.no_grad():
        logits = torch.log_softmax(ref(torch.tensor([prompt])).logits[0], -1)
    for i in range(1, len(prompt)):
        top = lp["top_logprobs"][i]
        assert len(top) >= 5, (i, top)
        assert max(top.values()) == pytest.approx(float(logits[i - 1].max()), abs=1e-4), i
        assert lp["tokens"][i].startswith("bytes:\\x")
        if lp["tokens"][i] in top:
            assert top[lp["tokens"][i]] == lp["token_logprobs"][i]


# ---- the OpenAI/vLLM request surface --------------------------------------------------------

def test_neutral_fields_extras_unknown_fields_and_model_names(model_dir, tokenizer):
    """What stock clients send is accepted: LangChain's neutral sampling fields, vLLM's extra
    parameters; unknown fields are ignored and named in a header (a 400 with
    --strict-fields); a wrong `model` is OpenAI's 404; /v1/models carries `created` and
    `owned_by`; `logprobs: 0` still names the sampled token."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    neutral = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
               "frequency_penalty": 0, "presence_penalty": 0, "n": 1, "best_of": 1,
               "logit_bias": {}, "seed": None, "suffix": None, "user": "someone",
               "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "top_k": -1,
               "top_p": 1, "model": "tiny"}

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/v1/completions", json=neutral) as r:
                plain = (r.status, r.headers.get("X-Ignored-Fields"), await r.json())
            async with session.post("/v1/completions", json={
                    **neutral, "colour": "red", "guided_json": {}}) as r:
                extra = (r.status, r.headers.get("X-Ignored-Fields"), await r.json())
            async with session.post("/v1/completions", json={**neutral, "model": "gpt-4"}) as r:
                wrong = (r.status, await r.json())
            async with session.post("/v1/completions", json={**neutral, "logprobs": 0}) as r:
                lp = (await r.json())["choices"][0]["logprobs"]
            async with session.get("/v1/models") as r:
                listed = await r.json()
            # The openai client's models.retrieve("tiny"): one entry, or OpenAI's 404.
            async with session.get("/v1/models/tiny") as r:
                one = (r.status, await r.json())
            async with session.get("/v1/models/gpt-4") as r:
                missing = (r.status, await r.json())
        assert one == (200, listed["data"][0])
        assert missing[0] == 404 and missing[1]["error"]["code"] == "model_not_found"
        async with serving(engine, tokenizer, metrics, strict_fields=True) as (_, session):
            async with session.post("/v1/completions", json={**neutral, "colour": 1}) as r:
                strict = (r.status, await r.json())
        return plain, extra, wrong, lp, listed, strict

    plain, extra, wrong, lp, listed, strict = asyncio.run(main())
    assert plain[0] == 200 and plain[1] is None
    assert plain[2]["choices"][0]["finish_reason"] == "length"
    assert extra[0] == 200 and extra[1] == "colour, guided_json"
    assert extra[2]["choices"][0]["text"] == plain[2]["choices"][0]["text"]
    assert wrong[0] == 404 and wrong[1]["error"]["code"] == "model_not_found"
    assert wrong[1]["error"]["param"] == "model"
    # logprobs: 0 -> each token's own entry, not {} (OpenAI and vLLM name the sampled token).
    assert [list(t) for t in lp["top_logprobs"]] == [[s] for s in lp["tokens"]]
    assert [list(t.values())[0] for t in lp["top_logprobs"]] == lp["token_logprobs"]
    (entry,) = listed["data"]
    assert entry["id"] == "tiny" and entry["owned_by"] == "bloomtrain"
    assert isinstance(entry["created"], int) and entry["created"] > 1.6e9
    assert strict[0] == 400 and "unknown field `colour`" in strict[1]["error"]["message"]


def test_n_and_best_of_match_separate_requests(model_dir, tokenizer):
    """`n: 4, seed: s` gives the samples of 4 requests seeded s..s+3 (the documented
    derivation); `best_of: 4, n: 2` returns the 2 of those 4 with the highest cumulative
    logprob, best first."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    base = {"prompt": "Привет, мир", "max_tokens": 12, "temperature": 1.0, "seed": 1234}

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/v1/completions", json={**base, "n": 4}) as r:
                n4 = await r.json()
            async with session.post("/v1/completions", json={
                    **base, "n": 4, "stream": True}) as r:
                events, _ = await sse_events(r)
            singles = []
            for j in range(4):
                async with session.post("/v1/completions", json={
                        **base, "seed": 1234 + j, "logprobs": 0}) as r:
                    singles.append((await r.json())["choices"][0])
            async with session.post("/v1/completions", json={
                    **base, "n": 2, "best_of": 4}) as r:
                best = await r.json()
        return n4, events, singles, best

    n4, events, singles, best = asyncio.run(main())
    texts = [c["text"] for c in sorted(n4["choices"], key=lambda c: c["index"])]
    assert texts == [s["text"] for s in singles]
    assert len(set(texts)) > 1  # the seeds really differ
    streamed = ["".join(ch["text"] for e in events for ch in e["choices"] if ch["index"] == i)
                for i in range(4)]
    assert streamed == texts
    ranked = sorted(singles, key=lambda s: -sum(s["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [s["text"] for s in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == sum(len(s["logprobs"]["tokens"])
                                                     for s in ranked[:2])


def test_chat_completions(model_dir, tokenizer):
    """/v1/chat/completions renders the messages with the chat template and completes the
    prompt: the same tokens as /v1/completions on the rendered text; streaming, n, stop and
    logprobs; without a template, a 400 that says what to do."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": "there"}]}]
    # Text parts joined by a newline, as vLLM joins them.
    rendered = "<|system|>Be brief.</s><|user|>Hello\nthere</s><|assistant|>"
    req = {"messages": messages, "max_tokens": 10, "temperature": 0, "model": "tiny"}

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/v1/chat/completions", json=req) as r:
                whole = await r.json()
            async with session.post("/v1/completions", json={
                    "prompt": rendered, "max_tokens": 10, "temperature": 0}) as r:
                plain = await r.json()
            async with session.post("/v1/chat/completions", json={
                    **req, "stream": True, "logprobs": True, "top_logprobs": 2}) as r:
                events, done = await sse_events(r)
            async with session.post("/v1/chat/completions", json={
                    **req, "n": 2, "temperature": 0.8, "seed": 5, "logprobs": True}) as r:
                two = await r.json()
            stop = plain["choices"][0]["text"][3:5]
            async with session.post("/v1/chat/completions", json={**req, "stop": [stop]}) as r:
                stopped = await r.json()
            async with session.post("/tokenize", json={"messages": messages}) as r:
                tokens = (await r.json())["tokens"]
            # A conversation that fills the context, no max_tokens: no room to answer is a
            # 400, not an empty answer cut for "length".
            async with session.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "word " * 200}]}) as r:
                full = (r.status, await r.json())
            assert full[0] == 400 and "no room is left" in full[1]["error"]["message"]
            assert full[1]["error"]["code"] == "context_length_exceeded"
        async with serving(engine, tokenizer, metrics, chat_template=None) as (_, session):
            async with session.post("/v1/chat/completions", json=req) as r:
                none = (r.status, await r.json())
        return whole, plain, events, done, two, stop, stopped, tokens, none

    whole, plain, events, done, two, stop, stopped, tokens, none = asyncio.run(main())
    text = plain["choices"][0]["text"]
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered)) == len(tokens)
    assert done and events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text
    content = [t for e in events for t in e["choices"][0]["logprobs"]["content"]]
    assert "".join(t["token"] for t in content) == text
    assert all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode())
               for t in content)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert stopped["choices"][0]["message"]["content"] == text[:text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert none[0] == 400 and "--chat-template FILE" in none[1]["error"]["message"]


def test_chat_requests_vllm_answers_otherwise(model_dir, tokenizer):
    """A lone surrogate in a role was the tokenizer's error as a 500 (in the content it was a
    400); without a generation prompt the answer's role was "assistant" where vLLM gives the
    last message's (the model continues it); a malformed max_tokens passed beside
    max_completion_tokens."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    base = {"max_tokens": 4, "temperature": 0}

    async def main():
        out = []
        async with serving(engine, tokenizer, metrics) as (_, session):
            for body in (
                    {**base, "messages": [{"role": "us\ud800er", "content": "hi"}]},
                    {**base, "messages": [{"role": "user", "content": "hi"}],
                     "add_generation_prompt": False},
                    {**base, "messages": [{"role": "user", "content": "hi"}],
                     "add_generation_prompt": False, "stream": True},
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "abc",
                     "max_completion_tokens": 3}):
                async with session.post("/v1/chat/completions", json=body) as r:
                    out.append((r.status, await (sse_events(r) if body.get("stream")
                                                 else r.json())))
            async with session.post("/tokenize", json={
                    "messages": [{"role": "us\ud800er", "content": "hi"}]}) as r:
                out.append((r.status, await r.json()))
        return out

    bad_role, continued, streamed, both, tokenize = asyncio.run(main())
    for status, body in (bad_role, tokenize):
        assert status == 400 and "lone surrogate" in body["error"]["message"], body
        assert body["error"]["param"] == "messages"
    assert continued[0] == 200 and continued[1]["choices"][0]["message"]["role"] == "user"
    events, _ = streamed[1]
    assert events[0]["choices"][0]["delta"]["role"] == "user"
    assert both[0] == 400 and "`max_tokens` must be an integer" in both[1]["error"]["message"]


def test_tokenizer_endpoints(model_dir, tokenizer):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-eval's remote tokenizer reads
    them: the eos_token string tokenizes to the end-of-text id."""
    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    text = "数据并行 and Привет"

    async def main():
        async with serving(engine, tokenizer, metrics) as (_, session):
            async with session.post("/tokenize", json={
                    "prompt": text, "add_special_tokens": False,
                    "return_token_strs": True}) as r:
                tok = await r.json()
            async with session.post("/detokenize", json={"tokens": tok["tokens"]}) as r:
                detok = await r.json()
            async with session.get("/tokenizer_info") as r:
                info = await r.json()
            async with session.post("/tokenize", json={"prompt": info["eos_token"]}) as r:
                eos = (await r.json())["tokens"]
            async with session.post("/detokenize", json={"tokens": [1, 99999]}) as r:
                bad = (r.status, await r.json())
        return tok, detok, info, eos, bad

    tok, detok, info, eos, bad = asyncio.run(main())
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == CFG.max_model_len
    assert tok["token_strs"] == [tokenizer.id_to_token(t) for t in tok["tokens"]]
    assert detok == {"prompt": text}
    assert eos == [tokenizer.eod_id]
    assert info["chat_template"] == CHAT_TEMPLATE and info["model_max_length"] == 128
    assert (info["bos_token"], info["pad_token"]) == ("<s>", "<pad>")
    assert bad[0] == 400 and "outside the vocabulary" in bad[1]["error"]["message"]


def test_drain_timeout_ends_streams_and_probes_get_503(model_dir, tokenizer):
    """During a drain the server still listens: /health and new completions get 503 with
    Retry-After. A stream still running when the drain times out ends with an error event
    and [DONE], and its sequence is aborted."""
    from bloomtrain.serve.server import drain

    _, path = model_dir
    engine = make_engine(path, wrap=Gate, tokenizer=tokenizer,
                         metrics=(metrics := ServeMetrics()))
    gate = engine.execute

    async def main():
        async with serving(engine, tokenizer, metrics) as (app, session):
            resp = await session.post("/v1/completions", json={
                "prompt": "The quick", "max_tokens": 100, "temperature": 0, "stream": True})
            await resp.content.readline()  # the first token's event
            gate.open.clear()  # the engine holds: the stream cannot finish in time
            draining = asyncio.ensure_future(drain(app, 1.0))
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession(session._base_url) as fresh:  # a new connection
                async with fresh.get("/health") as r:
                    health = (r.status, r.headers.get("Retry-After"))
                async with fresh.post("/v1/completions", json={"prompt": "x"}) as r:
                    late = (r.status, r.headers.get("Retry-After"))
            events, done = await sse_events(resp)
            finished = await draining
            gate.open.set()
            await wait_for(lambda: engine.num_live == 0)
            return health, late, events, done, finished

    health, late, events, done, finished = asyncio.run(main())
    assert health == (503, "1") and late == (503, "1")
    assert not finished
    assert done and "--drain-timeout" in events[-1]["error"]["message"]
    assert all("choices" in e for e in events[:-1])
    assert metrics.requests.values == {("abort",): 1}


@pytest.mark.parametrize("split", [False, True], ids=["thread", "process"])
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_slot_and_blocks(model_dir, tokenizer, stream, split):
    _, path = model_dir
    cfg = EngineConfig(max_model_len=512, block_size=8, kv_cache_tokens=1024, max_num_seqs=8,
                       max_batched_tokens=40, prefill_chunk=16, max_queue=8)
    engine = make_engine(path, cfg, wrap=Gate, tokenizer=tokenizer,
                         metrics=(metrics := ServeMetrics()))
    gate = engine.execute

    async def main():
        async with serving(engine, tokenizer, metrics, split=split) as (app, session):
            from bloomtrain.serve.server import STATE
            req = {"prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0,
                   "stream": stream}
            if stream:
                resp = await session.post("/v1/completions", json=req)
                await resp.content.readline()  # the first token's event
                gate.open.clear()
            else:
                gate.open.clear()
                task = asyncio.ensure_future(session.post("/v1/completions", json=req))
            await wait_for(lambda: engine.blocks_used > 0 and engine.num_live == 1)
            held = engine.blocks_used
            if stream:
                resp.close()  # hang up mid-stream
            else:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await wait_for(lambda: app[STATE].inflight == 0)  # the handler saw it, aborted
            gate.open.set()
            await wait_for(lambda: engine.num_live == 0)
            return held

    held = asyncio.run(main())
    assert held > 0
    assert engine.blocks_used == 0 and engine.num_running == 0
    assert metrics.requests.values == {("abort",): 1}


def test_overload_is_503_with_retry_after(model_dir, tokenizer):
    _, path = model_dir
    cfg = EngineConfig(max_model_len=128, block_size=8, kv_cache_tokens=1024, max_num_seqs=8,
                       max_batched_tokens=40, prefill_chunk=16, max_queue=2)
    engine = make_engine(path, cfg, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))
    req = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}

    async def main():
        # The engine is not started yet, so accepted requests stay queued.
        async with serving(engine, tokenizer, metrics, start=False) as (_, session):
            tasks = [asyncio.ensure_future(session.post("/v1/completions", json=req))
                     for _ in range(2)]
            await wait_for(lambda: engine.num_waiting == 2)
            async with session.post("/v1/completions", json=req) as resp:
                over = (resp.status, resp.headers.get("Retry-After"), await resp.json())
            engine.start()
            done = [await t for t in tasks]
            return over, [(r.status, (await r.json())["choices"][0]["finish_reason"])
                          for r in done]

    (status, retry, body), accepted = asyncio.run(main())
    assert status == 503 and int(retry) >= 1 and "overloaded" in body["error"]["message"]
    assert accepted == [(200, "length")] * 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_the_engine_turns_away_is_503_with_retry_after(model_dir, tokenizer, stream):
    """Split as `bloomtrain serve` runs: the front end's queue count is an estimate, so a
    request can pass it and still be refused by the engine's exact --max-queue. A stream then
    gets the front end's answer, a 503 with Retry-After, not a 200 whose event is an error;
    so does a whole response (it was a 503 without Retry-After)."""
    _, path = model_dir
    cfg = EngineConfig(max_model_len=128, block_size=8, kv_cache_tokens=1024, max_num_seqs=1,
                       max_batched_tokens=40, prefill_chunk=16, max_queue=1)
    engine = make_engine(path, cfg, tokenizer=tokenizer, metrics=ServeMetrics())
    gate = engine.execute = Gate(engine.execute)
    req = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0,
           "ignore_eos": True, "stream": stream}

    async def main():
        async with serving(engine, tokenizer, ServeMetrics(), split=True,
                           front_max_queue=100) as (_, session):
            first = asyncio.ensure_future(session.post("/v1/completions", json=req))
            await wait_for(lambda: engine.num_running == 1)  # it holds the one seq slot
            gate.open.clear()  # the engine stops before its next step
            later = [asyncio.ensure_future(session.post("/v1/completions", json=req))
                     for _ in range(2)]
            await asyncio.sleep(0.5)  # both reach the engine's pipe
            gate.open.set()
            results = []
            for task in [first, *later]:
                resp = await task
                results.append((resp.status, resp.headers.get("Retry-After"),
                                await resp.text()))
            return results

    (s0, _, t0), *later = asyncio.run(main())
    assert s0 == 200 and (t0.rstrip().endswith("data: [DONE]") if stream else
                          '"finish_reason": "length"' in t0.replace('":"', '": "'))
    statuses = sorted(s for s, _, _ in later)
    assert statuses == [200, 503], later  # one waits its turn, one is over the queue
    status, retry, body = next(r for r in later if r[0] == 503)
    assert int(retry) >= 1 and "--max-queue 1" in body and "overloaded" in body


@pytest.mark.parametrize("split", [False, True], ids=["thread", "process"])
def test_metrics_parse(model_dir, tokenizer, split):
    from prometheus_client.parser import text_string_to_metric_families

    _, path = model_dir
    engine = make_engine(path, tokenizer=tokenizer, metrics=(metrics := ServeMetrics()))

    async def main():
        async with serving(engine, tokenizer, metrics, split=split) as (_, session):
            reqs = [session.post("/v1/completions", json={
                "prompt": p, "max_tokens": 7, "temperature": 0}) for p in ("a b c", "x y")]
            for r in await asyncio.gather(*reqs):
                assert r.status == 200
            async with session.post("/v1/completions", data=b"{") as r:
                assert r.status == 400
            async with session.get("/metrics") as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                return await r.text()

    text = asyncio.run(main())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in families.values() for s in f.samples}
    assert families["bloomtrain_time_to_first_token_seconds"].type == "histogram"
    assert value[("bloomtrain_requests_total", (("finish_reason", "length"),))] == 2
    assert value[("bloomtrain_generation_tokens_total", ())] == 14
    assert value[("bloomtrain_time_to_first_token_seconds_count", ())] == 2
    assert value[("bloomtrain_inter_token_latency_seconds_count", ())] == 12
    assert value[("bloomtrain_http_responses_total",
                  (("code", "400"), ("endpoint", "/v1/completions")))] == 1
    assert value[("bloomtrain_queue_depth", ())] == 0
    assert value[("bloomtrain_kv_cache_blocks_used", ())] == 0
    assert value[("bloomtrain_kv_cache_blocks_total", ())] == CFG.num_blocks


def _tp_rank_from_checkpoint(rank, world, path):
    import weakref

    from bloomtrain.checkpoint.reader import CheckpointReader
    from bloomtrain.checkpoint.hf.slices import HFSliceReader
    from bloomtrain.serve.tp import load_serving_model, serving_layout
    from bloomtrain.topology import Topology

    full_loads, alive, peak, read = [], [], [0], [0]
    original, original_read = CheckpointReader.load, HFSliceReader._read

    def load(self, name, kind="model"):
        # The most numbers that tensors read whole from the checkpoint hold at once.
        out = original(self, name, kind)
        alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(out)]
        peak[0] = max(peak[0], sum(ref().numel() for ref in alive))
        full_loads.append(name)
        return out

    def hf_read(self, name, index):  # numbers read from HF safetensors, in all
        out = original_read(self, name, index)
        read[0] += out.numel()
        return out

    from bloomtrain.checkpoint import format as ckpt_format
    hashed, original_sha = [], ckpt_format.sha256_file
    ckpt_format.sha256_file = lambda f, *a: hashed.append(f.name) or original_sha(f, *a)
    CheckpointReader.load, HFSliceReader._read = load, hf_read
    try:
        model = load_serving_model(path, Topology.build(layout=serving_layout(world)))
    finally:
        CheckpointReader.load, HFSliceReader._read = original, original_read
        ckpt_format.sha256_file = original_sha
    ids = torch.arange(18).view(2, 9) * 7 % VOCAB
    with torch.no_grad():
        logits = model(ids)  # [b, s, V / tp]
    return {"logits": logits, "full_loads": full_loads, "peak": peak[0], "hf_read": read[0],
            "numel": sum(p.numel() for p in model.parameters()), "hashed": hashed}


@pytest.mark.parametrize("source", ["bloomtrain", "hf", "hf-bin"])
def test_tp_ranks_read_only_their_shards(tmp_path, source):
    """`--nproc 2 parallel.tp=2` on a bloomtrain checkpoint, HF safetensors or an HF torch .bin:
    each rank builds its part of the model from its own shards, so no rank ever holds the whole
    model (a parameter a bloomtrain checkpoint does not store split is read whole, one at a
    time, and cut; safetensors are read by slices; a .bin is memory-mapped and each slice
    copied out), and the split model's logits are the full model's."""
    from bloomtrain import checkpoint
    from bloomtrain.model import BloomShape, build_model
    from tests.dist import run_ranks

    shape = BloomShape(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    full = build_model(shape, seed=7).eval()
    from bloomtrain.checkpoint import hf
    from bloomtrain.checkpoint.hf.slices import sliceable

    checkpoint.save_checkpoint(tmp_path / "ck", 1, full.state_dict(), shape)
    exported = hf.export_hf(tmp_path / "ck", tmp_path / "hf", log=lambda *_: None)
    path = exported if source == "hf" else tmp_path / "ck"  # HF: safetensors, read by slices
    if source == "hf-bin":  # the same weights as a torch .bin, the way older HF repos ship them
        from safetensors.torch import load_file
        path = tmp_path / "hf-bin"
        shutil.copytree(exported, path)
        torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
        assert sliceable(path)
    ranks = run_ranks(2, _tp_rank_from_checkpoint, str(path))
    ids = torch.arange(18).view(2, 9) * 7 % VOCAB
    with torch.no_grad():
        want = full(ids)
        # An independent reference: HF transformers' Bloom on the same weights.
        ref = transformers.BloomForCausalLM.from_pretrained(exported).eval()
        hf_logits = ref(ids).logits
    got = torch.cat([r["logits"] for r in ranks], dim=-1)
    assert (got - want).abs().max().item() < 1e-5
    assert (got - hf_logits).abs().max().item() < 1e-4
    total = sum(p.numel() for p in full.parameters())
    for r in ranks:
        assert r["numel"] < 0.6 * total  # the matrices are halves; LayerNorms and biases whole
        if source != "bloomtrain":
            # Only this rank's slices (the embedding's twice: the tied head is compared with
            # it); reading the whole model and cutting it reads more than `total`.
            assert 0 < r["hf_read"] < 0.7 * total and r["full_loads"] == []
            continue
        # Read whole and held: one matrix at a time, besides the replicated vectors (loading
        # the whole model and then splitting it holds `total`).
        biggest = max(p.numel() for p in full.parameters())
        assert r["peak"] <= biggest + (total - sum(p.numel() for p in full.parameters()
                                                   if p.dim() == 2))
        # Saved at tp=1, each parameter is read whole once, as it is cut (or kept, when
        # replicated): never twice, never the model at once.
        assert sorted(r["full_loads"]) == sorted(set(r["full_loads"]))
        assert set(r["full_loads"]) <= set(full.state_dict()) - {"lm_head.weight"}
    if source == "bloomtrain":
        # The ranks share the checksums: each model file is hashed by one of them, not by all.
        files = [n for n in checkpoint.read_manifest(checkpoint.resolve(path))["files"]
                 if n.startswith("model")]
        hashed = [n for r in ranks for n in r["hashed"] if n.startswith("model")]
        assert files and sorted(hashed) == sorted(files)


def test_hf_slice_reader_reads_shards_and_refuses_an_untied_head(model_dir, tmp_path):
    """HFSliceReader's shards are the full tensors' chunks; an lm_head.weight that differs from
    the embedding is refused in the rows each rank reads, as a whole read refuses it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bloomtrain.checkpoint.hf.files import canonical_name
    from bloomtrain.model.presets import EMBEDDING
    from bloomtrain.checkpoint.hf.slices import HFSliceReader, sliceable
    from bloomtrain.errors import UserError

    _, path = model_dir
    reader = HFSliceReader(path)
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    dense = "transformer.h.0.self_attention.dense.weight"
    (weights,) = Path(path).glob("*.safetensors")
    with safe_open(str(weights), framework="pt") as f:  # the reference: safetensors itself
        whole = {canonical_name(k): f.get_tensor(k) for k in f.keys()}
    # The same weights as a torch .bin (zip format, memory-mapped) give the same shards; the
    # older pickle format cannot be read in part and is not offered to the slice reader.
    as_bin = tmp_path / "bin"
    shutil.copytree(path, as_bin)
    (as_bin / weights.name).unlink()
    torch.save(dict(whole), as_bin / "pytorch_model.bin")
    legacy = tmp_path / "legacy"
    shutil.copytree(as_bin, legacy)
    torch.save(dict(whole), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert sliceable(path) and sliceable(as_bin) and not sliceable(legacy)
    bin_reader = HFSliceReader(as_bin)
    assert bin_reader.names() == reader.names()
    for name, dim in ((qkv, 0), (dense, 1), (EMBEDDING, 0)):
        for rank in range(2):
            want = whole[name].chunk(2, dim)[rank]
            assert torch.equal(reader.load_tp_shard(name, "model", rank, 2, dim), want)
            got = bin_reader.load_tp_shard(name, "model", rank, 2, dim)
            assert torch.equal(got, want) and got.is_contiguous()
    bin_reader.close()
    untied = tmp_path / "untied"
    shutil.copytree(path, untied)
    (weights,) = untied.glob("*.safetensors")
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    emb = [k for k in tensors if k.endswith("word_embeddings.weight")][0]
    head = tensors[emb].clone()
    head[-1, 0] += 1.0  # the second rank's rows only
    save_file({**tensors, "lm_head.weight": head}, str(weights))
    reader = HFSliceReader(untied)
    reader.load_tp_shard(EMBEDDING, "model", 0, 2, 0)  # rank 0's rows agree
    with pytest.raises(UserError, match="untied LM heads are not supported"):
        reader.load_tp_shard(EMBEDDING, "model", 1, 2, 0)


# ---- the CLI, end to end: tensor parallelism, SIGTERM drain ---------------------------------

def test_cli_rejects_bad_settings(model_dir, tmp_path, capsys):
    from bloomtrain.cli import main

    path = str(model_dir[1])
    for argv, words in (
            (["pipeline.pp=2"], "only parallel.tp=N"),
            (["--nproc", "2", "parallel.tp=4"], "parallel.tp=4 needs 4 processes"),
            (["parallel.tp=2"], "add --nproc 2"),
            (["--max-batched-tokens", "20"], "at least --prefill-chunk + --max-num-seqs"),
            (["--max-model-len", "100000"], "must hold one sequence of --max-model-len"),
            # 2048 tokens make 42 blocks of 48: the message blamed 2048 tokens for 2048.
            (["--max-model-len", "2048", "--kv-cache-tokens", "2048", "--block-size", "48"],
             "in whole blocks of --block-size 48: 43 blocks (2064 tokens), but it makes 42"),
            # A cache no memory holds: a traceback from torch's allocator (exit 1).
            (["--kv-cache-tokens", str(10 ** 15), "--max-model-len", "64"],
             "does not fit in the memory of cpu; lower --kv-cache-tokens"),
            # inf passed, then every SIGTERM drain ended in a traceback (exit 1).
            (["--drain-timeout", "inf"], "--drain-timeout must be a finite number"),
            (["--drain-timeout", "nan"], "--drain-timeout must be a finite number"),
            (["--port", "70000"], "--port must be in [0, 65535]")):
        assert main(["serve", "--checkpoint", path, *argv]) == 2
        assert words in capsys.readouterr().err, argv
    assert main(["serve", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_url_it_prints_is_one_clients_can_use():
    from bloomtrain.serve.server import base_url
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert base_url("::1", 8000) == "http://[::1]:8000"  # was http://::1:8000
    assert base_url("localhost", 1) == "http://localhost:1"


def test_cli_warns_at_start_when_it_binds_beyond_loopback_without_a_key(model_dir, capsys,
                                                                        monkeypatch):
    from bloomtrain.cli import main

    monkeypatch.delenv("BLOOMTRAIN_API_KEY", raising=False)
    # A setting refused before anything is loaded or bound: each run stops right after the
    # warning would have come.
    argv = ["serve", "--checkpoint", str(model_dir[1]), "--max-batched-tokens", "20"]
    assert main([*argv, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "[serve] warning: --host 0.0.0.0 answers anyone who can reach port 8000 and no API key "
        "is set: give --api-key KEY or BLOOMTRAIN_API_KEY to ask clients for one\n"), err
    for host, key in (("127.0.0.1", []), ("::1", []), ("localhost", []),
                      ("0.0.0.0", ["--api-key", "k"])):
        assert main([*argv, "--host", host, *key]) == 2
        assert "warning" not in capsys.readouterr().err, host
    monkeypatch.setenv("BLOOMTRAIN_API_KEY", "k")
    assert main([*argv, "--host", "0.0.0.0"]) == 2
    assert "warning" not in capsys.readouterr().err
    for env, flag, name in (("  ", [], "BLOOMTRAIN_API_KEY"), ("k", ["--api-key", ""],
                                                               "--api-key")):
        monkeypatch.setenv("BLOOMTRAIN_API_KEY", env)
        assert main([*argv, *flag]) == 2
        assert f"the API key ({name}) is empty" in capsys.readouterr().err


def _spawned_children(pid: int) -> list[int]:
    """Pids of the multiprocessing-spawned children of `pid` (from /proc), not counting
    multiprocessing's resource tracker."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_cli_front_end_failures_end_the_server(model_dir):
    """The HTTP front end runs in its own process (bloomtrain.serve.remote). A port that is
    taken is a clear error and exit code 2; a front end that dies (SIGKILL) takes the engine
    process down with it, naming the signal, rather than leaving a server that never answers."""
    import socket

    _, path = model_dir
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(["--checkpoint", str(path), "--port", str(port)])
        try:
            server.wait_line(rf"cannot listen on 127\.0\.0\.1:{port}.*another --port")
            assert server.proc.wait(timeout=60) == 2
        finally:
            server.stop()
    server = ServerProcess(["--checkpoint", str(path)])
    try:
        server.wait_line(r"listening on http://")
        (front,) = _spawned_children(server.proc.pid)
        os.kill(front, signal.SIGKILL)
        server.wait_line(r"the HTTP front end was killed by SIGKILL")
        assert server.proc.wait(timeout=60) == 2
    finally:
        server.stop()


def test_cli_int8_and_sigterm_drain(model_dir, tokenizer):
    """`--quantize int8` serves the int8 model (its tokens are the in-process int8 engine's);
    SIGTERM while a stream is in flight: the server keeps listening, so a probe on a new
    connection gets 503 with Retry-After (not a refused connection), the stream finishes in
    full, and the process exits 0."""
    _, path = model_dir
    server = ServerProcess(["--checkpoint", str(path), "--quantize", "int8",
                            "--max-model-len", "512", "--kv-cache-tokens", "4096"])
    try:
        port = int(server.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))

        async def main():
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                async with session.post("/v1/completions", json={
                        "prompt": "The quick brown fox", "max_tokens": 16,
                        "temperature": 0}) as r:
                    text = (await r.json())["choices"][0]["text"]
                resp = await session.post("/v1/completions", json={
                    "prompt": "Привет", "max_tokens": 400, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}})
                await resp.content.readline()
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(server.wait_line, r"draining 1 request\(s\) in flight")
                async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as fresh:
                    async with fresh.get("/health") as r:
                        late = (r.status, r.headers.get("Retry-After"))
                    async with fresh.post("/v1/completions", json={"prompt": "x"}) as r:
                        late += (r.status, (await r.json())["error"]["message"])
                events, done = await sse_events(resp)
                return text, late, events, done

        text, late, events, done = asyncio.run(main())
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    assert late == (503, "1", 503, "the server is shutting down")
    assert done and events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 400
    engine = make_engine(path, tokenizer=tokenizer, quantize="int8")
    want = engine.generate([tokenizer.encode("The quick brown fox")],
                           SamplingParams(max_tokens=16, temperature=0))[0]["text"]
    assert text == want


def test_cli_tp2_equals_tp1_and_sigterm_drains(model_dir, tokenizer):
    """`--nproc 2 parallel.tp=2`: greedy tokens of concurrent requests equal tp=1's. SIGTERM
    while a stream is in flight: the stream finishes in full, and the server exits 0."""
    _, path = model_dir
    prompts = ["The quick brown fox", "数据并行、张量并行", "def f(x):\n\treturn", "Emoji 🎉"]
    server = ServerProcess(["--checkpoint", str(path), "--nproc", "2", "parallel.tp=2",
                            "--max-model-len", "512", "--kv-cache-tokens", "4096"])
    try:
        port = int(server.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))

        async def main():
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                reqs = [session.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 16, "temperature": 0}) for p in prompts]
                texts = [(await r.json())["choices"][0]["text"]
                         for r in await asyncio.gather(*reqs)]
                long_req = {"prompt": "The quick brown fox", "max_tokens": 400,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
                resp = await session.post("/v1/completions", json=long_req)
                await resp.content.readline()
                server.proc.send_signal(signal.SIGTERM)
                events, done = await sse_events(resp)
                return texts, events, done

        texts, events, done = asyncio.run(main())
        server.wait_line(r"draining 1 request\(s\) in flight")
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    engine = make_engine(path, tokenizer=tokenizer)
    want = engine.generate([tokenizer.encode(p) for p in prompts],
                           SamplingParams(max_tokens=16, temperature=0))
    assert texts == [w["text"] for w in want]
    # The stream in flight at SIGTERM ran to its end.
    assert done and events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 400


# ---- structure ------------------------------------------------------------------------------

def test_one_model_code_path_and_no_training_imports():
    """The runner runs the model's own forward: no block forward, attention math or ALiBi of
    its own, and every ALiBi bias tensor of the package is built in one function
    (model.bloom.alibi_bias; FlexAttention's score_mod is that kernel's in-kernel form). No
    serve module reaches bloomtrain.train or bloomtrain.generate, even through others (the
    shared launcher is bloomtrain.launch, the device and dtype code bloomtrain.devices), and generate takes its
    sampling from serve, not the other way round."""
    from tests.structure import import_graph

    runner = (ROOT / "bloomtrain/serve/runner.py").read_text()
    for code in ("baddbmm", "torch.softmax", "block.mlp", "self_attention", "slopes.to", "rel >",
                 "def _block", "def _attention"):
        assert code not in runner, code
    assert "self.model.transformer(" in runner
    sources = {p: p.read_text() for p in (ROOT / "bloomtrain").rglob("*.py")}
    built = [str(p.relative_to(ROOT)) for p, text in sources.items()
             if ".masked_fill(rel > 0" in text]
    assert built == ["bloomtrain/model/bloom.py"]
    graph = import_graph(ROOT)
    reached, todo = set(), [m for m in graph if m.startswith("bloomtrain.serve")]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += graph[m]
    assert sorted(m for m in reached if m.startswith(("bloomtrain.train",
                                                       "bloomtrain.generate"))) == []
    assert "bloomtrain.serve.sampling" in graph["bloomtrain.generate"]
    assert {"bloomtrain.launch", "bloomtrain.devices"} <= graph["bloomtrain.train.launch"]
    assert {"bloomtrain.launch", "bloomtrain.devices"} <= graph["bloomtrain.serve.cli"]


def test_scheduler_owns_its_queues_and_the_runner_its_imports():
    """Only the scheduler edits its waiting queue and running batch (add, abort, clear,
    release); the scheduler's step output (serve/batch.py) is imported by the runner and the
    scheduler, and neither imports the other."""
    import ast

    from tests.structure import import_graph

    edits = []
    for path in (ROOT / "bloomtrain" / "serve").glob("*.py"):
        if path.name == "scheduler.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in (
                    "append", "appendleft", "remove", "clear", "popleft", "pop", "extend") \
                    and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("waiting", "running"):
                edits.append(f"{path.name}:{node.lineno}")
    assert edits == []
    graph = import_graph(ROOT)
    assert "bloomtrain.serve.batch" in graph["bloomtrain.serve.runner"]
    assert "bloomtrain.serve.batch" in graph["bloomtrain.serve.scheduler"]
    assert "bloomtrain.serve.runner" not in graph["bloomtrain.serve.scheduler"]
    assert "bloomtrain.serve.scheduler" not in graph["bloomtrain.serve.runner"]


def test_both_engines_implement_the_engine_client_protocol(model_dir):
    """The front end drives one explicit interface: the in-process Engine and the pipe client
    (RemoteEngine) each have every member of interface.EngineClient, and the server probes
    neither with getattr."""
    import inspect
    import multiprocessing

    from bloomtrain.serve.interface import EngineClient
    from bloomtrain.serve.remote import RemoteEngine

    members = set(EngineClient.__annotations__) | {
        n for n, v in vars(EngineClient).items() if inspect.isfunction(v) and n[0] != "_"}
    assert {"submit", "abort", "check_request", "stop_accepting", "metrics_snapshot",
            "dispatch", "error", "num_waiting", "blocks_total"} <= members
    engine = make_engine(model_dir[1])
    here, there = multiprocessing.Pipe()
    remote = RemoteEngine(there, CFG, vocab_limit=VOCAB, has_tokenizer=True)
    try:
        for impl in (engine, remote):
            assert isinstance(impl, EngineClient)
            assert [m for m in members if not hasattr(impl, m)] == []
            assert inspect.iscoroutinefunction(impl.metrics_snapshot)
    finally:
        remote.close()  # says bye first: the reader then takes the closed pipe as the end
        here.close()
        engine.close()
    assert "getattr(" not in (ROOT / "bloomtrain/serve/server.py").read_text()


def test_a_sigterm_while_the_front_end_starts_is_a_clean_stop(model_dir):
    """SIGTERM just after the engine spawned the HTTP front end, before that process has its
    handlers (it is still importing): the front end dies of the forwarded signal, and the
    server exits 0 as a stop that was asked for, not 2 blaming the front end."""
    _, path = model_dir
    server = ServerProcess(["--checkpoint", str(path)])
    try:
        server.wait_line(r"matmuls padded to")  # printed just before the front end starts
        deadline = time.monotonic() + 60
        while not _children(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=60)
        out = "".join(server.log) + "".join(iter_lines(server))
    finally:
        server.stop()
    assert rc == 0, out
    assert "bloomtrain serve: error" not in out, out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def iter_lines(server):
    while not server.lines.empty():
        yield server.lines.get()


def test_cli_drain_timeout_ends_the_stream_with_an_error_event(model_dir):
    """`bloomtrain serve --drain-timeout 0.5` (front end and engine in their two processes):
    SIGTERM mid-stream, a stream too long to finish in time ends with an error event and
    `data: [DONE]`, the server says the drain timed out, and exits 0."""
    _, path = model_dir
    server = ServerProcess(["--checkpoint", str(path), "--drain-timeout", "0.5",
                            "--max-model-len", "4096", "--kv-cache-tokens", "8192"])
    try:
        port = int(server.wait_line(r"listening on http://127\.0\.0\.1:(\d+)").group(1))

        async def main():
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                resp = await session.post("/v1/completions", json={
                    "prompt": "The quick brown fox", "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True, "stream": True})
                await resp.content.readline()
                server.proc.send_signal(signal.SIGTERM)
                return await sse_events(resp)

        events, done = asyncio.run(main())
        server.wait_line(r"drain timed out")
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    assert done and "--drain-timeout" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "overloaded_error"
    tokens = sum(len(ch["text"]) > 0 for e in events[:-1] for ch in e["choices"])
    assert 0 < tokens < 4000


def test_fp16_weights_are_served_in_fp32_on_a_cpu(model_dir, tmp_path):
    # A CPU's fp16 attention rounded a request differently with others beside it (the decode
    # group's padded keys): 3 of 14 requests' logprobs moved when batched. `--dtype auto`
    # keeps a checkpoint's dtype, so an fp16 HF model was served so by default.
    from bloomtrain.errors import UserError
    from bloomtrain.serve.tp import load_serving_model
    import copy
    ref, _ = model_dir
    copy.deepcopy(ref).half().save_pretrained(tmp_path / "fp16")  # the fixture's stays fp32
    model = load_serving_model(tmp_path / "fp16")  # --dtype auto
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(UserError, match="--dtype fp16 on a CPU is not batch invariant"):
        load_serving_model(tmp_path / "fp16", dtype="fp16")
    assert load_serving_model(tmp_path / "fp16", dtype="bf16").lm_head.weight.dtype == \
        torch.bfloat16
