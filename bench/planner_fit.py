"""Refit the planner's efficiencies (bloomtrain.planner.efficiency.A100) to BLOOM's public runs in
docs/planner_data.csv and print every row's prediction against its measurement.

    python bench/planner_fit.py            # fit, leave-one-out band, the table (markdown)
    python bench/planner_fit.py --stored   # the table for the stored A100 figures only

The last line is one JSON object: the fitted figures and the worst held-out errors."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace

from bloomtrain.planner import fit
from bloomtrain.planner.efficiency import A100


def table(rows, eff) -> list[str]:
    lines = ["| row | role | layout | GPUs | s/it measured | predicted | error | TFLOP/s measured "
             "| predicted | error | GB measured | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in fit.report(rows, eff):
        mem = (f"{r['memory_gb']:.0f} | {r['predicted_memory_gb']:.1f} | "
               f"{r['memory_error']:+.1%}" if r["memory_gb"] else
               f"- | {r['predicted_memory_gb']:.1f} | -")
        lines.append(f"| {r['id']} | {r['role']} | `{r['layout']}` | {r['gpus']} | "
                     f"{r['step_s']:.2f} | {r['predicted_step_s']:.2f} | {r['step_error']:+.1%} | "
                     f"{r['tflops']:.2f} | {r['predicted_tflops']:.2f} | "
                     f"{r['tflops_error']:+.1%} | {mem} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stored", action="store_true", help="no refit: the stored A100 figures")
    args = ap.parse_args()
    rows = fit.load()
    eff = A100
    loo = {}
    if not args.stored:
        eff = fit.fit(rows, A100)
        band, loo = fit.leave_one_out(rows, A100)
        eff = replace(eff, band=band)
    print("\n".join(table(rows, eff)))
    if loo:
        print("\nleave-one-out log errors: " + ", ".join(f"{k} {v:+.3f}" for k, v in loo.items()))
    report = fit.report(rows, eff)
    held = [r for r in report if r["role"] == "holdout"]
    print(json.dumps({"efficiency": {k: v for k, v in asdict(eff).items() if k != "source"},
                      "worst_holdout_step_error": max(abs(r["step_error"]) for r in held),
                      "worst_tflops_error": max(abs(r["tflops_error"]) for r in report),
                      "worst_memory_error": max(abs(r["memory_error"]) for r in report
                                                if r["memory_error"] is not None),
                      "band_factor": math.exp(eff.band)}))


if __name__ == "__main__":
    main()
