
import pytest

from bloomtrain.model.params import base_spec
from bloomtrain.optim import DynamicLossScaler, LRSchedule
from tests.reference import megatron_lr


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_lr_schedule_against_megatron(style):
    # BLOOM-176B's schedule: 6e-5 -> 6e-6, warmup 183,105 samples, decay over 200M samples.
    sched = LRSchedule(6e-5, 6e-6, 183_105, 200_000_000, style)
    for s in (0, 1, 2048, 183_104, 183_105, 183_106, 50_000_000, 100_091_552, 199_999_999,
              200_000_000, 200_000_001, 220_000_000):
        assert sched(s) == pytest.approx(megatron_lr(s, 6e-5, 6e-6, 183_105, 200_000_000, style),
                                         rel=1e-12, abs=1e-18)
    if style == "cosine":
        assert sched(0) == 0.0
        assert sched(183_105) == pytest.approx(6e-5)
        mid = 183_105 + (200_000_000 - 183_105) // 2
        assert sched(mid) == pytest.approx(3.3e-5, rel=1e-5)
        assert sched(250_000_000) == 6e-6


def test_loss_scaler_hysteresis_window_min():
    sc = DynamicLossScaler(2.0 ** 12, window=3, hysteresis=2, min_scale=1.0)
    sc.update(True)            # first overflow: hysteresis absorbs it
    assert sc.scale == 4096
    sc.update(True)            # second: halve
    assert sc.scale == 2048
    sc.update(True)            # tracker stays exhausted: halve again
    assert sc.scale == 1024
    for _ in range(3):
        sc.update(False)
    assert sc.scale == 2048    # window of clean steps doubles and resets hysteresis
    sc.update(True)
    assert sc.scale == 2048
    tiny = DynamicLossScaler(2.0, window=500, hysteresis=1, min_scale=1.0)
    for _ in range(5):
        tiny.update(True)
    assert tiny.scale == 1.0
    state = sc.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    # A resume with a smaller window than the saved tracker: the scale grows at the next
    # clean step (Megatron's == would never grow it again).
    resumed = DynamicLossScaler(window=2)
    resumed.load_state_dict({"scale": 256.0, "growth_tracker": 3, "hysteresis_tracker": 2})
    resumed.update(False)
    assert resumed.scale == 512.0


def test_no_weight_decay_groups():
    # Megatron's rule: no decay on biases and LayerNorms, decay on every matrix.
    for name in ("transformer.h.0.self_attention.dense.bias", "transformer.h.0.input_layernorm.weight",
                 "transformer.ln_f.weight", "transformer.word_embeddings_layernorm.bias"):
        assert not base_spec(name).weight_decay, name
    for name in ("transformer.h.0.mlp.dense_h_to_4h.weight", "transformer.word_embeddings.weight",
                 "lm_head.weight"):
        assert base_spec(name).weight_decay, name
