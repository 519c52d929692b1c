"""Bitwise resume after a real crash, with dropout on, in four layouts.

Each layout trains 6 steps with dropout 0.1 in bf16 and a synchronous save at step 3, and every
rank SIGKILLs itself as soon as that save has returned: no finally blocks, no end-of-run save, the
process is simply gone. A fresh set of processes then resumes from the checkpoint and finishes.
An uninterrupted run of the same config must end with the same bits: every rank's compute
weights, fp32 masters and Adam moments, the final checkpoint, and every logged loss and gradient
norm. With dropout on, that holds only if the RNG state (including tensor parallelism's per-rank
streams, which are forked from it) is saved and restored exactly.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import Trainer
from tests.dist import RankError, run_ranks
from tests.helpers import make_cfg

CRASH_AT = 3
LAYOUTS = {
    "single": (1, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2, "pp_partition": "uniform"}),
    "tp2.pp2.dp2-z3": (8, {"tp": 2, "pp": 2, "zero_stage": 3, "pp_partition": "uniform"}),
}


def _cfg(dataset, tmp, parallel):
    return make_cfg(dataset, Path(tmp), parallel=parallel, train__precision="bf16",
                    train__micro_batch_size=1, train__train_iters=6,
                    model={"preset": "tiny", "vocab_size": 256, "hidden_dropout": 0.1,
                           "attention_dropout": 0.1},
                    checkpoint={"dir": f"{tmp}/ck", "save_interval": CRASH_AT,
                                "async_save": False})


def _local_state(trainer) -> dict[str, torch.Tensor]:
    """This rank's flat buffers: compute weights, fp32 masters, Adam moments."""
    bufs = trainer.engine.bufs
    return {k: getattr(bufs, k).clone() for k in ("compute", "master", "exp_avg", "exp_avg_sq")
            if getattr(bufs, k) is not None}  # stage 3 keeps no compute copy


def _crash_worker(rank, world, dataset, tmp, parallel):
    trainer = Trainer(_cfg(dataset, tmp, parallel), log=lambda *a: None)
    save = trainer.checkpoints.save

    def save_then_die(state):
        path = save(state)
        if state.step == CRASH_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    trainer.checkpoints.save = save_then_die
    trainer.run()
    return "the run did not crash"


def _finish_worker(rank, world, dataset, resumed_tmp, fresh_tmp, parallel):
    out = {}
    for kind, tmp in (("resumed", resumed_tmp), ("fresh", fresh_tmp)):
        trainer = Trainer(_cfg(dataset, tmp, parallel), log=lambda *a: None)
        start = trainer.state.step
        res = trainer.run()
        out[kind] = {"start": start, "losses": res.losses, "state": _local_state(trainer),
                     "checkpoint": res.checkpoint}
    return out


def _records(run_dir):
    records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return [r for r in records if "loss" in r]  # not the eval records


def _full_state(path):
    reader = ckpt.CheckpointReader(path, kinds=ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS)
    return {(k, n): reader.load(n, k) for n in reader.names()
            for k in ckpt.MODEL_KINDS + ckpt.OPTIM_KINDS}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_crash_and_resume_is_bitwise_equal(dataset, tmp_path, layout):
    world, parallel = LAYOUTS[layout]
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    with pytest.raises(RankError, match="exited with code -9"):
        run_ranks(world, _crash_worker, dataset, str(resumed), parallel)
    # The crash was real: the run stopped right after the step-3 save.
    assert [s for s, _ in ckpt.list_checkpoints(resumed / "ck")] == [CRASH_AT]
    assert [r["step"] for r in _records(resumed / "run")] == [1, 2, 3]

    outs = run_ranks(world, _finish_worker, dataset, str(resumed), str(fresh), parallel)
    for rank, out in enumerate(outs):
        a, b = out["resumed"], out["fresh"]
        assert a["start"] == CRASH_AT and b["start"] == 0
        assert a["losses"] == b["losses"][CRASH_AT:], rank
        for key, t in b["state"].items():
            assert torch.equal(a["state"][key], t), (rank, key)
    a, b = _full_state(outs[0]["resumed"]["checkpoint"]), _full_state(outs[0]["fresh"]["checkpoint"])
    assert a.keys() == b.keys()
    for key in b:
        assert torch.equal(a[key], b[key]), key
    ra, rb = _records(resumed / "run"), _records(fresh / "run")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(ra, rb):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), x["step"]
