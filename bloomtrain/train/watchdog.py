"""The hang watchdog. When an op has been waited on longer than the hang timeout
(`parallel.hang_timeout_minutes`, by default 90% of the collective timeout
`parallel.timeout_minutes`; comm.INFLIGHT records the op each thread is blocked in), or a
training step has gone that long outside any op (the trainer's `heartbeat`), the process writes
`run_dir/hang/RANK.txt` (a `key: value` header: the rank, its coordinates, the op, its group and
members, the peer, how long; then every thread's stack from faulthandler) and exits with
HANG_EXIT_CODE, from a daemon thread: a hung collective cannot be interrupted from Python. The
local launcher prints `summarize` of the ranks' reports: who waited in what, on whom.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from bloomtrain.parallel import comm
from bloomtrain.launch import HANG_EXIT_CODE, error_text

# Set by the local launcher: a folder where each reporting rank leaves the path of its report,
# for the launcher's summary. Under torchrun every rank prints its own summary line to stderr.
REPORTS_ENV = "BLOOMTRAIN_HANG_REPORTS"
# An op can raise before the hang timeout: a dead peer makes gloo raise "Connection closed by
# peer" at once (the collective timeout, which config keeps the longer, seldom comes first): comm
# hands the error to on_failure, which writes the same report. If unwinding then blocks again (the
# end-of-run barrier would wait one more timeout), the watchdog ends the process this long after.
GRACE_S = 10.0
P2P_KINDS = ("send", "recv", "batch_isend_irecv")


@dataclass
class Hang:
    state: str  # "waiting" (in an op), "failed" (an op raised), "outside" (no op, step too long)
    seconds: float
    step: int | None
    entry: tuple | None = None  # comm.INFLIGHT entry: (kind, name, group, peer, start)
    error: str = ""
    thread_id: int | None = None  # the thread that waits or steps (faulthandler's "Thread 0x")


def members(entry: tuple, rank: int) -> list[int] | None:
    """The global ranks taking part in an INFLIGHT entry's op (None: unknown)."""
    _, _, group, peer, _ = entry
    if peer is not None:
        return sorted({rank, *(peer if isinstance(peer, tuple) else (peer,))})
    if group is None:
        return [rank]
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group torch does not know (tests), or no process group
        return None


def ranks_text(ranks: list[int] | None) -> str:
    """[0, 1]; a long list (the world of a large job) shortened to its ends and its length."""
    if ranks is None:
        return "(unknown)"
    if len(ranks) <= 16:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _op_text(kind: str, name: str, peer, ranks) -> str:
    if kind == "send" and isinstance(peer, int):
        return f"{kind}/{name} to rank {peer}"
    if kind == "recv" and isinstance(peer, int):
        return f"{kind}/{name} from rank {peer}"
    return f"{kind}/{name} with ranks {ranks_text(ranks)}"


def _served(group) -> frozenset[str]:
    try:
        return comm.group_devices(group)
    except Exception:  # noqa: BLE001 - a group torch does not know (tests)
        return frozenset()


