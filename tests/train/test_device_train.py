"""The trainer on `--device` (CPU by default; `pytest -m device --device cuda` in bench/gpu.sh),
one process: what differs on CUDA is the device placement of everything the engine and the
checkpoint writer touch, which a CPU run cannot exercise.

An async save copies the state into pinned host buffers with non_blocking copies and writes it
from a thread while training goes on; the state that comes back on resume must be exactly the
state at the save, bit for bit (it is a copy, whatever the kernels). With the optimizer offloaded
the masters live on the host and the compute copy on the device.
"""
from __future__ import annotations

import pytest
import torch

from bloomtrain.train import Trainer
from tests.helpers import make_cfg

FEATURES = {
    "plain": {},
    "offload-z1": {"parallel": {"zero_stage": 1, "offload_optimizer": True}},
    # Compile, FlexAttention and selective recompute have their own CPU parity tests
    # (test_compile.py, test_attention.py); here they run only where they are the GPU path.
    "compile-flex-selective": {"train": {"compile": True, "attention": "flex",
                                         "activation_checkpointing": "selective"},
                               "cuda_only": True},
}


def _cfg(dataset, tmp, device, feature):
    over = FEATURES[feature]
    train_over = {"precision": "bf16", "device": device.type, "train_iters": 3,
                  **over.get("train", {})}
    return make_cfg(dataset, tmp, **{f"train__{k}": v for k, v in train_over.items()},
                    parallel=over.get("parallel", {}),
                    checkpoint={"dir": str(tmp / "ck"), "save_interval": 3, "async_save": True})


def _state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in {**trainer.engine.master_state(),
                                    **trainer.engine.optim_state()}.items()}


@pytest.mark.parametrize("feature", [
    pytest.param(f, marks=pytest.mark.cuda_only) if FEATURES[f].get("cuda_only") else f
    for f in sorted(FEATURES)])
def test_train_async_save_and_resume_on_device(dataset, tmp_path, device, feature):
    trainer = Trainer(_cfg(dataset, tmp_path, device, feature), log=lambda *a: None)
    result = trainer.run()  # the last step's save is async
    trainer.checkpoints.wait()
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.checkpoint and result.checkpoint.endswith("3")
    assert trainer.engine.bufs.grad.device.type == device.type
    saved = _state(trainer)

    # A fresh trainer resumes that checkpoint: the state is the saved one, bit for bit.
    resumed = Trainer(_cfg(dataset, tmp_path, device, feature), log=lambda *a: None)
    assert resumed.resumed and resumed.state.step == 3
    loaded = _state(resumed)
    assert loaded.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name
