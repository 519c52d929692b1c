"""The loss-spike monitor (`train.on_loss_spike`): a robust z-score of each step's loss against
the losses of the last `train.loss_spike_window` steps, the modified z-score of Iglewicz and
Hoaglin, z = (loss - median) / (1.4826 * MAD), where MAD is the median absolute deviation from
the median and 1.4826 * MAD estimates the standard deviation of normal data. A loss more than
`train.loss_spike_zscore` of those above the median is a spike (one-sided: a loss that falls is
never one). BLOOM-176B's and OPT-175B's operators watched for these by hand, then rolled back to
the last checkpoint and skipped the data that led to the spike; the trainer can do either step
for them (bloomtrain.train.loop).

The monitor is a pure function of the window and the loss, in Python floats: every rank holds
the same window and the same loss (the global batch's, the same bits everywhere; see
loop.global_loss), so every rank takes the same decision without communicating. The window
lives in TrainState, so a resumed run decides as the uninterrupted one would have.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.data.loader import batches_between
from bloomtrain.parallel import comm
from bloomtrain.train.metrics import IntervalMeter
from bloomtrain.files import atomic_output

# Losses needed before a spike can be flagged (or the whole window, when it is smaller): the
# median and MAD of a handful of losses are too unsteady to call anything 6 deviations out.
MIN_HISTORY = 10
# Scale factors that make a deviation estimate consistent with the normal standard deviation:
# 1 / Phi^-1(3/4) for the MAD, sqrt(pi / 2) for the mean absolute deviation.
MAD_TO_SIGMA = 1.4826
MEAN_AD_TO_SIGMA = 1.2533
# A window of identical losses has no spread to measure against; this fraction of the median
# stands in: a loss more than `zscore` tenths of a percent above a flat line is a spike.
FLAT_SPREAD = 1e-3
# In the run directory: the sample ranges rollbacks took out of the data order (TrainState's
# skipped_samples), so that a resume from a checkpoint older than a rollback skips them too.
SKIPPED_SAMPLES = "skipped_samples.json"


def robust_zscore(window: list[float], loss: float) -> tuple[float, float]:
    """(z, median) of `loss` against `window`. MAD = 0 (more than half the window equal) falls
    back to the mean absolute deviation, which still sees the rest of the window, as Iglewicz
    and Hoaglin's modified z-score does; an all-equal window to FLAT_SPREAD * |median|."""
    median = statistics.median(window)
    deviations = [abs(x - median) for x in window]
    spread = MAD_TO_SIGMA * statistics.median(deviations)
    if spread == 0.0:
        spread = MEAN_AD_TO_SIGMA * statistics.fmean(deviations)
    if spread == 0.0:
        spread = FLAT_SPREAD * abs(median) or FLAT_SPREAD
    return (loss - median) / spread, median


@dataclass
class Spike:
    """A flagged step and what the trainer does about it. `action` is train.on_loss_spike unless
    it could not be done (`fallback` says why: a rollback with no checkpoint to go to, or to one
    the run has rolled back to already)."""

    step: int
    loss: float
    zscore: float
    median: float
    window: int  # the number of losses it was scored against
    action: str  # log | skip | rollback
    fallback: str | None = None
    # A rollback's checkpoint (its step), and the samples [start, end) it takes out of the order.
    checkpoint_step: int | None = None
    skipped_samples: tuple[int, int] | None = None

    def line(self) -> str:
        head = (f"[train] loss spike at step {self.step}: loss {self.loss:.4f}, z "
                f"{self.zscore:.1f} over the last {self.window} steps (median "
                f"{self.median:.4f})")
        if self.action == "log":
            return head
        why = f" ({self.fallback})" if self.fallback else ""
        if self.action == "skip":
            return f"{head}; the step's update is skipped{why}"
        a, b = self.skipped_samples
        return (f"{head}; rolled back to the checkpoint of step {self.checkpoint_step} and "
                f"skipped samples [{a}, {b}); the next step is {self.step + 1}")

    def record(self) -> dict:
        rec = {"loss": self.loss, "zscore": self.zscore, "median": self.median,
               "action": self.action, "window": self.window}
        if self.fallback:
            rec["fallback"] = self.fallback
        if self.action == "rollback":
            rec["checkpoint_step"] = self.checkpoint_step
            rec["skipped_samples"] = list(self.skipped_samples)
        return rec


