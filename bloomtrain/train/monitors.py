"""What the trainer watches besides the loss: each rank's peak memory, stragglers, and the
gradient analyser's vanishing and exploding blocks. Off the hot path: per step, a memory sample
(only where no peak counter exists) and, every `train.grad_stats_interval` steps, the analyser
inside the optimizer's step; per record, one all-gather of four numbers per rank. A record
carries "mem_peak_bytes" (the largest over ranks), "mem_peak_rank", "mem_kind",
"step_time_max_s", "step_time_median_s", "busy_time_median_s", a straggler's "straggler_rank",
"straggler_ratio" and "straggler_node" (its hostname), and the last analysed step's "grad_stats".
"""
from __future__ import annotations

import math
import os
import resource
import socket
import statistics
import sys

import torch

from bloomtrain.parallel import comm
from bloomtrain.parallel.zero.grad_stats import GradStats

# The gradient analyser's flags (bloomtrain/parallel/zero/grad_stats.py: per-entry gradient norms and
# update/weight ratios): an entry is vanishing below this norm, exploding when its norm is not
# finite or above EXPLODING times the median entry norm.
VANISHING = 1e-8
EXPLODING = 100.0  # times the median entry norm
SHOWN_FLAGS = 6  # flags spelled out in one log line
HOST_BYTES = 64  # HOST_NAME_MAX on Linux: a straggler's node, by its hostname


# ---- memory --------------------------------------------------------------------------------------

def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS
        return True
    except OSError:
        return False


def _rss_now() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB on Linux


