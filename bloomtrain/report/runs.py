"""Reading a run directory (`metrics.jsonl`, `config.yaml`) and summarizing it, for `bloomtrain
plot`, the HTML report and `bloomtrain status`.

metrics.jsonl is appended by rank 0 while the run is live, so its last line may be half written:
an unterminated last line that is not a whole JSON object is ignored. Any other line that is not a
JSON object with a `step` is an error naming the line, because a plot or summary built around it
would silently be wrong.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bloomtrain import jsonl
from bloomtrain.errors import UserError
from bloomtrain.layout import BatchSchedule

# The keys of a downstream evaluation's results: eval/<task>/<metric> (bloomtrain.eval.run).
HARNESS_PREFIX = "eval/"
# Throughput and step time are medians over this many recent step records: the median ignores
# the odd slow interval (a checkpoint save, an eval) without lagging far behind a real change.
RECENT = 10


@dataclass
class Run:
    path: Path
    label: str
    steps: list[dict]  # step records (they have "loss"), in file order
    evals: list[dict]  # eval records (they have "eval_loss")
    config: dict | None  # run_dir/config.yaml, parsed; None when absent
    config_text: str | None
    partial_tail: bool  # the file ended in a half-written line (a live run mid-write)
    updated: float  # mtime of metrics.jsonl
    # downstream eval records (eval/<task>/<metric>: bloomtrain.eval.training)
    harness: list[dict] = field(default_factory=list)
    stops: list[dict] = field(default_factory=list)  # clean stops before the end ("stopped")
    # The stop record no step record follows in the file: where the run stands now. A start the
    # kill switch stops appends its stop (at its checkpoint's step) after the records of steps
    # a killed start logged past that checkpoint, which a resume drops.
    stop: dict | None = None


def read_metrics(path: Path) -> tuple[list[dict], bool]:
    """The records of a metrics.jsonl and whether its last line was half written."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: b"" when the file ends cleanly
    records, partial = [], False
    for num, raw in enumerate(lines, 1):
        records.append(_parse_line(path, num, raw))
    if tail.strip():
        # The writer puts a record and its newline in one write, so an unterminated tail is a
        # record being written now; keep it only if it is already whole.
        try:
            rec = jsonl.loads(tail)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError
            records.append(rec)
        except ValueError:
            partial = True
    return records, partial


def _parse_line(path: Path, num: int, raw: bytes) -> dict:
    where = f"{path} line {num}"
    if not raw.strip():
        raise UserError(f"{where} is empty; metrics.jsonl holds one JSON object per line: "
                        f"delete the empty line")
    try:
        rec = jsonl.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON ({e}): fix or delete that line") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        raise UserError(f"{where} is not a metrics record (a JSON object with an integer "
                        f"\"step\"): fix or delete that line")
    return rec


def load_run(path: str | Path, label: str | None = None) -> Run:
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a run directory" if path.exists() else "does not exist"
        raise UserError(f"run directory {path} {what}; give the run_dir of a training run (it "
                        f"holds metrics.jsonl and config.yaml)")
    mpath = path / "metrics.jsonl"
    if not mpath.is_file():
        raise UserError(f"{path} has no metrics.jsonl; give the run_dir of a training run "
                        f"(run_dir in its config)")
    records, partial = read_metrics(mpath)
    config, config_text = None, None
    cpath = path / "config.yaml"
    if cpath.is_file():
        try:
            config_text = cpath.read_text()
        except UnicodeDecodeError as e:
            raise UserError(f"{cpath} is not UTF-8 text ({e.reason} at byte {e.start}): fix "
                            f"that byte or write the file again as UTF-8") from None
        try:
            config = yaml.safe_load(config_text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise UserError(f"{cpath} is not valid YAML{where}: "
                            f"{getattr(e, 'problem', None) or e}") from None
        if not isinstance(config, dict):
            raise UserError(f"{cpath} does not hold a config (a mapping of sections)")
    return Run(path=path, label=label or path.resolve().name,
               steps=[r for r in records if "loss" in r and "eval_loss" not in r],
               evals=[r for r in records if "eval_loss" in r],
               harness=[r for r in records if any(k.startswith(HARNESS_PREFIX) for k in r)],
               stops=[r for r in records if "stopped" in r], stop=_final_stop(records),
               config=config, config_text=config_text, partial_tail=partial,
               updated=mpath.stat().st_mtime)


def _final_stop(records: list[dict]) -> dict | None:
    stop = None
    for r in records:
        if "stopped" in r:
            stop = r
        elif "loss" in r and "eval_loss" not in r:
            stop = None  # trained on after it: resumed
    return stop


def run_labels(paths: list[str | Path]) -> list[str]:
    """One label per run: the directory name, extended by parent directories until the labels
    differ (runs/a/run, runs/b/run -> a/run, b/run); the same directory given twice gets a
    counter."""
    parts = [Path(p).resolve().parts for p in paths]
    labels = []
    for pp in parts:
        depth = 1
        while depth < len(pp) and any(q != pp and q[-depth:] == pp[-depth:] for q in parts):
            depth += 1
        labels.append(Path(*pp[-depth:]).as_posix())
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} ({seen[lab]})")
    return out


