import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from bloomtrain.config import ModelConfig
from bloomtrain.model import (BloomForCausalLM, BloomShape, alibi_slopes, build_model,
                              resolve_model_config)
from bloomtrain.model.presets import megatron_tflops
from bloomtrain.errors import UserError

# Published parameter counts (docs/bloom_facts.md §1, §3).
PUBLISHED = {
    "bloom-560m": 559_214_592,
    "bloom-1b1": 1_065_314_304,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
    "bloom-176b": 176_247_271_424,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts(preset):
    shape = resolve_model_config(ModelConfig(preset=preset))
    assert shape.num_parameters() == PUBLISHED[preset]
    if preset != "bloom-176b":  # count the real module too (on the meta device: no memory)
        with torch.device("meta"):
            model = BloomForCausalLM(shape)
        assert sum(p.numel() for p in model.parameters()) == PUBLISHED[preset]


def test_preset_with_bloom_tokenizer_keeps_published_vocab():
    shape = resolve_model_config(ModelConfig(preset="bloom-560m"), vocab_size=250680)
    assert shape.vocab_size == 250880
    # The published size is a floor that is padded too: at tp=3 a multiple of 384 kept
    # 250,880 (no multiple of 3 or 384), and the layout error asked for the 384 that was set.
    shape = resolve_model_config(ModelConfig(preset="bloom-1b1", make_vocab_size_divisible_by=384),
                                 vocab_size=250680)
    assert shape.vocab_size == 251136 and shape.vocab_size % 384 == 0


def test_vocab_padding_and_shape_errors():
    shape = resolve_model_config(ModelConfig(preset="tiny"), vocab_size=1000)
    assert shape.vocab_size == 1024
    with pytest.raises(UserError, match="divisible by model.num_heads"):
        resolve_model_config(ModelConfig(preset=None, hidden_size=100, num_layers=2, num_heads=3,
                                         vocab_size=10))
    with pytest.raises(UserError, match="unknown"):
        resolve_model_config(ModelConfig(preset="bloom-9000"))


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 112])
def test_alibi_slopes_match_hf(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    seq = 5
    mask = torch.ones(1, seq)
    hf = build_alibi_tensor(mask, heads, torch.float32).view(heads, 1, seq)
    # HF's bias is slope * key_position; position 1 isolates the slope. HF raises the base to
    # each power in fp32, we in fp64 then round, hence a last-bit tolerance.
    assert torch.allclose(alibi_slopes(heads), hf[:, 0, 1], rtol=1e-6, atol=0)


def test_alibi_112_heads_values():
    s = alibi_slopes(112).double().tolist()
    assert math.isclose(s[0], 2 ** (-1 / 8), rel_tol=1e-6) and math.isclose(s[63], 2 ** (-8), rel_tol=1e-6)
    assert math.isclose(s[64], 2 ** (-1 / 16), rel_tol=1e-6)
    assert math.isclose(s[111], 2 ** (-95 / 16), rel_tol=1e-6)


def test_init_is_megatron_style(device):
    shape = BloomShape(vocab_size=512, hidden_size=256, num_layers=8, num_heads=4,
                       ffn_hidden_size=1024, init_method_std=0.02)
    model = build_model(shape, seed=3, device=device)
    sd = {n: p.cpu() for n, p in model.named_parameters()}
    qkv = sd["transformer.h.0.self_attention.query_key_value.weight"]
    out = sd["transformer.h.0.mlp.dense_4h_to_h.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.001
    assert abs(out.std().item() - 0.02 / math.sqrt(16)) < 0.0003
    assert torch.all(sd["transformer.h.0.input_layernorm.weight"] == 1)
    assert torch.all(sd["transformer.h.0.self_attention.dense.bias"] == 0)
    assert model.lm_head.weight is model.transformer.word_embeddings.weight
    # Same seed, same weights (on the CPU too); different seed, different weights.
    again = build_model(shape, seed=3)
    assert all(torch.equal(sd[n], p) for n, p in again.named_parameters())
    other = build_model(shape, seed=4)
    assert not torch.equal(other.transformer.word_embeddings.weight,
                           sd["transformer.word_embeddings.weight"])


# Dropout 0 runs the fused SDPA kernel; dropout > 0 the unfused one, which also draws masks that
# recomputation must replay.
RECOMPUTE_SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                             ffn_hidden_size=256)


class _KeptForBackward(TorchDispatchMode):
    """The bytes a forward leaves alive for backward: every storage an op makes inside the mode,
    held weakly, summed over those still alive after it (each once). Not saved_tensors_hooks:
    selective recompute keeps the matmul outputs in torch.utils.checkpoint's own cache, which
    autograd's saved-tensor hooks never see (they see only the checkpoint's inputs)."""

    def __init__(self):
        super().__init__()
        self.made = WeakIdKeyDictionary()  # storage -> None, dropped when the storage is freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[t.untyped_storage()] = None
        return out

    def kept(self, *exclude: torch.Tensor) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(st.nbytes() for st in list(self.made.keys()) if st.data_ptr() not in skip)


def _recompute_run(mode: str, dropout: float, ids, count_kept: bool = False,
                   attention: str = "sdpa"):
    """Loss, gradients and (optionally) the bytes the forward keeps for backward."""
    shape = RECOMPUTE_SHAPE.replace(hidden_dropout=dropout, attention_dropout=dropout)
    model = build_model(shape, seed=1).train()
    model.transformer.attention_impl = attention
    model.set_activation_checkpointing(mode)
    torch.manual_seed(7)
    mode_ = _KeptForBackward() if count_kept else contextlib.nullcontext()
    with mode_:
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    kept = mode_.kept(loss) if count_kept else 0
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], kept


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_same_gradients(dropout, attention):
    # Bitwise: recomputation runs the same deterministic CPU kernels on bit-identical inputs,
    # selective takes the matmul outputs from its cache (the very tensors forward made), and
    # torch.utils.checkpoint restores the RNG state, so dropout draws the same masks.
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, grads, _ = _recompute_run("none", dropout, ids, attention=attention)
    for mode in ("selective", "full"):
        loss_r, grads_r, _ = _recompute_run(mode, dropout, ids, attention=attention)
        assert loss_r == loss, mode
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_r)), mode
    with pytest.raises(ValueError, match="one of"):
        build_model(RECOMPUTE_SHAPE).set_activation_checkpointing(True)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_recompute_keeps_less_than_none_more_than_full(dropout, attention):
    # Issue 38: with SDPA's fused kernel (dropout 0) recomputing only the attention core kept
    # as much as no recompute. Selective now keeps per block only the block's input, the four
    # matmul outputs and the fused kernel's output and logsumexp.
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    kept = {mode: _recompute_run(mode, dropout, ids, True, attention)[2]
            for mode in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"]
    s, (b, n) = RECOMPUTE_SHAPE, ids.shape
    sbh, per_block = b * (n - 1) * s.hidden_size, kept["selective"] - kept["full"]
    # 4-byte elements: q, k, v (3 sbh), dense (1), h->4h (4), 4h->h (1), and with the fused,
    # dropout-free kernel its context (1) and a float32 logsumexp per head and token. None of
    # the a·s² scores of an unfused core.
    core = 4 * sbh + 4 * s.num_heads * b * (n - 1) if (attention, dropout) == ("sdpa", 0) else 0
    assert per_block == s.num_layers * (4 * 9 * sbh + core)
    # none keeps the two LayerNorm outputs, the second LayerNorm's input and the GeLU output
    # (1 + 1 + 1 + 4 sbh); selective keeps the dense and 4h->h outputs that none frees (at
    # dropout 0 nothing in backward reads them; kept, the replay need not run those matmuls).
    assert kept["none"] - kept["selective"] >= s.num_layers * 4 * (7 - 2) * sbh


def test_kv_cache_matches_full_forward(device):
    # The paged KV cache (the model's one inference protocol): 8 tokens prefilled, then one
    # token a step, against one forward over all 12. 1e-5: the same fp32 math, other orders.
    from tests.helpers import paged_logits

    shape = resolve_model_config(ModelConfig(preset="tiny"))
    model = build_model(shape, seed=2, device=device).eval()
    ids = torch.randint(0, 256, (2, 12)).to(device)
    with torch.no_grad():
        full = model(ids).cpu()
    assert torch.allclose(full[:, 8:], paged_logits(model, ids, 8), atol=1e-5)


def test_tflops_formula_reproduces_bloom_logs():
    # docs/bloom_facts.md §2: the 176B run logged 149.02 TFLOPs at 105.22 s/iteration on 384 GPUs.
    tf = megatron_tflops(2048, 2048, 70, 14336, 250880, 105.22, 384, True)
    assert tf == pytest.approx(149.02, abs=0.01)
    assert megatron_tflops(16, 2048, 70, 14336, 250880, 15.23, 384, True) == pytest.approx(8.04, abs=0.01)


def test_ignored_labels_are_left_out_of_the_mean_as_torch_and_hf_do():
    """HF-style labels (-100 where nothing is scored) through the Python API: the loss was
    divided by every position, the ignored ones too, so a batch with 12 of 16 ignored had a
    loss (and gradients) 4x too small. F.cross_entropy's own ignore_index is the reference."""
    import torch.nn.functional as F
    shape = RECOMPUTE_SHAPE
    model = build_model(shape, seed=1).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, shape.vocab_size, (2, 8), generator=g)
    labels = torch.randint(0, shape.vocab_size, (2, 8), generator=g)
    labels[0, :6] = -100
    labels[1, 2:] = -100
    logits = model(ids).detach()
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert model(ids, labels=labels).item() == pytest.approx(expected.item(), rel=1e-6)
    # With a loss mask too: the positions both score, as a plain loop counts them.
    mask = torch.ones(2, 8)
    mask[0, 7] = 0
    total, count = 0.0, 0
    for b in range(2):
        for s in range(8):
            if labels[b, s] != -100 and mask[b, s]:
                total += F.cross_entropy(logits[b, s][None], labels[b, s][None]).item()
                count += 1
    assert count == 3
    assert model(ids, labels=labels, loss_mask=mask).item() == pytest.approx(total / count,
                                                                              rel=1e-6)
    # Without ignored labels the loss is the plain mean, to the bit.
    plain = torch.randint(0, shape.vocab_size, (2, 8), generator=g)
    assert torch.equal(model(ids, labels=plain).detach(),
                       F.cross_entropy(logits.flatten(0, 1), plain.flatten()))
