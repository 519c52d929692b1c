"""Model shapes: the published BLOOM family plus a tiny one for tests, the resolution of a
`model:` config section into one concrete, padded shape, and Megatron's FLOPs of a step."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bloomtrain.errors import UserError

# The HF names of the tied word embedding and LM head (bloomtrain.model.params' table keys them),
# here for the checkpoint formats and HF interop, which need them without torch.
EMBEDDING = "transformer.word_embeddings.weight"
LM_HEAD = "lm_head.weight"

# All released BLOOM models share the 250,680-token tokenizer padded to 250,880 (= 490 * 512).
BLOOM_VOCAB = 250880


@dataclass(frozen=True)
class BloomShape:
    """A fully resolved model shape. `vocab_size` is the padded size (the embedding's rows)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    layer_norm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        """V*h (tied embedding) + 2h (embedding LN) + L*(block) + 2h (final LN)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        block = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return self.vocab_size * h + 2 * h + self.num_layers * block + 2 * h

    def replace(self, **kw) -> "BloomShape":
        return dataclasses.replace(self, **kw)


# name: (num_layers, hidden, heads, vocab, init_std). Shapes from docs/bloom_facts.md §1, §3.
# BLOOM used init std 0.0048 for every size (the tr11 scripts); tiny uses 0.02 so that a few
# hundred CPU steps move it visibly.
PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, init_method_std=0.02),
    "bloom-560m": dict(num_layers=24, hidden_size=1024, num_heads=16, vocab_size=BLOOM_VOCAB,
                       init_method_std=0.0048),
    "bloom-1b1": dict(num_layers=24, hidden_size=1536, num_heads=16, vocab_size=BLOOM_VOCAB,
                      init_method_std=0.0048),
    "bloom-1b7": dict(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=BLOOM_VOCAB,
                      init_method_std=0.0048),
    "bloom-3b": dict(num_layers=30, hidden_size=2560, num_heads=32, vocab_size=BLOOM_VOCAB,
                     init_method_std=0.0048),
    "bloom-7b1": dict(num_layers=30, hidden_size=4096, num_heads=32, vocab_size=BLOOM_VOCAB,
                      init_method_std=0.0048),
    "bloom-176b": dict(num_layers=70, hidden_size=14336, num_heads=112, vocab_size=BLOOM_VOCAB,
                       init_method_std=0.0048),
}


def pad_vocab(vocab_size: int, multiple: int) -> int:
    """Megatron pads the embedding so that its rows split evenly and matmuls stay aligned."""
    return int(math.ceil(vocab_size / multiple) * multiple)


def resolve_model_config(model_cfg, vocab_size: int | None = None) -> BloomShape:
    """Turn a ModelConfig (preset + explicit overrides) into a BloomShape.

    The vocabulary comes from `model.vocab_size`, else the tokenizer (`vocab_size` argument), and
    is padded to `make_vocab_size_divisible_by`. A preset's vocabulary acts like Megatron's
    `--pad-vocab-size-to`: the padded size is at least the preset's, so bloom-* presets with the
    BLOOM tokenizer (250,680) get the published 250,880 rows and the published parameter count.
    """
    base: dict = {}
    if model_cfg.preset is not None:
        if model_cfg.preset not in PRESETS:
            raise UserError(f"model.preset {model_cfg.preset!r} is unknown; choose one of "
                            f"{sorted(PRESETS)} or set model.preset=null with an explicit shape")
        base = dict(PRESETS[model_cfg.preset])
    for key in ("hidden_size", "num_layers", "num_heads", "init_method_std"):
        v = getattr(model_cfg, key)
        if v is not None:
            base[key] = v
    missing = [k for k in ("hidden_size", "num_layers", "num_heads") if base.get(k) is None]
    if missing:
        raise UserError(f"model.{missing[0]} is not set; give a model.preset or set "
                        f"{', '.join('model.' + k for k in missing)}")
    vocab = model_cfg.vocab_size or vocab_size or base.get("vocab_size")
    if not vocab or vocab <= 0:
        raise UserError("the vocabulary size is unknown: set data.tokenizer or model.vocab_size")
    h, nh = base["hidden_size"], base["num_heads"]
    for key, v in (("hidden_size", h), ("num_layers", base["num_layers"]), ("num_heads", nh)):
        if v <= 0:
            raise UserError(f"model.{key} must be positive, got {v}")
    if h % nh:
        raise UserError(f"model.hidden_size ({h}) must be divisible by model.num_heads ({nh})")
    if model_cfg.make_vocab_size_divisible_by <= 0:
        raise UserError("model.make_vocab_size_divisible_by must be positive")
    return BloomShape(
        # A preset's vocabulary (BLOOM's 250,880) is a floor, padded too: at tp=3 a multiple
        # of 384 kept 250,880 (no multiple of 3), and the error asked for what was set.
        vocab_size=pad_vocab(max(vocab, base.get("vocab_size", 0)),
                             model_cfg.make_vocab_size_divisible_by),
        hidden_size=h,
        num_layers=base["num_layers"],
        num_heads=nh,
        ffn_hidden_size=model_cfg.ffn_hidden_size or 4 * h,
        layer_norm_epsilon=model_cfg.layer_norm_epsilon,
        hidden_dropout=model_cfg.hidden_dropout,
        attention_dropout=model_cfg.attention_dropout,
        init_method_std=base.get("init_method_std", 0.02),
    )


def megatron_tflops(batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                    vocab_size: int, step_time_s: float, num_devices: int,
                    activation_checkpointing: bool) -> float:
    """Hardware TFLOP/s per device by Megatron's formula (docs/bloom_facts.md §2, M1 training.py):
    24·f·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)), f = 4 with full recompute, 3 without."""
    f = 4 if activation_checkpointing else 3
    flops = (24 * f * batch_size * seq_length * num_layers * hidden_size ** 2
             * (1.0 + seq_length / (6.0 * hidden_size)
                + vocab_size / (16.0 * num_layers * hidden_size)))
    return flops / (step_time_s * num_devices * 1e12)
