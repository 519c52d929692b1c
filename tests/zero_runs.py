"""The ZeRO tests' tiny model and training loop (tests/parallel/test_zero.py, tests/parallel/test_offload.py):
random global batches, each dp rank's micro-batches of them, and steps through the schedule
runtime, returning the mean losses, grad norms and skipped steps."""
from __future__ import annotations

import torch

from bloomtrain.model.presets import BloomShape
from bloomtrain.parallel import comm
from bloomtrain.parallel.pipeline import pipeline_train_step
from tests import helpers


SHAPE = BloomShape(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, ffn_hidden_size=256)
SEQ = 32
LR = 1e-3


def global_batches(steps: int, global_batch: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE.vocab_size, (global_batch, SEQ + 1), generator=g)
            for _ in range(steps)]


def micro_batches(batch: torch.Tensor, dp_rank: int, dp_size: int, mbs: int):
    """This dp rank's contiguous slice of the global batch, cut into micro-batches."""
    per_rank = batch.shape[0] // dp_size
    mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return list(mine.split(mbs))


def train(parts, batches, mbs, inject_nonfinite_at=None):
    """Steps over `batches` with every micro-batch through the schedule runtime."""
    topo, eng, opt = parts.topo, parts.engine, parts.optimizer
    losses, norms, skipped = [], [], []
    for step, batch in enumerate(batches):
        mbs_ = [{"tokens": ids[:, :-1], "labels": ids[:, 1:]}
                for ids in micro_batches(batch, topo.dp_rank, topo.dp_size, mbs)]
        scale = opt.scale_loss
        if inject_nonfinite_at == step and topo.dp_rank == topo.dp_size - 1:
            scale = (lambda loss: opt.scale_loss(loss) * float("inf"))  # one dp rank only
        loss = pipeline_train_step(topo.layout.schedule, parts.chunks, mbs_, topo,
                                   scale_loss=scale,
                                   recv_shape=topo.layout.recv_shape(mbs, SEQ, SHAPE.hidden_size),
                                   dtype=eng.compute_dtype, timeout=120)
        res = helpers.step(opt, LR)
        mean = torch.tensor(loss)
        comm.all_reduce(mean, topo.dp_group, "dp")
        mean /= topo.dp_size
        losses.append(float(mean))
        norms.append(res.grad_norm)
        skipped.append(res.skipped)
    return losses, norms, skipped
