"""The loss-spike monitor (train.on_loss_spike) on the tiny model: the robust z-score, then each
action in a real run: log (the line, the record, the alert), skip (the final weights equal a run
that never ran the spike's batch at all), rollback (the checkpoint reloaded, the samples that led
to the spike never trained on, recorded in run_dir/skipped_samples.json and in the next
checkpoint, and a resume from the checkpoint before the rollback taking the same way, bit for
bit), and a 4-rank pp2 x dp2 run where the spike is injected on one rank and every rank decides
alike.

Fault injection: `inject_spike` puts a forward hook on the last pipeline stage's chunk that
multiplies its loss by SPIKE_FACTOR at the given steps (in training mode), so the step's loss and
every gradient grow as a real spike's do while the data stays as it was: the sample ranges
checked below are exactly the data order's. The tiny model's loss falls steadily over these runs
(z < 0 at every normal step), and x10 gives z ~ 100-300 against its window.
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from bloomtrain import checkpoint as ckpt
from bloomtrain.train import Trainer
from bloomtrain.train.spikes import MIN_HISTORY, LossSpikeMonitor, robust_zscore
from tests.dist import run_ranks
from tests.helpers import make_cfg, metrics

pytestmark = pytest.mark.usefixtures("one_thread")

SPIKE_FACTOR = 10.0
GBS = 8  # make_cfg's global batch


def inject_spike(trainer, steps, factor=SPIKE_FACTOR):
    """The fault-injection hook (see the module docstring); only the last stage holds the loss."""
    chunk = trainer.parts.chunks[-1]
    if chunk.is_last:
        chunk.register_forward_hook(
            lambda mod, args, out: out * factor
            if mod.training and trainer.state.step + 1 in steps else None)


def record_batches(trainer) -> list[int]:
    """The first sample index of every global batch the run trains on, checked against the
    dataset's samples (one process: micro-batch 0's first row is that sample)."""
    taken, data = [], trainer.data
    read = data.next_batch

    def next_batch():
        start = data.stream.next_start()
        mbs = read()
        assert torch.equal(mbs[0]["tokens"][0], torch.from_numpy(
            data.train_ds[start][:-1].astype("int64"))), start
        taken.append(start)
        return mbs
    data.next_batch = next_batch
    return taken


def capture(lines):
    return lambda *a: lines.append(" ".join(map(str, a)))


def masters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine.master_state().items()}


def steps_of(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "loss" in r}


# ---- the score --------------------------------------------------------------------------------
def test_robust_zscore_and_its_guards():
    window = [5.0, 5.1, 4.9, 5.2, 4.8, 5.0, 5.05, 4.95, 5.15, 4.85]
    z, median = robust_zscore(window, 6.0)
    mad = statistics.median(abs(x - 5.0) for x in window)
    assert median == 5.0 and z == pytest.approx(1.0 / (1.4826 * mad))
    # MAD = 0 (over half the window equal): the mean absolute deviation takes over.
    z, _ = robust_zscore([5.0] * 6 + [5.5, 4.5, 6.0, 4.0], 8.0)
    assert z == pytest.approx(3.0 / (1.2533 * 0.3))
    # An all-equal window: 0.1% of the median stands in, so a 1% rise is z = 10.
    assert robust_zscore([5.0] * 10, 5.05)[0] == pytest.approx(10.0)
    monitor = LossSpikeMonitor(window=100, zscore=6.0, action="log")
    assert monitor.min_history == MIN_HISTORY == 10
    assert monitor.check(10, 60.0, window[:9]) is None  # too little history yet
    assert monitor.check(11, 60.0, window).zscore > 6
    assert monitor.check(11, 4.0, window) is None  # one-sided: a falling loss is no spike
    assert monitor.check(11, float("nan"), window) is None  # the engine's overflow path
    hist = list(window)
    LossSpikeMonitor(window=4, zscore=6.0, action="log").observe(hist, 7.0)
    assert hist == window[-3:] + [7.0]
    assert LossSpikeMonitor(window=3, zscore=6.0, action="log").min_history == 3


def test_data_order_jumps_skipped_ranges():
    # Megatron's ramp-up, 4 -> 8 over 16 samples: batches [0,4) [4,8) [8,12) [12,16) [16,24) ...
    import numpy as np

    from bloomtrain.config import ParallelConfig
    from bloomtrain.data.loader import DataIterator, batches_between, skip_past
    from bloomtrain.layout import BatchSchedule, ParallelLayout
    schedule = BatchSchedule(8, 2, ParallelLayout.from_config(ParallelConfig(), 1), (4, 4, 16))
    assert skip_past(schedule, 8, [(8, 16)]) == 16 and batches_between(schedule, 8, 16) == 2
    assert skip_past(schedule, 4, [(8, 16)]) == 4  # not reached yet
    # A batch that would straddle a range's start begins at its end: [16, 24) meets [20, 24).
    assert skip_past(schedule, 16, [(20, 24)]) == 24
    assert skip_past(schedule, 8, [(8, 16), (16, 24)]) == 24  # back to back
    dataset = [np.full(5, i, dtype=np.int64) for i in range(64)]  # sample i is all i
    it = DataIterator(dataset, schedule, 0, prefetch=True)
    it.set_skipped([(8, 16), (24, 32)])
    firsts = []
    while it.consumed_samples < 48:
        firsts.append([int(mb["tokens"][r, 0]) for mb in it.next_global_batch()
                       for r in range(mb["tokens"].shape[0])])
    it.close()
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7], list(range(16, 24)), list(range(32, 40)),
                      list(range(40, 48))]


# ---- log ----------------------------------------------------------------------------------------
def test_log_writes_the_line_the_record_and_the_alert(dataset, tmp_path):
    cfg = make_cfg(dataset, tmp_path, train__train_iters=14, train__log_interval=5)
    lines = []
    trainer = Trainer(cfg, log=capture(lines))
    inject_spike(trainer, {12})
    res = trainer.run()
    spike_lines = [l for l in lines if "loss spike" in l]
    assert spike_lines == [f"[train] loss spike at step 12: loss {res.losses[11]:.4f}, z "
                           f"{robust_zscore(res.losses[:11], res.losses[11])[0]:.1f} over the "
                           f"last 11 steps (median {statistics.median(res.losses[:11]):.4f})"]
    recs = steps_of(tmp_path / "run")
    assert sorted(recs) == [5, 10, 12, 14]  # 12: the spike wrote it; 14: the last steps
    spike = recs[12]["loss_spike"]
    assert spike["action"] == "log" and spike["loss"] == res.losses[11]
    assert spike["median"] == statistics.median(res.losses[:11]) and spike["zscore"] > 100
    assert recs[12]["alerts"] == [spike_lines[0].removeprefix("[train] ")]
    assert all("loss_spike" not in r for s, r in recs.items() if s != 12)
    assert "skipped" not in recs[12]
    # Logged, and applied: every step updated the weights; the spike is in the window.
    assert trainer.optimizer.step_count == 14 and trainer.state.skipped_steps == 0
    assert trainer.state.loss_window == res.losses


# ---- skip ---------------------------------------------------------------------------------------
def _never_ran(dataset, tmp_path, spike_step: int, steps: int):
    """The reference: the same run driven by hand, the spike's batch read and never trained on
    (no forward, no backward, no optimizer step), the step and samples still counted; the
    learning rate moves by the batches of applied updates only, as Megatron's scheduler."""
    ref = Trainer(make_cfg(dataset, tmp_path / "ref", train__train_iters=steps),
                  log=lambda *a: None)
    losses = []
    for step in range(1, steps + 1):
        batch = ref.data.next_batch()
        if step != spike_step:
            losses.append(ref.train_step(batch)[0])
            assert ref.spike is None  # and nothing else in this run is a spike
            ref.state.lr_samples += GBS
        ref.state.step += 1
        ref.state.consumed_samples += GBS
    return ref, losses


