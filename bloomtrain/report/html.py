"""The run report: `report.html` beside the plot PNGs, with a summary table of every run, its
loss spikes and alerts, every plot (by relative path, so the directory can be copied or served
as a whole) with a caption of the figures it shows, and the resolved config: a run's whole, or
for several runs the keys whose values differ.

The page is static apart from a short inline script that records each image's natural width in
the DOM once it has loaded and marks an image that failed visibly, so a broken report is obvious
to a reader and checkable by a headless browser.
"""
from __future__ import annotations

import html
import json
import math
import time
from pathlib import Path
from urllib.parse import quote

from bloomtrain.errors import UserError
from bloomtrain.report.plot import Panel, write_plots
from bloomtrain.report.runs import (Run, Summary, fmt, fmt_mem, fmt_spike, fmt_steps, load_runs,
                                    summarize)
from bloomtrain.files import atomic_output

# Alerts and spikes listed per run in the report; the summary table gives the full counts.
MAX_LISTED = 50

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 0 0 2em 0; }
img { max-width: 100%; border: 1px solid #ddd; }
img.broken { border: 3px solid #c00; min-width: 200px; min-height: 60px; }
.broken-note { color: #c00; font-weight: bold; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
"""

# Runs after the images are in the DOM: each <img> gets data-natural-width once it has loaded,
# and one that fails gets a red border and a note naming it.
SCRIPT = """
(function () {
  var imgs = Array.prototype.slice.call(document.images), pending = imgs.length;
  function done() {
    if (--pending > 0) return;
    var bad = document.querySelectorAll('img.broken').length;
    document.body.setAttribute('data-images-checked', String(imgs.length));
    document.body.setAttribute('data-images-broken', String(bad));
  }
  function mark(img) {
    if (img.naturalWidth > 0) {
      img.setAttribute('data-natural-width', String(img.naturalWidth));
    } else {
      img.classList.add('broken');
      var note = document.createElement('div');
      note.className = 'broken-note';
      note.textContent = 'image failed to load: ' + img.getAttribute('src');
      img.parentNode.insertBefore(note, img);
    }
    done();
  }
  if (!imgs.length) { pending = 1; done(); }
  imgs.forEach(function (img) {
    if (img.complete) { mark(img); return; }
    img.addEventListener('load', function () { mark(img); });
    img.addEventListener('error', function () { mark(img); });
  });
})();
"""


def _e(text) -> str:
    return html.escape(str(text))


def _summary_rows(runs: list[Run], sums: list[Summary]) -> list[tuple[str, list[str]]]:
    def eval_text(s: Summary) -> str:
        if s.eval_loss is None:
            return "-"
        return f"{s.eval_loss:.4f} (ppl {fmt(s.eval_ppl, '.2f')}, step {s.eval_step:,})"

    def harness_text(s: Summary) -> str:
        if s.harness_step is None:
            return "-"
        tasks = "; ".join(f"{task}: " + ", ".join(f"{m} {v:.4g}" for m, v in sorted(ms.items()))
                          for task, ms in sorted(s.harness.items()))
        return f"step {s.harness_step:,}: {tasks or 'no results'}"

    def spikes_text(s: Summary) -> str:
        if not s.spikes:
            return "0"
        return f"{len(s.spikes)} (last: {fmt_spike(s.spikes[-1])})"

    return [
        ("run dir", [str(r.path) for r in runs]),
        ("steps", [fmt_steps(s) + (" finished" if s.finished else
                                   f" stopped ({s.stopped})" if s.stopped else "")
                   for s in sums]),
        ("samples", [fmt(s.consumed_samples, ",") for s in sums]),
        ("last loss", [fmt(s.loss) for s in sums]),
        ("last eval loss", [eval_text(s) for s in sums]),
        ("last downstream eval", [harness_text(s) for s in sums]),
        ("tokens/s (recent median)", [fmt(s.tokens_per_s, ",.0f") for s in sums]),
        ("TFLOP/s per device", [fmt(s.tflops, ".3g") for s in sums]),
        ("MFU", [fmt(None if s.mfu is None else 100 * s.mfu, ".1f") +
                 ("%" if s.mfu is not None else "") for s in sums]),
        ("step time (recent median)", [fmt(s.step_time_s, ".3f") + " s"
                                       if s.step_time_s is not None else "-" for s in sums]),
        ("peak memory", [fmt_mem(s) for s in sums]),
        ("skipped steps", [str(s.skipped_steps) for s in sums]),
        ("loss scale", [fmt(s.loss_scale, "g") for s in sums]),
        ("loss spikes", [spikes_text(s) for s in sums]),
        ("alerts", [str(len(s.alerts)) for s in sums]),
        ("last straggler", ["-" if s.straggler is None else
                            f"rank {s.straggler[1]} x{fmt(s.straggler[2], '.2f', '?')} "
                            f"(step {s.straggler[0]:,})" for s in sums]),
        ("layout", [s.layout or "-" for s in sums]),
    ]


def _g(v: float) -> str:
    return f"{v:,.4g}"


def _line_text(label: str, xs: list[float], ys: list[float]) -> str | None:
    """A plotted line's first and last values, and its extremes where they lie elsewhere."""
    pts = [(int(x), y) for x, y in zip(xs, ys) if math.isfinite(y)]
    if not pts:
        return None
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    if len(pts) == 1:
        return f"{label} {_g(y0)} at step {x0:,}"
    text = f"{label} {_g(y0)} at step {x0:,} -> {_g(y1)} at step {x1:,}"
    inner = [f"{name} {_g(y)} at step {x:,}" for name, (x, y) in
             (("min", min(pts, key=lambda p: p[1])), ("max", max(pts, key=lambda p: p[1])))
             if y not in (y0, y1)]
    return text + (f" ({', '.join(inner)})" if inner else "")


def caption(panel: Panel, runs: list[Run], sums: list[Summary]) -> str:
    """What the image cannot say exactly: each line's values at its ends and extremes, the loss
    spikes, and for memory where the peak was and what was measured."""
    parts = []
    for ylabel, lines in panel.shown.items():
        texts = []
        for label, (xs, ys) in lines.items():
            if label == "loss spike":
                texts.append(f"{len(xs)} loss spike(s), at step(s) "
                             f"{', '.join(f'{int(x):,}' for x in xs)}")
            elif (text := _line_text(label, xs, ys)) is not None:
                texts.append(text)
        parts.append(f"{ylabel}: {'; '.join(texts)}")
    if panel.file == "memory.png":
        parts.append("peak " + "; ".join(f"{r.label} {fmt_mem(s)}" for r, s in zip(runs, sums)
                                        if s.mem_peak is not None))
    return ". ".join(parts) + "."


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _config_html(runs: list[Run]) -> list[str]:
    """One run: its resolved config. Several: the keys whose values differ, one column per
    run (whole configs side by side hide the one key that matters among a hundred)."""
    if len(runs) == 1:
        run = runs[0]
        return [f"<pre>{_e(run.config_text)}</pre>" if run.config_text is not None else
                f"<p>{_e(run.path)} has no config.yaml.</p>"]
    missing = [r for r in runs if r.config is None]
    flat = [_flat(r.config) for r in runs if r.config is not None]
    keys = sorted({k for f in flat for k in f})
    differ = [k for k in keys if len({json.dumps(f.get(k, "<absent>"), sort_keys=True, default=str)
                                      for f in flat}) > 1]
    with_config = [r for r in runs if r.config is not None]
    out = [f"<p>{len(differ)} of {len(keys)} keys differ between the runs' config.yaml "
           f"({', '.join(_e(r.path / 'config.yaml') for r in with_config)}); the others are "
           f"equal.</p>" if with_config else ""]
    if differ:
        out.append("<table><tr><th>key</th>" +
                   "".join(f"<th>{_e(r.label)}</th>" for r in with_config) + "</tr>")
        for k in differ:
            cells = "".join(f"<td>{_e(json.dumps(f[k], default=str) if k in f else '(absent)')}</td>"
                            for f in flat)
            out.append(f"<tr><th>{_e(k)}</th>{cells}</tr>")
        out.append("</table>")
    out.extend(f"<p>{_e(r.path)} has no config.yaml.</p>" for r in missing)
    return [line for line in out if line]


def render_html(runs: list[Run], panels: list[Panel], generated: float | None = None) -> str:
    sums = [summarize(r) for r in runs]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(generated or time.time()))
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>bloomtrain report: {_e(', '.join(r.label for r in runs))}</title>",
           f"<style>{STYLE}</style></head><body>",
           "<h1>bloomtrain report</h1>",
           f"<p>Generated {_e(when)} from {len(runs)} run(s).</p>",
           "<h2>Summary</h2>", "<table>",
           "<tr><th></th>" + "".join(f"<th>{_e(r.label)}</th>" for r in runs) + "</tr>"]
    for name, cells in _summary_rows(runs, sums):
        out.append(f"<tr><th>{_e(name)}</th>" + "".join(f"<td>{_e(c)}</td>" for c in cells) +
                   "</tr>")
    out.append("</table>")
    events = [(r, s) for r, s in zip(runs, sums) if s.spikes or s.alerts]
    if events:
        out.append("<h2>Loss spikes and alerts</h2>")
        for run, s in events:
            items = [f"step {st:,}: {text}" for st, text in sorted(
                [(st, f"loss spike z={fmt(z, '.1f', '?')} {a}") for st, z, a in s.spikes] +
                s.alerts, key=lambda item: item[0])]
            more = len(items) - MAX_LISTED
            out.append(f"<h3>{_e(run.label)}</h3><ul>" +
                       "".join(f"<li>{_e(i)}</li>" for i in items[-MAX_LISTED:]) +
                       (f"<li>... and {more} earlier</li>" if more > 0 else "") + "</ul>")
    out.append("<h2>Plots</h2>")
    if not panels:
        out.append("<p>No run has a logged step yet: nothing to plot.</p>")
    for p in panels:
        out.append(f'<figure><img src="{_e(quote(p.file))}" alt="{_e(p.title)}">'
                   f"<figcaption>{_e(caption(p, runs, sums))}</figcaption></figure>")
    out.append("<h2>Config</h2>")
    out.extend(_config_html(runs))
    out.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(out) + "\n"


def write_report(run_dirs: list, out_dir=None) -> Path:
    """Write the plots and report.html for `run_dirs` into `out_dir` (default: the first run
    dir's plots/); returns the path of report.html."""
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    runs = load_runs(run_dirs)
    empty = [str(r.path) for r in runs if not r.steps and not r.evals and not r.harness]
    if len(empty) == len(runs):
        raise UserError(f"nothing to plot: metrics.jsonl has no records yet in {', '.join(empty)}"
                        f" (training writes one every train.log_interval steps)")
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "plots"
    # Rendered once before any image is written: a run it cannot summarize then leaves the
    # output directory as it was, not new images beside the old report.
    render_html(runs, [])
    panels = write_plots(runs, out)
    path = out / "report.html"
    with atomic_output(path, "wb") as f:
        f.write(render_html(runs, panels).encode("utf-8"))
    return path
