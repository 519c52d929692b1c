"""Decode attention read in place from the paged KV cache with FlexAttention
(bloomtrain.model.paged_flex), against an independent reference and against the gather path.

The reference is written out here: for each sequence its keys and values picked slot by slot from
the cache's planes (position p in slot table[p // bs] * bs + p % bs), then softmax(q·kᵀ/√d +
slope·(k - q)) v in float64 with ALiBi's slopes from HF's formula. On CPU, FlexAttention's eager
(uncompiled) reference runs the same score_mod and mask_mod as the compiled kernel; the CUDA
tests (`-m device --device cuda`) run the compiled kernel, in the engine, graphs included.

Model for the engine tests: an HF BloomForCausalLM (hidden 64, 4 heads, 2 layers, vocab 512)
with widened weights, as tests/serve/test_serve_graphs.py's, so greedy tokens are not decided by
rounding.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bloomtrain.errors import UserError
from bloomtrain.model.bloom import alibi_slopes
from bloomtrain.model.paged_flex import DECODE_KERNEL_ENV, decode_kernel, flex_paged_decode
from bloomtrain.serve.batch import SeqStep, StepBatch
from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.engine import Engine
from bloomtrain.serve.graphs import DecodeGraphs
from bloomtrain.serve.kv_cache import PagedKVCache
from bloomtrain.serve.runner import plan_step
from bloomtrain.serve.sampling import SamplingParams
from bloomtrain.serve.tp import build_runner
from tests.serving import random_prompts, save_tiny_hf

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

NH, HD, BS = 4, 8, 8
VOCAB = 512


def random_cache(num_blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, BS, NH, HD, torch.float32, "cpu")
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=g))
    return cache, g


def decode_step(ctx_lens, tables):
    """One decode token per sequence (row i: sequence i), at context lengths `ctx_lens`."""
    return StepBatch([0] * len(ctx_lens), [SeqStep(i, 1, n, t[:-(-n // BS)])
                                           for i, (n, t) in enumerate(zip(ctx_lens, tables))],
                     list(range(len(ctx_lens))))


def attend(meta, q):
    """The decodes' context [nh, D, hd] of queries q [nh, D, hd], writing nothing."""
    meta = dataclasses.replace(meta, write_slots=meta.write_slots[:0], num_tokens=0)
    empty = torch.zeros((1, NH, 0, HD))
    return meta.attend(0, q[None], empty, empty)[0]


def reference(cache, q, ctx_lens, tables):
    """Float64, per sequence, its keys picked slot by slot (see the module docstring)."""
    slopes = alibi_slopes(NH).double()
    keys, values = (p.double().reshape(NH, -1, HD) for p in cache.kv[0])
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (n, table) in enumerate(zip(ctx_lens, tables)):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        k, v = keys[:, slots], values[:, slots]  # [nh, n, hd]
        alibi = slopes[:, None] * (torch.arange(n) - (n - 1)).double()  # [nh, n]
        scores = (k @ q[:, i].double()[:, :, None])[..., 0] / math.sqrt(HD) + alibi
        out[:, i] = (scores.softmax(-1)[:, None, :] @ v)[:, 0]
    return out


def shuffled_tables(g, num_blocks, per=6, count=5):
    order = torch.randperm(num_blocks, generator=g).tolist()
    return [order[i * per:(i + 1) * per] for i in range(count)]


