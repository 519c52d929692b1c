"""Fit the GEMM efficiency (bloomtrain.planner.efficiency) to a real run: the value at which the
planner's step time for the run's own layout, batch and model equals the run's measured median
step time (run_dir/metrics.jsonl). The other terms (communication, bubble, host, optimizer) keep
their rates, so what is left is the GEMM rate of the device the run used."""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bloomtrain import jsonl
from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.planner.evaluate import evaluate
from bloomtrain.planner.hardware import Cluster
from bloomtrain.planner.search import candidate_from_config, workload_from_config


@dataclass
class Calibration:
    efficiency: float
    measured_step_s: float
    world_size: int
    records: int


def run_records(run_dir: Path) -> tuple[Config, list[dict]]:
    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for p in (cfg_path, metrics_path):
        if not p.is_file():
            raise UserError(f"--calibrate {run_dir}: {p.name} is missing; give the run_dir of a "
                            f"bloomtrain train run")
    records = []
    for n, line in enumerate(metrics_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = jsonl.loads(line)
        except ValueError:
            raise UserError(f"{metrics_path}:{n} is not JSON") from None
        if not isinstance(rec, dict):
            raise UserError(f"{metrics_path}:{n} is not a record (a JSON object)")
        if "step_time_s" in rec and not rec.get("skipped"):
            t = rec["step_time_s"]
            # A NaN compares false everywhere: the fit ran down to an efficiency of 1e-6.
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
                raise UserError(f"{metrics_path}:{n}: step_time_s {t!r} is not a positive "
                                f"number of seconds")
            records.append(rec)
    if not records:
        raise UserError(f"{metrics_path} has no step records to calibrate from")
    return Config.load(str(cfg_path)), records


def world_size_of(records: list[dict], cfg: Config) -> int:
    """tp·pp·dp from the layout every record carries ("tp=2 pp=1 dp=2 ...")."""
    layout = records[-1].get("layout")
    m = re.search(r"tp=(\d+) pp=(\d+) dp=(\d+)", layout if isinstance(layout, str) else "")
    if not m:
        raise UserError("the run's metrics carry no layout; it was written by an older "
                        "bloomtrain, calibrate from a newer run")
    tp, pp, dp = map(int, m.groups())
    return tp * pp * dp


def calibrate_efficiency(run_dir: str, cluster: Cluster) -> Calibration:
    """The compute efficiency of `cluster`'s GPU that reproduces the run in `run_dir`. The first
    record (compilation, warm-up) is left out when there are others."""
    cfg, records = run_records(Path(run_dir))
    world = world_size_of(records, cfg)
    steady = records[1:] if len(records) > 1 else records
    measured = statistics.median(r["step_time_s"] for r in steady)
    work = workload_from_config(cfg)
    cand = candidate_from_config(cfg, world)
    base = replace(cluster, num_gpus=world,
                   gpus_per_node=min(cluster.gpus_per_node, world))

    def predicted(eff: float) -> float:
        p = evaluate(cand, work, base.with_efficiency(eff), memory_limit=float("inf"))
        if p.reason:
            raise UserError(f"--calibrate: the run's layout cannot be planned: {p.reason}")
        return p.step_time_s

    # A GPU runs at most its peak; the cpu device's peak is one core's nominal figure, which a
    # rank with several threads exceeds.
    top = 1.0 if cluster.gpu.kind == "cuda" else 64.0
    if predicted(top) > measured:
        raise UserError(f"the run's step ({measured:.3f} s) is faster than {cluster.gpu.name} at "
                        f"its full peak would allow ({predicted(top):.3f} s); was it run on "
                        f"another GPU? Pass the run's --gpu")
    lo, hi = 1e-6, top   # predicted() falls as the efficiency rises
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
    if predicted(min(top, 2 * hi)) > 0.99 * measured:
        raise UserError(f"--calibrate {run_dir}: the run's step ({measured:.4g} s) is bound by "
                        f"its host (kernel launches), not its GEMMs, on {cluster.gpu.name}: its "
                        f"GEMM rate cannot be read from it; calibrate from a run with a larger "
                        f"model or micro-batch, or give the run's --gpu")
    return Calibration(efficiency=hi, measured_step_s=measured, world_size=world,
                       records=len(steady))
