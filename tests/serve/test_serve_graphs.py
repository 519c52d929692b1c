"""Decode steps from CUDA graphs (bloomtrain.serve.graphs): on static buffers at padded batch
sizes and key widths, padding rows writing only the cache's scratch block, eager for every
other step, and `--enforce-eager` turning them off.

On CPU the static-buffer path runs eagerly (capture=False): the same inputs, padding and model
code as a replayed graph, checked bitwise against the normal decode (the engine's batch
invariance, bloomtrain.serve.runner, makes padded and unpadded steps bitwise equal on CPU).
The CUDA tests (`-m device --device cuda`, bench/gpu.sh) capture and replay real graphs.

Model: an HF BloomForCausalLM (hidden 64, 4 heads, 2 layers, vocab 512) with widened weights,
as tests/serve/test_serve.py's, so that greedy tokens are not decided by rounding.
"""
from __future__ import annotations

import pytest
import torch

from bloomtrain.serve.batch import SeqStep, StepBatch
from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.engine import Engine
from bloomtrain.serve.graphs import DecodeGraphs, graphs_wanted
from bloomtrain.serve.sampling import SamplingParams
from bloomtrain.serve.tp import build_runner
from tests.serving import random_prompts, save_tiny_hf

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512
CFG = EngineConfig(max_model_len=128, block_size=8, kv_cache_tokens=2048, max_num_seqs=8,
                   max_batched_tokens=40, prefill_chunk=16, max_queue=64)
BLOCKS = 16  # blocks per sequence in the hand-built steps: 128 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """(HF reference model, its save_pretrained directory)."""
    path = tmp_path_factory.mktemp("graphs") / "tiny"
    ref = save_tiny_hf(path, VOCAB)
    return ref, path


def lp_values(result):
    return [(e.token_id, e.logprob, e.top) for e in result["logprobs"]]


def static_path(runner, sizes=None, max_model_len=CFG.max_model_len):
    """The graph path without graphs: the static-buffer decode run eagerly."""
    runner.graphs = DecodeGraphs(runner, CFG.max_num_seqs, max_model_len, capture=False,
                                 sizes=sizes)
    return runner.graphs


