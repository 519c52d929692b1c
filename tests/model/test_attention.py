"""The attention kernels (bloomtrain.model.attention): FlexAttention with an ALiBi score_mod and a
causal BlockMask against SDPA with the float bias (`train.attention`'s resolution is
tests/test_layout.py's).

Compiled flex_attention runs forward on CPU, so logits, queries at an offset and HF parity are
checked everywhere. It has no backward on CPU (torch 2.13), so gradient parity runs with `--device cuda`
(tests/conftest.py). Each compiled shape costs seconds on CPU; the tests share three: batch 2,
head_dim 16, (4 heads, 32 x 32), (6 heads, 32 x 32) and (4 heads, 8 queries x 32 keys).

Tolerance: 1e-5 max abs on fp32 logits of size ~2 (gradients: 1e-5 relative). Both kernels add
the same fp32 bias slope * (k - q) to the same scores; they may differ only in the order of the
online softmax's sums (on CPU they agreed bit for bit; on CUDA blocked sums differ by ~1e-7
relative). A wrong slope, head order or query offset moves logits by > 1e-2.
"""
from __future__ import annotations

import pytest
import torch

import bloomtrain
from bloomtrain.model import BloomShape, build_model
from bloomtrain.model.attention import EagerBias, FlexAlibi, attention_core
from bloomtrain.errors import UserError
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

LOGITS_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
BATCH, SEQ = 2, 32


def tiny(num_heads: int) -> BloomShape:
    hidden = 16 * num_heads  # head_dim 16 whatever the head count
    return BloomShape(vocab_size=256, hidden_size=hidden, num_layers=2, num_heads=num_heads,
                      ffn_hidden_size=4 * hidden)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _logits(model, ids, impl):
    model.transformer.attention_impl = impl
    with torch.no_grad():
        return model(ids).cpu()


@pytest.mark.parametrize("num_heads", [4, 6], ids=["4heads", "6heads"])
def test_flex_logits_match_sdpa(num_heads, ids, device):
    # 6 heads: the slopes are not one geometric sequence (docs/bloom_facts.md §8).
    model = build_model(tiny(num_heads), seed=1, device=device).eval()
    x = ids[:, :SEQ].to(device)
    assert isinstance(model.transformer.attention_bias(SEQ, SEQ, torch.float32), torch.Tensor)
    want = _logits(model, x, "sdpa")
    got = _logits(model, x, "flex")
    assert isinstance(model.transformer.attention_bias(SEQ, SEQ, torch.float32), FlexAlibi)
    assert (got - want).abs().max().item() < LOGITS_ATOL


def _offset_core(impl: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last 8 of 32 queries attended alone, with the bias of 8 queries over 32 keys; the
    same rows of all 32 attended with SDPA's full bias) for random q, k, v of 4 heads."""
    model = build_model(tiny(4), seed=1, device=device).eval()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(BATCH, 4, SEQ, 16, generator=g).to(device) for _ in range(3))
    tr = model.transformer
    full = attention_core(q, k, v, tr.attention_bias(SEQ, SEQ, torch.float32))[:, :, 24:]
    tr.attention_impl = impl
    with torch.no_grad():
        part = attention_core(q[:, :, 24:], k, v, tr.attention_bias(8, SEQ, torch.float32))
    return part.cpu(), full.cpu()


def test_flex_queries_at_an_offset_match_the_full_sequence(device):
    """Queries are the last 8 of 32 positions: the score_mod and the BlockMask take the offset
    (inference reads the paged cache through the engine; the kernel keeps the general form)."""
    part, full = _offset_core("flex", device)
    assert (part - full).abs().max().item() < LOGITS_ATOL


