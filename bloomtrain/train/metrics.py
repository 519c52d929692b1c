"""What a run reports: `run_dir/metrics.jsonl` (one JSON object per logged step and per eval,
written by rank 0, appended on resume), its mirrors for TensorBoard and W&B (bloomtrain.train.sinks)
and the progress line.

A record covers the steps since the previous one: the loss is the mean over the applied (not
skipped) steps, step time and tokens/s over all of them, TFLOP/s by Megatron's formula, and the
ETA is the steps left at that step time."""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from bloomtrain import jsonl
from bloomtrain.errors import UserError
from bloomtrain.model.presets import megatron_tflops
from bloomtrain.train.sinks import open_sinks
from bloomtrain.files import atomic_output
from bloomtrain.progress import draw_in_place, format_duration, is_terminal


class Console:
    """Rank 0's lines through `log`. When they reach a terminal, the progress line is redrawn in
    place and ended with a newline before any other line and at close; anywhere else (a file, a
    pipe, a log callback) each progress line is a line of its own."""

    def __init__(self, log=print, stream=None):
        # `stream` is where `log` writes, when known; print's is whatever sys.stdout is by then.
        self.log, self._stream = log, stream
        self._open = None  # the stream holding an unfinished progress line
        # The async checkpoint writer logs from its own thread.
        self._lock = threading.Lock()

    def _terminal(self):
        stream = (self._stream if self._stream is not None else
                  sys.stdout if self.log is print else None)
        return stream if is_terminal(stream) else None

    def _end_progress(self) -> None:
        if self._open is not None:
            self._open.write("\n")
            self._open.flush()
            self._open = None

    def line(self, *args) -> None:
        with self._lock:
            self._end_progress()
            self.log(*args)

    def progress(self, text: str) -> None:
        with self._lock:
            stream = self._terminal()
            if stream is None:
                self._end_progress()
                self.log(text)
                return
            draw_in_place(stream, text)
            self._open = stream

    def close(self) -> None:
        with self._lock:
            self._end_progress()


def _drop_unfinished_line(path: Path, log) -> None:
    """Cut a last line a kill left unfinished (no newline) from `path`, keeping the rest."""
    with contextlib.suppress(FileNotFoundError):
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            log(f"[metrics] dropping the unfinished last line of {path}")
            with atomic_output(path, "wb") as f:
                f.write(data[:data.rfind(b"\n") + 1])


