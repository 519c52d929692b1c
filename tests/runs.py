"""Made-up run directories for the report and status tests: step records with every field the
trainer may write, and a run directory holding them (metrics.jsonl, config.yaml)."""
from __future__ import annotations

import json
from pathlib import Path


def step_record(step: int, **extra) -> dict:
    rec = {"step": step, "consumed_samples": 8 * step, "loss": 5.0 - 0.02 * step, "lr": 1e-3,
           "grad_norm": 1.0 + 0.01 * step, "global_batch_size": 8, "step_time_s": 0.5,
           "tokens_per_s": 512.0, "tflops_per_device": 0.01, "skipped_steps": 0,
           "layout": "tp=1 pp=1 dp=1 zero=0 precision=bf16 attention=sdpa"}
    rec.update(extra)
    return rec



def write_run(run_dir: Path, records: list[dict], config: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        import yaml
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir



def full_records(n: int = 30, mem_gib: float = 3.0) -> list[dict]:
    """Step records with every optional field the trainer may write, and two evals."""
    recs = []
    for s in range(1, n + 1):
        rec = step_record(s, mfu=0.4 + 0.001 * s, mem_peak_bytes=int(mem_gib * 2 ** 30) - s,
                          mem_peak_rank=1, mem_kind="cuda",
                          mem_reserved_bytes=int((mem_gib + 1) * 2 ** 30),
                          step_time_max_s=0.6, step_time_median_s=0.5,
                          loss_scale=2.0 ** (16 - (s > 10)), skipped_steps=int(s > 10),
                          grad_stats={"h.0": {"grad_norm": 0.1}})
        if s == 11:
            rec["skipped"], rec["grad_norm"] = True, float("inf")
        if s == 20:
            # The record's loss is the interval's mean; the spike's own is in loss_spike.
            rec["loss"] = 6.0
            rec["loss_spike"] = {"loss": 9.0, "zscore": 8.5, "action": "log"}
            rec["alerts"] = ["loss spike at step 20: z=8.5"]
        if s == 25:
            rec["straggler_rank"], rec["straggler_ratio"] = 3, 1.5
            rec["alerts"] = ["straggler: rank 3 at 1.50x the median step time"]
        recs.append(rec)
        if s % 10 == 0:
            recs.append({"step": s, "consumed_samples": 8 * s, "eval_loss": 4.9 - 0.01 * s,
                         "eval_ppl": 130.0})
    return recs