def test_flex_matches_hf_logits(ids, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.hf_reference import ATOL, make_hf_model  # the HF parity tolerance, unchanged

    ref = make_hf_model({"hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256}, seed=4,
                        perturb=True)
    assert isinstance(ref, transformers.BloomForCausalLM)
    x = ids[:, :SEQ]
    with torch.no_grad():
        want = ref(x).logits
    ref.save_pretrained(tmp_path / "hf")
    model = bloomtrain.load_model(tmp_path / "hf")
    assert model.transformer.attention_impl == "sdpa"  # load_model's default
    assert (_logits(model, x, "flex") - want).abs().max().item() < ATOL


@pytest.mark.cuda_only  # FlexAttention has no backward on CPU (torch 2.13)
@pytest.mark.parametrize("num_heads", [4, 6], ids=["4heads", "6heads"])
def test_flex_gradients_match_sdpa(num_heads, ids, device):
    results = {}
    for impl, mode in (("sdpa", "none"), ("flex", "none"), ("flex", "selective")):
        model = build_model(tiny(num_heads), seed=1, device=device).train()
        model.transformer.attention_impl = impl
        model.set_activation_checkpointing(mode)
        x = ids.to(device)
        loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        results[impl, mode] = (loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    want_loss, want = results["sdpa", "none"]
    for key in (("flex", "none"), ("flex", "selective")):
        loss, grads = results[key]
        assert loss == pytest.approx(want_loss, rel=1e-6), key
        for n, g in want.items():
            torch.testing.assert_close(grads[n], g, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_flex_attention_refuses_dropout():
    with pytest.raises(UserError, match="FlexAttention has no attention dropout"):
        bias = FlexAlibi(torch.ones(4), None)
        attention_core(*(torch.zeros(1, 4, 2, 8) for _ in range(3)), bias, dropout_p=0.1)


def test_parallelize_sets_kernel_and_recompute_mode():
    parts = helpers.build(helpers.config(attention="auto", activation_checkpointing="selective"),
                          engine=False)
    (chunk,) = parts.chunks
    assert chunk.transformer.attention_impl == "sdpa"
    assert chunk.transformer.activation_checkpointing == "selective"
    cfg = helpers.config(attention="flex")
    cfg.model.attention_dropout = 0.1
    with pytest.raises(UserError, match="model.attention_dropout=0"):
        helpers.build(cfg, engine=False)
    model = build_model(tiny(4))
    model.transformer.attention_impl = "flash"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        model(torch.zeros(1, 4, dtype=torch.long))


# ---- the eager kernel (HF BloomAttention's math) ------------------------------------------------

def _loss_and_grads(impl, mode, ids, dtype=torch.float32, dropout=0.0, seed=0):
    shape = tiny(4).replace(attention_dropout=dropout)
    model = build_model(shape, seed=1).to(dtype).train()
    model.transformer.attention_impl = impl
    model.set_activation_checkpointing(mode)
    torch.manual_seed(seed)
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_eager_matches_sdpa_logits_grads_and_kv_cache(ids):
    model = build_model(tiny(6), seed=1).eval()
    x = ids[:, :SEQ]
    want = _logits(model, x, "sdpa")
    got = _logits(model, x, "eager")
    assert isinstance(model.transformer.attention_bias(SEQ, SEQ, torch.float32), EagerBias)
    assert (got - want).abs().max().item() < LOGITS_ATOL
    part, full = _offset_core("eager", "cpu")  # queries at an offset: the last 8 of 32
    assert (part - full).abs().max().item() < LOGITS_ATOL
    want_loss, want_g = _loss_and_grads("sdpa", "none", ids)
    for mode in ("none", "selective"):  # attention_core is the recompute unit
        loss, grads = _loss_and_grads("eager", mode, ids)
        assert loss == pytest.approx(want_loss, rel=1e-6), mode
        for n, g in want_g.items():
            torch.testing.assert_close(grads[n], g, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_eager_bf16_close_to_sdpa_and_fp32(ids):
    ref_loss, ref = _loss_and_grads("sdpa", "none", ids)
    for impl in ("sdpa", "eager"):
        loss, grads = _loss_and_grads(impl, "none", ids, dtype=torch.bfloat16)
        assert loss == pytest.approx(ref_loss, rel=2e-2), impl
        for n, g in ref.items():  # bf16 rounding: a few percent of each tensor's scale
            err = (grads[n] - g).abs().max().item()
            assert err <= 0.05 * g.abs().max().item() + 1e-4, (impl, n, err)


def test_eager_dropout_replays_under_selective_recompute(ids):
    loss0, plain = _loss_and_grads("eager", "none", ids, dropout=0.0)
    loss, want = _loss_and_grads("eager", "none", ids, dropout=0.3, seed=7)
    assert loss != loss0  # the dropout acts (near-uniform logits: a small change)
    assert max((want[n] - plain[n]).abs().max().item() for n in want) > 1e-4
    got_loss, got = _loss_and_grads("eager", "selective", ids, dropout=0.3, seed=7)
    assert got_loss == loss
    for n, g in want.items():  # recompute restores the RNG: the same mask
        torch.testing.assert_close(got[n], g, rtol=0, atol=0)


def test_eager_matches_hf_logits(ids, tmp_path):
    from tests.hf_reference import ATOL, make_hf_model

    ref = make_hf_model({"hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256}, seed=4,
                        perturb=True)
    x = ids[:, :SEQ]
    with torch.no_grad():
        want = ref(x).logits
    ref.save_pretrained(tmp_path / "hf")
    model = bloomtrain.load_model(tmp_path / "hf")
    assert (_logits(model, x, "eager") - want).abs().max().item() < ATOL
