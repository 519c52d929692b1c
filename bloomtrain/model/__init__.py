"""Single-device BLOOM model and its shapes. No distributed code lives here."""
from bloomtrain.model.presets import (  # noqa: F401
    BLOOM_VOCAB,
    PRESETS,
    BloomShape,
    pad_vocab,
    resolve_model_config,
)
from bloomtrain.utils import lazy_exports

# bloom.py imports torch; presets (shapes, for config validation) must not wait for it.
__getattr__ = lazy_exports(__name__, dict.fromkeys(
    ["BloomBlock", "BloomForCausalLM", "BloomModel", "alibi_causal_bias", "alibi_slopes",
     "build_model", "check_state", "expected_parameters", "init_weights", "lm_loss"], "bloom"))