def prefill(runner, prompts):
    """Prompts of sequence i in blocks [i * BLOCKS, (i + 1) * BLOCKS), one prefill step (eager
    whatever `runner.graphs`); returns the block tables."""
    tables = [list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(len(prompts))]
    seqs, row = [], 0
    for p, t in zip(prompts, tables):
        seqs.append(SeqStep(row, len(p), len(p), t[:-(-len(p) // CFG.block_size)]))
        row += len(p)
    runner.forward(StepBatch(sum(prompts, []), seqs, []))
    return tables


def decode_batch(tokens, ctx_lens, tables):
    """One decode token per sequence, at context lengths `ctx_lens` (after the step)."""
    bs = CFG.block_size
    return StepBatch(list(tokens), [SeqStep(i, 1, n, t[:-(-n // bs)])
                                    for i, (n, t) in enumerate(zip(ctx_lens, tables))],
                     list(range(len(tokens))))


# ---- CPU: the static-buffer path against the normal decode -----------------------------------

def test_static_decode_path_equals_eager_bitwise(model_dir):
    """Seven requests joining at different steps (decode batches of 1 to 7 sequences, padded
    to 1, 2, 4 or 8), greedy and seeded sampling mixed: every token and logprob bitwise those
    of the eager engine."""
    _, path = model_dir
    prompts = random_prompts([3, 9, 17, 30, 5, 12, 40], seed=4)
    params = [SamplingParams(max_tokens=20, temperature=0, logprobs=2) if i % 2 == 0 else
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=i, logprobs=2)
              for i in range(len(prompts))]
    arrivals = [0, 0, 2, 3, 5, 8, 11]
    eager = Engine(build_runner(path, CFG).forward, CFG, vocab_size=VOCAB)
    want = eager.generate(prompts, params, arrival_steps=arrivals)
    runner = build_runner(path, CFG)
    graphs = static_path(runner)
    sizes = []
    run = graphs.run
    graphs.run = lambda batch: (sizes.append(graphs.shape_for(batch)), run(batch))[1]
    got = Engine(runner.forward, CFG, vocab_size=VOCAB).generate(prompts, params,
                                                                 arrival_steps=arrivals)
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"] and len(g["token_ids"]) == 20
        assert lp_values(g) == lp_values(w)  # bitwise
    used = {s for s in sizes if s is not None}
    assert graphs.replays == len([s for s in sizes if s is not None]) > 20
    assert {size for size, _ in used} >= {1, 2, 4, 8}  # 3, 5, 6, 7 sequences were padded
    assert len({keys for _, keys in used}) >= 2  # more than one key width
    assert None in sizes  # the steps with prompt chunks ran eagerly


def test_padding_rows_write_only_the_scratch_block(model_dir):
    """Three sequences decoding, padded to four: the static step's logits are bitwise the
    eager step's, and the only KV-cache block that differs afterwards is the scratch block
    (real slots rewritten with the same values; the padding row wrote the scratch block)."""
    _, path = model_dir
    runner = build_runner(path, CFG)
    prompts = random_prompts([5, 19, 11], seed=5)
    tables = prefill(runner, prompts)
    batch = decode_batch([7, 8, 9], [len(p) + 1 for p in prompts], tables)
    with torch.inference_mode():
        want = runner.forward(batch)  # eager: runner.graphs is None
        before = {i: kv.clone() for i, kv in runner.cache.kv.items()}
        graphs = static_path(runner)
        assert graphs.shape_for(batch) == (4, 32)
        got = runner.forward(batch)
    assert graphs.replays == 1
    assert torch.equal(got, want)
    scratch = runner.cache.scratch_block
    for i, kv in runner.cache.kv.items():
        assert torch.equal(kv[:, :, :scratch], before[i][:, :, :scratch])
        assert not torch.equal(kv[:, :, scratch], before[i][:, :, scratch])


def test_shapes_outside_the_captured_set_run_eagerly(model_dir):
    """A batch larger than the largest size, a step with a prompt chunk, logit rows other than
    one per sequence, or a context beyond the buffers' width: `run` declines (None) and the
    runner's eager step gives the logits, equal to a runner without the path."""
    _, path = model_dir
    runner, plain = build_runner(path, CFG), build_runner(path, CFG)
    graphs = static_path(runner, sizes=(1, 2), max_model_len=64)
    prompts = random_prompts([6, 70, 13], seed=6)
    tables = prefill(runner, prompts)
    prefill(plain, prompts)
    lens = [len(p) + 1 for p in prompts]
    three = decode_batch([1, 2, 3], lens, tables)
    long_ctx = decode_batch([2], lens[1:2], tables[1:2])  # 71 tokens > 64
    not_rows = StepBatch([1, 2], three.seqs[:2], [1, 0])
    chunk = StepBatch([4, 5, 6], [SeqStep(0, 1, lens[0], tables[0][:1]),
                                  SeqStep(1, 2, 8, tables[2][:1])], [0, 2])
    for batch in (three, long_ctx, not_rows, chunk):
        assert graphs.shape_for(batch) is None
    assert graphs.shape_for(decode_batch([1, 2], lens[::2], tables[::2])) == (2, 32)
    with torch.inference_mode():
        for batch in (three, long_ctx):
            assert torch.equal(runner.forward(batch), plain.forward(batch))
    assert graphs.replays == 0


def test_static_decode_step_traces_as_one_graph(model_dir):
    """The step a graph captures (`DecodeGraphs._step`) traces whole under torch.compile's
    fullgraph mode: no host sync (.item(), .tolist()) and no Python branching on tensor values
    inside it, either of which a CUDA capture would reject or freeze. On CPU it reads the cache
    through the CPU gather (on CUDA: one index_select); the eager backend, so nothing compiles."""
    _, path = model_dir
    graphs = static_path(build_runner(path, CFG))
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            want = graphs._step(4, 64)
            got = torch.compile(graphs._step, fullgraph=True, backend="eager")(4, 64)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)


def test_enforce_eager_parses_and_reaches_the_runner(model_dir, tmp_path, monkeypatch):
    """`bloomtrain serve --enforce-eager` sets EngineConfig.enforce_eager, which build_runner
    hands to use_decode_graphs; graphs are only wanted on CUDA at tp=1 without it."""
    from bloomtrain.cli import build_parser
    from bloomtrain.serve import cli
    from bloomtrain.serve.offline import offline_engine

    argv = ["serve", "--checkpoint", str(tmp_path)]
    for extra, want in (([], False), (["--enforce-eager"], True)):
        args = build_parser(argv + extra).parse_args(argv + extra)
        assert cli._engine_config(vars(args)).enforce_eager is want
    assert graphs_wanted("cuda", None, False)
    assert not graphs_wanted("cuda", None, True)
    assert not graphs_wanted("cuda", object(), False)  # tensor parallel: eager
    assert not graphs_wanted("cpu", None, False)
    seen = []
    model = build_runner(model_dir[1], CFG).model
    with monkeypatch.context() as m:
        m.setattr("bloomtrain.serve.graphs.use_decode_graphs",
                  lambda runner, n, length, eager: seen.append((n, length, eager)))
        build_runner(model_dir[1], EngineConfig(**{**CFG.__dict__, "enforce_eager": True}))
        engine = offline_engine(model, num_seqs=2, max_len=32, longest_prompt=8,
                                enforce_eager=True)
    assert seen == [(CFG.max_num_seqs, CFG.max_model_len, True), (2, 32, True)]
    assert engine.config.enforce_eager
    with pytest.raises(Exception, match="enforce_eager"):
        EngineConfig(enforce_eager="yes").check()


# ---- CUDA: captured graphs against eager ------------------------------------------------------

@pytest.mark.cuda_only
def test_cuda_graph_logits_equal_eager_within_bf16_rounding(model_dir, device):
    """bf16 on CUDA: five sequences (padded to 8) decode four tokens; at each step the graph's
    logits equal the eager step's within bf16 rounding of the largest logit (the two run
    different kernels: other batch and key shapes). Graphs captured once per shape, replayed."""
    _, path = model_dir
    cfg = EngineConfig(**{**CFG.__dict__, "enforce_eager": False})
    runner = build_runner(path, cfg, device=device, dtype="bf16")
    graphs = runner.graphs
    assert graphs is not None and graphs.capture
    prompts = random_prompts([4, 12, 20, 25, 9], seed=7)
    tables = prefill(runner, prompts)
    tokens = [1, 2, 3, 4, 5]
    for t in range(4):
        batch = decode_batch(tokens, [len(p) + 1 + t for p in prompts], tables)
        with torch.inference_mode():
            runner.graphs = None
            eager = runner.forward(batch).cpu()
            runner.graphs = graphs
            got = runner.forward(batch).cpu()
        # 8 bf16 ulps (2^-8 each) of the largest logit: a few roundings apart, through two
        # layers and the head, not a wrong row or a stale input.
        assert (got - eager).abs().max() <= 2 ** -5 * eager.abs().max(), t
        tokens = eager.argmax(-1).tolist()
    assert list(graphs.graphs) == [(8, 32)] and graphs.replays == 4


@pytest.mark.cuda_only
def test_cuda_graph_greedy_tokens_equal_eager_in_fp32(model_dir, device):
    """fp32 on CUDA: requests joining at different steps (decode batches of 1 to 6, padded),
    greedy: the engine with graphs gives exactly the eager engine's tokens, and HF's."""
    ref, path = model_dir
    prompts = random_prompts([3, 9, 17, 30, 5, 40], seed=8)
    params = SamplingParams(max_tokens=24, temperature=0)
    arrivals = [0, 0, 2, 3, 5, 8]
    out = {}
    for eager in (False, True):
        cfg = EngineConfig(**{**CFG.__dict__, "enforce_eager": eager})
        runner = build_runner(path, cfg, device=device, dtype="fp32")
        assert (runner.graphs is None) is eager
        engine = Engine(runner.forward, cfg, vocab_size=VOCAB, device=runner.device)
        out[eager] = [r["token_ids"] for r in engine.generate(prompts, params, arrivals)]
        if not eager:
            assert runner.graphs.replays > 20 and len(runner.graphs.graphs) >= 3
    assert out[False] == out[True]
    for prompt, got in zip(prompts, out[False]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False)
        assert got == hf[0, len(prompt):].tolist()
