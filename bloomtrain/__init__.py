"""bloomtrain: a 3D-parallel trainer for BLOOM-architecture language models.

`import bloomtrain` stays cheap (no torch); `load_model` imports what it needs when called.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("bloomtrain")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "load_model", "plan"]

def plan(model=None, **kwargs):
    """Memory and step-time plans of layouts (bloomtrain.planner.plan): the fitting layouts of
    `model` on `gpus` GPUs, fastest first, or one `layout`'s record. See `bloomtrain plan -h`."""
    from bloomtrain.planner import plan as _plan
    return _plan(model, **kwargs)


def load_model(path, device="cpu", dtype=None):
    """A single-device `BloomForCausalLM` in eval mode from a bloomtrain checkpoint (a step
    directory or a root holding `latest`) or an HF Bloom directory (config.json + weights).

    `dtype` (a torch dtype or a name such as "bf16") defaults to the dtype the weights are stored
    in. `model(input_ids)` returns logits [b, s, vocab] over the padded vocabulary.
    """
    import torch

    from bloomtrain import hf
    from bloomtrain.checkpoint.reader import open_model
    from bloomtrain.model import BloomForCausalLM, alibi_slopes, check_state
    from bloomtrain.model.presets import EMBEDDING, LM_HEAD
    from bloomtrain.devices import torch_dtype

    if hf.is_hf_dir(path):
        shape, state, _ = hf.collect_hf_state(path)
    else:
        reader = open_model(path)
        shape = reader.shape
        state = {n: reader.load(n) for n in reader.names() if n != LM_HEAD}
        check_state(shape, {n: tuple(t.shape) for n, t in state.items()}, reader.path)
    dtype = torch_dtype(dtype) if dtype is not None else state[EMBEDDING].dtype

    # Built on the meta device and filled by assignment: no random init and no second copy of
    # the weights, which matters for the billion-parameter presets.
    with torch.device("meta"):
        model = BloomForCausalLM(shape)
    state = dict(state)
    state[LM_HEAD] = state[EMBEDDING]
    model.load_state_dict(state, strict=True, assign=True)
    # Assignment wraps each module's tensor in its own Parameter; re-tie so that the head *is*
    # the embedding, as in a freshly built model.
    model.lm_head.weight = model.transformer.word_embeddings.weight
    # The non-persistent ALiBi slopes were left on meta. They stay fp32 whatever the weights'
    # dtype, because the bias is built in fp32 (a slope like 2^-0.5625 rounded to bf16 would
    # shift every score), so they are set after the cast.
    model.transformer.alibi_slopes = None
    model.to(device=device, dtype=dtype)
    model.transformer.alibi_slopes = alibi_slopes(shape.num_heads).to(device)
    return model.eval()