def _on_stack(thread_id: int, code) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class Watchdog:
    """One per process (`start` stops the previous one). `check` and `report` are usable
    without the thread."""
    # The process's running watchdog: a second trainer in the same process (tests, notebooks)
    # stops the first one's thread. Allow-listed state (tests/structure.py).
    _active: "Watchdog | None" = None

    def __init__(self, topo, run_dir, timeout_s: float, poll_s: float | None = None):
        self.rank, self.world_size = topo.rank, topo.world_size
        c = topo.coords
        self.coords = f"pp {c.pp}, dp {c.dp}, tp {c.tp}"
        self.timeout_s = timeout_s
        self.dir = Path(run_dir) / "hang"
        self.poll_s = poll_s or min(1.0, max(0.05, timeout_s / 10))
        self._beat: tuple | None = None  # (step, start, thread id, code of the caller)
        # comm.INFLIGHT.last as the previous check saw it, and when it last changed
        self._seen_last: tuple | None = None
        self._active_at = 0.0
        self._progress_at = 0.0
        self._lock = threading.Lock()
        self._reported = False
        self._failed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, topo, run_dir, timeout_s: float) -> "Watchdog":
        """The watchdog of a training run: watching in a daemon thread when the job has more
        than one rank (one process has nothing to wait on)."""
        if cls._active is not None:
            cls._active.stop()
        dog = cls(topo, run_dir, timeout_s)
        # A report left by an earlier attempt or run is kept, as RANK.previous.txt, where it
        # cannot be read as this one's.
        with contextlib.suppress(OSError):
            os.replace(dog.dir / f"{dog.rank}.txt", dog.dir / f"{dog.rank}.previous.txt")
        if topo.world_size > 1:
            comm.INFLIGHT.on_failure = dog.on_failure
            dog._thread = threading.Thread(target=dog._watch, name="bloomtrain-watchdog",
                                           daemon=True)
            dog._thread.start()
            cls._active = dog
        return dog

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if comm.INFLIGHT.on_failure == self.on_failure:
            comm.INFLIGHT.on_failure = None
        if Watchdog._active is self:
            Watchdog._active = None

    def heartbeat(self, step: int) -> None:
        """Step `step` starts now (called by the training loop, from the loop itself)."""
        self._beat = (step, time.monotonic(), threading.get_ident(), sys._getframe(1).f_code)

    def progress(self) -> None:
        """Work between steps went a step further (an evaluation batch): the step clock starts
        again. Under pure data parallelism an evaluation has no collective until its mean, so
        without this a long one (eval_iters of 100 at a 16 s step) was taken for a hang."""
        self._progress_at = time.monotonic()

    # ---- detection ------------------------------------------------------------------------------
    def check(self, now: float | None = None) -> Hang | None:
        """The hang, if any. The step clock counts from the later of the heartbeat and the last
        time a check saw a new op begun (any thread), only while no op is in flight and while
        the heartbeat's caller (the training loop) is still running: evaluation and saving,
        which communicate, and whatever follows the loop, are never taken for a hang. A
        checkpoint's write and reads (comm.INFLIGHT.long_phase) stop the step clock, and the
        checkpoint group's ops (comm.LONG_OPS), where ranks wait for the slowest one's disk, are
        left to their collective timeout: a slow filesystem is no hang."""
        now = time.monotonic() if now is None else now
        slot = comm.INFLIGHT
        if slot.in_long_phase:  # a checkpoint is written or read: its clock starts after
            self._active_at = now
            return None
        inflight = {k: v for k, v in slot.snapshot().items() if v[1] not in comm.LONG_OPS}
        last = slot.last
        if last is not self._seen_last:  # an op began since the previous check: progress
            self._seen_last, self._active_at = last, now
        beat = self._beat
        step = beat[0] if beat is not None else None
        if inflight:
            thread_id, oldest = min(inflight.items(), key=lambda item: item[1][4])
            if now - oldest[4] >= self.timeout_s:
                return Hang("waiting", now - oldest[4], step, oldest, thread_id=thread_id)
            return None
        if beat is None:
            return None
        _, started, thread_id, code = beat
        progress = max(started, self._active_at, self._progress_at)
        if now - progress < self.timeout_s or not _on_stack(thread_id, code):
            return None
        return Hang("outside", now - started, step, thread_id=thread_id)

    # ---- reporting ------------------------------------------------------------------------------
    def header(self, hang: Hang) -> dict[str, str]:
        """The report's fields; `summary` is the sentence the launcher prints."""
        who = f"rank {self.rank} ({self.coords})"
        fields = {"rank": str(self.rank), "coords": self.coords, "state": hang.state,
                  "seconds": f"{hang.seconds:.1f}", "step": str(hang.step),
                  "timeout_s": f"{self.timeout_s:g}", "pid": str(os.getpid()),
                  "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
        if hang.thread_id is not None:
            fields["thread"] = f"0x{hang.thread_id:016x}"
        if hang.entry is not None:
            kind, name, _, peer, _ = hang.entry
            ranks = members(hang.entry, self.rank)
            fields.update(op=kind, comm=name, ranks=json.dumps(ranks),
                          peer=json.dumps(list(peer) if isinstance(peer, tuple) else peer))
            summary = f"{who} waited {hang.seconds:.1f} s in {_op_text(kind, name, peer, ranks)}"
            if hang.error:
                fields["error"] = hang.error
                summary += f", then it raised: {hang.error}"
        else:
            summary = f"{who} was in step {hang.step} for {hang.seconds:.1f} s, outside any " \
                      f"collective"
            last = comm.INFLIGHT.last
            if last is not None:
                op = _op_text(last[0], last[1], last[3], members(last, self.rank))
                fields["last_op"] = op
                summary += f" (the last op it entered: {op}"
                if last[2] is not None and "cuda" in _served(last[2]):
                    # An NCCL call returns once enqueued: the GPU may still wait in it.
                    summary += ", which may still be waiting on the GPU"
                summary += ")"
        fields["summary"] = summary
        return fields

    def report(self, hang: Hang) -> Path | None:
        """Write this rank's report (the first one only: a later call returns None)."""
        with self._lock:
            if self._reported:
                return None
            self._reported = True
            fields = self.header(hang)
            path = self.dir / f"{self.rank}.txt"
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                tmp = self.dir / f".{self.rank}.txt.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write("# bloomtrain hang report\n")
                    f.writelines(f"{k}: {v}\n" for k, v in fields.items())
                    f.write("\nstack (faulthandler, all threads, most recent call first):\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                os.replace(tmp, path)
            except OSError as e:
                print(f"[bloomtrain] rank {self.rank}: could not write the hang report {path}: "
                      f"{e}", file=sys.stderr, flush=True)
                path = None
            if path is not None:
                _leave_pointer(self.rank, path)
            # A collective that raised (a peer's closed connection) is the op's failure; the
            # hang, if any, is elsewhere.
            what = "op failed" if hang.state == "failed" else "hang"
            print(f"[bloomtrain] {what}: {fields['summary']}; report and stack: {path}",
                  file=sys.stderr, flush=True)
            return path

    def on_failure(self, entry: tuple, error: BaseException) -> None:
        """comm's hook: a collective raised a timeout or connection error."""
        try:
            step = self._beat[0] if self._beat is not None else None
            self.report(Hang("failed", time.monotonic() - entry[4], step, entry,
                             error_text(error), threading.get_ident()))
        except Exception as e:  # noqa: BLE001 - never mask the collective's own error
            print(f"[bloomtrain] hang report failed: {e!r}", file=sys.stderr, flush=True)
        finally:
            self._failed_at = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            hang = self.check()
            if hang is not None:
                self.report(hang)
                _exit()
            failed = self._failed_at
            if failed is not None and time.monotonic() - failed >= GRACE_S:
                _exit()


def _exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep a hung process alive
            pass
    os._exit(HANG_EXIT_CODE)


def forget_pointer(rank: int) -> None:
    """A worker's first act: the pointer its previous attempt left (before a restart) goes, so
    that the launcher's summary of a later failure reads only this attempt's reports (a rank
    that hung in attempt 0 was shown as the cause of attempt 1's ValueError)."""
    folder = os.environ.get(REPORTS_ENV)
    if folder:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, str(rank)))


