"""What the serving tests share: a tiny random HF Bloom saved as an HF directory (the engine's
input and the reference it is checked against) and random prompts."""
from __future__ import annotations

import torch

VOCAB = 512


def save_tiny_hf(path, vocab: int = VOCAB):
    """A 2-layer, hidden-64 BloomForCausalLM with random weights scaled up (matrices x5, the
    rest shifted), so that its logits are far from uniform and greedy choices are clear; saved
    with save_pretrained at `path`. Returns the model (eval mode)."""
    import transformers

    cfg = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=vocab,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    ref = transformers.BloomForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(5.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(path)
    return ref


def random_prompts(lengths, seed=1, high=VOCAB):
    """Prompts of `lengths` tokens below `high`, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lengths]
