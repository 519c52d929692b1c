"""The lines a training run ends with, from what it left on disk (its run directory's
metrics.jsonl and config.yaml, and the checkpoint directory): where it stopped, its last train
and eval losses, its throughput, the checkpoint and run directory, and the commands that come
next. `bloomtrain train` prints them on rank 0 (or its launcher), and `bloomtrain demo` ends
with them.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.report.runs import fmt, load_run, summarize


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint a resume or an export takes from `directory` (`latest`), None without."""
    if not directory:
        return None
    from bloomtrain import checkpoint as ckpt
    try:
        return ckpt.resolve(directory)
    except Exception:  # noqa: BLE001 - none saved, or none readable: the lines say so
        return None


def closing_lines(run_dir, checkpoint_dir, *, prefix: str = "[train]",
                  report: Path | None = None, exported: Path | None = None) -> list[str]:
    """The run's closing lines. `report`: its report.html, when one was written; `exported`:
    where it was exported to HF already (the demo), in place of the export-hf command."""
    run = load_run(run_dir)
    s = summarize(run)
    checkpoint = latest_checkpoint(checkpoint_dir)
    where = "" if s.step is None else f"at step {s.step:,}"
    if s.step is not None and s.total_steps:
        where += f" of {s.total_steps:,}"
    ended = "finished" if (s.finished or s.total_steps is None) and not s.stopped else \
        "stopped" + (f" ({s.stopped})" if s.stopped else "")
    samples = f" ({s.consumed_samples:,} samples)" if s.consumed_samples is not None else ""
    lines = [f"{prefix} {ended} {where}{samples}".rstrip()]
    if run.steps:
        first, last = run.steps[0], run.steps[-1]
        lines.append(f"  train loss    {fmt(s.loss)} at step {last['step']:,} (first logged: "
                     f"{fmt(first.get('loss'))} at step {first['step']:,})")
    else:
        lines.append("  train loss    - (no step logged)")
    if s.eval_loss is not None:
        lines.append(f"  eval loss     {fmt(s.eval_loss)} at step {s.eval_step:,} "
                     f"(perplexity {fmt(s.eval_ppl, '.2f')})")
    if s.tokens_per_s is not None:
        lines.append(f"  tokens/s      {s.tokens_per_s:,.0f} (median of the last logged "
                     f"intervals)")
    if checkpoint is not None:
        lines.append(f"  checkpoint    {checkpoint}")
    else:
        lines.append("  checkpoint    none" + ("" if checkpoint_dir else
                                                " (set checkpoint.dir to save one)"))
    lines.append(f"  run dir       {run_dir}  (config.yaml, metrics.jsonl)")
    if exported is not None:
        lines.append(f"  HF export     {exported}  "
                     f"(transformers.BloomForCausalLM.from_pretrained)")
    if report is not None:
        lines.append(f"  report        {report}")
    q = shlex.quote
    lines += ["Next:", f"  bloomtrain status {q(str(run_dir))}",
              f"  bloomtrain plot {q(str(run_dir))}"]
    if checkpoint is not None and exported is None:
        lines.append(f"  bloomtrain export-hf --checkpoint {q(str(checkpoint))} --output "
                     f"{q(str(Path(run_dir) / 'hf'))}")
    tensorboard = Path(run_dir) / "tensorboard"
    if tensorboard.is_dir():
        lines.append(f"  tensorboard --logdir {q(str(tensorboard))}")
    return lines


def print_closing(run_dir, checkpoint_dir) -> None:
    """`bloomtrain train`'s last lines. A run directory that cannot be read (another rank's
    node, a file removed) costs the finished run nothing but them."""
    try:
        lines = closing_lines(run_dir, checkpoint_dir)
    except (UserError, OSError) as e:
        lines = [f"[train] done; no summary: {e}"]
    print("\n".join(lines), flush=True)