@pytest.mark.parametrize("action", ["skip", "rollback"],
                         ids=["skip", "rollback-without-checkpoint"])
def test_skip_discards_exactly_that_update(dataset, tmp_path, action):
    # rollback before any checkpoint exists falls back to skip, saying so.
    cfg = make_cfg(dataset, tmp_path, train__train_iters=14, train__on_loss_spike=action,
                   checkpoint={"dir": str(tmp_path / "ck"), "save_interval": 100})
    lines = []
    trainer = Trainer(cfg, log=capture(lines))
    inject_spike(trainer, {12})
    taken = record_batches(trainer)
    res = trainer.run()
    ref, ref_losses = _never_ran(dataset, tmp_path, 12, 14)
    # fp32, no dropout: the discarded gradients leave no trace, bit for bit.
    for k, v in masters(ref).items():
        assert torch.equal(trainer.engine.master_state()[k], v), k
    assert res.losses[:11] + res.losses[12:] == ref_losses
    assert taken == [GBS * i for i in range(14)]  # the step and its samples still count
    assert trainer.state.skipped_steps == 1 and trainer.optimizer.step_count == 13
    rec = steps_of(tmp_path / "run")[12]
    assert rec["skipped"] is True and rec["skipped_steps"] == 1
    assert rec["loss_spike"]["action"] == "skip"
    (line,) = [l for l in lines if "loss spike" in l]
    assert "the step's update is skipped" in line and "non-finite" not in "".join(lines)
    if action == "rollback":
        assert rec["loss_spike"]["fallback"] == "no checkpoint to roll back to yet"
        assert line.endswith("(no checkpoint to roll back to yet)")
        assert not (tmp_path / "run" / "skipped_samples.json").exists()


