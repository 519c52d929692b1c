"""The run plots: one PNG per panel, several runs overlaid on the same axes, drawn with
matplotlib's Agg canvas (no pyplot, so no global backend is switched in the caller's process).

matplotlib is the optional `plot` extra and is imported only when a plot is drawn. A panel, or a
sub-plot of one, that no run has data for is left out rather than drawn empty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.report.runs import HARNESS_PREFIX, Run, harness_metrics, number
from bloomtrain.files import atomic_output

GIB = 2.0 ** 30


@dataclass(frozen=True)
class Line:
    source: str  # "steps", "evals" or "harness": which records of a run it reads
    key: str
    suffix: str = ""  # appended to the run's label in the legend
    scale: float = 1.0
    style: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Axis:
    ylabel: str
    lines: tuple[Line, ...]
    yscale: str = "linear"  # "log" when every value is positive and they span over 2 decades;
    # "log2" for the loss scale, which moves in powers of two
    spikes: bool = False  # mark records with a loss_spike on the first line
    from_zero: bool = False  # the y axis starts at 0, so that a small change looks small
    # A count that stayed 0 in every run (skipped steps) is drawn only where it is not: a flat
    # line at 0 says less than the summary table's "0".
    zero_is_empty: bool = False
    title: str = ""  # this sub-plot's part of a title composed from the sub-plots drawn


@dataclass(frozen=True)
class PanelSpec:
    file: str
    title: str  # "": the drawn sub-plots' titles, joined
    axes: tuple[Axis, ...]


DASHED = {"linestyle": "--", "marker": "o", "markersize": 3}
PANELS = (
    PanelSpec("loss.png", "Loss", (
        Axis("loss", (Line("steps", "loss"), Line("evals", "eval_loss", " eval", style=DASHED)),
             spikes=True),)),
    PanelSpec("lr.png", "Learning rate", (Axis("learning rate", (Line("steps", "lr"),)),)),
    PanelSpec("grad_norm.png", "Gradient norm", (
        Axis("grad norm", (Line("steps", "grad_norm"),), yscale="log"),)),
    PanelSpec("throughput.png", "Throughput", (
        Axis("tokens/s", (Line("steps", "tokens_per_s"),)),
        Axis("TFLOP/s per device", (Line("steps", "tflops_per_device"),)),
        Axis("MFU (%)", (Line("steps", "mfu", scale=100.0),)))),
    PanelSpec("memory.png", "Memory (peak per interval, max over ranks)", (
        Axis("GiB", (Line("steps", "mem_peak_bytes", " peak", 1 / GIB),
                     Line("steps", "mem_reserved_bytes", " reserved", 1 / GIB,
                          {"linestyle": "--"})), from_zero=True),)),
    # Only fp16 runs scale the loss (the trainer records loss_scale then); any run may skip a
    # step whose gradient norm is not finite.
    PanelSpec("loss_scale.png", "", (
        Axis("loss scale", (Line("steps", "loss_scale"),), yscale="log2", title="loss scale"),
        Axis("skipped steps (total)", (Line("steps", "skipped_steps",
                                            style={"drawstyle": "steps-post"}),),
             zero_is_empty=True, title="skipped steps"))),
)


# A run keeps its colour in every panel; on a downstream sub-plot its tasks differ by these.
TASK_STYLES = tuple({"linestyle": ls, "marker": m, "markersize": 4}
                    for m, ls in zip("os^Dv<>p", ("-", "--", ":", "-.") * 2))


def harness_panels(runs: list[Run]) -> tuple[PanelSpec, ...]:
    """The downstream evaluations' panel (eval/<task>/<metric> records, bloomtrain.eval): a
    sub-plot per metric, a line per task; none when no run has such a record."""
    tasks_of: dict[str, set[str]] = {}
    for run in runs:
        for rec in run.harness:
            for task, metrics in harness_metrics(rec).items():
                for metric in metrics:
                    tasks_of.setdefault(metric, set()).add(task)
    if not tasks_of:
        return ()
    axes = tuple(
        Axis(metric, tuple(Line("harness", f"{HARNESS_PREFIX}{task}/{metric}", f" {task}",
                                style=TASK_STYLES[i % len(TASK_STYLES)])
                           for i, task in enumerate(sorted(tasks))), yscale="log")
        for metric, tasks in sorted(tasks_of.items()))
    return (PanelSpec("downstream.png", "Downstream evaluation (lm-evaluation-harness)", axes),)


@dataclass
class Panel:
    """A written image: its file name (in the output dir), title and the sub-plots drawn, and
    what each sub-plot shows, read back from the figure's own artists: ylabel -> legend label ->
    (steps, values) for every line and marker set."""
    file: str
    title: str
    axes: list[str]
    shown: dict[str, dict[str, tuple[list[float], list[float]]]] = field(default_factory=dict)
    ylims: dict[str, tuple[float, float]] = field(default_factory=dict)  # ylabel -> (low, high)


def series(records: list[dict], line: Line) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = number(r, line.key)
        if v is None:
            continue
        xs.append(r["step"])
        # Non-finite values (a skipped step's grad norm) become gaps, not a ruined y range.
        ys.append(v * line.scale if math.isfinite(v) else math.nan)
    return xs, ys


def _finite(ys) -> list[float]:
    return [y for y in ys if math.isfinite(y)]


def _load_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'bloomtrain[plot]'") from None
    return Figure, FigureCanvasAgg


def write_plots(runs: list[Run], out_dir: Path) -> list[Panel]:
    """Draw every panel that has data in at least one run into out_dir; returns what was
    written, in display order."""
    Figure, FigureCanvasAgg = _load_matplotlib()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--output {out_dir} is a file; the plots go into a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in PANELS + harness_panels(runs):
        # (axis, [(run index, line, xs, ys)]) for the axes that have any finite value.
        drawn = []
        for axis in spec.axes:
            data = [(i, line, *series(getattr(run, line.source), line))
                    for i, run in enumerate(runs) for line in axis.lines]
            data = [d for d in data if _finite(d[3])]
            if axis.zero_is_empty and not any(y for d in data for y in _finite(d[3])):
                data = []
            if data:
                drawn.append((axis, data))
        if not drawn:
            continue
        title = spec.title or " and ".join(a.title for a, _ in drawn).capitalize()
        fig = Figure(figsize=(9, 0.8 + 2.7 * len(drawn)), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        fig.suptitle(title)
        axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
        legend = None
        for ax, (axis, data) in zip(axes, drawn):
            legend = _draw_axis(ax, axis, data, runs, legend)
        axes[-1].set_xlabel("step")
        with atomic_output(out_dir / spec.file, "wb") as f:
            fig.savefig(f, format="png")
        written.append(Panel(spec.file, title, [a.ylabel for a, _ in drawn],
                             {ax.get_ylabel(): _shown(ax) for ax in axes},
                             {ax.get_ylabel(): tuple(map(float, ax.get_ylim())) for ax in axes}))
    return written


def _shown(ax) -> dict[str, tuple[list[float], list[float]]]:
    out = {line.get_label(): ([float(x) for x in line.get_xdata()],
                              [float(y) for y in line.get_ydata()]) for line in ax.get_lines()}
    for markers in ax.collections:
        xy = markers.get_offsets()
        out[markers.get_label()] = ([float(x) for x, _ in xy], [float(y) for _, y in xy])
    return out


def legend_text(label: str) -> str:
    """A run's label as matplotlib shows it literally: `$` would start mathtext (and a bad
    expression fails the whole figure), and a leading `_` hides the entry from the legend."""
    label = label.replace("$", r"\$")
    return "\u200b" + label if label.startswith("_") else label


def run_colour(i: int):
    """Run i's colour: the default cycle's ten, then tab20b's and tab20c's forty other hues
    (C10 is C0 again, which made run 11 run 1's double on every panel)."""
    if i < 10:
        return f"C{i}"
    import matplotlib

    extra = [matplotlib.colormaps[name](k) for name in ("tab20b", "tab20c") for k in range(20)]
    return extra[(i - 10) % len(extra)]


def _draw_axis(ax, axis: Axis, data, runs: list[Run], above: list | None) -> list:
    """Draw one sub-plot; returns its legend labels. The legend is left off when the sub-plot
    above shows the same one."""
    for i, line, xs, ys in data:
        style = {"linewidth": 1.2} | line.style
        if len(_finite(ys)) == 1:  # a line through one point draws nothing
            style.setdefault("marker", "o")
        # One colour per run across every panel, so runs can be followed from image to image.
        ax.plot(xs, ys, color=run_colour(i), label=legend_text(runs[i].label + line.suffix), **style)
    if axis.spikes:
        first = axis.lines[0]
        # At the spike's own loss: the record's is the interval's mean (with a skipped spike,
        # of the steps before it), which would put the marker at the curve's lowest point.
        pts = [(r["step"], number(r["loss_spike"], "loss") if number(r["loss_spike"], "loss")
                is not None else number(r, first.key)) for run in runs
               for r in getattr(run, first.source) if isinstance(r.get("loss_spike"), dict)]
        pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
        if pts:  # every run's spikes in one marker set, one legend entry
            ax.scatter(*zip(*pts), marker="x", color="red", zorder=3, s=40, label="loss spike")
    values = [y for *_, ys in data for y in _finite(ys)]
    if axis.yscale == "log2" and min(values) > 0:
        ax.set_yscale("log", base=2)
    elif axis.yscale == "log" and min(values) > 0 and max(values) > 100 * min(values):
        ax.set_yscale("log")
    if axis.from_zero:
        ax.set_ylim(bottom=0)
    ax.set_ylabel(axis.ylabel)
    ax.grid(True, alpha=0.3)
    labels = ax.get_legend_handles_labels()[1]
    if labels != above:
        ax.legend(fontsize="small", loc="best")
    return labels
