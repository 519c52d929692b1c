"""The fit of the step-time model's efficiencies (bloomtrain.planner.efficiency) to BLOOM's public
runs (docs/planner_data.csv; sources in docs/bloom_facts.md): least squares on log(predicted /
measured step time) over the rows marked `fit`, every other row held out and only predicted. The
error band is the leave-one-out spread: each fit row predicted by a fit without it.
Each row is planned as `bloomtrain plan --system megatron-deepspeed --gpu a100-80g
--inter-node-gbps 400` with dropout 0.1 would plan it. bench/planner_fit.py prints the result."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

from bloomtrain.model.presets import BloomShape
from bloomtrain.planner.efficiency import Efficiency
from bloomtrain.planner.evaluate import Plan, evaluate
from bloomtrain.planner.hardware import GPUS, Cluster
from bloomtrain.planner.workload import Candidate, Workload

DATA = Path(__file__).resolve().parents[2] / "docs" / "planner_data.csv"
# Jean Zay's A100 nodes: 4 x 100 Gb/s Omni-Path links (docs/bloom_facts.md §1).
JEAN_ZAY_GBPS = 400.0
# What the fit moves, each within its physical range (a fraction of a peak is at most 1; a
# host op takes at most a millisecond): every other field stays as given.
PARAMETERS = {"gemm": 1.0, "nvlink": 1.0, "network": 1.0, "hbm": 1.0, "op_s": 1e-3}


@dataclass(frozen=True)
class Row:
    id: str
    role: str
    work: Workload
    cand: Candidate
    gpus: int
    step_s: float
    tflops: float
    memory_gb: float | None
    source: str
    note: str


def load(path: Path = DATA) -> list[Row]:
    with open(path, newline="") as f:
        return [_row(r) for r in csv.DictReader(f)]


def _row(r: dict) -> Row:
    i = {k: int(r[k]) for k in ("num_layers", "hidden", "heads", "vocab", "seq", "global_batch",
                                "nodes", "tp", "pp", "dp", "mbs", "zero")}
    shape = BloomShape(vocab_size=i["vocab"], hidden_size=i["hidden"],
                       num_layers=i["num_layers"], num_heads=i["heads"],
                       ffn_hidden_size=4 * i["hidden"], hidden_dropout=0.1,
                       attention_dropout=0.1)
    work = Workload(shape=shape, seq=i["seq"], global_batch=i["global_batch"],
                    precision=r["precision"], attention="unfused", system="megatron-deepspeed",
                    partition=r["partition"])
    cand = Candidate.of(tp=i["tp"], pp=i["pp"], dp=i["dp"], micro_batch=i["mbs"],
                        zero_stage=i["zero"], recompute=r["recompute"],
                        partition=r["partition"])
    return Row(r["id"], r["role"], work, cand, i["nodes"] * 8, float(r["step_s"]),
               float(r["tflops"]), float(r["memory_gb"]) if r["memory_gb"] else None,
               r["source"], r["note"])


def predict(row: Row, eff: Efficiency) -> Plan:
    spec = replace(GPUS["a100-80g"], efficiency=eff)
    cluster = Cluster(spec, row.gpus, 8, inter_node_gbps=JEAN_ZAY_GBPS)
    return evaluate(row.cand, row.work, cluster, memory_limit=float("inf"))


def residuals(rows: list[Row], eff: Efficiency) -> list[float]:
    """log(predicted / measured) step time per row."""
    return [math.log(predict(r, eff).step_time_s / r.step_s) for r in rows]


def fit(rows: list[Row], start: Efficiency, names=tuple(PARAMETERS),
        iterations: int = 60) -> Efficiency:
    """Levenberg-Marquardt on log(predicted / measured) over `names`, on the rows marked `fit`,
    each parameter kept inside (0, PARAMETERS[name]) by a logistic map; the band is the
    residuals' root mean square scaled by n / (n - k)."""
    import numpy as np
    train = [r for r in rows if r.role == "fit"]
    upper = np.array([PARAMETERS[n] for n in names])
    frac = np.clip(np.array([getattr(start, n) for n in names]) / upper, 1e-6, 1 - 1e-6)
    x = np.log(frac / (1 - frac))

    def eff_of(v):
        values = upper / (1 + np.exp(-v))
        return replace(start, **{n: float(a) for n, a in zip(names, values)})

    def res(v):
        return np.array(residuals(train, eff_of(v)))
    damping, r = 1e-3, res(x)
    for _ in range(iterations):
        jac = np.stack([(res(x + d) - r) / 1e-6 for d in np.eye(len(x)) * 1e-6], axis=1)
        step = np.linalg.solve(jac.T @ jac + damping * np.diag(np.diag(jac.T @ jac) + 1e-12),
                               -jac.T @ r)
        trial = res(x + step)
        if trial @ trial < r @ r:
            x, r, damping = x + step, trial, damping / 3
        else:
            damping *= 4
        if float(np.abs(step).max()) < 1e-7 or damping > 1e8:
            break
    band = math.sqrt(float(r @ r) / max(1, len(train) - len(names)))
    return replace(eff_of(x), band=band)


def leave_one_out(rows: list[Row], start: Efficiency) -> tuple[float, dict]:
    """(root mean square, per row) of log(predicted / measured) for each fit row, predicted by
    a fit to the other fit rows: the error a prediction off the fitted points carries."""
    out = {}
    for i, row in enumerate(rows):
        if row.role != "fit":
            continue
        others = [replace(r, role="holdout") if j == i else r for j, r in enumerate(rows)]
        out[row.id] = residuals([row], fit(others, start))[0]
    return math.sqrt(sum(v * v for v in out.values()) / max(1, len(out))), out


def report(rows: list[Row], eff: Efficiency) -> list[dict]:
    """Every row predicted with `eff`: step time, TFLOP/s and memory against the measured."""
    out = []
    for r in rows:
        p = predict(r, eff)
        gb = p.memory_per_gpu / 1e9
        out.append({"id": r.id, "role": r.role, "layout": r.cand.label(), "gpus": r.gpus,
                    "step_s": r.step_s, "predicted_step_s": p.step_time_s,
                    "step_error": p.step_time_s / r.step_s - 1, "tflops": r.tflops,
                    "predicted_tflops": p.tflops_per_gpu,
                    "tflops_error": p.tflops_per_gpu / r.tflops - 1,
                    "memory_gb": r.memory_gb, "predicted_memory_gb": gb,
                    "memory_error": gb / r.memory_gb - 1 if r.memory_gb else None,
                    "terms": {k: v for k, v in p.time.items() if k.endswith("_s")}})
    return out