# ---- rollback -----------------------------------------------------------------------------------
ROLLBACK = dict(train__train_iters=16, train__on_loss_spike="rollback", train__log_interval=4)
SKIPPED = {"start": 80, "end": 104, "step": 13, "checkpoint_step": 10}


def _rollback_cfg(dataset, tmp, **over):
    return make_cfg(dataset, tmp, **ROLLBACK, **over)


def test_rollback_skips_the_samples_and_a_resume_does_too(dataset, tmp_path):
    # Saves at step 10 (80 samples). The spike at 13 rolls back to it and takes samples
    # [80, 104) out: training goes on at step 13, at sample 104. The same spike at 14 meets the
    # loop guard (the run rolled back to step 10 once already) and is skipped instead.
    cfg = _rollback_cfg(dataset, tmp_path, checkpoint={"dir": str(tmp_path / "ck"),
                                                       "save_interval": 10})
    lines = []
    trainer = Trainer(cfg, log=capture(lines))
    inject_spike(trainer, {13, 14})
    taken = record_batches(trainer)
    res = trainer.run()
    trainer.checkpoints.wait()  # the final save is async
    assert taken == [GBS * i for i in range(13)] + [104, 112, 120]
    assert any("rolled back to the checkpoint of step 10 and skipped samples [80, 104); "
               "the next step is 14" in l for l in lines)
    assert "[train] skipping samples [80, 104) (loss-spike rollback, skipped_samples.json): " \
           "steps 11-13 are skipped" in lines
    assert any(l.startswith("[train] loss spike at step 14") and l.endswith(
        "(the run rolled back to the checkpoint of step 10 once already)") for l in lines)
    state = trainer.state
    # Steps 11-13 rolled back, 14 skipped: 12 updates in 16 steps; all 128 samples counted.
    assert (state.step, state.consumed_samples, state.skipped_steps) == (16, 128, 4)
    assert trainer.optimizer.step_count == 12
    recorded = json.loads((tmp_path / "run" / "skipped_samples.json").read_text())
    (entry,) = recorded["skipped_samples"]
    assert {k: entry[k] for k in SKIPPED} == SKIPPED and entry["loss"] == res.losses[12]
    final = ckpt.read_manifest(res.checkpoint)
    assert final["step"] == 16
    # The LR's position: the 12 applied updates' samples (Megatron's scheduler).
    # With the data order's digest over its 128 samples (TrainData.order_digest).
    assert final["train_state"] == {"step": 16, "consumed_samples": 128, "skipped_steps": 4,
                                    "lr_samples": 96, "skipped_samples": [entry],
                                    "data_order": final["train_state"]["data_order"]}
    assert final["train_state"]["data_order"]["samples"] == 128
    recs = steps_of(tmp_path / "run")
    assert sorted(recs) == [4, 8, 12, 13, 14, 16]
    r13, r14 = recs[13], recs[14]
    assert r13["loss_spike"]["action"] == "rollback" and r13["skipped"] is True
    assert r13["loss_spike"]["checkpoint_step"] == 10
    assert r13["loss_spike"]["skipped_samples"] == [80, 104]
    assert (r13["consumed_samples"], r13["skipped_steps"]) == (104, 3)
    assert r14["loss_spike"]["action"] == "skip" and r14["skipped_steps"] == 4

    # A crash after the rollback, then a resume from the checkpoint before it: the run dir's
    # skipped_samples.json makes it jump the same range, and it ends in the same bits.
    run2 = tmp_path / "run2"
    shutil.copytree(tmp_path / "run", run2)
    cfg2 = _rollback_cfg(dataset, tmp_path, run_dir=str(run2),
                         checkpoint={"dir": str(tmp_path / "ck2"),
                                     "resume": str(tmp_path / "ck" / ckpt.step_dir_name(10))})
    lines2 = []
    resumed = Trainer(cfg2, log=capture(lines2))
    assert resumed.state.step == 10 and resumed.state.skipped_samples == []
    inject_spike(resumed, {14})
    taken2 = record_batches(resumed)
    res2 = resumed.run()
    resumed.checkpoints.wait()
    assert taken2 == [104, 112, 120]
    assert "[train] skipping samples [80, 104) (loss-spike rollback, skipped_samples.json): " \
           "steps 11-13 are skipped" in lines2
    assert res2.losses == res.losses[13:]
    for k, v in masters(trainer).items():
        assert torch.equal(resumed.engine.master_state()[k], v), k
    assert ckpt.read_manifest(res2.checkpoint)["train_state"] == final["train_state"]
    # Its metrics hold the rollback's record as the uninterrupted run's do (the resume's trim
    # dropped it with the other records after step 10, and status then showed one spike less).
    spikes = [{k: r[k] for k in ("step", "loss_spike")} for r in
              (json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()) if "loss_spike" in r]
    again = [{k: r[k] for k in ("step", "loss_spike")} for r in
             (json.loads(x) for x in (run2 / "metrics.jsonl").read_text().splitlines())
             if "loss_spike" in r]
    assert [s["step"] for s in spikes] == [13, 14] and again == spikes
    # So does the record of step 12, a step the rollback undid, which the resumed run jumps
    # (it was lost: the file no longer read as the uninterrupted run's).
    assert sorted(steps_of(run2)) == [4, 8, 12, 13, 14, 16]
    assert steps_of(run2)[12]["loss"] == recs[12]["loss"]