class MetricsLog:
    """Records in run_dir/metrics.jsonl and its sinks, and lines through a Console, on rank 0
    only. Every rank builds one: a sink the config requires but cannot open fails on all."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None, log=print, *,
                 cfg=None, train_samples: int | None = None, append_only: bool = False):
        """`append_only`: a start that trains nothing (the kill switch is there) adds its
        record to the file as it is, and opens no sinks (a TensorBoard sink would purge the
        steps after the checkpoint): the records it would rewrite are the last ones the
        stopped job logged, which are the ones looked at."""
        self.enabled, self.train_samples = enabled, train_samples
        self.console = Console(log)
        self.path = Path(run_dir) / "metrics.jsonl"
        history = []
        # A resume drops the records after its checkpoint; a rollback's among them is written
        # again when the resumed run jumps its samples (replay), or the spike would vanish
        # from the file, status and the plots (skipped_samples.json alone kept it), and so are
        # the records of the steps it undid, which the resumed run jumps too.
        self.rollbacks: dict[int, list[dict]] = {}
        if not enabled:
            pass
        elif append_only:
            _drop_unfinished_line(self.path, log)  # or the record appended would join it
        elif resume_step is None or not self.path.exists():
            # A fresh run, or a resume into a new run_dir (another run's checkpoint, an
            # import): the file is there from the start, so `status` reads a run that has begun.
            with atomic_output(self.path, "w"):
                pass
        else:
            history = self._keep_until(resume_step, log)
        self.sinks, self.notes = (([], []) if cfg is None or append_only else
                                  open_sinks(cfg, Path(run_dir), enabled, resume_step, history))

    def _keep_until(self, resume_step: int, log) -> list[dict]:
        """Drop the records after `resume_step` (those steps are about to run again) so the
        file reads as one uninterrupted run; the records kept."""
        keep, history, undone = [], [], []
        lines = list(filter(str.strip, self.path.read_text().splitlines()))
        for i, line in enumerate(lines):
            try:
                rec = jsonl.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a record")
            except ValueError:
                if i == len(lines) - 1:  # cut short by a kill or a full disk
                    log(f"[metrics] dropping the unfinished last line of {self.path}")
                    break
                raise UserError(f"{self.path} line {i + 1} is not JSON; a resumed run keeps "
                                f"the records up to its step: repair or remove that line"
                                ) from None
            # A stop at the resumed step is over: `status` read it as the run's state while
            # the resumed run trained, until its first record.
            if rec.get("step", 0) <= resume_step and not (
                    "stopped" in rec and rec.get("step") == resume_step):
                keep.append(line)
                history.append(rec)
            elif (rec.get("loss_spike") or {}).get("action") == "rollback":
                # The resume jumps its samples again: it, and the records of the steps after
                # its checkpoint that it undid, are written again then.
                since = rec["loss_spike"].get("checkpoint_step")
                self.rollbacks[rec["step"]] = [r for r in undone if since is not None and
                                               since < r.get("step", 0) < rec["step"]] + [rec]
                undone = []
            elif "stopped" not in rec:
                undone.append(rec)
        with atomic_output(self.path, "w") as f:
            f.write("".join(line + "\n" for line in keep))
        return history

    def where(self) -> list[str]:
        """Where this run's metrics go and how to view them."""
        return [f"metrics: {self.path}"] + [s.where() for s in self.sinks] + self.notes

    def print(self, *args) -> None:
        if self.enabled:
            self.console.line(*args)

    def progress(self, text: str) -> None:
        if self.enabled:
            self.console.progress(text)

    def record(self, rec: dict) -> None:
        if not self.enabled:
            return
        if "step_time_s" in rec and self.train_samples is not None:
            # Under train_iters, train_samples is train_iters x the global batch (a ramp-up
            # needs train_samples), so this is train_iters - step; a partial last batch is
            # not trained (BatchSchedule.fits).
            left = max(self.train_samples - rec["consumed_samples"], 0) \
                // rec["global_batch_size"]
            rec["eta_s"] = left * rec["step_time_s"]
        with open(self.path, "a") as f:
            f.write(jsonl.dumps(rec) + "\n")  # strict JSON: NaN and inf as strings
        for sink in self.sinks:
            sink.write(rec)

    def replay(self, step: int) -> None:
        """The resumed run jumped the samples of the rollback at `step`: its record again, after
        those of the steps it undid."""
        for rec in self.rollbacks.pop(step, []):
            self.record(rec)

    def eval(self, step: int, consumed: int, loss: float) -> None:
        # exp overflows past ~709: inf, as a diverged run's perplexity is (a cap would write a
        # finite, wrong one); a NaN loss stays NaN.
        ppl = math.exp(loss) if loss < 700 else (loss if math.isnan(loss) else math.inf)
        self.record({"step": step, "consumed_samples": consumed, "eval_loss": loss,
                     "eval_ppl": ppl})
        self.print(f"[eval] step {step} | loss {loss:.4f} | ppl {ppl:.2f}")

    def stopped(self, step: int, consumed: int, reason: str) -> None:
        """A clean stop before the end (the kill switch, a signal, the time limit): a record,
        so that `status` reads a run that stopped, not one in progress."""
        self.record({"step": step, "consumed_samples": consumed, "stopped": reason})

    def close(self) -> None:
        """Finish the sinks' files and the progress line."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        self.console.close()


@dataclass
class IntervalMeter:
    """Accumulates the steps since the last record."""

    seq_length: int
    shape: object
    num_devices: int
    recompute: bool
    # The device's dense bf16 peak (hardware.device_peak_tflops) where known and the run is
    # in bf16/fp16: each record's MFU is its TFLOP/s over it.
    peak_tflops: float | None = None
    loss: float = 0.0
    applied: int = 0
    steps: int = 0
    time: float = 0.0
    tokens: int = 0

    def add(self, loss: float, skipped: bool, seconds: float, global_batch: int) -> None:
        if not skipped:
            self.loss += loss
            self.applied += 1
        self.steps += 1
        self.time += seconds
        self.tokens += global_batch * self.seq_length

    def record(self, state, loss: float, lr: float, result, global_batch: int) -> dict:
        """The record of the interval (then reset)."""
        step_time = self.time / self.steps
        s = self.shape
        rec = {
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "loss": self.loss / self.applied if self.applied else loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "global_batch_size": global_batch,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens / self.time if self.time else 0.0,
            "tflops_per_device": megatron_tflops(global_batch, self.seq_length, s.num_layers,
                                                 s.hidden_size, s.vocab_size, step_time,
                                                 self.num_devices, self.recompute),
            "skipped_steps": state.skipped_steps,
        }
        if self.peak_tflops:
            # Model FLOPs only: recompute's extra forward is hardware work, not the model's
            # (bloom_facts.md: MFU vs HFU), so full recompute read 4/3 of the planner's MFU.
            rec["mfu"] = (rec["tflops_per_device"] if not self.recompute else
                          megatron_tflops(global_batch, self.seq_length, s.num_layers,
                                          s.hidden_size, s.vocab_size, step_time,
                                          self.num_devices, False)) / self.peak_tflops
        self.loss, self.applied, self.steps, self.time, self.tokens = 0.0, 0, 0, 0.0, 0
        return rec


def progress_line(rec: dict) -> str:
    return (f"step {rec['step']:6d} | samples {rec['consumed_samples']:9d} | loss "
            f"{rec['loss']:.4f} | lr {rec['lr']:.3e} | grad_norm {rec['grad_norm']:.3f} | "
            f"{rec['step_time_s']:.3f} s/step | {rec['tokens_per_s']:.0f} tok/s | "
            f"{rec['tflops_per_device']:.3f} TFLOP/s/dev"
            + (f" | ETA {format_duration(rec['eta_s'])}" if "eta_s" in rec else ""))
