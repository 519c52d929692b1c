"""A long soak: does a run leak memory, file descriptors, speed or disk over thousands of steps?

`--steps` (2,000) steps of tp2·dp2 ZeRO-1 on 4 local CPU processes (gloo), launched through
bloomtrain's own launcher (`launch_local`, torch's elastic agent), with a checkpoint every
`--save-interval` (50) steps and `checkpoint.keep_last` (3). A small model (hidden 64, 2 layers,
seq 64, fp32) on the tests' synthetic dataset, so the run is dominated by the machinery around
the model: collectives, the data pipeline's epochs, saves and their pruning, records, monitors.

Each rank samples at every log interval (10 steps), right after the trainer writes its record:
its resident set (VmRSS of /proc/self/status, the current size, not the peak), its open file
descriptors (/proc/self/fd) and, on rank 0, the bytes under the checkpoint directory. Reported:
- RSS per rank at step 100 and at the last step, and the growth (goal < 2%);
- open fds per rank at step 100 and the last step (goal: flat);
- tokens/s, median of the records in the first and the last 10% of steps (goal within 5%), and
  the CPU time per step over the same windows (user + system of every rank), which says the same
  on a machine that other work shares;
- checkpoint disk: the largest seen, against keep_last + 1 checkpoints (one being written while
  keep_last are kept), and the checkpoints left at the end (goal: keep_last).
Step 100 rather than step 10 is the RSS baseline: the allocator, the data index caches and the
first checkpoint's buffers settle in the first saves. Not part of CI (minutes); prints the figures,
then one JSON line. Linux only (/proc).

    python bench/soak.py                       # 2,000 steps
    python bench/soak.py --steps 300 --keep    # a short look; keep the run dir
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.synthetic import write_synthetic_dataset  # noqa: E402

LOG_INTERVAL = 10


def make_config(args, root: Path, dataset: str) -> dict:
    return {
        "model": {"preset": None, "hidden_size": args.hidden, "num_layers": args.layers,
                  "num_heads": 4, "vocab_size": 256},
        "parallel": {"tp": 2, "pp": 1, "zero_stage": 1},
        "data": {"paths": [dataset], "seq_length": args.seq, "split": "95,5,0"},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_samples": 64},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": args.steps,
                  "precision": "fp32", "log_interval": LOG_INTERVAL, "eval_interval": 500,
                  "eval_iters": 2, "device": "cpu"},
        "checkpoint": {"dir": str(root / "checkpoints"), "save_interval": args.save_interval,
                       "keep_last": args.keep_last},
        "run": {"tensorboard": False},
        "run_dir": str(root / "run"),
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # pruned while we walked
                pass
    return total


def worker(config: dict, samples_dir: str) -> None:
    """One rank: the trainer as `bloomtrain train` runs it, with a sample after every record."""
    import torch.distributed as dist

    from bloomtrain.config import Config
    from bloomtrain.train import loop, steplog

    rank = int(os.environ["RANK"])
    out = open(Path(samples_dir) / f"rank{rank}.jsonl", "w")
    ckpt_dir = Path(config["checkpoint"]["dir"])
    record = steplog.StepLog.record

    def sampled(self, meter, state, *a, **kw):
        record(self, meter, state, *a, **kw)
        t = os.times()
        s = {"step": state.step, "rss": _rss_bytes(),
             "fds": len(os.listdir("/proc/self/fd")), "cpu_s": t.user + t.system}
        if rank == 0:
            s["ckpt_bytes"] = _tree_bytes(ckpt_dir) if ckpt_dir.exists() else 0
            s["ckpts"] = len([p for p in ckpt_dir.glob("step_*") if p.is_dir()]) \
                if ckpt_dir.exists() else 0
        out.write(json.dumps(s) + "\n")
        out.flush()

    steplog.StepLog.record = sampled
    try:
        loop.train(Config.from_dict(config), log=lambda *a: None)
    finally:
        out.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _at(samples: list[dict], step: int) -> dict:
    """The sample at `step`, or the first after it."""
    return next(s for s in samples if s["step"] >= step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-interval", type=int, default=50)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--baseline-step", type=int, default=100)
    ap.add_argument("--dir", help="run here (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args()

    from bloomtrain.train.launch import launch_local

    root = Path(args.dir or tempfile.mkdtemp(prefix="bloomtrain-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    samples_dir = root / "samples"
    samples_dir.mkdir(exist_ok=True)
    dataset = write_synthetic_dataset(root / "data" / "synthetic_text_document")
    config = make_config(args, root, dataset)
    launch_local(4, worker, config, str(samples_dir))

    ranks = {r: [json.loads(line) for line in open(samples_dir / f"rank{r}.jsonl")]
             for r in range(4)}
    records = [json.loads(line) for line in open(root / "run" / "metrics.jsonl")]
    last = args.steps
    result = {"steps": args.steps, "save_interval": args.save_interval,
              "keep_last": args.keep_last, "baseline_step": args.baseline_step, "ranks": {}}
    print(f"soak: {args.steps} steps, tp2 dp2 ZeRO-1 on 4 CPU processes, a save every "
          f"{args.save_interval}, keep_last {args.keep_last}; run dir {root}")
    for r, samples in ranks.items():
        a, b = _at(samples, args.baseline_step), _at(samples, last)
        growth = b["rss"] / a["rss"] - 1
        result["ranks"][r] = {"rss_base": a["rss"], "rss_last": b["rss"], "rss_growth": growth,
                              "fds_base": a["fds"], "fds_last": b["fds"],
                              "fds_max": max(s["fds"] for s in samples if s["step"] >= a["step"])}
        print(f"  rank {r}: RSS {a['rss'] / 2**20:.1f} MiB at step {a['step']} -> "
              f"{b['rss'] / 2**20:.1f} MiB at step {b['step']} ({growth:+.2%}); open fds "
              f"{a['fds']} -> {b['fds']} (max {result['ranks'][r]['fds_max']})")
    tps = [(r["step"], r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    window = max(LOG_INTERVAL, args.steps // 10)
    # The first record also times the first steps' warm-up: start the window after it.
    first = statistics.median(t for s, t in tps if LOG_INTERVAL < s <= LOG_INTERVAL + window)
    final = statistics.median(t for s, t in tps if s > args.steps - window)
    result.update(tokens_per_s_first=first, tokens_per_s_last=final,
                  tokens_per_s_change=final / first - 1)
    print(f"  tokens/s: {first:.0f} (median, steps {LOG_INTERVAL + 1}-{LOG_INTERVAL + window}) "
          f"-> {final:.0f} (last {window} steps), {final / first - 1:+.2%}")
    # CPU seconds per step (user + system, summed over ranks): the work a step takes, which a
    # leak (growing lists, caches, descriptors) would raise, and which other load on the machine
    # does not, unlike wall-clock tokens/s.
    def cpu_per_step(lo: int, hi: int) -> float:
        total = 0.0
        for samples in ranks.values():
            a, b = _at(samples, lo), _at(samples, hi)
            total += (b["cpu_s"] - a["cpu_s"]) / (b["step"] - a["step"])
        return total
    cpu_first = cpu_per_step(LOG_INTERVAL, LOG_INTERVAL + window)
    cpu_last = cpu_per_step(args.steps - window, args.steps)
    result.update(cpu_s_per_step_first=cpu_first, cpu_s_per_step_last=cpu_last,
                  cpu_s_per_step_change=cpu_last / cpu_first - 1)
    print(f"  CPU time per step (all ranks, user + system): {cpu_first * 1e3:.1f} ms -> "
          f"{cpu_last * 1e3:.1f} ms ({cpu_last / cpu_first - 1:+.2%}); unlike tokens/s, not "
          f"moved by other load on the machine")
    r0 = ranks[0]
    one = None
    with_ckpt = [s for s in r0 if s["ckpts"] == 1]
    if with_ckpt:
        one = with_ckpt[-1]["ckpt_bytes"]
    peak = max(s["ckpt_bytes"] for s in r0)
    end_ckpts = len([p for p in (root / "checkpoints").glob("step_*") if p.is_dir()])
    end_bytes = _tree_bytes(root / "checkpoints")
    result.update(ckpt_bytes_one=one, ckpt_bytes_max_seen=peak, ckpt_bytes_end=end_bytes,
                  ckpts_end=end_ckpts, ckpts_max_seen=max(s["ckpts"] for s in r0))
    print(f"  checkpoints: one {one / 2**20:.2f} MiB; largest seen {peak / 2**20:.2f} MiB "
          f"({max(s['ckpts'] for s in r0)} checkpoints) against keep_last + 1 = "
          f"{(args.keep_last + 1) * one / 2**20:.2f} MiB; at the end {end_ckpts} checkpoints, "
          f"{end_bytes / 2**20:.2f} MiB" if one else "  checkpoints: none seen with one kept")
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"bench": "soak", **result}))


if __name__ == "__main__":
    main()
