"""What the trainer says about its run: the opening lines, each logged step's record
(metrics.jsonl, its sinks and the progress line) with the monitors' fields, the loss scale and
this rank's collective traffic, and the warning of a skipped step."""
from __future__ import annotations

from bloomtrain.train.metrics import progress_line


def layout_text(cfg, layout, attention: str) -> str:
    """`tp=2 pp=1 dp=4 zero=1 precision=bf16 attention=sdpa ...`: what a record's `layout`
    and the opening line say of the run's layout."""
    p, t = cfg.parallel, cfg.train
    ac = t.activation_checkpointing
    return (f"tp={layout.tp} pp={layout.pp} dp={layout.dp} zero={p.zero_stage}"
            f"{' offload' if p.offload_optimizer else ''}"
            f"{' schedule=' + p.pp_schedule if layout.pp > 1 else ''}"
            f"{' sp' if p.sequence_parallel else ''} precision={t.precision} "
            f"attention={attention}{' compile' if t.compile else ''}"
            f"{'' if ac == 'none' else ' recompute=' + ac}")


class StepLog:
    def __init__(self, layout: str, metrics, monitors, optimizer, print):
        """`layout`: layout_text's; `metrics`: the MetricsLog; `print`: rank 0's lines."""
        self.layout, self.metrics, self.monitors = layout, metrics, monitors
        self.optimizer, self.print = optimizer, print
        self.last: tuple | None = None  # the last step's (loss, lr, result, batch, stats)

    def announce(self, shape, train_samples: int, run_dir, plan_text: str) -> None:
        self.print(f"[train] model {shape.num_parameters():,} parameters (L={shape.num_layers}, "
                   f"h={shape.hidden_size}, heads={shape.num_heads}, vocab={shape.vocab_size}); "
                   f"{self.layout}; {train_samples:,} samples, run dir {run_dir}")
        self.print(f"[train] {plan_text}")
        for where in self.metrics.where():
            self.print(f"[train] {where}")

    def warn_skipped(self, state, res) -> None:
        scale = (f"; loss scale {res.loss_scale:g} -> {self.optimizer.loss_scale:g}"
                 if res.loss_scale is not None else "")
        self.print(f"[train] WARNING step {state.step}: non-finite gradient norm "
                   f"({res.grad_norm}), step skipped{scale} ({state.skipped_steps} skipped "
                   f"so far)")

    def step(self, meter, state, args: tuple, due: bool) -> None:
        """After every step: its record when `due` (`args`: record's from `loss` on)."""
        self.last = args
        if due:
            self.record(meter, state, *args)

    def flush(self, meter, state) -> None:
        """The record of the steps since the last one, if any: at the end of the run and at a
        stop, where the last interval is usually partial (train_samples, a ramp-up, a signal);
        without it the run's last steps, and its final loss, would be in no record."""
        if meter.steps and self.last is not None:
            self.record(meter, state, *self.last)

    def record(self, meter, state, loss: float, lr: float, res, gbs: int, stats) -> None:
        """The record of the steps since the last one (a collective: every rank calls it)."""
        num_steps = meter.steps  # before record() starts the next interval
        rec = meter.record(state, loss, lr, res, gbs)
        rec["layout"] = self.layout
        # Memory, step times over ranks, stragglers, the gradient analyser's last figures: a
        # collective, before the traffic below is read so that the record counts its own.
        fields, alerts, lines = self.monitors.record(rec["step_time_s"], num_steps)
        rec.update(fields)
        if alerts:
            rec.setdefault("alerts", []).extend(a.removeprefix("[train] ") for a in alerts)
        for line in lines:
            self.print(line)
        if res.loss_scale is not None:
            rec["loss_scale"] = self.optimizer.loss_scale
        if stats.enabled:
            # This rank's collective traffic since the last record, per kind and group.
            rec["comm"] = {f"{k}/{g}": v for (k, g), v in stats.snapshot().items()}
            stats.reset()
        if res.skipped:
            # The record's loss is the mean of the interval's applied steps (Megatron's); the
            # step that was not applied (a NaN, an overflow, a skipped spike) shows its own.
            rec["skipped"] = True
            rec["step_loss"] = loss
        self.metrics.record(rec)
        self.metrics.progress(progress_line(rec))
