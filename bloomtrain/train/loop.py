"""The trainer: the parts built from a validated Config (join the job, the process groups, the
model built on meta and `parallelize`d, the data in Megatron's sample order, the learning-rate
schedule, a resume), then a loop that reads top to bottom. Every step runs through the pipeline
schedule runtime, with one chunk when pp = 1.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.data.check import check_data
from bloomtrain.data.gpt_dataset import SEPARATE_LAST_EPOCH_FRACTION
from bloomtrain.eval.training import HarnessHook
from bloomtrain.model.attention import resolve_attention
from bloomtrain.validate import validate, RunLayout
from bloomtrain.model import BloomForCausalLM
from bloomtrain.optim import LRSchedule
from bloomtrain.parallel import comm
from bloomtrain.parallel.parallelize import parallelize
from bloomtrain.parallel.pipeline import Timeline, pipeline_eval_step, pipeline_train_step
from bloomtrain.parallel.tensor.rng import kept_rng, stage_seed
from bloomtrain.planner import plan_for_run
from bloomtrain.planner.hardware import device_peak_tflops
from bloomtrain.planner.host import check_host, node_ranks, resident_bytes
from bloomtrain.topology import Topology
from bloomtrain.train.checkpointing import TrainCheckpoints, TrainState
from bloomtrain.train.control import RunControl
from bloomtrain.train.launch import (env_from_slurm, init_distributed, resolve_device,
                                     world_size_from_env)
from bloomtrain.train.metrics import MetricsLog
from bloomtrain.train.runlock import lock_run
from bloomtrain.train.monitors import Monitors
from bloomtrain.train.sinks import open_sinks
from bloomtrain.train.spikes import LossSpikes, Spike, SpikeMeter
from bloomtrain.train.steplog import StepLog, layout_text
from bloomtrain.train.watchdog import Watchdog
from bloomtrain.files import atomic_output


@dataclass
class TrainResult:
    state: TrainState
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    checkpoint: str | None = None
    run_dir: str = ""
    exit_reason: str = "finished"
    stop_signal: int | None = None  # the SIGTERM or SIGUSR1 that stopped the run, if one did


def _epochs_text(epochs: list) -> str:
    """[[2, True], [1, False]] -> "2 (the last shuffled on its own), 1"."""
    return ", ".join(f"{e}{' (the last shuffled on its own)' if apart else ''}"
                     for e, apart in epochs)


class TrainData:
    """The train and valid splits, and this dp rank's stream of global batches."""

    def __init__(self, cfg: Config, run, topo: Topology, tokenizer, device):
        from bloomtrain.data.loader import DataIterator, build_train_valid_test_datasets
        t, d = cfg.train, cfg.data
        self.cfg, self.topo, self.device, self.batches = cfg, topo, device, run.batches
        self.train_samples = (t.train_samples if t.train_samples is not None
                              else t.train_iters * t.global_batch_size)
        self.train_iters = t.train_iters or run.batches.steps_until(self.train_samples)
        # Megatron's valid split (training.py build_train_valid_test_data_iterators): a window
        # of eval_iters global batches for every evaluation of the run, the one at the end
        # included. The count sets the split's epochs, so its sample order too.
        evals = self.train_iters // t.eval_interval + 1 if t.eval_interval else 1
        self.train_ds, self.valid_ds, _ = build_train_valid_test_datasets(
            d, tokenizer, [self.train_samples, t.eval_iters * t.global_batch_size * evals, 0],
            d.seq_length)
        self.eod_id = tokenizer.eod_id if tokenizer else None
        self.stream = DataIterator(self.train_ds, run.batches, topo.dp_rank, 0, self.eod_id,
                                   d.eod_mask_loss, prefetch=True)

    def order_digest(self, samples: int) -> dict | None:
        """The order of the training data over its first `samples` samples, as a checkpoint
        records it, with the run's length: "index", the key of what Megatron's index arrays (and
        the blend's) are built from, the length replaced by what it decides ("epochs" of each
        dataset, and whether the last is shuffled on its own: a length past an epoch's end, or
        the last epoch's share crossing SEPARATE_LAST_EPOCH_FRACTION, rebuilds the index, which
        shuffles over all the epochs); and "sha256", a hash of the tokens at five positions
        (the first, the last, three between), which the data's content changes."""
        if samples <= 0 or samples > min(len(self.train_ds), self.train_samples):
            return None
        digest = hashlib.sha256()
        for pos in sorted({samples - 1, *(samples * i // 4 for i in range(4))}):
            digest.update(np.asarray(self.train_ds[pos], dtype=np.int64).tobytes())
        order = self.train_ds.order
        return {"samples": samples, "train_samples": self.train_samples,
                "sha256": digest.hexdigest(), "index": order["key"], "epochs": order["epochs"]}

    def check_order(self, state: TrainState) -> None:
        """Refuse to resume `state` on a data order other than the one its run trained on
        (unless data.override_order): the run would train on some samples twice and never on
        others, and nothing would say so. Megatron rebuilds its index silently. A run shorter
        than the samples consumed has nothing to train, which the loop says."""
        saved = state.data_order
        if not saved or self.cfg.data.override_order:
            return
        now = self.order_digest(saved["samples"])
        if now is None or (now["sha256"] == saved["sha256"]
                           and saved.get("index", now["index"]) == now["index"]):
            return  # a record from before the index key is checked on its tokens
        length = ""
        if saved["train_samples"] != self.train_samples:
            epochs = saved.get("epochs")
            change = (f"; epochs of each dataset {_epochs_text(epochs)} -> "
                      f"{_epochs_text(now['epochs'])}" if epochs and epochs != now["epochs"]
                      else "")
            length = (f" (train samples {saved['train_samples']:,} -> {self.train_samples:,}"
                      f"{change}: Megatron's index, and so ours, is built for the epochs a "
                      f"length takes, the last shuffled on its own while under "
                      f"{SEPARATE_LAST_EPOCH_FRACTION:.0%} of an epoch, and shuffles over "
                      f"all of them)")
        raise UserError(
            f"the training data's order differs from the one the checkpoint's run trained on: "
            f"its first {saved['samples']:,} samples are not the same{length}; resumed, the "
            f"run would train on some samples again and never on others. Keep the "
            f"checkpoint's data settings and length ({saved['train_samples']:,} samples: "
            f"train.train_samples={saved['train_samples']}, or the train.train_iters that "
            f"gives it; a new run can be longer from the start), or set "
            f"data.override_order=true to go on in the new order")

    def _to_device(self, micro_batches):
        return [{k: v.to(self.device) for k, v in mb.items()} for mb in micro_batches]

    def next_batch(self) -> list[dict]:
        return self._to_device(self.stream.next_global_batch())

    def has_batch(self, consumed_samples: int) -> bool:
        """Whether another step runs: its whole batch within train_samples (Megatron throws
        away a partial last batch)."""
        return self.batches.fits(consumed_samples, self.train_samples)

    def eval_batches(self, window: int = 0):
        """The micro-batches of the `eval_iters` global batches of the valid split's `window`-th
        window: Megatron's evaluations read on through the valid split (one iterator,
        consumed_valid_samples), so the k-th evaluation of a run reads the k-th window."""
        from bloomtrain.data.loader import get_micro_batches
        t = self.cfg.train
        if self.valid_ds is None:
            return
        for i in range(t.eval_iters):
            start = (window * t.eval_iters + i) * t.global_batch_size
            if start + t.global_batch_size > len(self.valid_ds):
                return
            yield self._to_device(get_micro_batches(
                self.valid_ds, start, t.global_batch_size, t.micro_batch_size, self.topo.dp_rank,
                self.topo.dp_size, eod_id=self.eod_id, eod_mask_loss=self.cfg.data.eod_mask_loss))


@dataclass
class Preflight:
    """What a run checks and resolves before any process group starts."""
    device: torch.device
    tokenizer: object
    run: RunLayout
    attention: str
    plan: object
    plan_text: str
    host_resident: int
    host: object


def preflight(cfg: Config, run: RunLayout, world: int) -> Preflight:
    device = resolve_device(cfg)
    # The model's vocabulary follows the tokenizer's, and every dataset's token ids must
    # fit it. `bloomtrain train` checked before launching; a Trainer built from Python was
    # not (the result is cached: a second check reads one small file per dataset).
    tokenizer, run = check_data(cfg, run)
    # The kernel depends on the device and shape: resolved before any process group starts.
    attention = resolve_attention(cfg.train.attention, cfg.model.attention_dropout, device,
                                  cfg.train.precision, cfg.data.seq_length, run.shape.head_dim)
    # ZeRO-Offload's host memory on this node, checked before anything is allocated: the
    # node's ranks are all here (none passes init_distributed before the others arrive),
    # each holding what this one holds now. First: its line names offload's own parts.
    resident = resident_bytes()  # the process before it allocates
    host = check_host(cfg, run.shape, run.layout, "cuda" if device.type == "cuda" else "cpu",
                      node_ranks(world), resident)
    # The planner's memory prediction for this layout, before any process group: a layout it
    # predicts not to fit the device (on the CPU, the host) is refused here, not by an OOM at
    # the first step.
    plan, plan_text = plan_for_run(cfg, run.shape, world, device)
    return Preflight(device, tokenizer, run, attention, plan, plan_text, resident, host)


class Trainer:
    spike: Spike | None = None  # the loss spike the last train_step found

    def __init__(self, cfg: Config, log=print, run: RunLayout | None = None):
        """`run`: what `validate(cfg, world)` returned, when the caller (the CLI, the launcher)
        checked the config already."""
        env_from_slurm()
        world = world_size_from_env()
        if run is None:
            run = validate(cfg, world)  # before anything starts
        self.cfg = cfg
        pre = preflight(cfg, run, world)
        self.device, self.tokenizer, run = pre.device, pre.tokenizer, pre.run
        self.attention, self.plan, self.plan_text = pre.attention, pre.plan, pre.plan_text
        self.host_resident, self.host = pre.host_resident, pre.host
        open_sinks(cfg, Path(cfg.run_dir), False, None, [])  # a required viewer's package
        self.harness = HarnessHook.from_config(cfg, self.tokenizer, self.print)
        init_distributed(cfg, self.device)
        self.topo = Topology.build(layout=run.layout, timeout_minutes=cfg.parallel.timeout_minutes)
        # One job per run directory and checkpoint.dir, before either is written.
        self.run_lock = lock_run(cfg.run_dir, cfg.checkpoint.dir, self.topo, log, owner=self)
        try:
            self._build(cfg, run, log)
        except BaseException:
            # A failed build holds nothing: a notebook keeps the traceback, and this object
            # with it, until the kernel restarts.
            self.run_lock.release()
            raise

    def _build(self, cfg: Config, run: RunLayout, log) -> None:
        """Everything after the lock: the model, data, checkpoints and logs of this run."""
        self.watchdog = Watchdog.start(self.topo, cfg.run_dir, cfg.parallel.hang_timeout_s)
        self.is_logger = self.topo.rank == 0
        self._log = log
        self.shape, self.batches = run.shape, run.batches
        torch.manual_seed(stage_seed(cfg.train.seed, self.topo.pp_rank))
        with torch.device("meta"):
            model = BloomForCausalLM(self.shape)
        self.parts = parallelize(model, self.topo, cfg, attention=self.attention,
                                 device=self.device)
        self.data = TrainData(cfg, run, self.topo, self.tokenizer, self.device)
        self.lr_schedule = lr_schedule(cfg.optim, self.data.train_samples, self.print,
                                       self.batches.last_step_start(self.data.train_samples))
        self.checkpoints = TrainCheckpoints(cfg, self.parts, self.tokenizer, log=self.print,
                                            order_digest=self.data.order_digest)
        self.state = (resumed := self.checkpoints.resume()) or TrainState()
        self.resumed = resumed is not None
        self.data.check_order(self.state)
        self.data.stream.load_state_dict({"consumed_samples": self.state.consumed_samples})
        self.run_dir = Path(cfg.run_dir)
        self.control = RunControl(cfg.train, cfg.checkpoint, self.device)
        # Before the run directory is written: a start the kill switch stops rewrites nothing.
        self.kill_switched = self.control.kill_switch_at_start(self.print)
        self.metrics = MetricsLog(self.run_dir, self.is_logger,
                                  self.state.step if self.resumed else None, log=self._log,
                                  cfg=cfg, train_samples=self.data.train_samples,
                                  append_only=self.kill_switched)
        # Every later line goes through the metrics console, which ends an in-place progress
        # line first.
        self._log = self.metrics.console.line
        if self.is_logger and not self.kill_switched:
            with atomic_output(self.run_dir / "config.yaml", "w") as f:
                f.write(cfg.to_yaml())

    @property
    def engine(self):
        return self.parts.engine

    @property
    def optimizer(self):
        return self.parts.optimizer

    def print(self, *args) -> None:
        if self.is_logger:
            self._log(*args)

    # ---- one step ------------------------------------------------------------------------------
    def _schedule_kwargs(self, micro_batches) -> dict:
        t, layout = self.cfg.train, self.topo.layout
        return dict(recv_shape=layout.recv_shape(t.micro_batch_size, self.cfg.data.seq_length,
                                                 self.shape.hidden_size),
                    dtype=self.engine.compute_dtype,
                    timeout=self.cfg.parallel.timeout_minutes * 60)

    def train_step(self, micro_batches: list[dict]):
        """One step, in torchtitan's order: the gradients zeroed, forward and backward of every
        micro-batch through the schedule, the engine's reductions, the clip, then the optimizer
        step at the learning rate of the samples consumed so far. The loss-spike monitor may
        veto the step (train.on_loss_spike skip or rollback): then the gradients are discarded
        (run() does the rollback). Returns (loss averaged over the global batch, the step
        result, lr); the spike is left in self.spike."""
        self.parts.train(True)
        self.optimizer.zero_grad()
        timeline = self._timeline()
        loss = pipeline_train_step(self.cfg.parallel.pp_schedule, self.parts.chunks, micro_batches,
                                   self.topo, scale_loss=self.optimizer.scale_loss,
                                   timeline=timeline, **self._schedule_kwargs(micro_batches))
        if timeline is not None:
            timeline.save(self.run_dir, self.state.step + 1)
        # A dp collective, the step's first under ZeRO 0-1 (2-3 reduce in backward): where a
        # rank waits for a slow dp peer, timed as the engine's own waits (the straggler check).
        with self.engine.waits.waiting():
            loss = global_loss(loss, self.topo, self.device)
        self.spike = self.spikes.check(self.state, loss)  # before the step it may veto
        lr = self.lr_schedule(self.state.lr_samples)
        self.engine.reduce_gradients()
        if self.spike is not None and self.spike.action != "log":
            return loss, self.optimizer.discard(), lr
        self.optimizer.clip_grad_norm()
        return loss, self._optimizer_step(lr), lr

    @functools.cached_property
    def spikes(self) -> LossSpikes:
        return LossSpikes(self.cfg, self.checkpoints, self.data.stream, self.batches,
                          self.run_dir, self.is_logger, log=self.print)

    @functools.cached_property
    def monitors(self) -> Monitors:
        return Monitors(self.cfg.train, self.topo, self.device, self.engine)

    @functools.cached_property
    def steplog(self) -> StepLog:
        return StepLog(layout_text(self.cfg, self.topo.layout, self.attention), self.metrics,
                       self.monitors, self.optimizer, self.print)

    def _optimizer_step(self, lr: float):
        """The optimizer's step, with the gradient analyser on the steps it is due (every rank
        alike: it takes a collective), then the monitors' per-step sample."""
        step = self.state.step + 1
        result = self.optimizer.step(lr, grad_stats=self.monitors.grad_stats_due(step))
        for line in self.monitors.after_step(step, result):
            self.print(line)
        return result

    def _timeline(self) -> Timeline | None:
        p, t = self.cfg.parallel, self.cfg.train
        due = p.pp_timeline and p.pp > 1 and (self.state.step + 1) % t.log_interval == 0
        return Timeline() if due else None

    @torch.no_grad()
    def evaluate(self, window: int = 0) -> float | None:
        self.parts.train(False)
        total, count = 0.0, 0
        with kept_rng():  # training's dropout must not depend on whether evaluations ran
            for mbs in self.data.eval_batches(window):
                self.watchdog.progress()
                loss = pipeline_eval_step(self.cfg.parallel.pp_schedule, self.parts.chunks,
                                          mbs, self.topo, **self._schedule_kwargs(mbs))
                total, count = total + loss * len(mbs), count + len(mbs)
        return mean_over_dp(total / count, self.topo, self.device) if count else None

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg, t, state = self.cfg, self.cfg.train, self.state
        result = TrainResult(state=state, run_dir=str(self.run_dir))
        self.steplog.announce(self.shape, self.batches.trained_samples(self.data.train_samples),
                              self.run_dir, self.plan_text)
        if self.kill_switched:
            result.exit_reason = "kill switch"
            # Said in the metrics too: a fresh run's report read "finished", its status
            # "stalled?" an hour later.
            self.metrics.stopped(state.step, state.consumed_samples, "kill switch")
            return result
        if not self.data.has_batch(state.consumed_samples):
            # A resumed run at its end: say so, rather than exit 0 having done nothing.
            total = t.train_iters if t.train_iters is not None else state.step
            keep = ("" if self.cfg.optim.decay_samples is not None else
                    f", with optim.decay_samples={self.data.train_samples} to keep this run's "
                    f"decay")
            self.print(f"[train] already at step {state.step} of {total}; nothing to train "
                       f"(raise train.train_iters or train.train_samples to continue{keep})")
            result.exit_reason = "nothing to train"
            return result
        self.spikes.load(state, self.resumed)
        meter = SpikeMeter(cfg.data.seq_length, self.shape, self.topo.world_size,
                           t.activation_checkpointing == "full", peak_tflops(self.device, t))
        with self.control.active(), comm.stats_scope(cfg.parallel.comm_stats) as stats, \
                contextlib.closing(self.data.stream), contextlib.closing(self.metrics):
            while self.data.has_batch(state.consumed_samples):
                if self.spikes.jump(state):  # samples a loss-spike rollback took out
                    self.metrics.replay(state.step)
                    continue
                # The step clock of the hang watchdog runs while this loop does.
                self.watchdog.heartbeat(state.step + 1)
                self._step(meter, result, stats)
                stop = stop_or_save(self, result)
                if stop:
                    return end_on_stop(self, meter, result, stop)
            self.steplog.flush(meter, state)
            self._finish(result)
        return result

    def _step(self, meter: SpikeMeter, result: TrainResult, stats) -> None:
        """One step, its place in the train state, and what is due after it: its record, the
        evaluation, the harness's tasks."""
        t, state = self.cfg.train, self.state
        gbs = self.batches.global_batch_size_at(state.consumed_samples)
        t0 = time.time()
        loss, res, lr = self.train_step(self.data.next_batch())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        spike = self.spike
        if spike is not None and spike.action == "rollback":
            self.spikes.rollback(state, spike)  # the checkpoint's weights, new data
        else:
            state.step += 1
            state.consumed_samples += gbs
            state.skipped_steps += res.skipped
            if not res.skipped:  # the LR schedule moves with applied updates only
                state.lr_samples += gbs
        result.losses.append(loss)
        meter.add(loss, res.skipped, time.time() - t0, gbs)
        if spike is not None:
            meter.spike = spike  # its record carries it
            if spike.action != "rollback":  # the rollback said it, with where to
                self.print(spike.line())
        if res.skipped and (spike is None or spike.action == "log"):  # skipped by overflow
            self.steplog.warn_skipped(state, res)
        self.steplog.step(meter, state, (loss, lr, res, gbs, stats),
                          due=state.step % t.log_interval == 0 or res.skipped or spike is not None)
        if t.eval_interval and state.step % t.eval_interval == 0:
            self._eval_and_log(result, state.step // t.eval_interval - 1)
        if self.harness is not None and self.harness.due(state.step):
            self._harness_eval()

    def _finish(self, result: TrainResult) -> None:
        """The end of the samples: the evaluations not run at the last step, the last save."""
        t, state = self.cfg.train, self.state
        if not (t.eval_interval and state.step % t.eval_interval == 0):
            # After the run's periodic evaluations, the next window (Megatron's evaluation at
            # the end of training reads on from them too).
            self._eval_and_log(result, state.step // t.eval_interval if t.eval_interval else 0)
        if self.harness is not None and not self.harness.due(state.step):
            self._harness_eval()
        # A resumed step, or one whose interval save committed, needs no new save.
        if self.cfg.checkpoint.dir and self.checkpoints.saved_step() != state.step:
            result.checkpoint = str(self.checkpoints.save_final(state))

    def _harness_eval(self) -> None:
        """lm-evaluation-harness tasks on the live model (bloomtrain.eval.training)."""
        self.harness.run(self.parts, self.engine.compute_dtype, self.device, self.state,
                         self.metrics)

    def _eval_and_log(self, result: TrainResult, window: int) -> None:
        loss = self.evaluate(window)
        if loss is not None:
            result.eval_loss = loss
            self.metrics.eval(self.state.step, self.state.consumed_samples, loss)


def stop_or_save(trainer: Trainer, result: TrainResult) -> str | None:
    """Why the run stops now, if it does, after saving; else a save if one is due (a module
    function for the Trainer's loop)."""
    stop = trainer.control.should_stop()
    if stop:
        trainer.print(trainer.control.stop_line(trainer.state.step, stop))
    if stop or trainer.control.time_to_save(trainer.state.step):
        # A failed save returns None (checkpoint.on_save_error=continue): the next interval
        # tries again. On a stop there is no next one: it raises.
        save = trainer.checkpoints.save_final if stop else trainer.checkpoints.save
        path = save(trainer.state)
        if path is not None:
            result.checkpoint = str(path)
        trainer.control.saved()
    if stop and not trainer.data.has_batch(trainer.state.consumed_samples):
        # The stop came at the last step: saved first, the run then ends as it would have
        # (its final evaluations), not as a stop, which no resume would make up for
        # ("nothing to train").
        return None
    return stop


def end_on_stop(trainer: Trainer, meter, result: TrainResult, stop: str) -> TrainResult:
    """The records of a run that stops before its end: the steps since the last record, then
    the stop, last (status reads a record after a stop as the run trained on: resumed)."""
    trainer.steplog.flush(meter, trainer.state)
    trainer.metrics.stopped(trainer.state.step, trainer.state.consumed_samples, stop)
    result.exit_reason, result.stop_signal = stop, trainer.control.signal
    return result


def peak_tflops(device, t) -> float | None:
    """What a record's MFU is against: the device's dense bf16 peak, in a 16-bit run."""
    return device_peak_tflops(device) if t.precision in ("bf16", "fp16") else None


def lr_schedule(o, train_samples: int, log, last_start: int | None = None) -> LRSchedule:
    """The run's LR schedule; the decay over the whole run where optim.decay_samples is unset.
    A run whose last step (starting at `last_start` samples) is still inside the warmup (a
    shortened demo, a smoke test) is said, not refused: its learning rate never reaches
    optim.lr. A step reads the rate at the samples consumed before it (Megatron's order), so
    the last step's is the highest."""
    sched = LRSchedule(o.lr, o.min_lr, o.warmup_samples, o.decay_samples or train_samples,
                       o.decay_style)
    if last_start is not None and last_start < o.warmup_samples:
        log(f"[train] WARNING the run's {train_samples} samples end inside the warmup "
            f"(optim.warmup_samples {o.warmup_samples}): the learning rate reaches only "
            f"{sched(last_start):.3g}, at its last step (optim.lr {o.lr:g}); lower the "
            f"warmup or train longer")
    return sched


def mean_over_dp(value: float, topo: Topology, device) -> float:
    t = torch.tensor(value, dtype=torch.float32, device=device)
    comm.all_reduce(t, topo.dp_group, "dp")
    return float(t / topo.dp_size)


def global_loss(loss: float, topo: Topology, device) -> float:
    """This dp rank's loss (the same on its tp ranks, and on its pp ranks by broadcast)
    averaged over dp, the same bits on every rank: the loss-spike decision rests on that. Each
    dp group runs its own all-reduce, and a float sum depends on the order it adds in; fp32
    values summed in fp64 are exact whatever the order (for losses within 2^(29 - log2 dp) of
    each other), then rounded as mean_over_dp's (its very value for dp <= 2)."""
    t = torch.tensor(loss, dtype=torch.float32, device=device).double()
    comm.all_reduce(t, topo.dp_group, "dp")
    return float(t.float() / topo.dp_size)


def train(cfg: Config, log=print, run: RunLayout | None = None) -> TrainResult:
    trainer = Trainer(cfg, log=log, run=run)
    ended = False
    try:
        result = trainer.run()
        ended = True
        return result
    finally:
        trainer.checkpoints.wait()  # an async save must be committed before the process ends
        if ended:
            # Every rank leaves together. Not after a failure on this rank: its peers are
            # likely waiting on it (a pipeline receive, a collective), so a barrier would hold
            # its traceback until the hang watchdog fired and the job would be called a hang;
            # once this process exits with the error, the launcher ends the others.
            comm.barrier(comm.world_group(), "end")
        trainer.watchdog.stop()
        trainer.run_lock.release()
