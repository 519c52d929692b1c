"""Run a function on N gloo ranks on CPU, for multi-rank tests.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

The return values come back in rank order. If any rank raises or dies, or the ranks do not finish
within `timeout`, a RankError carrying every failing rank's traceback is raised, so a failure never
turns into a hang. `fn` must be importable (defined at module level): it travels by name.

Under pytest the ranks come from a rank pool (tests/conftest.py opens one for the session): up to
8 worker processes started once, which have imported torch already, so a test pays for neither
interpreter start-up nor imports. Every submission gets a new default process group of exactly
its world size, made from the pool's long-lived TCP store under a key of its own, and destroyed
when the function returns, which also destroys every subgroup the function made. Creating and
destroying a world-8 gloo group costs ~0.1 s; spawning 8 ranks ~15 s on a loaded 2-core machine.

A reused worker starts each function clean (`_Clean`): the environment, working directory,
umask, signal handlers, warning filters and logging handlers it had when it started; torch's
default dtype and device, one intra-op thread, grad mode on, anomaly detection and deterministic
algorithms off, dynamo's caches reset, the global RNGs as a fresh process has them (torch's fixed
default seed, Python's and NumPy's from OS entropy); bloomtrain's module-level state (comm's STATS,
INFLIGHT and group-device cache, an active watchdog) as at import. What cannot be reset is
refused: a worker that is left with a thread the function started (but a library's idle
process-wide helper, BENIGN_THREADS), or that has grown past `MAX_WORKER_RSS`, retires after
reporting and the pool starts a new one when next needed.

A function that hangs, kills its process or leaves its peers blocked in a collective does not
poison the next test: the pool kills the workers that did not come back, starts new ones for the
next submission, and records the culprit (the test and the function), which the session's summary
prints ("rank pool" section). A worker found dead between tests is blamed on the last function it
ran, not on the test that finds it.

Outside a pool (benchmarks, fixture scripts), or with `fresh=True`, each call spawns its own
processes as before. Tests that must launch real jobs (the launcher, chaos, restart, multi-node,
lost rank, the serve CLI) start their own processes and do not come here.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import logging
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait as wait_for

import torch.distributed as dist
import torch.multiprocessing as mp

# A collective that waits this long inside a submitted function fails instead of hanging.
GROUP_TIMEOUT = timedelta(seconds=120)
# After one rank failed, how long the others get to report before they are killed (a peer blocked
# in a collective with the failed rank usually fails at once when that rank closes its group).
FAILURE_GRACE_S = 5.0
# A worker still this large after a function (and malloc_trim) is retired: 8 workers at this size
# still fit the CI machine.
MAX_WORKER_RSS = 3 * 2 ** 30
POOL_SIZE = 8
# Process-wide helpers a library starts once and keeps, idle, whoever called it first.
BENIGN_THREADS = {"tqdm_monitor"}

_SIGNALS = [s for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and isinstance(s, signal.Signals)]
# torch's CPU generator's seed in a process that never seeded it (c10's default_rng_seed_val).
_TORCH_DEFAULT_SEED = 67280421310721


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


_LIBC_TRIM = _malloc_trim()


class RankError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" (", 1)[0]


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size))


def _call(rank, world_size, fn, args, init) -> tuple[bool, bytes | str]:
    """fn(rank, world_size, *args) in a process group made by `init`: (True, pickled result) or
    (False, traceback)."""
    import torch
    # All ranks share two CPU cores; more intra-op threads per rank only thrash.
    torch.set_num_threads(1)
    try:
        init()
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message; torch's reductions (shared-memory file
        # descriptors) break when the sender exits or moves on before the parent reads them.
        return True, pickle.dumps(out)
    except BaseException:
        return False, traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- fresh processes -----------------------------------------------------------------------------

def _spawned(rank, world_size, port, fn, args, env, results):
    os.environ.update(env)
    os.environ.update(_rank_env(rank, world_size, port))

    def init():
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    results.put((rank, *_call(rank, world_size, fn, args, init)))


def spawn_ranks(world_size: int, fn, *args, timeout: float = 600.0, env: dict | None = None):
    """run_ranks on processes of its own: spawned for this call, gone after it."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, env or {},
                                                results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(errors) < world_size:
            try:
                rank, ok, val = results.get(timeout=1.0)
                (outs if ok else errors)[rank] = pickle.loads(val) if ok else val
            except queue.Empty:
                pending = set(range(world_size)) - outs.keys() - errors.keys()
                dead = [r for r in sorted(pending) if procs[r].exitcode is not None]
                if dead:
                    errors.update({r: f"process exited with code {procs[r].exitcode} "
                                      f"without reporting" for r in dead})
                elif time.monotonic() > deadline:
                    raise RankError(f"ranks {sorted(pending)} did not finish within {timeout}s")
            if errors:
                # One rank failed; the others may now block in a collective forever.
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 10)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise _rank_error(errors)
    return [outs[r] for r in range(world_size)]