class PeakMemory:
    """This rank's peak memory since the last `take()`, by the best measure the platform has:
    - "cuda": torch.cuda.max_memory_allocated and max_memory_reserved, reset after each read;
    - "rss_peak": the kernel's peak resident set (VmHWM of /proc/self/status), reset after each
      read by writing 5 to /proc/self/clear_refs (Linux >= 4.0): transients inside a step too;
    - "rss_sampled", where that reset is refused: the current RSS sampled at the end of each
      step, which misses the peaks inside one (the activations are freed by its end);
    - "rss_lifetime", without /proc (macOS): ru_maxrss, the peak since the process started.
    Nothing is reset before the first step: the first record's peak covers start-up too."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.kind = "cuda"
        elif _status_bytes("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK):
            self.kind = "rss_peak"
        elif _rss_now() is not None:
            self.kind = "rss_sampled"
        else:
            self.kind = "rss_lifetime"
        self._sampled = 0

    def sample(self) -> None:
        """At the end of a step."""
        if self.kind == "rss_sampled":
            self._sampled = max(self._sampled, _rss_now() or 0)

    def take(self) -> tuple[int, int]:
        """(peak bytes, peak reserved bytes (CUDA; else 0)), then start a new interval."""
        if self.kind == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak, reserved
        if self.kind == "rss_peak":
            peak = _status_bytes("VmHWM") or 0
            if not _reset_rss_peak():  # refused after all (a changed sandbox): sample instead
                self.kind = "rss_sampled"
            return peak, 0
        if self.kind == "rss_sampled":
            peak, self._sampled = max(self._sampled, _rss_now() or 0), 0
            return peak, 0
        return _lifetime_peak(), 0


# ---- stragglers ----------------------------------------------------------------------------------

def find_straggler(busy: list[float], factor: float) -> tuple[int, float] | None:
    """(rank, its busy time over the median) of the busiest rank when that exceeds `factor`.
    Busy time is step time less the time a rank stalled on its dp peers (the engine's
    WaitClock, bloomtrain/parallel/zero/waits.py: why step time alone cannot tell)."""
    median = statistics.median(busy)
    rank = max(range(len(busy)), key=busy.__getitem__)
    if median <= 0:
        return None
    ratio = busy[rank] / median
    return (rank, ratio) if ratio > factor else None


# ---- gradient analyser ---------------------------------------------------------------------------

def flag_entries(stats: GradStats) -> list[dict]:
    """Vanishing and exploding entries of a GradStats, with the median they were judged by."""
    finite = [n for n in stats.grad_norm if math.isfinite(n)]
    median = statistics.median(finite) if finite else float("nan")
    flags = []
    for name, norm in zip(stats.names, stats.grad_norm):
        if not math.isfinite(norm) or (finite and norm > EXPLODING * median):
            kind = "exploding"
        elif norm < VANISHING:
            kind = "vanishing"
        else:
            continue
        flags.append({"entry": name, "kind": kind, "norm": norm, "median": median})
    return flags


def flags_line(step: int, flags: list[dict]) -> str:
    parts = [f"{f['entry']} {f['kind']} (norm {f['norm']:.3g} vs median {f['median']:.3g})"
             for f in flags[:SHOWN_FLAGS]]
    more = f"; and {len(flags) - SHOWN_FLAGS} more" if len(flags) > SHOWN_FLAGS else ""
    return f"[train] grad stats: step {step}: " + "; ".join(parts) + more


# ---- the trainer's side --------------------------------------------------------------------------

class Monitors:
    def __init__(self, train_cfg, topo, device: torch.device, engine):
        self.t, self.topo, self.device, self.engine = train_cfg, topo, device, engine
        self.memory = PeakMemory(device)
        # The last analysed step's figures and its flags line, until a record takes them (the
        # same step's when it is a log step; of several analysed steps, the last).
        self._grad_stats: dict | None = None
        self._flags_line: str | None = None
        self._hosts: list[str] | None = None  # every rank's hostname, gathered at the first record

    def grad_stats_due(self, step: int) -> bool:
        every = self.t.grad_stats_interval
        return bool(every) and step % every == 0

    def after_step(self, step: int, result) -> list[str]:
        """After the optimizer step `step` (1-based); returns lines for the log."""
        self.memory.sample()
        stats = result.grad_stats
        if stats is None:
            return []
        flags = flag_entries(stats)
        self._grad_stats = {"step": step, "names": stats.names,
                            "block_grad_norm": stats.grad_norm,
                            "block_update_ratio": stats.update_ratio,
                            "flagged": [{k: f[k] for k in ("entry", "kind", "norm")}
                                        for f in flags]}
        self._flags_line = flags_line(step, flags) if flags else None
        return [self._flags_line] if flags else []

    def hosts(self) -> list[str]:
        """Every rank's hostname, by global rank: which node a straggler is on. Gathered once,
        as fixed-size byte rows (a collective: every rank calls it at the same record)."""
        if self._hosts is None:
            world = self.topo.world_size
            mine = torch.zeros(HOST_BYTES, dtype=torch.uint8, device=self.device)
            name = socket.gethostname().encode()[:HOST_BYTES]
            mine[:len(name)] = torch.tensor(list(name), dtype=torch.uint8)
            rows = torch.empty(world * HOST_BYTES, dtype=torch.uint8, device=self.device)
            comm.all_gather_into_tensor(rows, mine, comm.world_group(), "monitor")
            self._hosts = [bytes(row).rstrip(b"\0").decode(errors="replace")
                           for row in rows.view(world, HOST_BYTES).cpu().tolist()]
        return self._hosts

    def record(self, step_time_s: float, num_steps: int) -> tuple[dict, list[str], list[str]]:
        """(fields, alerts, lines) of a record covering `num_steps` steps of mean wall time
        `step_time_s` on this rank: its fields, its alert lines (a straggler, the flags of the
        analysed step it carries) and those of them not logged yet. A collective: every rank
        calls it at the same record."""
        peak, reserved = self.memory.take()
        busy = step_time_s - self.engine.waits.take() / max(num_steps, 1)
        mine = torch.tensor([peak, reserved, step_time_s, busy], dtype=torch.float64,
                            device=self.device)
        world = self.topo.world_size
        rows = torch.empty(world * 4, dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(rows, mine, comm.world_group(), "monitor")
        peaks, reserveds, step_times, busies = (list(col) for col in
                                                zip(*rows.view(world, 4).tolist()))
        peak_rank = max(range(world), key=peaks.__getitem__)
        fields = {"mem_peak_bytes": int(peaks[peak_rank]), "mem_peak_rank": peak_rank,
                  "mem_kind": self.memory.kind}
        if self.memory.kind == "cuda":
            fields["mem_reserved_bytes"] = int(max(reserveds))
        fields.update(step_time_max_s=max(step_times),
                      step_time_median_s=statistics.median(step_times),
                      busy_time_median_s=statistics.median(busies))
        lines = []
        found = find_straggler(busies, self.t.straggler_factor)
        if found is not None:
            rank, ratio = found
            c = self.topo.layout.coords(rank)
            host = self.hosts()[rank]
            fields.update(straggler_rank=rank, straggler_ratio=ratio, straggler_node=host)
            lines.append(f"[train] straggler: rank {rank} (pp {c.pp}, dp {c.dp}, tp {c.tp}) on "
                         f"node {host}, {ratio:.2f}x the median step time (busy time: less "
                         f"waits for dp peers)")
        alerts = list(lines)
        if self._grad_stats is not None:
            fields["grad_stats"], self._grad_stats = self._grad_stats, None
            if self._flags_line is not None:
                alerts.append(self._flags_line)
                self._flags_line = None
        return fields, alerts, lines
