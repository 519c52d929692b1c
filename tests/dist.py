"""Run a function on N gloo ranks on CPU, for multi-rank tests.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

Each rank is a fresh spawned process with its own process group on a free localhost port. The
return values come back in rank order. If any rank raises or dies, the others are torn down and a
RankError carrying every failing rank's traceback is raised, so a failure never turns into a hang.
`fn` must be importable (defined at module level) because ranks are spawned, not forked.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, env, results):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    # All ranks share two CPU cores; more intra-op threads per rank only thrash.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message; the queue's default (shared-memory file
        # descriptors) breaks when this process exits before the parent reads them.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 600.0, env: dict | None = None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env or {}, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(errors) < world_size:
            try:
                rank, ok, val = results.get(timeout=1.0)
                val = pickle.loads(val) if ok else val
                (outs if ok else errors)[rank] = val
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
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankError(f"{len(errors)} rank(s) failed:\n{msg}")
    return [outs[r] for r in range(world_size)]