def _rank_error(errors: dict[int, str], extra: str = "") -> RankError:
    msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
    return RankError(f"{len(errors)} rank(s) failed:\n{msg}{extra}")


# ---- the pool's workers --------------------------------------------------------------------------

class _Clean:
    """A worker's state as it started, restored around each submitted function; what cannot be
    restored (threads the function left running, memory it grew) makes `dirty()` say why."""

    def __init__(self):
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.warning_filters = list(warnings.filters)
        self.log_handlers = list(logging.root.handlers)
        self.log_level = logging.root.level
        self.threads = set(threading.enumerate())
        self.sys_path = list(sys.path)

    def restore(self, env: dict | None = None) -> None:
        """The starting state, with `env` added to the environment."""
        import numpy as np
        import torch
        os.environ.clear()
        os.environ.update(self.env)
        os.environ.update(env or {})
        os.chdir(self.cwd)
        os.umask(self.umask)
        for s, h in self.handlers.items():
            if h is not None and signal.getsignal(s) is not h:
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(s, h)
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()
        logging.root.handlers[:] = self.log_handlers
        logging.root.setLevel(self.log_level)
        sys.path[:] = self.sys_path
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.use_deterministic_algorithms(False)
        torch.manual_seed(_TORCH_DEFAULT_SEED)
        random.seed()
        np.random.seed()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        _reset_bloomtrain_globals()
        gc.collect()
        _LIBC_TRIM()  # freed heap back to the OS: the next function starts near a fresh RSS

    def dirty(self) -> str | None:
        """Why this worker must not run another function (None: it may)."""
        def extra():
            return [t for t in set(threading.enumerate()) - self.threads
                    if t.is_alive() and t.name not in BENIGN_THREADS]
        deadline = time.monotonic() + 2.0
        for t in extra():  # a thread that is just finishing
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        left = [t.name for t in extra()]
        if left:
            return f"left thread(s) running: {', '.join(sorted(left))}"
        rss = _rss_bytes()
        if rss > MAX_WORKER_RSS:
            return f"grew to {rss / 2 ** 30:.1f} GiB resident"
        return None


def _reset_bloomtrain_globals() -> None:
    """bloomtrain's module-level state back to what an import gives (the modules that hold any;
    each says so in its docstring). Reset in place: other modules hold references to them."""
    comm = sys.modules.get("bloomtrain.parallel.comm")
    if comm is not None:
        comm.STATS.__init__()
        comm.INFLIGHT.__init__()
        comm._GROUP_DEVICES.clear()
    watchdog = sys.modules.get("bloomtrain.train.watchdog")
    if watchdog is not None and watchdog.Watchdog._active is not None:
        watchdog.Watchdog._active.stop()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _pool_worker(conn, store_port: int) -> None:
    import torch  # noqa: F401  (the import every function needs, paid once per worker)
    import bloomtrain  # noqa: F401
    # Ctrl-C in the terminal reaches the whole process group: the parent decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=timedelta(seconds=60))
    clean = _Clean()
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the parent is gone
            return
        key, rank, world_size, payload = pickle.loads(message)
        if key is None:
            return
        try:
            fn, args, env = pickle.loads(payload)
        except BaseException:
            clean.restore()
            ok, result = False, traceback.format_exc()
        else:
            # The call's environment is in place before module state is reset from it (comm's
            # STATS reads BLOOMTRAIN_COMM_STATS), as it would be at a fresh process's imports.
            clean.restore({**env, **_rank_env(rank, world_size, store_port)})

            def init():
                dist.init_process_group("gloo", store=dist.PrefixStore(key, store), rank=rank,
                                        world_size=world_size, timeout=GROUP_TIMEOUT)
            ok, result = _call(rank, world_size, fn, args, init)
        clean.restore()
        why = clean.dirty()
        conn.send_bytes(pickle.dumps((key, ok, result, why)))
        if why:
            return