def load_runs(paths: list[str | Path]) -> list[Run]:
    return [load_run(p, lab) for p, lab in zip(paths, run_labels(paths))]


# ---- numbers ---------------------------------------------------------------------------------
def number(rec: dict, key: str) -> float | None:
    """rec[key] as a float, None when absent or not a number. json writes inf/nan for
    non-finite values (a skipped step's grad norm); they come back as floats."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def recent_median(steps: list[dict], key: str) -> float | None:
    # The first interval carries start-up (allocator warm-up, compilation): leave it out when
    # there is anything else.
    pool = steps[1:] if len(steps) > 1 else steps
    vals = _finite(number(r, key) for r in pool[-RECENT:])
    return statistics.median(vals) if vals else None


def _schedule(train: dict) -> BatchSchedule | None:
    """The batch schedule of a config's train section as the trainer runs it (only the batch
    sizes, which need no parallel layout); None for values training would have refused."""
    gbs, rampup = train.get("global_batch_size"), train.get("rampup_batch_size")
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs <= 0:
        return None
    if rampup is not None and (not isinstance(rampup, list) or len(rampup) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in rampup)
            or rampup[0] > gbs):
        return None  # not a ramp training could run; no total rather than a wrong one
    return BatchSchedule(gbs, train.get("micro_batch_size") or 1, None,
                         tuple(rampup) if rampup else None)


def planned_steps(train: dict, step: int, consumed: int) -> int | None:
    """The step the run ends at, from its config's train section: train_iters, or the steps
    until train_samples are consumed at the batch schedule (with ramp-up) from where it is."""
    if isinstance(train.get("train_iters"), int):
        return train["train_iters"]
    samples, batches = train.get("train_samples"), _schedule(train)
    if not isinstance(samples, int) or samples <= 0 or batches is None:
        return None
    try:
        return step + batches.steps_until(samples, consumed)  # the trainer's rule
    except (UserError, ArithmeticError):  # no total rather than no end
        return None


def planned_samples(train: dict) -> int | None:
    """The samples the run consumes in all: train_samples less a partial last batch (which is
    not trained), or train_iters global batches (a ramp-up needs train_samples)."""
    samples, iters, gbs = (train.get(k) for k in ("train_samples", "train_iters",
                                                    "global_batch_size"))
    if isinstance(samples, int) and samples > 0:
        batches = _schedule(train)
        try:
            return batches.trained_samples(samples) if batches is not None else samples
        except (UserError, ArithmeticError):
            return samples
    if isinstance(iters, int) and isinstance(gbs, int) and gbs > 0:
        return iters * gbs
    return None


@dataclass
class Summary:
    step: int | None = None
    total_steps: int | None = None
    consumed_samples: int | None = None
    total_samples: int | None = None  # train_samples, or train_iters x the global batch
    loss: float | None = None
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_step: int | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    mem_peak: float | None = None
    mem_peak_rank: int | None = None
    mem_reserved: float | None = None
    mem_kind: str | None = None  # what the trainer measured (see bloomtrain.train.monitors)
    skipped_steps: int = 0
    loss_scale: float | None = None
    layout: str | None = None
    spikes: list[tuple[int, float | None, str]] = field(default_factory=list)
    alerts: list[tuple[int, str]] = field(default_factory=list)
    straggler: tuple[int, int, float | None] | None = None  # (step, rank, ratio), the last named
    harness_step: int | None = None  # the last downstream evaluation's step
    harness: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> metric -> value

    stopped: str | None = None  # why the run stopped before its end, when that is its last word

    @property
    def finished(self) -> bool:
        return self.step is not None and self.total_steps is not None and \
            self.step >= self.total_steps


def summarize(run: Run) -> Summary:
    s = Summary()
    steps, evals = run.steps, run.evals
    records = steps + evals + run.harness
    if records:
        last_any = max(records, key=lambda r: r["step"])
        s.step = last_any["step"]
        consumed = number(last_any, "consumed_samples")  # a hand-edited "abc" is no number
        s.consumed_samples = int(consumed) if consumed is not None and math.isfinite(consumed) \
            else None
    if run.stop is not None:  # the run stands at its stop, which resuming starts from
        s.step = run.stop["step"]
        consumed = number(run.stop, "consumed_samples")
        if consumed is not None and math.isfinite(consumed):
            s.consumed_samples = int(consumed)
        s.stopped = str(run.stop["stopped"])
        # The records past it (a killed start's) are undone: a resume drops them.
        steps = [r for r in steps if r["step"] <= s.step]
        evals = [r for r in evals if r["step"] <= s.step]
    if steps:
        last = steps[-1]
        s.loss = number(last, "loss")
        skipped = number(last, "skipped_steps")  # a hand-edited NaN or 1e400 is no count
        s.skipped_steps = int(skipped) if skipped is not None and math.isfinite(skipped) else 0
        s.loss_scale = number(last, "loss_scale")
        s.layout = last.get("layout")
    if evals:
        ev = evals[-1]
        s.eval_loss, s.eval_ppl, s.eval_step = number(ev, "eval_loss"), number(ev, "eval_ppl"), \
            ev["step"]
    s.tokens_per_s = recent_median(steps, "tokens_per_s")
    s.tflops = recent_median(steps, "tflops_per_device")
    s.mfu = recent_median(steps, "mfu")
    s.step_time_s = recent_median(steps, "step_time_s")
    train = (run.config or {}).get("train") or {}
    if s.step is not None and isinstance(train, dict):
        s.total_steps = planned_steps(train, s.step, s.consumed_samples or 0)
        s.total_samples = planned_samples(train)
    # By samples, not steps: under a batch-size ramp-up the steps left are larger than the
    # recent ones (a ramp from 16 to 1024 would put the ETA 20x too early).
    per_sample = recent_median([{"s": number(r, "step_time_s") / number(r, "global_batch_size")}
                                for r in steps if number(r, "step_time_s") is not None
                                and number(r, "global_batch_size")], "s")
    if s.total_samples is not None and per_sample is not None and s.consumed_samples is not None:
        s.eta_s = max(s.total_samples - s.consumed_samples, 0) * per_sample
    elif steps and number(steps[-1], "eta_s") is not None:
        s.eta_s = number(steps[-1], "eta_s")  # no config to count steps from: the run's own
    _summarize_monitors(steps, s)
    _summarize_harness(run, s)
    return s


def _summarize_monitors(steps: list[dict], s: Summary) -> None:
    """The peaks, spikes, alerts and the last straggler the step records carry."""
    for r in steps:
        peak = number(r, "mem_peak_bytes")
        if peak is not None and (s.mem_peak is None or peak > s.mem_peak):
            s.mem_peak = peak
            rank = r.get("mem_peak_rank")
            s.mem_peak_rank = rank if isinstance(rank, int) else None
            s.mem_kind = r.get("mem_kind") if isinstance(r.get("mem_kind"), str) else None
        res = number(r, "mem_reserved_bytes")
        if res is not None and (s.mem_reserved is None or res > s.mem_reserved):
            s.mem_reserved = res
        spike = r.get("loss_spike")
        if isinstance(spike, dict):
            z = spike.get("zscore")
            s.spikes.append((r["step"], float(z) if isinstance(z, (int, float)) else None,
                             str(spike.get("action", ""))))
        alerts = r.get("alerts")
        if isinstance(alerts, list):
            s.alerts.extend((r["step"], str(a)) for a in alerts)
        if isinstance(r.get("straggler_rank"), int):
            s.straggler = (r["step"], r["straggler_rank"], number(r, "straggler_ratio"))


def harness_metrics(rec: dict) -> dict[str, dict[str, float]]:
    """task -> metric -> value of a downstream evaluation record, stderrs left out."""
    out: dict[str, dict[str, float]] = {}
    for key in rec:
        if not key.startswith(HARNESS_PREFIX):
            continue
        task, _, metric = key[len(HARNESS_PREFIX):].rpartition("/")
        v = number(rec, key)
        if task and v is not None and "_stderr" not in metric:
            out.setdefault(task, {})[metric] = v
    return out


def _summarize_harness(run: Run, s: Summary) -> None:
    """The last downstream evaluation's results, and its failed tasks among the alerts (none
    past the stop the run stands at)."""
    harness = [r for r in run.harness if run.stop is None or r["step"] <= run.stop["step"]]
    if harness:
        last = harness[-1]
        s.harness_step, s.harness = last["step"], harness_metrics(last)
    for r in harness:
        alerts = r.get("alerts")
        if isinstance(alerts, list):
            s.alerts.extend((r["step"], str(a)) for a in alerts)
    s.alerts.sort(key=lambda item: item[0])


# ---- text ------------------------------------------------------------------------------------
def fmt(v: float | None, spec: str = ".4f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = round(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def fmt_steps(s: Summary) -> str:
    if s.step is None:
        return "no step logged yet"
    if s.total_steps:
        # Done by samples where known: under a ramp-up early steps are small ones.
        done = (s.consumed_samples / s.total_samples
                if s.total_samples and s.consumed_samples is not None else s.step / s.total_steps)
        return f"{s.step:,} / {s.total_steps:,} ({100 * min(done, 1.0):.1f}%)"
    return f"{s.step:,}"


MEM_KINDS = {"cuda": "CUDA allocated", "rss_peak": "RSS", "rss_sampled": "RSS, sampled",
             "rss_lifetime": "RSS since start"}


def fmt_mem(s: Summary) -> str:
    if s.mem_peak is None:
        return "-"
    text = fmt_bytes(s.mem_peak)
    where = ([f"rank {s.mem_peak_rank}"] if s.mem_peak_rank is not None else []) + \
        ([MEM_KINDS.get(s.mem_kind, s.mem_kind)] if s.mem_kind else [])
    if where:
        text += f" ({', '.join(where)})"
    if s.mem_reserved is not None:
        text += f", reserved {fmt_bytes(s.mem_reserved)}"
    return text


def fmt_spike(spike: tuple[int, float | None, str]) -> str:
    step, z, action = spike
    return f"step {step:,} z={fmt(z, '.1f', '?')}{' ' + action if action else ''}"
