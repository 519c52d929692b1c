"""How long this rank stalls on its dp peers: the input of the trainer's straggler check
(bloomtrain.train.monitors). Every step synchronizes all ranks several times, so their wall step
times come out equal: a rank slow before a collective makes its peers wait inside it, and they
all end the step together. The slow rank computes while its peers wait, so "step time less the
time stalled on peers" is what singles it out. The waits fall in the per-step reduction (stages
0-1), the reduce-scatters waited for in backward (stages 2-3) and the parameter gathers (stage
3): the engine runs all of them, so it times them here.
"""
from __future__ import annotations

import contextlib
import time

import torch


class WaitClock:
    """Only dp collectives are timed: ranks of one dp group play the same part in the model
    (same pp stage, same tp rank), so none waits by construction, whereas a stage waiting for
    its pipeline neighbour (the bubble) or for the tied-embedding sum would look like a fast
    rank when it is not. The price: a slow rank's tp and pp peers wait for it inside layers and
    the schedule, where the engine cannot see, so with tp or pp > 1 the check singles out the
    slow rank's model replica, and names the slowest-looking rank of it.

    On the CPU a stall is host time spent in the blocking call. On CUDA the host does not block
    (NCCL queues the collective and makes the compute stream wait for it), so a stall is the
    time the compute stream waits: CUDA events before and after, read once completed."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def waiting(self):
        """Around a collective (or the wait for one) with the rank's dp peers."""
        if not self.cuda:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._seconds += time.perf_counter() - start
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
            self._collect(block=False)

    def _collect(self, block: bool) -> None:
        # Completed pairs are read as they come in, so an engine used without the trainer (which
        # never calls take()) holds no more than the events still in flight.
        while self._events:
            start, end = self._events[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            self._seconds += start.elapsed_time(end) / 1e3
            self._events.pop(0)

    def take(self) -> float:
        """Seconds stalled since the last take (waits for the events still in flight)."""
        self._collect(block=True)
        seconds, self._seconds = self._seconds, 0.0
        return seconds
