"""Convergence under compressed gradient reduction (parallel.grad_reduce_dtype): the demo's run
(its built-in corpus of the Python standard library, its tokenizer, model and optimizer) trained
for `--steps` steps three times from the same seed on `--world` gloo ranks (ZeRO-1, bf16):
fp32 reduction, int8 (blockwise absmax, ZeRO++'s qgZ), and int8 with error feedback.

Reports, for each int8 run against fp32: the final loss difference (the last step, and the mean
of the last `--window` steps, relative to fp32's), and the largest gap between the running means
(over `--window` steps) of the two curves, relative to fp32's. Draws the three curves in one plot
(`--plot`, default docs/compress_convergence.png). Ends with one JSON line. Measures; asserts
nothing.

    python bench/compress_convergence.py
    python bench/compress_convergence.py --steps 100 --world 4
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bloomtrain.config import Config  # noqa: E402
from bloomtrain.demo import DEMO_CONFIG, _prepare_data  # noqa: E402
from tests.dist import spawn_ranks  # noqa: E402

VARIANTS = {"fp32": {"grad_reduce_dtype": "fp32"},
            "int8": {"grad_reduce_dtype": "int8"},
            "int8+ef": {"grad_reduce_dtype": "int8", "grad_error_feedback": True}}


def _config(dataset: Path, tok_dir: Path, run_dir: Path, steps: int, parallel: dict) -> Config:
    data = yaml.safe_load(DEMO_CONFIG)
    data["data"].update(paths=[str(dataset)], tokenizer=str(tok_dir))
    data["parallel"].update(parallel)
    data["train"].update(train_iters=steps, precision="bf16", log_interval=50,
                         eval_interval=None, device="cpu")
    data["checkpoint"] = {"dir": None, "save_interval": None}
    data["run_dir"] = str(run_dir)
    return Config.from_dict(data)


def _rank(rank, world, cfg_dict):
    from bloomtrain.train import Trainer
    return Trainer(Config.from_dict(cfg_dict), log=lambda *a: None).run().losses


def running_mean(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def compare(base: list[float], other: list[float], window: int) -> dict:
    rb, ro = running_mean(base, window), running_mean(other, window)
    gaps = [abs(o - b) / b for b, o in zip(rb, ro)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"final_loss_diff": other[-1] - base[-1],
            "final_loss_rel_diff": (other[-1] - base[-1]) / base[-1],
            "final_mean_rel_diff": (ro[-1] - rb[-1]) / rb[-1],
            "max_running_mean_rel_gap": gaps[worst], "max_gap_step": worst + 1}


def plot(curves: dict, window: int, path: Path, title: str) -> None:
    """The curves (faint) with their running means, and below, each running mean's gap to
    fp32's in percent (the curves themselves overlap at this scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    base = running_mean(curves["fp32"], window)
    for name, losses in curves.items():
        steps = range(1, len(losses) + 1)
        line, = ax.plot(steps, losses, alpha=0.2, linewidth=0.8)
        mean = running_mean(losses, window)
        ax.plot(steps, mean, color=line.get_color(), label=f"{name} (running mean of {window})")
        gap.plot(steps, [100 * (m - b) / b for m, b in zip(mean, base)],
                 color=line.get_color(), label=name)
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=8)
    ax.legend()
    gap.set_xlabel("step")
    gap.set_ylabel("running mean vs fp32 (%)")
    gap.axhline(0, color="grey", linewidth=0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _title(world: int) -> str:
    m = yaml.safe_load(DEMO_CONFIG)["model"]
    return (f"demo corpus, BLOOM h={m['hidden_size']} L={m['num_layers']}, {world} gloo ranks, "
            f"ZeRO-1, bf16\ndp gradient reduction: fp32 / int8 / int8 + error feedback")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--max-docs", type=int, default=None, help="corpus documents (default all)")
    ap.add_argument("--data-dir", default=None, help="reuse the demo's data directory")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parents[1] / "docs" /
                                          "compress_convergence.png"))
    ap.add_argument("--replot", metavar="OUTPUT", help="only draw the plot again from a run's "
                    "saved output (its last line)")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text().strip().splitlines()[-1])
        plot(saved["curves"], saved["window"], Path(args.plot), _title(saved["world"]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir or tmp) / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        _, tok_dir, dataset = _prepare_data(data_dir, args.max_docs, print)
        curves = {}
        for name, parallel in VARIANTS.items():
            cfg = _config(dataset, tok_dir, Path(tmp) / name, args.steps, parallel)
            curves[name] = spawn_ranks(args.world, _rank, cfg.to_dict(), timeout=7200)[0]
            print(f"{name}: first loss {curves[name][0]:.4f}, last {curves[name][-1]:.4f}",
                  flush=True)
    results = {name: compare(curves["fp32"], curves[name], args.window)
               for name in VARIANTS if name != "fp32"}
    for name, r in results.items():
        print(f"{name} vs fp32: final loss diff {r['final_loss_diff']:+.4f} "
              f"({100 * r['final_loss_rel_diff']:+.2f}%), last-{args.window} mean "
              f"{100 * r['final_mean_rel_diff']:+.2f}%, largest running-mean gap "
              f"{100 * r['max_running_mean_rel_gap']:.2f}% at step {r['max_gap_step']}")
    plot(curves, args.window, Path(args.plot), _title(args.world))
    print(f"plot: {args.plot}")
    print(json.dumps({"bench": "compress_convergence", "steps": args.steps, "world": args.world,
                      "window": args.window, "results": results, "curves": curves}))


if __name__ == "__main__":
    main()