# ---- every rank decides alike -------------------------------------------------------------------
def _ranks_worker(rank, world, dataset, tmp):
    cfg = _rollback_cfg(dataset, Path(tmp), train__micro_batch_size=2,
                        parallel={"pp": 2, "pp_partition": "uniform", "zero_stage": 1},
                        checkpoint={"dir": f"{tmp}/ck", "save_interval": 10})
    trainer = Trainer(cfg, log=lambda *a: None)
    topo = trainer.topo
    if topo.dp_rank == 0:  # one dp rank's loss only: a bad batch on one replica
        inject_spike(trainer, {13})
    decisions = []
    check = trainer.spikes.check

    def recording_check(state, loss):
        spike = check(state, loss)
        decisions.append((state.step + 1, loss, spike and (spike.action, spike.zscore)))
        return spike
    trainer.spikes.check = recording_check
    trainer.run()
    s = trainer.state
    return {"pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank, "decisions": decisions,
            "state": (s.step, s.consumed_samples, s.skipped_steps, s.skipped_samples,
                      s.loss_window), "step_count": trainer.optimizer.step_count}


def test_every_rank_takes_the_same_decision(dataset, tmp_path):
    # pp2 x dp2, the spike injected on the last stage of dp rank 0 only: the first stages see
    # the loss by the pipeline's broadcast, dp rank 1 through the dp mean. Every rank scores the
    # same bits and rolls back together (a rank that did not would hang the next collective).
    outs = run_ranks(4, _ranks_worker, dataset, str(tmp_path))
    assert sorted((o["pp_rank"], o["dp_rank"]) for o in outs) == [(0, 0), (0, 1), (1, 0),
                                                                   (1, 1)]
    first = outs[0]
    flagged = [d for d in first["decisions"] if d[2] is not None]
    assert [(d[0], d[2][0]) for d in flagged] == [(13, "rollback")]
    for o in outs[1:]:
        assert o["decisions"] == first["decisions"]  # losses and z-scores: the same floats
        assert o["state"] == first["state"]
    step, consumed, skipped, ranges, _ = first["state"]
    assert (step, consumed, skipped, first["step_count"]) == (16, 128, 3, 13)
    assert [(r["start"], r["end"]) for r in ranges] == [(80, 104)]