def test_flex_decode_equals_gather_and_the_reference():
    """Five sequences of 1 to 46 tokens, blocks shuffled over the pool: the flex decode (eager
    reference kernel) equals the independent float64 result within fp32 rounding, and so does
    the gather path; the two agree with each other to a few fp32 ulps."""
    cache, g = random_cache()
    tables = shuffled_tables(g, 40)
    ctx_lens = [1, 8, 9, 33, 46]  # one slot, a full block, one past it, longer ones
    q = torch.randn((NH, len(ctx_lens), HD), generator=g)
    batch = decode_step(ctx_lens, tables)
    slopes = alibi_slopes(NH)
    _, gather, _ = plan_step(batch, cache, slopes, torch.float32, "cpu", 1, "gather")
    _, flex, _ = plan_step(batch, cache, slopes, torch.float32, "cpu", 1, "flex")
    assert flex.flex_decodes and not flex.decodes and gather.decodes
    want = reference(cache, q, ctx_lens, tables)
    # fp32 softmax and sums over <= 46 terms of O(1) values: 1e-5 is a few hundred ulps of
    # the outputs' scale, far below the O(0.1) change a wrong slot or slope makes.
    for meta in (flex, gather):
        assert torch.allclose(attend(meta, q).double(), want, atol=1e-5, rtol=0)
    assert torch.allclose(attend(flex, q), attend(gather, q), atol=1e-6, rtol=0)


def test_a_sequence_reads_only_its_own_blocks_and_positions():
    """Garbage in the table entries past a sequence's last block (another sequence's blocks,
    repeated), new values in every slot it does not own and in its own slots after its
    position: its flex result is bitwise unchanged, and equals its result decoded alone."""
    cache, g = random_cache()
    tables = shuffled_tables(g, 40)
    ctx_lens = [13, 30, 21, 5, 40]
    q = torch.randn((NH, 5, HD), generator=g)
    slopes = alibi_slopes(NH)

    def run(c, tabs, lens, qs):
        d = len(lens)
        return attend_flex(c, tabs, lens, qs, slopes, torch.arange(d))

    first = run(cache, tables, ctx_lens, q)
    # Sequence 0 (13 tokens: blocks 0 and 1 of its table); its table padded with sequence 1's.
    junk_tables = [tables[0][:2] + tables[1][:4]] + tables[1:]
    other = cache.kv[0].clone()
    mine = set(tables[0][:2])
    for b in range(other.shape[2]):
        if b not in mine:
            other[:, :, b] = 100 * torch.randn(other[:, :, b].shape, generator=g)
    other[:, :, tables[0][1], 13 - BS:] = 100.0  # its own block, past its position
    alone = run(cache, tables[:1], ctx_lens[:1], q[:, :1])
    cache.kv[0].copy_(other)
    again = run(cache, junk_tables, ctx_lens, q)
    assert torch.equal(again[:, 0], first[:, 0])
    assert torch.allclose(alone[:, 0], first[:, 0], atol=1e-6, rtol=0)


def attend_flex(cache, tables, ctx_lens, q, slopes, rows):
    """flex_paged_decode straight from (possibly junk-padded) tables, eager kernel."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    decode = flex_paged_decode(rows, padded, torch.tensor(ctx_lens) - 1, slopes, BS,
                               cache.num_blocks + 1, compiled=False)
    keys, values = cache.kv[0].view(2, 1, NH, -1, HD)
    return decode.attend(q, keys, values)


def test_decode_kernel_choice(monkeypatch):
    monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    assert decode_kernel("cpu", 16) == "gather"  # measured faster on CPU, batch invariant
    assert decode_kernel("cuda", 16) == "flex"
    assert decode_kernel("cuda", 8) == "gather"  # below the kernel's smallest tile
    assert decode_kernel("cpu", 8, "flex") == "flex"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "flex")
    assert decode_kernel("cpu", 16) == "flex"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "fast")
    with pytest.raises(UserError, match=DECODE_KERNEL_ENV):
        decode_kernel("cpu", 16)


# ---- the engine ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CFG = EngineConfig(max_model_len=128, block_size=16, kv_cache_tokens=2048, max_num_seqs=8,
                   max_batched_tokens=40, prefill_chunk=16, max_queue=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """(HF reference model, its save_pretrained directory)."""
    path = tmp_path_factory.mktemp("flex") / "tiny"
    ref = save_tiny_hf(path, VOCAB)
    return ref, path


def engine_tokens(path, cfg, decode, device="cpu", dtype=None, logprobs=None, static=False):
    """The engine's results for six prompts joining at different steps, and the prompts;
    `static`: decode-only steps on CUDA graphs' static buffers, run eagerly (CPU)."""
    runner = build_runner(path, cfg, device=device, dtype=dtype)
    runner.decode = decode
    if static:
        runner.graphs = DecodeGraphs(runner, cfg.max_num_seqs, cfg.max_model_len, capture=False)
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=logprobs)
    prompts = random_prompts([3, 9, 17, 30, 5, 40], seed=8)
    engine = Engine(runner.forward, cfg, vocab_size=VOCAB, device=runner.device)
    return engine.generate(prompts, params, arrival_steps=[0, 0, 2, 3, 5, 8]), prompts


