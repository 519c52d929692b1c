"""`bloomtrain status RUN_DIR`: one plain-text screen (at most 80 columns by 24 lines) on where a
run stands, read from its run dir while it trains or after it has ended.

The latest checkpoint is the checkpoint package's own answer (`find_latest_valid`: the newest
that verifies), so status never calls a checkpoint good that resuming would skip; it checks the
manifest, fragment index and file sizes but not the sha256 of every file, which on a 2 TB
checkpoint would take tens of minutes (resume still checks them).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from bloomtrain.checkpoint import find_latest_valid
from bloomtrain.config import TrainConfig
from bloomtrain.train.runlock import LOCK_NAME, ended_holder, lock_free
from bloomtrain.report.runs import (Run, Summary, fmt, fmt_duration, fmt_mem, fmt_spike,
                                    fmt_steps, load_run, summarize)

WIDTH, HEIGHT = 80, 24
LABEL = 11  # width of the label column
HARNESS_ROWS = 4  # downstream tasks shown, one row each; the rest counted


def _clip(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _clip_left(text: str, width: int) -> str:
    """Paths keep their informative end."""
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _row(label: str, text: str) -> str:
    return _clip(f"{label:<{LABEL}}{text}")


def checkpoint_root(run: Run) -> tuple[str | None, Path | None]:
    """(checkpoint.dir as configured, where it is on disk or None). A relative dir is relative
    to where training was launched: found by stripping the config's relative run_dir off this
    run dir's absolute path; the current directory is tried after it."""
    cfg = run.config or {}
    section = cfg.get("checkpoint") if isinstance(cfg.get("checkpoint"), dict) else {}
    configured = section.get("dir")
    if not configured:
        return None, None
    d = Path(str(configured))
    candidates = [d] if d.is_absolute() else []
    run_dir = cfg.get("run_dir")
    if not d.is_absolute() and run_dir and not Path(str(run_dir)).is_absolute():
        rel = Path(os.path.normpath(str(run_dir))).parts
        here = run.path.resolve().parts
        if rel and ".." not in rel and here[-len(rel):] == rel:
            candidates.append(Path(*here[:-len(rel)]) / d)
    if not d.is_absolute():
        candidates.append(Path.cwd() / d)
    for c in candidates:
        if c.is_dir():
            return str(configured), c
    return str(configured), None


def _checkpoint_rows(run: Run, now: float) -> list[str]:
    configured, root = checkpoint_root(run)
    if configured is None:
        why = "checkpoint.dir is not set" if run.config is not None else \
            "no config.yaml in the run dir to say where"
        return [_row("checkpoint", f"none ({why})")]
    if root is None:
        return [_row("checkpoint", f"none yet ({configured} does not exist)")]
    skipped: list[str] = []
    path = find_latest_valid(root, log=skipped.append, check_sums=False)
    where = _clip_left(str(root), WIDTH - LABEL - 40)
    if path is None:
        rows = [_row("checkpoint", f"none valid yet in {where}")]
    else:
        age = now - (path / "manifest.json").stat().st_mtime
        rows = [_row("checkpoint", f"{path.name}, saved {fmt_duration(max(age, 0))} ago "
                                   f"in {where}")]
    if skipped:
        # find_latest_valid's own words for the newest one it passed over.
        note = skipped[0].removeprefix("[checkpoint] ")
        rows.append(_row("", f"{len(skipped)} newer skipped: {note}"))
    return rows


# A run's start (indices built, the model built, the first log_interval steps) takes minutes,
# up to tens of minutes at scale; an hour without a record is worth the question.
FIRST_RECORD_WAIT_S = 3600.0


def _state(run: Run, s: Summary, now: float) -> str:
    age = max(now - run.updated, 0.0)
    if s.step is None:
        # metrics.jsonl is created as the run starts: its age is the time since. A hang in the
        # first step (a rendezvous, a collective) would otherwise read as a healthy start.
        if age > FIRST_RECORD_WAIT_S:
            return f"no step logged {fmt_duration(age)} after the start: stalled?"
        return f"started {fmt_duration(age)} ago, no step logged yet"
    if s.finished:
        return f"finished (last record {fmt_duration(age)} ago)"
    if s.stopped:
        return f"stopped at step {s.step:,} ({s.stopped}), {fmt_duration(age)} ago"
    gone = ended_holder(run.path)
    if gone is not None:  # its records alone read "in progress" for ten minutes or more
        return f"killed or crashed at step {s.step:,} (pid {gone} is gone); rerun to resume"
    train = (run.config or {}).get("train")
    every = train.get("log_interval") if isinstance(train, dict) else None
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        every = TrainConfig.log_interval  # a hand-edited "10" is no interval to multiply
    due = s.step_time_s * every if s.step_time_s else None
    # Evals and checkpoint saves stretch the gap between records now and then; only a gap far
    # past both is worth the question.
    if due and age > max(10 * due, 600.0):
        return (f"no record for {fmt_duration(age)}: stopped or stalled? (one was due every "
                f"~{fmt_duration(due)})")
    return f"in progress (last record {fmt_duration(age)} ago)"


