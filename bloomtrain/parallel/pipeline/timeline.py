"""The timeline of a pipeline step (forward, backward, send, recv wait and idle per micro-batch),
and its summary against the schedule's theoretical bubble (Narayanan et al., arXiv 2104.04473).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from bloomtrain.parallel.pipeline.schedules import theoretical_bubble
from bloomtrain.files import atomic_output

TIMELINE_DIR = "pipeline_timeline"
COMPUTE = ("F", "B", "W")


class Timeline:
    """Wall-clock events of one pipeline step on one rank, relative to the step's start: "F", "B"
    and, under zb-h1, "W" (compute of a micro-batch on a model chunk), "recv" (waiting for a
    message), "send" (posting messages) and "send_wait" (the end-of-step wait for outstanding
    sends). Idle time is everything that is not F, B or W. A Timeline passed to a step is reset by
    it."""

    def __init__(self):
        self.events: list[dict] = []
        self.meta: dict = {}
        self._t0 = 0.0

    def begin(self, topo, schedule: str, num_micro: int, num_chunks: int) -> None:
        self.events = []
        self.meta = dict(rank=topo.rank, pp_rank=topo.pp_rank, pp_size=topo.pp_size,
                         dp_rank=topo.dp_rank, tp_rank=topo.tp_rank, schedule=schedule,
                         num_micro_batches=num_micro, num_virtual_stages=num_chunks,
                         wall_start=time.time())
        self._t0 = time.perf_counter()

    def record(self, kind: str, start: float, end: float, chunk: int | None = None,
               micro_batch: int | None = None) -> None:
        self.events.append(dict(kind=kind, chunk=chunk, micro_batch=micro_batch,
                                start=start - self._t0, end=end - self._t0))

    def end(self) -> None:
        self.meta["step_time"] = time.perf_counter() - self._t0

    def summary(self) -> dict:
        return summarize(self.to_dict())

    def to_dict(self) -> dict:
        return dict(self.meta, events=list(self.events))

    def save(self, run_dir, step: int) -> Path:
        path = Path(run_dir) / TIMELINE_DIR / f"step_{step}_rank_{self.meta['rank']}.json"
        data = dict(self.to_dict(), step=step)
        with atomic_output(path, "w") as f:
            json.dump(data, f)
        return path


def summarize(data: dict) -> dict:
    """Compute, idle and bubble of one saved timeline. The bubble is idle over compute time, the
    paper's definition, next to the schedule's theoretical value."""
    compute = sum(e["end"] - e["start"] for e in data["events"] if e["kind"] in COMPUTE)
    recv = sum(e["end"] - e["start"] for e in data["events"] if e["kind"] == "recv")
    step_time = data["step_time"]
    idle = max(step_time - compute, 0.0)
    return dict(step_time=step_time, compute=compute, idle=idle, recv_wait=recv,
                idle_fraction=idle / step_time if step_time else 0.0,
                bubble=idle / compute if compute else 0.0,
                theory=theoretical_bubble(data["schedule"], data["pp_size"],
                                          data["num_micro_batches"], data["num_virtual_stages"]))