def test_engine_greedy_tokens_equal_with_flex_and_gather_on_cpu(model_dir):
    """Requests joining at different steps (decode batches of 1 to 6, padded to 8 for flex):
    the engine's greedy tokens with flex decodes equal the gather path's and HF's, their
    logprobs within fp32 rounding."""
    ref, path = model_dir
    got, prompts = engine_tokens(path, CFG, "flex", logprobs=1)
    want, _ = engine_tokens(path, CFG, "gather", logprobs=1)
    for g, w, prompt in zip(got, want, prompts):
        assert g["token_ids"] == w["token_ids"]
        lp = torch.tensor([e.logprob for e in g["logprobs"]])
        assert torch.allclose(lp, torch.tensor([e.logprob for e in w["logprobs"]]), atol=1e-4)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                              do_sample=False)
        assert g["token_ids"] == hf[0, len(prompt):].tolist()


def test_static_graph_path_takes_flex_decodes(model_dir):
    """The CUDA-graph decode step's static buffers (run eagerly here, bloomtrain.serve.graphs)
    build the flex metadata from the buffers alone: same greedy tokens as the gather engine."""
    _, path = model_dir
    got, _ = engine_tokens(path, CFG, "flex", static=True)
    want, _ = engine_tokens(path, CFG, "gather")
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]


@pytest.mark.cuda_only
def test_cuda_flex_decode_tokens_equal_gather_in_fp32(model_dir, device):
    """fp32 on CUDA, the compiled kernel, with CUDA graphs (decode-only steps) and eagerly
    (mixed steps): greedy tokens equal the gather path's."""
    _, path = model_dir
    got, _ = engine_tokens(path, CFG, "flex", device=device, dtype="fp32")
    want, _ = engine_tokens(path, CFG, "gather", device=device, dtype="fp32")
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]


@pytest.mark.cuda_only
def test_cuda_flex_decode_logits_within_bf16_rounding(model_dir, device):
    """bf16 on CUDA, eager steps: five sequences decode four tokens; each step's logits with
    flex decodes equal the gather path's within bf16 rounding of the largest logit."""
    _, path = model_dir
    cfg = dataclasses.replace(CFG, enforce_eager=True)
    runners = {k: build_runner(path, cfg, device=device, dtype="bf16") for k in ("flex", "gather")}
    prompts = random_prompts([4, 12, 20, 25, 9], seed=7)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]
    seqs, row = [], 0
    for p, t in zip(prompts, tables):
        seqs.append(SeqStep(row, len(p), len(p), t[:-(-len(p) // CFG.block_size)]))
        row += len(p)
    tokens = [1, 2, 3, 4, 5]
    with torch.inference_mode():
        for kind, r in runners.items():
            r.decode = kind
            r.forward(StepBatch(sum(prompts, []), seqs, []))
        for t in range(4):
            lens = [len(p) + 1 + t for p in prompts]
            batch = StepBatch(tokens, [SeqStep(i, 1, n, tb[:-(-n // CFG.block_size)])
                                       for i, (n, tb) in enumerate(zip(lens, tables))],
                              list(range(5)))
            flex, gather = (runners[k].forward(batch).cpu() for k in ("flex", "gather"))
            # 8 bf16 ulps (2^-8 each) of the largest logit: different kernels' roundings
            # through two layers and the head, not a wrong block or position.
            assert (flex - gather).abs().max() <= 2 ** -5 * gather.abs().max(), t
            tokens = gather.argmax(-1).tolist()
