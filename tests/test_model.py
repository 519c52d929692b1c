import contextlib
import math

import pytest
import torch

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


def _recompute_run(mode: str, dropout: float, ids, count_saved: bool = False):
    """Loss, gradients and (optionally) the bytes autograd saved in forward, each storage once.
    The hooks also see what torch.utils.checkpoint keeps of a recomputed region: its inputs."""
    shape = RECOMPUTE_SHAPE.replace(hidden_dropout=dropout, attention_dropout=dropout)
    model = build_model(shape, seed=1).train()
    model.set_activation_checkpointing(mode)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(7)
    hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved
             else contextlib.nullcontext())
    with hooks:
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], sum(storages.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_same_gradients(dropout):
    # Bitwise: recomputation runs the same deterministic CPU kernels on bit-identical inputs, and
    # torch.utils.checkpoint restores the RNG state, so dropout draws the same masks.
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, grads, _ = _recompute_run("none", dropout, ids)
    for mode in ("selective", "full"):
        loss_r, grads_r, _ = _recompute_run(mode, dropout, ids)
        assert loss_r == loss, mode
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_r)), mode
    with pytest.raises(ValueError, match="one of"):
        build_model(RECOMPUTE_SHAPE).set_activation_checkpointing(True)


def test_selective_recompute_saves_less_than_none_more_than_full():
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    saved = {mode: _recompute_run(mode, 0.1, ids, count_saved=True)[2]
             for mode in ("none", "selective", "full")}
    assert saved["none"] > saved["selective"] > saved["full"]
    # What selective drops is at least Korthikanti et al.'s 5as² per layer (softmax output,
    # dropout mask, dropped probabilities; here fp32 + bool + fp32 = 9 bytes per score).
    s = RECOMPUTE_SHAPE
    scores = ids.shape[0] * s.num_heads * (ids.shape[1] - 1) ** 2
    assert saved["none"] - saved["selective"] >= s.num_layers * 9 * scores


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
