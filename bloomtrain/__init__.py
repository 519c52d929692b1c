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
    directory or a root holding `latest`) or an HF Bloom directory (config.json + weights),
    through the one loader (bloomtrain.checkpoint.load.load_sharded) with no layout.

    `device`: cpu, cuda, cuda:N or auto. `dtype` (a torch dtype or a name such as "bf16") defaults to the dtype the weights are stored
    in. `model(input_ids)` returns logits [b, s, vocab] over the padded vocabulary.
    """
    from bloomtrain.checkpoint.load import load_sharded
    from bloomtrain.devices import resolve_device

    # Before the load: a device that is not there is a one-line UserError, not torch's error
    # after the whole model has been read. "auto" is the GPU when there is one.
    device = resolve_device(str(device))
    model = load_sharded(path, None, dtype).model
    return model.to(device).eval()  # a move, no cast: the ALiBi slopes stay fp32