class LossSpikeMonitor:
    def __init__(self, window: int, zscore: float, action: str):
        self.window, self.threshold, self.action = window, zscore, action
        self.min_history = min(MIN_HISTORY, window)

    def check(self, step: int, loss: float, window: list[float]) -> Spike | None:
        """The spike `loss` at `step` is against `window` (the recent losses, oldest first), or
        None. A non-finite loss is never scored: the engine skips its step as an overflow."""
        window = window[-self.window:]  # a resumed run may have had a longer one
        if not math.isfinite(loss) or len(window) < self.min_history:
            return None
        z, median = robust_zscore(window, loss)
        if z <= self.threshold:
            return None
        return Spike(step=step, loss=loss, zscore=z, median=median, window=len(window),
                     action=self.action)

    def observe(self, window: list[float], loss: float) -> None:
        """Add `loss` to `window` in place, keeping the last `self.window`."""
        if math.isfinite(loss):
            window.append(loss)
            del window[:-self.window]


class SpikeMeter(IntervalMeter):
    """The interval meter whose record also carries the spike that ended the interval (a spike
    step always writes a record): `loss_spike` with what was done, and the spike's line among
    the record's `alerts`."""

    spike: Spike | None = None

    def record(self, state, loss: float, lr: float, result, global_batch: int) -> dict:
        rec = super().record(state, loss, lr, result, global_batch)
        if self.spike is not None:
            rec["loss_spike"] = self.spike.record()
            rec.setdefault("alerts", []).append(self.spike.line().removeprefix("[train] "))
            self.spike = None
        return rec


