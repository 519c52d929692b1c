"""The rank pool (tests/dist.py): a function that kills its worker, hangs, fails while a peer
waits in a collective, or leaves a thread running does not poison the next multi-rank test; the
pool replaces the worker and names the culprit; and state a function changes (process groups,
environment, cwd, torch defaults, RNG, bloomtrain's module globals) does not reach the next one.

The tests run in file order on the session's pool: each "...then" test is the multi-rank test
that follows a poisoning one."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from bloomtrain.parallel import comm
from tests.dist import RankError, run_ranks


def _all_reduce(rank, world):
    x = torch.tensor([float(rank + 1)])
    comm.all_reduce(x, comm.world_group(), "test")
    return x.item(), dist.get_world_size(), os.getpid()


def _expected_sum(world):
    return world * (world + 1) / 2


def _kill_rank_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(1)
    # rank 0 waits here for a peer that is gone
    comm.all_reduce(x, comm.world_group(), "test")
    return "unreachable"


def test_a_worker_killed_mid_collective_fails_only_its_own_test(rank_pool):
    before = len(rank_pool.incidents)
    with pytest.raises(RankError, match="rank 1 ---\nprocess exited with code -9"):
        run_ranks(2, _kill_rank_1)
    new = rank_pool.incidents[before:]
    assert any("test_a_worker_killed_mid_collective" in line and "_kill_rank_1" in line
               for line in new), new


def test_then_a_multi_rank_test_passes(rank_pool):
    pids = set()
    for world in (2, 4, 2):
        outs = run_ranks(world, _all_reduce)
        assert [o[:2] for o in outs] == [(_expected_sum(world), world)] * world
        pids |= {o[2] for o in outs}
    assert len(pids) == 4  # the same workers served the three runs


def _hang(rank, world):
    if rank == 0:
        time.sleep(3600)
    comm.barrier(comm.world_group(), "test")


def test_a_hang_is_killed_at_the_timeout_and_named(rank_pool):
    before = len(rank_pool.incidents)
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not finish within 5s \(.*_hang\)"):
        run_ranks(2, _hang, timeout=5)
    assert sum("_hang" in line and "killed" in line
               for line in rank_pool.incidents[before:]) == 2


def test_then_after_the_hang(rank_pool):
    assert [o[0] for o in run_ranks(2, _all_reduce)] == [3.0, 3.0]


def _fail_while_peer_waits(rank, world):
    if rank == 0:
        raise ValueError("rank 0 gives up")
    comm.recv(torch.empty(1), 0, "test")  # never sent


def test_a_failure_with_a_peer_blocked_reports_the_failure(rank_pool):
    with pytest.raises(RankError, match="ValueError: rank 0 gives up"):
        run_ranks(2, _fail_while_peer_waits)
    assert run_ranks(2, _all_reduce)[1][0] == 3.0


def _leave_a_thread(rank, world):
    threading.Thread(target=time.sleep, args=(3600,), name="left-behind", daemon=True).start()
    return rank


def test_a_worker_left_with_a_thread_is_retired(rank_pool):
    before = len(rank_pool.incidents)
    assert run_ranks(2, _leave_a_thread) == [0, 1]
    new = rank_pool.incidents[before:]
    assert sum("left thread(s) running: left-behind" in line for line in new) == 2, new
    assert run_ranks(2, _all_reduce)[0][0] == 3.0


def _dirty(rank, world, tmp):
    os.environ["BLOOMTRAIN_TEST_LEAK"] = "1"
    os.chdir(tmp)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.manual_seed(123)
    signal.signal(signal.SIGUSR1, lambda *a: None)
    comm.STATS.enable()
    comm.STATS.record("all_reduce", "leak", torch.ones(4))
    comm.declare_devices(None, {"cuda"})
    dist.new_group([0, 1])
    return os.getpid()


def _observe(rank, world):
    return dict(pid=os.getpid(), env=os.environ.get("BLOOMTRAIN_TEST_LEAK"), cwd=os.getcwd(),
                dtype=torch.get_default_dtype(), threads=torch.get_num_threads(),
                grad=torch.is_grad_enabled(), seed=torch.initial_seed(),
                sigusr1=signal.getsignal(signal.SIGUSR1), stats=comm.STATS.enabled,
                counts=comm.STATS.snapshot(), devices=sorted(comm.group_devices(None)),
                world=dist.get_world_size(), rank=dist.get_rank())


def test_state_a_function_changes_does_not_reach_the_next(tmp_path):
    fresh = run_ranks(2, _observe)
    pids = run_ranks(2, _dirty, str(tmp_path))
    given = run_ranks(2, _observe, env={"BLOOMTRAIN_TEST_LEAK": "given"})
    assert [g["env"] for g in given] == ["given", "given"]  # a call's env is its own
    after = run_ranks(2, _observe)
    assert [a["pid"] for a in after] == pids, "the same workers"
    changed = [(r, k, f[k], a[k]) for r, (f, a) in enumerate(zip(fresh, after)) for k in f
               if f[k] != a[k]]
    assert not changed, changed  # (rank, what, before, after)
    assert after[0]["cwd"] != str(tmp_path) and after[0]["dtype"] == torch.float32
    assert after[0]["seed"] == 67280421310721 and after[0]["devices"] == ["cpu"]
    assert [a["rank"] for a in after] == [0, 1] and after[0]["world"] == 2


def test_fresh_processes_when_asked():
    pid = os.getpid()
    outs = run_ranks(2, _all_reduce, fresh=True)
    assert [o[0] for o in outs] == [3.0, 3.0] and pid not in {o[2] for o in outs}
