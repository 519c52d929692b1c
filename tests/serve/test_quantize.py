"""INT8 weights (bloomtrain.serve.quantize): the per-row absmax scheme, model bytes, the
perplexity change on a trained model, tensor-parallel quantization equal to tp=1's, and
`bloomtrain generate --quantize int8`."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import bloomtrain
from bloomtrain import checkpoint
from bloomtrain.cli import main
from bloomtrain.generate import generate
from bloomtrain.model import BloomShape, build_model
from bloomtrain.serve.quantize import Int8Linear, model_bytes, quantize_model, quantize_rows
from tests.dist import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   ffn_hidden_size=256)


def test_quantize_rows():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (32,)
    absmax = w.abs().amax(1)
    live = absmax > 0
    # Symmetric absmax: each row's largest magnitude maps to +-127, rounding error <= s/2.
    assert torch.equal(q[live].abs().amax(1), torch.full((31,), 127, dtype=torch.int8))
    assert torch.equal(q[3], torch.zeros(48, dtype=torch.int8))
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()


def test_fp16_products_that_fit_fp16_stay_finite():
    """In fp16, x·qᵀ before the row scale is 127 / absmax(row) times the output: outputs of a
    few hundred over rows of small weights were inf (an fp16 model's generate then printed
    junk), though the output fits fp16. The reference is the dequantized weight in fp32."""
    from bloomtrain.serve.quantize import int8_matmul
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.01
    x = torch.randn(4, 256, generator=g) * 100  # outputs of tens, rows of absmax ~0.04
    q, scale = quantize_rows(w)
    ref = x @ (q.float() * scale[:, None]).t()
    assert ref.abs().max() < 65504 < (x @ q.float().t()).abs().max()  # before the scale: past
    got = int8_matmul(x.half(), q, scale)
    assert torch.isfinite(got).all()
    assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # bf16 and fp32 keep the scale after the product (their range has room).
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = int8_matmul(x.to(dtype), q, scale).float()
        assert (got - ref).abs().max() <= tol * ref.abs().max(), dtype


def markov_batches(num, seq, seed):
    """Sequences from a sparse random Markov chain (4 successors per token): structure a small
    model learns in a few dozen steps, so its weights are trained, not random."""
    g = torch.Generator().manual_seed(1234)
    succ = torch.randint(0, SHAPE.vocab_size, (SHAPE.vocab_size, 4), generator=g)
    g.manual_seed(seed)
    x = torch.empty(num, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, SHAPE.vocab_size, (num,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 4, (num,), generator=g)
        x[:, t] = succ[x[:, t - 1], pick]
    return x


def perplexity(model, data):
    with torch.no_grad():
        logits = model(data[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
    return math.exp(loss.item())


def test_int8_perplexity_and_bytes():
    torch.manual_seed(0)
    model = build_model(SHAPE, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = markov_batches(16 * 80, 33, seed=1)
    for step in range(80):
        loss = model(train[step * 16:(step + 1) * 16, :-1],
                     labels=train[step * 16:(step + 1) * 16, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    valid = markov_batches(64, 33, seed=2)
    ppl = perplexity(model, valid)
    assert ppl < 40  # trained: a uniform guess is 256, the chain's floor is 4
    q = quantize_model(copy.deepcopy(model))
    ppl_q = perplexity(q, valid)
    delta = (ppl_q - ppl) / ppl
    print(f"\nvalid perplexity fp32 {ppl:.4f}, int8 {ppl_q:.4f}: {100 * delta:+.3f}% "
          f"(bytes {model_bytes(q)} vs {model_bytes(model)}: "
          f"{model_bytes(q) / model_bytes(model):.3f})")
    assert abs(delta) <= 0.01  # the goal: <= 1% relative
    # One byte per element of every matrix and of the tied embedding, which is stored once;
    # per-row scales, biases and LayerNorms in fp32.
    matrices = [m for m in q.modules() if isinstance(m, Int8Linear)]
    assert len(matrices) == 4 * SHAPE.num_layers
    emb = q.transformer.word_embeddings
    assert emb.weight_int8.dtype == torch.int8 and q.lm_head(torch.zeros(1, 64)).shape == (1, 256)
    int8 = sum(m.weight_int8.numel() for m in matrices) + emb.weight_int8.numel()
    scales = sum(m.scale.numel() for m in matrices) + emb.scale.numel()
    rest = sum(p.numel() for n, p in q.named_parameters())
    slopes = q.transformer.alibi_slopes.numel()
    assert model_bytes(q) == int8 + 4 * (scales + rest + slopes)
    assert model_bytes(model) == 4 * (int8 + rest + slopes)


def _tp_quantized(rank, world, shape):
    from bloomtrain.parallel.tensor.plan import apply_tensor_parallel
    from bloomtrain.topology import Topology

    topo = Topology.build(tp=world)
    model = apply_tensor_parallel(build_model(shape, seed=7).eval(), topo)
    quantize_model(model)
    dense = model.transformer.h[0].self_attention.dense  # row-parallel: shards of each row
    qkv = model.transformer.h[0].self_attention.query_key_value  # column-parallel
    ids = torch.randint(0, shape.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)  # [b, s, V / tp]
    return {"dense": (dense.weight_int8, dense.scale), "qkv": (qkv.weight_int8, qkv.scale),
            "logits": logits}


def test_tensor_parallel_int8_equals_tp1():
    """Quantized after the tp=2 split, each rank holds exactly its piece of the tp=1 int8
    weights (row-parallel scales come from the full rows), and the logits agree to fp32
    rounding (1e-5: the row-parallel sums are added in another order)."""
    shape = SHAPE
    ranks = run_ranks(2, _tp_quantized, shape)
    full = quantize_model(build_model(shape, seed=7).eval())
    att = full.transformer.h[0].self_attention
    dq, ds = att.dense.weight_int8, att.dense.scale
    assert torch.equal(torch.cat([r["dense"][0] for r in ranks], dim=1), dq)
    assert all(torch.equal(r["dense"][1], ds) for r in ranks)
    assert torch.equal(torch.cat([r["qkv"][0] for r in ranks]), att.query_key_value.weight_int8)
    ids = torch.randint(0, shape.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = full(ids)
    got = torch.cat([r["logits"] for r in ranks], dim=-1)
    assert (got - want).abs().max().item() < 1e-5


def test_cli_generate_int8(tmp_path, tiny_tokenizer_dir, capsys):
    from bloomtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    shape = BloomShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    checkpoint.save_checkpoint(tmp_path, 1, build_model(shape, seed=3).state_dict(), shape,
                               tokenizer=tok)
    prompt = "The quick brown fox"
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", prompt,
                 "--max-new-tokens", "8", "--quantize", "int8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    model = quantize_model(bloomtrain.load_model(tmp_path))
    ids = torch.tensor([tok.encode(prompt)])
    new = generate(model, ids, 8, eos_token_id=tok.eod_id,
                   vocab_limit=tok.vocab_size)[0, ids.shape[1]:].tolist()
    new = new[:new.index(tok.eod_id)] if tok.eod_id in new else new
    assert out == tok.decode(ids[0].tolist() + new) + "\n"
    with pytest.raises(SystemExit):  # argparse: int8 is the only choice
        main(["generate", "--checkpoint", str(tmp_path), "--prompt", prompt,
              "--quantize", "int4"])