def _harness_rows(s: Summary) -> list[str]:
    """The last downstream evaluation: its step, then a row per task with its metrics."""
    if s.harness_step is None:
        return []
    tasks = sorted(s.harness)
    rows = [_row("downstream", f"lm-eval at step {s.harness_step:,}"
                               + ("" if tasks else ": no task gave results"))]
    width = max((len(t) for t in tasks[:HARNESS_ROWS]), default=0)
    for task in tasks[:HARNESS_ROWS]:
        shown = "  ".join(f"{m} {v:.4g}" for m, v in sorted(s.harness[task].items()))
        rows.append(_row("", f"  {task:<{width}}  {shown}"))
    if len(tasks) > HARNESS_ROWS:
        rows.append(_row("", f"  and {len(tasks) - HARNESS_ROWS} more task(s)"))
    return rows


def status_lines(run_dir, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    starting = _starting(Path(run_dir), now)
    if starting:
        return starting
    run = load_run(run_dir)
    s = summarize(run)
    rows = [_row("run", _clip_left(str(run.path.resolve()), WIDTH - LABEL)),
            _row("state", _state(run, s, now))]
    samples = f"   samples {s.consumed_samples:,}" if s.consumed_samples is not None else ""
    rows.append(_row("step", fmt_steps(s) + samples))
    # No ETA row once the run finished, or before its first step (nothing to estimate from).
    running = not s.finished and not s.stopped and s.step is not None and \
        ended_holder(run.path) is None
    if running and s.eta_s is not None:
        train = (run.config or {}).get("train")
        gbs = train.get("global_batch_size") if isinstance(train, dict) else None
        ramping = run.steps and run.steps[-1].get("global_batch_size") != gbs
        basis = (" (the run's own estimate)" if s.total_samples is None or not run.steps else
                 f" at the recent time per sample, the batch ramping up to {gbs}" if ramping else
                 f" at {s.step_time_s:.3g} s/step (recent median)")
        rows.append(_row("ETA", fmt_duration(s.eta_s) + basis))
    elif running and s.total_steps is None:
        why = ("no config.yaml in the run dir" if run.config is None else
               "config.yaml has no train.train_iters or train.train_samples")
        rows.append(_row("ETA", f"- ({why})"))
    ev = ("-" if s.eval_loss is None else
          f"{s.eval_loss:.4f} (ppl {fmt(s.eval_ppl, '.2f')}, step {s.eval_step:,})")
    rows.append(_row("loss", f"{fmt(s.loss):<10}  eval loss {ev}"))
    rows += _harness_rows(s)
    speed = f"{fmt(s.tokens_per_s, ',.0f')} tokens/s   {fmt(s.tflops, '.3g')} TFLOP/s per device"
    if s.mfu is not None:
        speed += f"   MFU {100 * s.mfu:.1f}%"
    rows.append(_row("speed", speed))
    rows.append(_row("memory", "peak " + fmt_mem(s)))
    if s.layout:
        rows.append(_row("layout", s.layout))
    rows += _checkpoint_rows(run, now)
    scale = f"   loss scale {s.loss_scale:g}" if s.loss_scale is not None else ""
    steps = "step" if s.skipped_steps == 1 else "steps"
    rows.append(_row("skipped", f"{s.skipped_steps} {steps}{scale}"))
    spikes = f"{len(s.spikes)}" + (f", last {fmt_spike(s.spikes[-1])}" if s.spikes else "")
    rows.append(_row("spikes", spikes))
    if s.straggler is not None:
        step, rank, ratio = s.straggler
        rows.append(_row("straggler", f"rank {rank} at {fmt(ratio, '.2f', '?')}x the median "
                                      f"step time (step {step:,})"))
    if run.partial_tail:
        rows.append(_row("note", "metrics.jsonl ends in a line being written (left out)"))
    rows.append(_row("alerts", f"{len(s.alerts)}" + (", latest:" if s.alerts else "")))
    room = HEIGHT - len(rows)
    shown = s.alerts[-room:] if room > 0 else []
    rows += [_clip(f"  step {step:,}: {text}") for step, text in shown]
    return rows[:HEIGHT]


def _starting(path: Path, now: float) -> list[str] | None:
    """The screen of a run that holds its lock but has no metrics.jsonl yet: training writes it
    once the model, the data's indices and the checkpoint to resume are ready, which at scale
    takes minutes after the run directory appears."""
    lock = path / LOCK_NAME
    if not path.is_dir() or (path / "metrics.jsonl").exists() or not lock.is_file():
        return None
    try:
        age = max(now - lock.stat().st_mtime, 0.0)
    except OSError:
        return None
    gone = ended_holder(path)
    if gone:
        state = f"ended while starting (pid {gone} gone): failed or killed, see its log"
    elif lock_free(path):  # its holder ran on another host (a job's node) and has ended
        state = "ended while starting (its lock is free): failed or killed, see its log"
    else:
        state = (f"starting for {fmt_duration(age)} (building model, data, checkpoint), no "
                 f"step yet")
    return [_row("run", _clip_left(str(path.resolve()), WIDTH - LABEL)),
            _row("state", _clip(state, WIDTH - LABEL))]


def status_text(run_dir, now: float | None = None) -> str:
    return "\n".join(status_lines(run_dir, now))


