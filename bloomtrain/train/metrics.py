"""What a run reports: `run_dir/metrics.jsonl` (one JSON object per logged step and per eval,
written by rank 0, appended on resume) and the progress line.

A record covers the steps since the previous one: the loss is the mean over the applied (not
skipped) steps, step time and tokens/s over all of them, TFLOP/s by Megatron's formula."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bloomtrain.optim import megatron_tflops
from bloomtrain.utils import atomic_output


class MetricsLog:
    """Progress lines through `log` and records in run_dir/metrics.jsonl, on rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None, log=print):
        self.enabled, self.log = enabled, log
        self.path = Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        if resume_step is None:
            with atomic_output(self.path, "w"):
                pass
        elif self.path.exists():
            # Steps after the checkpoint are about to run again: drop their old records so the
            # file reads as one uninterrupted run.
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with atomic_output(self.path, "w") as f:
                f.write("".join(line + "\n" for line in keep))

    def print(self, *args) -> None:
        if self.enabled:
            self.log(*args)

    def record(self, rec: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def eval(self, step: int, consumed: int, loss: float) -> None:
        ppl = math.exp(min(loss, 50.0))
        self.record({"step": step, "consumed_samples": consumed, "eval_loss": loss,
                     "eval_ppl": ppl})
        self.print(f"[eval] step {step} | loss {loss:.4f} | ppl {ppl:.2f}")


@dataclass
class IntervalMeter:
    """Accumulates the steps since the last record."""

    seq_length: int
    shape: object
    num_devices: int
    recompute: bool
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
        self.loss, self.applied, self.steps, self.time, self.tokens = 0.0, 0, 0, 0.0, 0
        return rec


def progress_line(rec: dict) -> str:
    return (f"step {rec['step']:6d} | samples {rec['consumed_samples']:9d} | loss "
            f"{rec['loss']:.4f} | lr {rec['lr']:.3e} | grad_norm {rec['grad_norm']:.3f} | "
            f"{rec['step_time_s']:.3f} s/step | {rec['tokens_per_s']:.0f} tok/s | "
            f"{rec['tflops_per_device']:.3f} TFLOP/s/dev")
