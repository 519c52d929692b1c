"""HF transformers' BloomForCausalLM as the tests' reference model, and the tolerance bloomtrain's
model is held to against it (tests/checkpoint/test_hf.py, tests/model/test_attention.py)."""
from __future__ import annotations

import torch


ATOL = 1e-4


def make_hf_model(config_kwargs, seed=0, perturb=False, dtype=torch.float32):
    import transformers

    cfg = transformers.BloomConfig(**config_kwargs)
    torch.manual_seed(seed)
    model = transformers.BloomForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF's init is normal(0, 0.02) for matrices but zero biases and unit LayerNorms; a
            # mistake in any of those would be invisible without this.
            if perturb and ("bias" in name or "layernorm" in name or "ln_f" in name):
                p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype).eval()
