"""`bloomtrain pipeline-timeline RUN_DIR`: print the per-stage timeline of a pipeline step, as
written by `Timeline.save` (run_dir/pipeline_timeline/step_N_rank_R.json), with the measured
bubble next to the theory of arXiv 2104.04473: (p-1)/m for GPipe and 1F1B, (p-1)/(v·m)
interleaved, and of arXiv 2401.10241 for zb-h1: (p-1)/(3m) with equal F, B and W times."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from bloomtrain.parallel.pipeline import SPLIT_BACKWARD, TIMELINE_DIR, summarize
from bloomtrain.errors import UserError

_FILE = re.compile(r"step_(\d+)_rank_(\d+)\.json")
_FILL = {"F": "-", "B": "=", "W": "~", "recv": "."}


def load_step(run_dir, step: int | None = None) -> tuple[int, list[dict]]:
    """The saved timelines of `step` (default: the latest), one per pipeline stage: the lowest
    rank's (dp 0, tp 0 when they were saved), in stage order."""
    folder = Path(run_dir) / TIMELINE_DIR
    found: dict[int, list[Path]] = {}
    for path in folder.glob("step_*_rank_*.json") if folder.is_dir() else []:
        m = _FILE.fullmatch(path.name)
        if m:
            found.setdefault(int(m.group(1)), []).append(path)
    if not found:
        raise UserError(f"no pipeline timeline in {folder}; a run with pp > 1 writes one every "
                        f"log interval when parallel.pp_timeline=true")
    if step is None:
        step = max(found)
    if step not in found:
        raise UserError(f"no pipeline timeline for step {step} in {folder} (steps saved: "
                        f"{', '.join(map(str, sorted(found)))})")
    stages: dict[int, dict] = {}
    for path in sorted(found[step], key=lambda p: int(_FILE.fullmatch(p.name).group(2))):
        data = json.loads(path.read_text())
        stages.setdefault(data["pp_rank"], data)
    return step, [stages[k] for k in sorted(stages)]


def _label(event: dict, num_chunks: int) -> str:
    mb = event["micro_batch"]
    return f"{event['kind']}{mb}" if num_chunks == 1 else f"{event['kind']}{event['chunk']}.{mb}"


def render_row(data: dict, offset: float, seconds_per_col: float) -> str:
    """One stage as text: each event at its time column, forwards as `F3---`, backwards as `B3===`
    (zb-h1: the input gradient), zb-h1's deferred weight gradients as `W3~~~`, waits for a message
    as dots, idle as blanks. A label is never cut: an event shorter than its label pushes the
    following ones right, so order stays exact and timing approximate."""
    row: list[str] = []
    for e in sorted(data["events"], key=lambda e: e["start"]):
        if e["kind"] not in _FILL:
            continue
        start_col = round((e["start"] + offset) / seconds_per_col)
        end_col = round((e["end"] + offset) / seconds_per_col)
        if e["kind"] == "recv":
            if end_col > len(row):
                row += [" "] * max(start_col - len(row), 0)
                row += ["."] * (end_col - len(row))
            continue
        label = _label(e, data["num_virtual_stages"])
        row += [" "] * max(start_col - len(row), 0)
        if row and row[-1] not in " .":
            row.append(" ")  # keep adjacent labels apart
        span = max(end_col - len(row), len(label))
        row += list(label) + [_FILL[e["kind"]]] * (span - len(label))
    return "".join(row)


def format_timeline(run_dir, step: int | None = None, width: int | None = None) -> str:
    step, stages = load_step(run_dir, step)
    width = width or shutil.get_terminal_size((120, 24)).columns
    first = stages[0]
    starts = [s.get("wall_start", 0.0) for s in stages]
    offsets = [t - min(starts) for t in starts]  # each rank's clock starts at its own step start
    total = max(o + s["step_time"] for o, s in zip(offsets, stages))
    prefix = "stage {:>2} |"
    seconds_per_col = total / max(width - len(prefix.format(0)) - 1, 10)
    v = first["num_virtual_stages"]
    lines = [f"pipeline timeline {Path(run_dir)} step {step}: schedule {first['schedule']}, "
             f"pp {first['pp_size']}, {first['num_micro_batches']} micro-batches"
             + (f", {v} model chunks per stage" if v > 1 else "")
             + f", step {total * 1e3:.1f} ms, one column = {seconds_per_col * 1e3:.2f} ms"]
    for data, offset in zip(stages, offsets):
        lines.append(prefix.format(data["pp_rank"]) + render_row(data, offset, seconds_per_col))
    split = first["schedule"] in SPLIT_BACKWARD
    lines.append("F<mb> forward, B<mb> backward" + (" (F<chunk>.<mb> with model chunks)"
                                                    if v > 1 else "")
                 + (" of the input, W<mb> of the weights" if split else "")
                 + ", '.' waiting for a message, blank: idle")
    lines.append("")
    lines.append(f"{'stage':>5} {'compute ms':>11} {'idle ms':>9} {'recv wait ms':>13} "
                 f"{'bubble':>7}")
    summaries = [summarize(d) for d in stages]
    for data, s in zip(stages, summaries):
        lines.append(f"{data['pp_rank']:>5} {s['compute'] * 1e3:>11.1f} {s['idle'] * 1e3:>9.1f} "
                     f"{s['recv_wait'] * 1e3:>13.1f} {s['bubble']:>7.3f}")
    formula = {"interleaved": "(p-1)/(v*m)", "zb-h1": "(p-1)/(3m)"}.get(first["schedule"],
                                                                       "(p-1)/m")
    measured = sum(s["idle"] for s in summaries) / max(sum(s["compute"] for s in summaries), 1e-12)
    lines.append(f"measured bubble (idle / compute, all stages) {measured:.3f} vs theory "
                 f"{formula} = {summaries[0]['theory']:.3f}")
    return "\n".join(lines)