# ---- the pool ------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, ctx, slot: int, store_port: int):
        self.slot = slot
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pool_worker, args=(child, store_port), daemon=True,
                                name=f"rank-pool-{slot}")
        self.proc.start()
        child.close()
        self.last = None  # (test, function) of the last submission it ran

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RankPool:
    """Up to `size` gloo worker processes kept for many run_ranks calls (module doc)."""

    def __init__(self, size: int = POOL_SIZE):
        self.size = size
        self.ctx = mp.get_context("spawn")
        self.store = None
        self.workers: dict[int, _Worker] = {}
        self.incidents: list[str] = []   # each replacement of a worker, naming its culprit
        self.runs = 0
        self.started = 0
        self._keys = itertools.count()

    def _worker(self, slot: int) -> _Worker:
        w = self.workers.get(slot)
        if w is not None and not w.alive():
            code = w.proc.exitcode
            test, fn = w.last or ("(no test)", "(no function)")
            self.incidents.append(f"{test} ({fn}): worker {slot} exited (code {code}) after "
                                  f"the run; found dead and replaced before {_current_test()}")
            w.kill()
            w = None
        if w is None:
            if self.store is None:
                self.store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
            w = self.workers[slot] = _Worker(self.ctx, slot, self.store.port)
            self.started += 1
        return w

    def _retire(self, slot: int, why: str) -> None:
        w = self.workers.pop(slot, None)
        if w is not None:
            w.kill()
            test, fn = w.last or ("(no test)", "(no function)")
            self.incidents.append(f"{test} ({fn}): worker {slot} {why}; replaced")

    def run(self, world_size: int, fn, args, timeout: float, env: dict | None):
        if not 1 <= world_size <= self.size:
            raise ValueError(f"the rank pool has {self.size} workers; world_size {world_size} "
                             f"needs run_ranks(..., fresh=True)")
        payload = pickle.dumps((fn, args, dict(env or {})))
        key = f"run{next(self._keys)}/"
        culprit = (_current_test(), _describe(fn))
        workers = [self._worker(r) for r in range(world_size)]
        self.runs += 1
        outs, errors = {}, {}
        pending = set(range(world_size))
        for rank, w in enumerate(workers):
            w.last = culprit
            try:
                w.conn.send_bytes(pickle.dumps((key, rank, world_size, payload)))
            except OSError:  # it died just now; the loop below sees it
                pass
        deadline = time.monotonic() + timeout
        try:
            while pending:
                now = time.monotonic()
                if now > deadline:
                    break
                wait_for([workers[r].conn for r in pending]
                         + [workers[r].proc.sentinel for r in pending],
                         timeout=min(1.0, deadline - now))
                for r in sorted(pending):
                    w = workers[r]
                    reply = None
                    if w.conn.poll():
                        with contextlib.suppress(EOFError, OSError):
                            reply = pickle.loads(w.conn.recv_bytes())
                    if reply is not None:
                        got_key, ok, val, why = reply
                        assert got_key == key, (got_key, key)
                        pending.discard(r)
                        if ok:
                            outs[r] = pickle.loads(val)
                        else:
                            errors[r] = val
                        if why:
                            self._retire(r, f"retired: it {why}")
                    elif not w.alive():
                        pending.discard(r)
                        errors[r] = (f"process exited with code {w.proc.exitcode} without "
                                     f"reporting")
                if errors and pending:
                    # One rank failed; the others may be blocked in a collective with it.
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        finally:
            # Whatever did not come back (a hang, a peer still blocked, an interrupt) is killed.
            for r in sorted(pending):
                self._retire(r, "killed: still running when the run ended")
            for r in range(world_size):
                w = self.workers.get(r)
                if w is workers[r] and not w.alive():
                    self._retire(r, "died")
        if pending and not errors:
            raise RankError(f"ranks {sorted(pending)} did not finish within {timeout}s "
                            f"({culprit[1]}); the pool killed their workers")
        if errors:
            extra = (f"\n(ranks {sorted(pending)} were still running {FAILURE_GRACE_S:g} s "
                     f"after the failure and were killed)" if pending else "")
            raise _rank_error(errors, extra)
        return [outs[r] for r in range(world_size)]

    def close(self) -> None:
        for w in self.workers.values():
            with contextlib.suppress(OSError, BrokenPipeError):
                w.conn.send_bytes(pickle.dumps((None, 0, 0, b"")))
        for w in self.workers.values():
            w.proc.join(timeout=5)
            w.kill()
        self.workers.clear()
        self.store = None


_POOL: RankPool | None = None


@contextlib.contextmanager
def use_pool(pool: RankPool):
    """run_ranks submits to `pool` inside the block."""
    global _POOL
    saved, _POOL = _POOL, pool
    try:
        yield pool
    finally:
        _POOL = saved


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0, env: dict | None = None,
              fresh: bool = False):
    """fn(rank, world_size, *args) on `world_size` gloo ranks; the results in rank order. On the
    session's rank pool when there is one and `fresh` is false, else on processes spawned for
    this call. `env` is added to each rank's environment for the call."""
    if _POOL is not None and not fresh:
        return _POOL.run(world_size, fn, args, timeout, env)
    return spawn_ranks(world_size, fn, *args, timeout=timeout, env=env)