def test_a_rollback_to_an_async_save_that_failed_goes_to_the_one_before(dataset, tmp_path,
                                                                        monkeypatch):
    """The newest checkpoint is a background save still being written when the spike comes,
    and that save fails (a full disk; checkpoint.on_save_error=continue). The spike's target
    is settled first: here no checkpoint is left, so the spike is skipped and the run goes on.
    It chose the save in flight, found nothing to load, and died on a TypeError."""
    from bloomtrain.checkpoint import writer

    real = writer.CheckpointWriter._save

    def save(self, step, *args, **kwargs):
        if step == 12:
            raise writer.CheckpointSaveError("no space left on device (injected)")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(writer.CheckpointWriter, "_save", save)
    cfg = _rollback_cfg(dataset, tmp_path,
                        checkpoint={"dir": str(tmp_path / "ck"), "save_interval": 12,
                                    "async_save": True, "on_save_error": "continue"})
    lines = []
    trainer = Trainer(cfg, log=capture(lines))
    inject_spike(trainer, {13})
    res = trainer.run()
    trainer.checkpoints.wait()
    assert res.exit_reason == "finished" and res.state.step == 16
    assert res.state.skipped_steps == 1 and not res.state.skipped_samples
    assert any(l.startswith("[train] loss spike at step 13") and
               "no checkpoint to roll back to yet" in l for l in lines), lines
    assert any("no space left on device (injected)" in l for l in lines)


@pytest.mark.parametrize("action", ["skip", "log"])
def test_an_fp16_spike_that_overflows_is_an_overflow_too(dataset, tmp_path, action):
    # A spike's gradients often overflow in fp16. Vetoed (skip), the step still counts as the
    # overflow it is: the scale backs off (hysteresis) instead of growing at the next step. Let
    # through (log), the overflow's skip is said as well as the spike.
    cfg = make_cfg(dataset, tmp_path, train__train_iters=13, train__on_loss_spike=action,
                   train__precision="fp16",
                   optim={"initial_loss_scale": 4096.0, "loss_scale_window": 6})
    lines = []
    trainer = Trainer(cfg, log=capture(lines))
    inject_spike(trainer, {12}, factor=1e6)
    scales = {}
    step = trainer._step

    def recording(*args):
        step(*args)
        scales[trainer.state.step] = trainer.optimizer.scaler.state_dict()
    trainer._step = recording
    trainer.run()
    # Steps 7-11 clean after the growth at 6: the tracker at 5 of 6 before step 12.
    assert scales[11]["growth_tracker"] == 5
    assert scales[12]["growth_tracker"] == 0 and scales[12]["hysteresis_tracker"] == 1
    assert scales[13]["scale"] == scales[11]["scale"]  # not doubled after the overflow
    rec = steps_of(tmp_path / "run")[12]
    assert rec["skipped"] is True and rec["loss_spike"]["action"] == action
    said = "".join(lines)
    assert "loss spike at step 12" in said
    assert ("non-finite" in said) == (action == "log")
