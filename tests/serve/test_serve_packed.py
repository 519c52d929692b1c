"""MKL's packed GEMM for the serving runner's small steps (bloomtrain.serve.packed): which layers
are packed, that a packed layer's rows equal torch's own F.linear at every row count a step can
have from the padding up (so batch invariance holds through it), that a shape whose packed
product rounds differently stays plain, and that the model's parameters and state dict are
untouched. The engine-level checks (batched equals alone, greedy equals HF) run through packed
layers in tests/serve/test_serve.py, since build_runner packs."""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bloomtrain.serve import packed
from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.packed import PackedLinear, mkl_packing_available, pack_linears
from bloomtrain.serve.tp import build_runner, load_serving_model
from tests.serving import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = EngineConfig(max_model_len=128, block_size=8, kv_cache_tokens=1024, max_num_seqs=8,
                   max_batched_tokens=40, prefill_chunk=16, max_queue=8)


def test_this_torch_has_mkl_packing_on_x86():
    """CI's torch (the x86 CPU wheel) has the ops; a build without them would only lose speed,
    but then the tests below would prove nothing, so that must not pass silently."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("MKL is an x86 library")
    assert mkl_packing_available()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "tiny"
    save_tiny_hf(path, 96)
    runner = build_runner(path, CFG)
    runner.path = path
    return runner


def test_packed_layers_equal_f_linear_from_the_padding_up(served):
    model, rows = served.model, served.min_rows
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed_layers = [m for m in layers if type(m) is PackedLinear]
    assert rows > 1 and packed_layers, "nothing was packed: the test would prove nothing"
    # Every packed copy is counted, once per layer (the tied LM head's too).
    assert served.packed_bytes == sum(m.weight.numel() * 4 for m in packed_layers)
    g = torch.Generator().manual_seed(1)
    for m in packed_layers:
        assert m.packed_rows == rows
        x = torch.randn(CFG.max_batched_tokens, m.in_features, generator=g)
        full = F.linear(x, m.weight, m.bias)
        for n in range(1, CFG.max_batched_tokens + 1):
            out = m(x[:n][None])[0]  # the runner's [1, rows, hidden]
            if n >= rows:
                assert torch.equal(out, full[:n]), (m, n)
            else:
                torch.testing.assert_close(out, full[:n], rtol=1e-5, atol=1e-5)


def test_a_shape_whose_packed_rows_differ_stays_plain(served, monkeypatch):
    plain = load_serving_model(served.path)  # the same model, not packed
    h = plain.shape.hidden_size
    rounds_differently = {(4 * h, h)}  # dense_h_to_4h's shape
    # The probe says dense_h_to_4h's packed product rounds differently.
    real = packed._packed_rows_match
    monkeypatch.setattr(packed, "_packed_rows_match",
                        lambda w, b, *a: tuple(w.shape) not in rounds_differently
                        and real(w, b, *a))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    added = pack_linears(plain, served.min_rows, CFG.max_batched_tokens)
    kinds = {(tuple(m.weight.shape), type(m)) for m in plain.modules()
             if isinstance(m, nn.Linear)}
    assert ((4 * h, h), nn.Linear) in kinds and ((4 * h, h), PackedLinear) not in kinds
    assert ((h, 4 * h), PackedLinear) in kinds
    assert added == sum(m.weight.numel() * 4 for m in plain.modules()
                        if type(m) is PackedLinear)
    # Parameters and the state dict are the model's own, unchanged.
    after = plain.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert plain.lm_head.weight is plain.transformer.word_embeddings.weight


def test_nothing_is_packed_without_padding_or_off_fp32(served):
    model = load_serving_model(served.path)
    assert pack_linears(model, 1, 40) == 0  # generate's engine: no padding, nothing to pack
    model.to(torch.bfloat16)
    assert pack_linears(model, 16, 40) == 0
    assert not any(type(m) is PackedLinear for m in model.modules())