class LossSpikes:
    """The trainer's side of the monitor: what a spike gets, the rollback, and the skipped
    sample ranges in the data order. Every method takes the run's TrainState and updates it in
    place.

    Rollback semantics. Rolled back to the checkpoint's: the weights, the optimizer (moments,
    Adam's step count, the loss scale), the RNG and the loss window. Not rolled back: the data
    position and the step counter. The samples [checkpoint's consumed_samples, end of the
    spike's batch) are skipped and consumed_samples counts them; the learning rate, which
    follows the samples of applied updates (TrainState.lr_samples, Megatron's scheduler), goes
    on from the checkpoint's, as it did for BLOOM's restarts under Megatron's
    --skip-train-iteration-range, whose skipped iterations step no scheduler. The steps from
    the checkpoint's to the spike's count as skipped steps, so training goes on at the spike's
    step. Step numbers in metrics and checkpoints never go
    back, and train_iters ends the run at the same step and sample as without the rollback,
    with those steps' updates not applied. A resume from a checkpoint older than the rollback
    makes the same jump when its data order reaches the range (jump)."""

    def __init__(self, cfg, checkpoints, stream, batches, run_dir: Path, is_logger: bool,
                 log=print):
        t = cfg.train
        self.monitor = LossSpikeMonitor(t.loss_spike_window, t.loss_spike_zscore,
                                        t.on_loss_spike)
        self.checkpoints, self.stream, self.batches = checkpoints, stream, batches
        self.path, self.is_logger, self.log = Path(run_dir) / SKIPPED_SAMPLES, is_logger, log

    def check(self, state, loss: float) -> Spike | None:
        """Score the step's loss and settle what a spike gets: a rollback with no checkpoint to
        go to, or to the checkpoint the run has rolled back to already (the same weights would
        meet the same trouble again), is a skip instead. The loss joins the window unless the
        step is rolled back (the rollback restores the checkpoint's window)."""
        spike = self.monitor.check(state.step + 1, loss, state.loss_window)
        if spike is not None and spike.action == "rollback":
            # An async save in flight is settled first (the rollback waits for it anyway): if
            # it fails, the target is the checkpoint before it, or none (rolling back to it
            # found nothing to load, and died on a TypeError).
            self.checkpoints.wait()
            last = self.checkpoints.last
            if last is None:
                spike.action, spike.fallback = "skip", "no checkpoint to roll back to yet"
            elif any(r.get("checkpoint_step") == last[0] for r in state.skipped_samples):
                spike.action, spike.fallback = "skip", (f"the run rolled back to the checkpoint "
                                                        f"of step {last[0]} once already")
        if spike is None or spike.action != "rollback":
            self.monitor.observe(state.loss_window, loss)
        return spike

    def rollback(self, state, spike: Spike) -> None:
        """Load the last checkpoint on every rank and jump past the spike's samples; `state` is
        the spike step's before it was counted (see the class docstring for the semantics)."""
        end = state.consumed_samples + self.batches.global_batch_size_at(state.consumed_samples)
        ckpt, _ = self.checkpoints.rollback()
        spike.checkpoint_step = ckpt.step
        spike.skipped_samples = (ckpt.consumed_samples, end)
        state.skipped_samples.append({"start": ckpt.consumed_samples, "end": end,
                                      "step": spike.step, "checkpoint_step": ckpt.step,
                                      "loss": spike.loss, "zscore": spike.zscore})
        state.step, state.consumed_samples = ckpt.step, ckpt.consumed_samples
        state.skipped_steps, state.lr_samples = ckpt.skipped_steps, ckpt.lr_samples
        state.loss_window[:] = ckpt.loss_window
        self._write(state)
        self.log(spike.line())
        self.stream.load_state_dict({"consumed_samples": state.consumed_samples})
        self.stream.set_skipped(state.skipped_ranges())
        self.jump(state)

    def jump(self, state) -> bool:
        """Move past a skipped sample range the data order has reached (right after a rollback,
        or in a run resumed from a checkpoint older than the rollback): the step counter moves on
        by the global batches in the range and counts them as skipped, as the rolled-back run
        did. Whether it moved."""
        start = self.stream.next_start()
        if start == state.consumed_samples:
            return False
        n = batches_between(self.batches, state.consumed_samples, start)
        self.log(f"[train] skipping samples [{state.consumed_samples}, {start}) (loss-spike "
                 f"rollback, {SKIPPED_SAMPLES}): steps {state.step + 1}-{state.step + n} are "
                 f"skipped")
        state.step += n
        state.skipped_steps += n
        state.consumed_samples = start
        self.stream.load_state_dict({"consumed_samples": start})
        return True

    def load(self, state, resumed: bool) -> None:
        """Put this run's skipped ranges into the data order: the checkpoint's and those of
        run_dir/skipped_samples.json (a rollback after that checkpoint, then a crash). On a
        fresh start the file belongs to an earlier run and goes. Rank 0 reads it for all."""
        if not resumed:
            if self.is_logger:
                self.path.unlink(missing_ok=True)
            return
        found = self._read() if self.is_logger else None  # the ranges, or what is wrong
        found = comm.broadcast_object(found, 0, comm.world_group(), "skipped_samples")
        if isinstance(found, str):
            raise UserError(found)
        known = set(state.skipped_ranges())
        state.skipped_samples += [r for r in found if (r["start"], r["end"]) not in known]
        state.skipped_samples.sort(key=lambda r: (r["start"], r["end"]))
        if state.skipped_samples:
            self._write(state)
        self.stream.set_skipped(state.skipped_ranges())

    def _read(self) -> list[dict] | str:
        if not self.path.is_file():
            return []
        try:
            found = json.loads(self.path.read_text())["skipped_samples"]
            return [{**r, "start": int(r["start"]), "end": int(r["end"])} for r in found]
        except (ValueError, KeyError, TypeError) as e:
            return (f"{self.path} is not a list of skipped sample ranges ({e!r}); loss-spike "
                    f"rollbacks write it: restore it, or delete it to train on those samples "
                    f"after all")

    def _write(self, state) -> None:
        """The whole list, atomically: the file only ever grows over a run."""
        if self.is_logger:
            with atomic_output(self.path, "w") as f:
                json.dump({"skipped_samples": state.skipped_samples}, f, indent=1)
                f.write("\n")
