"""Single-device BLOOM model and its shapes. No distributed code lives here."""
from bloomtrain.model.bloom import (  # noqa: F401
    BloomBlock,
    BloomForCausalLM,
    BloomModel,
    alibi_causal_bias,
    alibi_slopes,
    build_model,
    expected_parameters,
    init_weights,
    lm_loss,
)
from bloomtrain.model.presets import (  # noqa: F401
    BLOOM_VOCAB,
    PRESETS,
    BloomShape,
    pad_vocab,
    resolve_model_config,
)
