"""Eval's loglikelihood scoring (bloomtrain.eval.forward.score) packs a batch's rows into one
padding-free row of tokens, each attending causally to itself with no KV cache
(bloomtrain.model.attention.PackedAttention). Checked here against an independent reference:
HF transformers' BloomForCausalLM, run on each request alone, its log_softmax and argmax at every
position; on requests of very different lengths (1 to 150 tokens), in one micro-batch and in
several, with greedy flags both ways. Layouts (tp, pp, dp) giving one process's answers:
tests/eval/test_eval.py.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bloomtrain.eval import forward, protocol  # noqa: E402
from bloomtrain.eval.model import load_eval_model  # noqa: E402
from bloomtrain.model.attention import PackedAttention  # noqa: E402
from bloomtrain.model.bloom import packed_attention  # noqa: E402
from bloomtrain.topology import Topology  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
LENGTHS = [150, 1, 37, 2, 96, 5, 64, 3]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random HF Bloom (biases and LayerNorms moved off their init) and its directory."""
    cfg = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=3, vocab_size=VOCAB)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.BloomForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name or "layernorm" in name or "ln_f" in name:
                    p.add_(0.2 * torch.randn_like(p))
    model.eval()
    path = tmp_path_factory.mktemp("hf_bloom")
    model.save_pretrained(path)
    return model, path


def requests(model, seed: int = 1) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Rows of LENGTHS random tokens, and a query at every position of each: at even positions
    the token HF's model ranks first there (greedy), at odd ones a random token (almost never
    greedy), so that greedy flags go both ways."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    queries = []
    for r, row in enumerate(rows):
        with torch.no_grad():
            top = model(torch.tensor([row])).logits[0].argmax(-1).tolist()
        for p in range(len(row)):
            target = top[p] if p % 2 == 0 else int(torch.randint(0, VOCAB, (1,), generator=g))
            queries.append((r, p, target))
    return rows, queries


def hf_reference(model, rows, queries) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's log-probability and greedy flag from HF's model on its row alone."""
    with torch.no_grad():
        logits = [model(torch.tensor([row])).logits[0].double() for row in rows]
    lp = torch.tensor([logits[r][p].log_softmax(-1)[t].item() for r, p, t in queries])
    greedy = torch.tensor([int(logits[r][p].argmax()) == t for r, p, t in queries])
    return lp, greedy


@pytest.mark.parametrize("micro_rows", [None, 3], ids=["one-micro-batch", "micro-batches-of-3"])
def test_packed_scoring_equals_hf_on_each_request_alone(hf_model, micro_rows):
    model, path = hf_model
    rows, queries = requests(model)
    want_lp, want_greedy = hf_reference(model, rows, queries)
    executor = protocol.Executor(load_eval_model(path, Topology.single(), "cpu"), micro_rows)
    got = executor.score(rows, queries)
    assert want_greedy.any() and not want_greedy.all()
    # fp32 on both sides; per-token log-probabilities, HF's from a log_softmax over the whole
    # row, ours from the max and the sum of exponentials.
    assert (got[0].double() - want_lp).abs().max() < 1e-5
    assert torch.equal(got[1] > 0.5, want_greedy)


def test_packed_scoring_equals_the_padded_forward(hf_model):
    """The same batch through the right-padded path (sequence parallelism's): the same
    figures within fp32 rounding (SDPA on padded rows against per-sequence eager attention)."""
    hf, path = hf_model
    rows, queries = requests(hf, seed=2)
    model = load_eval_model(path, Topology.single(), "cpu")
    executor = protocol.Executor(model)
    packed = executor.score(rows, queries)
    model.sequence_parallel = True  # tp = 1: only the padded path changes
    try:
        padded = executor.score(rows, queries)
    finally:
        model.sequence_parallel = False
    assert (packed[0] - padded[0]).abs().max() < 1e-5
    assert torch.equal(packed[1], padded[1]) and 0 < int(packed[1].sum()) < len(queries)


def test_packed_attention_is_each_sequence_alone():
    """One layer's attention over three packed sequences equals each sequence's causal ALiBi
    attention alone (the training forward's SDPA bias), and shorter sequences use the top-left
    corner of the longest one's bias."""
    from bloomtrain.model.bloom import alibi_causal_bias, alibi_slopes

    g = torch.Generator().manual_seed(3)
    lengths, nh, hd = [7, 1, 12], 4, 8
    q, k, v = (torch.randn((1, nh, sum(lengths), hd), generator=g) for _ in range(3))
    slopes = alibi_slopes(nh)
    meta = packed_attention(lengths, slopes, torch.float32)
    assert isinstance(meta, PackedAttention) and meta.spans == [(0, 7), (7, 8), (8, 20)]
    got = meta.attend(0, q, k, v)
    for start, end in meta.spans:
        n = end - start
        bias = alibi_causal_bias(slopes, n, n, torch.float32)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], attn_mask=bias)
        torch.testing.assert_close(got[:, :, start:end], want, atol=1e-6, rtol=1e-5)


def test_scoring_writes_no_kv_cache(hf_model, monkeypatch):
    """A scoring step never builds the engine's KV cache: it has nothing to decode."""
    from bloomtrain.serve import kv_cache

    def refuse(*args, **kwargs):
        raise AssertionError("scoring built a KV cache")

    monkeypatch.setattr(kv_cache.PagedKVCache, "__init__", refuse)
    rows, queries = requests(hf_model[0])
    model = load_eval_model(hf_model[1], Topology.single(), "cpu")
    batch = score_batch(rows, queries)
    assert forward.score(model, batch).shape == (2, len(queries))


def score_batch(rows, queries) -> forward.ScoreBatch:
    """The batch a SCORE command carries: rows right-padded, their lengths, the queries."""
    inputs = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.int64)
    for i, r in enumerate(rows):
        inputs[i, :len(r)] = torch.tensor(r)
    q = torch.tensor(queries, dtype=torch.int64).t()
    return forward.ScoreBatch(inputs, torch.tensor([len(r) for r in rows]), q[0], q[1], q[2])