def _leave_pointer(rank: int, path: Path) -> None:
    """Tell the local launcher (if it started this process) where the report is."""
    folder = os.environ.get(REPORTS_ENV)
    if not folder or not os.path.isdir(folder):
        return
    try:
        tmp = os.path.join(folder, f".{rank}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(path.resolve()))
        os.replace(tmp, os.path.join(folder, str(rank)))
    except OSError:  # the report itself is written; only the launcher's summary misses it
        pass


# ---- the launcher's side ------------------------------------------------------------------------
def read_report(path) -> dict[str, str]:
    """A report's header fields, plus `path`."""
    fields = {"path": str(path)}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                break
            if not line.startswith("#"):
                key, _, value = line.rstrip("\n").partition(": ")
                fields[key] = value
    return fields


def read_pointers(folder) -> dict[int, dict[str, str]]:
    """The reports whose paths the ranks left in `folder` (REPORTS_ENV), by rank."""
    out = {}
    for entry in sorted(Path(folder).iterdir()):
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = read_report(entry.read_text(encoding="utf-8").strip())
            except OSError:
                continue
    return out


def _doing(report: dict[str, str]) -> str:
    if report.get("state") == "outside":
        return f"in step {report.get('step')}, outside any collective"
    return f"in {report.get('op')}/{report.get('comm')}"


def summarize(reports: dict[int, dict[str, str]], world_size: int,
              nnodes: int = 1) -> list[str]:
    """One line per reporting rank: who waited in what, on whom; then the ranks that did not
    report (with `nnodes` > 1, this node's launcher sees only its own ranks' reports)."""
    if not reports:
        return []
    lines = [(f"bloomtrain: the job hung; {len(reports)} of {world_size} ranks reported (each "
              f"report holds every thread's stack):")]
    for rank in sorted(reports):
        r = reports[rank]
        line = r.get("summary", f"rank {rank}: unreadable report")
        if r.get("state") in ("waiting", "failed") and r.get("op") not in P2P_KINDS:
            ranks = json.loads(r.get("ranks") or "null") or []
            others = [q for q in ranks if q != rank and not _same_op(reports.get(q), r)]
            known = [f"rank {q} ({_doing(reports[q])})" for q in others if q in reports]
            unknown = [q for q in others if q not in reports]
            parts = known[:8] + ([f"{len(known) - 8} more"] if len(known) > 8 else []) + (
                [f"rank(s) {ranks_text(unknown)} (no report)"] if unknown else [])
            if parts:
                line += "; waiting on " + ", ".join(parts)
        lines.append(f"  {line} [{r['path']}]")
    missing = [q for q in range(world_size) if q not in reports]
    if missing and nnodes > 1:
        lines.append(f"  rank(s) {ranks_text(missing)} did not report here: they run on the "
                     f"other nodes, whose launchers list their reports (each rank's is in "
                     f"run_dir/hang/), or ended before their watchdog fired")
    elif missing:
        lines.append(f"  rank(s) {ranks_text(missing)} did not report (exited, or killed, "
                     f"before their watchdog fired)")
    return lines


def _same_op(other: dict[str, str] | None, mine: dict[str, str]) -> bool:
    return other is not None and other.get("state") in ("waiting", "failed") and all(
        other.get(k) == mine.get(k) for k in ("op", "comm", "ranks"))
