"""The dropout RNG of tensor-parallel regions (after Megatron-LM, arXiv 1909.08053): a per-tp-rank
stream forked around the regions whose activations are split over tp.
"""
from __future__ import annotations

import contextlib
import random

import torch
from torch import nn

_SEED_MIX = 0x9E3779B97F4A7C15  # odd, so distinct tp ranks always map to distinct seeds


def stage_seed(seed: int, pp_rank: int) -> int:
    """The default generators' seed on pipeline stage `pp_rank`, as Megatron's
    `_set_random_seed` (seed + 100 x pp rank): the stages hold different blocks, which in one
    process draw different dropout masks; with one seed everywhere, block k of every stage
    would drop exactly the elements block k of stage 0 drops. The same on every tp and dp rank
    of a stage (tp's replicated regions need it; dp ranks see different data, as in Megatron)."""
    return seed + 100 * pp_rank


class TensorParallelRNG:
    """The dropout RNG of tensor-parallel regions, after Megatron's
    `model_parallel_cuda_manual_seed` (per-rank seed = seed + 2718 + tp_rank).

    Replicated regions (hidden dropout without sequence parallelism) use the default generator,
    which is seeded identically on every tp rank and so drops the same elements everywhere, as
    the replicated activations require. Split regions (attention dropout on local heads; with
    sequence parallelism, everything inside a block, which then runs on sequence shards or local
    heads) must drop independently per rank, or every rank would repeat the same mask on its part
    of the tensor. `fork()` switches the default generator of `device` to a per-rank stream
    inside its `with` block and restores it afterwards.

    Unlike Megatron's tracker, the forked stream is not carried from fork to fork. Each fork
    draws one number from the default CPU generator (the same draw on every tp rank, so the
    default streams stay in step) and seeds the per-rank stream from (draw, seed, tp_rank).
    The forked masks are therefore a function of the default RNG state, which is what
    torch.utils.checkpoint saves and restores around a recomputation and what a checkpoint
    saves: activation recomputation replays the same attention-dropout masks (with a carried
    tracker state it would silently draw new ones and compute wrong gradients), and resuming
    needs only the default generators' states. The state dict is therefore just the seed.
    """

    def __init__(self, seed: int, tp_rank: int, device="cpu"):
        self.seed = int(seed)
        self.tp_rank = tp_rank
        self.device = torch.device(device)

    @property
    def rank_seed(self) -> int:
        return self.seed + 2718 + self.tp_rank

    @contextlib.contextmanager
    def fork(self):
        draw = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        stream_seed = (draw + self.rank_seed * _SEED_MIX) % 2 ** 63
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(stream_seed)
        else:
            saved = torch.get_rng_state()
            torch.default_generator.manual_seed(stream_seed)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)

    def state_dict(self) -> dict:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])


def fork_rng_around_forward(module: nn.Module, fork) -> None:
    """Run module.forward inside fork() by hooks, so the module keeps its class and its HF
    parameter names. always_call closes the context even when forward raises."""
    open_contexts = []

    def enter(mod, args):
        ctx = fork()
        ctx.__enter__()
        open_contexts.append(ctx)

    def leave(mod, args, output):
        open_contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


@contextlib.contextmanager
def kept_rng():
    """Python's, NumPy's and torch's (CPU and CUDA) generator states as they were, on every
    rank, around an evaluation: the harness seeds rank 0's, and a tensor-parallel forward
    draws from the default generator even in eval mode (`fork`). Training must not depend on
    whether an evaluation ran: the end-of-run save, made after the final evaluation, recorded
    a generator one evaluation ahead, and the run extended from it diverged at tp > 1."""
    import numpy as np

    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if saved[3] is not None:
            torch.cuda.set_rng_state_all(saved[3])
