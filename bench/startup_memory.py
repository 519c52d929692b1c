"""Start-up memory: how much resident memory each rank gains while the trainer builds itself,
against the model states it ends up holding.

bloom-560m (or --preset) on 4 gloo ranks with tp=2 and pp=2, bf16, ZeRO-0 (dp = 1). Each rank
imports everything first, resets its peak-RSS counter (/proc/self/clear_refs), builds the
`Trainer` (config validation, process groups, the model on the meta device, parallelize with
materialization of its own shards, the data, the LR schedule) and then reads its peak RSS
(VmHWM). The figure per rank is

    startup_peak_over_model_states = (peak RSS - RSS after imports) / model-state bytes

with model-state bytes from the engine's buffers (bf16 weights, fp32 master, fp32 gradient
accumulator, Adam m and v). 1.0 means the rank never held more than what it keeps. Prints a
table, then one JSON line with the worst rank's ratio. Measures; asserts nothing.

    python bench/startup_memory.py
    python bench/startup_memory.py --preset bloom-1b1 --tp 2 --pp 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.dist import run_ranks  # noqa: E402
from tests.synthetic import write_synthetic_dataset  # noqa: E402


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def rank_fn(rank, world, args, dataset, tmp):
    import torch

    from bloomtrain.config import Config
    from bloomtrain.train import Trainer  # every import before the baseline
    cfg = Config.from_dict({
        "model": {"preset": args.preset},
        "parallel": {"tp": args.tp, "pp": args.pp, "zero_stage": args.zero_stage},
        "data": {"paths": [dataset], "seq_length": args.seq, "split": "90,10,0"},
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 1,
                  "precision": "bf16", "device": "cpu"},
        "run_dir": f"{tmp}/run{rank}"})
    torch.set_num_threads(1)
    exact = _reset_peak()
    before = _status_kb("VmRSS") * 1024
    trainer = Trainer(cfg, log=lambda *a: None)
    peak = _status_kb("VmHWM") * 1024
    after = _status_kb("VmRSS") * 1024
    report = trainer.engine.memory_report()
    states = report["measured"]["total"]
    return {"rank": rank, "pp_rank": trainer.topo.pp_rank, "tp_rank": trainer.topo.tp_rank,
            "psi": report["psi"], "model_state_bytes": states, "rss_before": before,
            "rss_after": after, "peak": peak, "growth": peak - before,
            "ratio": (peak - before) / states, "peak_exact": exact}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bloom-560m")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    world = args.tp * args.pp
    print(f"{args.preset} on {world} gloo ranks: tp={args.tp} pp={args.pp} dp=1 "
          f"zero={args.zero_stage}, bf16; GiB per rank")
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_synthetic_dataset(Path(tmp) / "data" / "synth_text_document")
        rows = run_ranks(world, rank_fn, args, dataset, tmp, timeout=3600)
    gib = 2 ** 30
    print(f"{'rank':>4} {'pp':>3} {'tp':>3} {'params':>14} {'states':>8} {'growth':>8} "
          f"{'peak':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['rank']:>4} {r['pp_rank']:>3} {r['tp_rank']:>3} {r['psi']:>14,} "
              f"{r['model_state_bytes'] / gib:8.2f} {r['growth'] / gib:8.2f} "
              f"{r['peak'] / gib:8.2f} {r['ratio']:6.3f}")
    worst = max(r["ratio"] for r in rows)
    print(f"startup peak / model states, worst rank: {worst:.3f} (1.0: nothing beyond what the "
          f"rank keeps; peak counter reset exactly: {all(r['peak_exact'] for r in rows)})")
    print(json.dumps({"bench": "startup_memory", "preset": args.preset, "tp": args.tp,
                      "pp": args.pp, "zero_stage": args.zero_stage, "ranks": rows,
                      "startup_peak_over_model_states": worst}))


if __name__ == "__main__":
    main()
