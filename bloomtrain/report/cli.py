"""`bloomtrain plot RUN_DIR [RUN_DIR ...] [--output DIR]` and `bloomtrain status RUN_DIR`."""
from __future__ import annotations

from pathlib import Path

from bloomtrain.report.html import write_report
from bloomtrain.report.status import status_text


def cmd_plot(args) -> int:
    path = write_report(args.run_dirs, args.output)
    print(f"wrote the plots and {path}")
    return 0


def cmd_status(args) -> int:
    print(status_text(args.run_dir))
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plot",
        description="Plot one or more runs from their metrics.jsonl: loss and eval loss, "
                    "learning rate, gradient norm, throughput (tokens/s, TFLOP/s, MFU), memory, "
                    "loss scale and skipped steps (when a run has them), several runs overlaid "
                    "on the same axes. Also writes report.html showing every plot with the "
                    "figures it shows, a summary of each run and its config (for several runs, "
                    "the keys that differ). Needs matplotlib (pip install 'bloomtrain[plot]').")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories (each holds metrics.jsonl and config.yaml)")
    p.add_argument("--output", type=Path, default=None, metavar="DIR",
                   help="where the PNGs and report.html go (default: the first RUN_DIR's "
                        "plots/ directory)")
    p.set_defaults(func=cmd_plot)

    s = sub.add_parser(
        "status",
        description="Show a run's step and total, ETA, last loss and eval loss, throughput, "
                    "MFU, peak memory, the latest valid checkpoint and its age, skipped steps, "
                    "loss spikes and alerts, from its run directory, while it trains or after.")
    s.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (run_dir in its config)")
    s.set_defaults(func=cmd_status)


def register_timeline(subparsers) -> None:
    p = subparsers.add_parser(
        "pipeline-timeline",
        description="Print the forward/backward/recv timeline of one pipeline-parallel step, one "
                    "row per stage on a time grid, and the measured bubble against (p-1)/m "
                    "(GPipe, 1F1B), (p-1)/(v*m) (interleaved) or (p-1)/(3m) (zb-h1).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="step to show (default: the latest)")
    p.add_argument("--width", type=int, default=None,
                   help="columns of the time grid (default: the terminal width)")
    p.set_defaults(func=cmd_timeline)


def cmd_timeline(args) -> int:
    from bloomtrain.pipeline_timeline import format_timeline

    print(format_timeline(args.run_dir, args.step, args.width))
    return 0
