"""The hang watchdog (bloomtrain/train/watchdog.py): comm's record of the op each thread is blocked
in, the report's format and the launcher's summary, shown without processes; then a real 4-rank
job through `bloomtrain train --nproc 4` in which one rank stops inside a step (the fault
injection BLOOMTRAIN_TEST_SLEEP, tests/faults.py), which must end with every rank's report and a
non-zero exit within the timeout plus 60 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bloomtrain.layout import ParallelLayout
from bloomtrain.parallel import comm
from bloomtrain.topology import Topology
from bloomtrain.train import watchdog
from bloomtrain.train.watchdog import Watchdog
from tests import faults


class FakeWork:
    """A torch Work that records what comm's slot holds while it is waited for."""

    def __init__(self):
        self.seen = None

    def wait(self, timeout=None):
        self.seen = comm.INFLIGHT.snapshot()
        return True

    def is_completed(self):
        return True


@pytest.fixture
def fake_group():
    """A stand-in group: comm's device check is told it serves CPU tensors."""
    group = object()
    comm.declare_devices(group, {"cpu"})
    comm.declare_devices(None, {"cpu"})  # p2p calls pass group=None, read as the world
    saved = comm.INFLIGHT.on_failure
    yield group
    comm.INFLIGHT.on_failure = saved
    comm.declare_devices(group, None)
    comm.declare_devices(None, None)


def test_inflight_slot_holds_the_op_while_it_blocks(monkeypatch, fake_group):
    me = threading.get_ident()
    seen = {}

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen["during"] = comm.INFLIGHT.snapshot()
        return FakeWork() if async_op else None

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    before = time.monotonic()
    comm.all_reduce(torch.zeros(2), fake_group, "dp")
    kind, name, group, peer, start = seen["during"][me]
    assert (kind, name, group, peer) == ("all_reduce", "dp", fake_group, None)
    assert start >= before
    # Returned: nothing in flight; the op is remembered as the last one begun.
    assert me not in comm.INFLIGHT.snapshot()
    assert comm.INFLIGHT.last[:4] == ("all_reduce", "dp", fake_group, None)

    # Async: in flight while posted, not after, and again while its Work is waited for.
    work = comm.all_reduce(torch.zeros(2), fake_group, "dp", async_op=True)
    assert isinstance(work, comm.Work) and me not in comm.INFLIGHT.snapshot()
    assert work.is_completed()  # the handle's other methods pass through
    assert work.wait() is True
    assert work.work.seen[me][:4] == ("all_reduce", "dp", fake_group, None)
    assert me not in comm.INFLIGHT.snapshot()

    # Point to point names the peer; the pipeline's batches give each op its own record.
    monkeypatch.setattr(dist, "irecv", lambda tensor, src, group=None: FakeWork())
    work = comm.irecv(torch.zeros(2), 3, "pp")
    work.wait()
    assert work.work.seen[me][:4] == ("recv", "pp", None, 3)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [FakeWork() for _ in ops])
    # What comm reads of a dist.P2POp (whose constructor needs a process group).
    ops = [SimpleNamespace(op=dist.isend, tensor=torch.zeros(1), peer=1, group=fake_group),
           SimpleNamespace(op=dist.irecv, tensor=torch.zeros(1), peer=2, group=fake_group)]
    works = comm.batch_isend_irecv(ops, "pp")
    for w in works:
        w.wait()
    assert [w.work.seen[me][:4] for w in works] == [("send", "pp", fake_group, 1),
                                                    ("recv", "pp", fake_group, 2)]


def test_timeouts_and_broken_connections_are_reported_before_they_propagate(monkeypatch,
                                                                             fake_group):
    reported = []
    comm.INFLIGHT.on_failure = lambda entry, error: reported.append((entry[:4], str(error)))
    for error, is_failure in [
        (RuntimeError("[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"), True),
        (RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
        (RuntimeError("Tensors must be contiguous"), False),  # a bug, not a hang
        (ValueError("bad argument"), False),
    ]:
        def barrier(group=None, error=error):
            raise error
        monkeypatch.setattr(dist, "barrier", barrier)
        reported.clear()
        with pytest.raises(type(error)):
            comm.barrier(fake_group, "checkpoint")
        assert len(reported) == int(is_failure), error
        if is_failure:
            assert reported[0] == (("barrier", "checkpoint", fake_group, None), str(error))
        assert threading.get_ident() not in comm.INFLIGHT.snapshot()


def _dog(tmp_path, rank=1, timeout_s=3.0):
    # pp=2 x dp=2: rank 1 is (pp 0, dp 1, tp 0), as in the issue's example.
    topo = Topology.describe_rank(ParallelLayout(pp=2, dp=2), rank)
    return Watchdog(topo, tmp_path, timeout_s)


def test_an_op_past_the_timeout_is_reported_with_its_group_and_a_stack(tmp_path, monkeypatch,
                                                                        fake_group):
    monkeypatch.setattr(dist, "get_process_group_ranks",
                        lambda g: [0, 1] if g is fake_group else pytest.fail("other group"))
    pointers = tmp_path / "launcher"  # what the local launcher sets up for its workers
    pointers.mkdir()
    monkeypatch.setenv(watchdog.REPORTS_ENV, str(pointers))
    dog = _dog(tmp_path)
    now = time.monotonic()
    thread_id = 12345  # a thread that is not this one, blocked in a dp all-reduce
    monkeypatch.setitem(comm.INFLIGHT.busy, thread_id, ("all_reduce", "dp", fake_group, None,
                                                        now - 2.0))
    assert dog.check(now) is None  # 2 s of 3: still waiting
    hang = dog.check(now + 1.0)
    assert hang.state == "waiting" and hang.thread_id == thread_id
    path = dog.report(hang)
    assert path == tmp_path / "hang" / "1.txt"
    fields = watchdog.read_report(path)
    assert fields["summary"] == ("rank 1 (pp 0, dp 1, tp 0) waited 3.0 s in all_reduce/dp "
                                 "with ranks [0, 1]")
    assert (fields["rank"], fields["coords"], fields["op"], fields["comm"], fields["ranks"],
            fields["peer"]) == ("1", "pp 0, dp 1, tp 0", "all_reduce", "dp", "[0, 1]", "null")
    assert fields["thread"] == f"0x{thread_id:016x}"
    text = path.read_text()
    # faulthandler's dump of every thread: this test's frame is in it.
    assert "most recent call first" in text and "test_an_op_past_the_timeout" in text
    assert not list((tmp_path / "hang").glob(".*"))  # written under a temporary name, renamed
    assert dog.report(hang) is None  # the first report stands
    assert watchdog.read_pointers(pointers)[1]["summary"] == fields["summary"]

    # A p2p op names its peer; a raised error is quoted without gloo's source prefix.
    dog = _dog(tmp_path / "p2p", rank=1)
    dog.on_failure(("recv", "pp", None, 3, time.monotonic() - 15.0),
                   RuntimeError("[unbound_buffer.cc:78] Timed out waiting 15000ms for recv"))
    fields = watchdog.read_report(tmp_path / "p2p" / "hang" / "1.txt")
    assert fields["summary"] == ("rank 1 (pp 0, dp 1, tp 0) waited 15.0 s in recv/pp from "
                                 "rank 3, then it raised: Timed out waiting 15000ms for recv")
    assert (fields["state"], fields["peer"], fields["ranks"]) == ("failed", "3", "[1, 3]")


def test_the_step_heartbeat_sees_a_rank_stuck_outside_communication(tmp_path, monkeypatch,
                                                                     fake_group):
    dog = _dog(tmp_path, rank=3)
    world = list(range(4))
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: world)
    monkeypatch.setattr(comm.INFLIGHT, "busy", {})
    last = ("all_reduce", "control", fake_group, None, 0.0)
    monkeypatch.setattr(comm.INFLIGHT, "last", last)
    dog.check(0.0)  # the watchdog has seen the last op before the step

    def training_loop():
        dog.heartbeat(7)
        start = dog._beat[1]
        out = {"early": dog.check(start + 2.9), "late": dog.check(start + 5.0)}
        # In a collective (under the timeout): the op is what gets watched, not the step.
        comm.INFLIGHT.busy[threading.get_ident()] = ("barrier", "data", None, None, start + 4.5)
        out["in_op"] = dog.check(start + 5.0)
        comm.INFLIGHT.busy.clear()
        # An op began since the previous check: progress, the step clock starts again there.
        comm.INFLIGHT.last = ("barrier", "data", None, None, start + 4.5)
        out["after_progress"] = dog.check(start + 6.0)
        out["stuck_again"] = dog.check(start + 9.0)
        comm.INFLIGHT.last = last
        return out, start

    out, start = training_loop()
    assert out["early"] is None and out["after_progress"] is None and out["in_op"] is None
    assert out["stuck_again"].state == "outside"
    hang = out["late"]
    assert (hang.state, hang.step, hang.entry) == ("outside", 7, None)
    fields = dog.header(hang)
    assert fields["summary"] == ("rank 3 (pp 1, dp 1, tp 0) was in step 7 for 5.0 s, outside "
                                 "any collective (the last op it entered: all_reduce/control "
                                 "with ranks [0, 1, 2, 3])")
    # On an NCCL group a call returns once enqueued, so the device may be what waits.
    comm.declare_devices(fake_group, {"cuda"})
    assert dog.header(hang)["summary"].endswith("with ranks [0, 1, 2, 3], which may still be "
                                                "waiting on the GPU)")
    # The loop that beat has returned (evaluation, saving, the caller's own work): not a hang.
    assert dog.check(start + 100.0) is None


def test_an_evaluation_between_steps_is_progress(tmp_path, monkeypatch, fake_group):
    """Under pure data parallelism an evaluation runs eval_iters forwards with no collective
    until its mean: the step clock starts again at each of its batches (both ranks of a dp=2
    run were ended, exit 124, in the eval at step 2: eval_iters 40, a 0.45 s step, 1.8 s
    timeout). A batch stuck past the timeout is still a hang."""
    dog = _dog(tmp_path, rank=1)
    monkeypatch.setattr(comm.INFLIGHT, "busy", {})
    dog.check(0.0)

    def training_loop():
        dog.heartbeat(2)
        start = dog._beat[1]
        seen = []
        for _ in range(4):  # four eval batches of 2 s each: 8 s in all, past the 3 s timeout
            dog.progress()
            seen.append(dog.check(dog._progress_at + 2.0))
        return seen, dog.check(dog._progress_at + 3.5), start

    seen, stuck, start = training_loop()
    assert seen == [None] * 4
    assert stuck.state == "outside" and stuck.step == 2


def test_a_slow_checkpoint_is_no_hang(tmp_path, monkeypatch, fake_group):
    """A shard's write can outlast the hang timeout on a slow filesystem: the other ranks wait
    in the checkpoint group's gather, the writing rank is in its step outside any op. Neither
    is a hang (the ranks were ended with `.step_N.tmp` left and no checkpoint); the checkpoint
    group's collective timeout bounds them. The step clock starts again after the write."""
    dog = _dog(tmp_path, rank=1)
    monkeypatch.setattr(comm.INFLIGHT, "busy", {})
    now = time.monotonic()
    comm.INFLIGHT.busy[12345] = ("gather_object", "checkpoint", fake_group, None, now - 60.0)
    assert dog.check(now) is None
    comm.INFLIGHT.busy[12345] = ("gather_object", "dp", fake_group, None, now - 60.0)
    assert dog.check(now).state == "waiting"  # any other group's op is watched as before
    comm.INFLIGHT.busy.clear()

    def training_loop():
        dog.heartbeat(4)
        start = dog._beat[1]
        with comm.INFLIGHT.long_phase("checkpoint write"):
            during = dog.check(start + 60.0)
        return during, dog.check(start + 62.0), dog.check(start + 64.0)

    during, after, late = training_loop()
    assert during is None and after is None  # 2 s since the write ended, of 3
    assert late.state == "outside"
    assert not comm.INFLIGHT.in_long_phase


class Exited(Exception):
    pass


def test_the_thread_reports_and_ends_the_process(tmp_path, monkeypatch):
    """What the daemon thread does, run here in the foreground with os._exit replaced."""
    def fake_exit():
        raise Exited
    monkeypatch.setattr(watchdog, "_exit", fake_exit)
    monkeypatch.setattr(comm.INFLIGHT, "busy", {})
    # An op in flight past the timeout: report, then exit.
    dog = _dog(tmp_path / "a", timeout_s=0.05)
    dog.poll_s = 0.01
    comm.INFLIGHT.busy[1] = ("recv", "pp", None, 3, time.monotonic())
    with pytest.raises(Exited):
        dog._watch()
    assert watchdog.read_report(tmp_path / "a" / "hang" / "1.txt")["state"] == "waiting"
    comm.INFLIGHT.busy.clear()
    # A collective raised (the backend's own timeout fired first): the report is written at
    # once, and the process ended GRACE_S later if the error has not ended it by then.
    monkeypatch.setattr(watchdog, "GRACE_S", 0.05)
    dog = _dog(tmp_path / "b")
    dog.poll_s = 0.01
    dog.on_failure(("barrier", "end", None, None, time.monotonic()),
                   RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert watchdog.read_report(tmp_path / "b" / "hang" / "1.txt")["state"] == "failed"
    with pytest.raises(Exited):
        dog._watch()
    # Stopped: the thread returns without a report.
    dog = _dog(tmp_path / "c")
    dog.stop()
    dog._watch()
    assert not (tmp_path / "c" / "hang").exists()


def test_one_watchdog_per_process_and_none_for_one_rank(tmp_path, fake_group):
    comm.INFLIGHT.on_failure = None
    single = Watchdog.start(Topology.single(), tmp_path, 10.0)
    assert single._thread is None and comm.INFLIGHT.on_failure is None
    topo = Topology.describe_rank(ParallelLayout(dp=2), 0)
    first = Watchdog.start(topo, tmp_path, 10.0)
    assert first._thread.is_alive() and comm.INFLIGHT.on_failure == first.on_failure
    second = Watchdog.start(topo, tmp_path, 10.0)  # a second trainer in the same process
    assert not first._thread.is_alive() and comm.INFLIGHT.on_failure == second.on_failure
    second.stop()
    assert not second._thread.is_alive() and comm.INFLIGHT.on_failure is None


def test_fault_injection_hook_parses(monkeypatch):
    assert faults.parse_sleep("1:2:0.5") == (1, 2, 0.5)
    assert faults.parse_sleep("") is None
    with pytest.raises(ValueError, match="RANK:STEP:SECONDS"):
        faults.parse_sleep("1:2")
    monkeypatch.setenv(faults.SLEEP_ENV, "3:2:0.01")
    injected = faults.Faults.from_env()
    with injected.fault_in_step(3, 1):
        pass
    t0 = time.monotonic()
    with injected.fault_in_step(3, 2):
        assert time.monotonic() - t0 >= 0.01


def test_summary_says_who_waited_on_whom():
    def rep(rank, coords, **kw):
        return {"path": f"run/hang/{rank}.txt", "rank": str(rank), "coords": coords, **kw}
    reports = {
        0: rep(0, "pp 0, dp 0, tp 0", state="waiting", op="all_reduce", comm="dp",
               ranks="[0, 1]", peer="null", summary="rank 0 (...) waited 15.0 s in all_reduce/dp"),
        1: rep(1, "pp 0, dp 1, tp 0", state="failed", op="recv", comm="pp", ranks="[1, 3]",
               peer="3", summary="rank 1 (...) waited 15.0 s in recv/pp from rank 3"),
        3: rep(3, "pp 1, dp 1, tp 0", state="outside", step="2",
               summary="rank 3 (...) was in step 2 for 15.2 s, outside any collective"),
    }
    lines = watchdog.summarize(reports, 4)
    assert "3 of 4 ranks reported" in lines[0]
    assert lines[1] == ("  rank 0 (...) waited 15.0 s in all_reduce/dp; waiting on rank 1 "
                        "(in recv/pp) [run/hang/0.txt]")
    assert lines[2] == "  rank 1 (...) waited 15.0 s in recv/pp from rank 3 [run/hang/1.txt]"
    assert lines[3].startswith("  rank 3 (...) was in step 2")
    assert lines[4].startswith("  rank(s) [2] did not report")
    # Both ranks of a group in the same collective: neither waits on the other.
    reports[1] = dict(reports[0], rank="1", path="run/hang/1.txt")
    assert "waiting on" not in watchdog.summarize(reports, 4)[1]
    assert watchdog.summarize({}, 4) == []
    # A large job's groups and missing ranks are shortened.
    assert watchdog.ranks_text(list(range(384))) == "[0, 1, ..., 383] (384 ranks)"
    assert watchdog.summarize({0: reports[0]}, 384)[-1].startswith(
        "  rank(s) [1, 2, ..., 383] (383 ranks) did not report")


# ---- a real job ------------------------------------------------------------------------------
TIMEOUT_MINUTES = 0.25  # 15 s: far above a step of the tiny model on a loaded 2-core machine
SLEEPER, SLEEP_STEP = 3, 2


def _config(tmp_path: Path, dataset) -> Path:
    cfg = tmp_path / "hang.yaml"
    cfg.write_text(
        f"model: {{preset: tiny, vocab_size: 256}}\n"
        f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
        f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: 400}}\n"
        f"train: {{micro_batch_size: 1, global_batch_size: 8, train_iters: 4, precision: fp32,"
        f" log_interval: 1, device: cpu}}\n"
        f"parallel: {{pp: 2, pp_partition: uniform, timeout_minutes: {TIMEOUT_MINUTES}}}\n"
        f"run_dir: {tmp_path / 'run'}\n")
    return cfg


def _run_until_exit(args, env) -> tuple[int, str, float | None]:
    """Run the CLI; returns (exit code, its output, seconds from the injected hang to its exit).
    The job is killed if it outlives the hang by more than the timeout + 60 s."""
    proc = subprocess.Popen([sys.executable, "-m", "bloomtrain", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, hung_at = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if faults.SLEEP_ENV in line and not hung_at:
                hung_at.append(time.monotonic())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    limit = TIMEOUT_MINUTES * 60 + 60
    deadline = time.monotonic() + 600  # start-up: four ranks import torch on two cores
    while proc.poll() is None:
        if hung_at:
            deadline = min(deadline, hung_at[0] + limit)
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            reader.join(timeout=5)
            pytest.fail(f"the job was still running {limit:g} s after the hang (or never got "
                        f"there):\n{''.join(lines)[-6000:]}")
        time.sleep(0.2)
    reader.join(timeout=10)
    return proc.returncode, "".join(lines), (time.monotonic() - hung_at[0]) if hung_at else None


def test_a_rank_stuck_in_a_step_ends_the_job_with_every_ranks_report(dataset, tmp_path):
    # pp=2 x dp=2, 1F1B. Rank 3 (pp 1, dp 1) stops in step 2 outside any collective; rank 1
    # (pp 0, dp 1) then waits for its gradient from rank 3 (p2p); ranks 0 and 2 finish their
    # pipeline and wait in the dp gradient reduction with ranks 1 and 3.
    env = dict(os.environ, OMP_NUM_THREADS="1",
               **faults.env(sleep=f"{SLEEPER}:{SLEEP_STEP}:600"))
    rc, out, after_hang = _run_until_exit(["train", "--config", str(_config(tmp_path, dataset)),
                                           "--nproc", "4"], env)
    assert after_hang is not None, out[-6000:]
    assert rc != 0, out[-6000:]
    hang = tmp_path / "run" / "hang"
    reports = {r: watchdog.read_report(hang / f"{r}.txt") for r in range(4)}
    for r, fields in reports.items():
        assert fields["rank"] == str(r)
        assert "most recent call first" in (hang / f"{r}.txt").read_text(), r
    # The stuck rank: its own step clock, and its stack at the sleep.
    stuck = reports[SLEEPER]
    assert (stuck["state"], stuck["step"], stuck["coords"]) == ("outside", "2",
                                                                 "pp 1, dp 1, tp 0")
    assert "in fault_in_step" in (hang / f"{SLEEPER}.txt").read_text()
    # Its pipeline neighbour: a p2p receive from it, the peer named.
    p2p = reports[1]
    assert (p2p["op"], p2p["comm"], p2p["peer"], p2p["ranks"]) == ("recv", "pp", "3", "[1, 3]")
    assert p2p["state"] in ("waiting", "failed")
    # The other pipeline: the dp gradient reduction, with the group's members.
    for r, members in ((0, [0, 1]), (2, [2, 3])):
        assert reports[r]["comm"] == "dp" and json.loads(reports[r]["ranks"]) == members, r
    # The launcher's summary of who waited on what.
    assert "4 of 4 ranks reported" in out
    assert "rank 1 (pp 0, dp 1, tp 0) waited" in out and "in recv/pp from rank 3" in out
    assert "waiting on rank 3 (in step 2, outside any collective)" in out
    assert "rank 3 (pp 1, dp 1, tp 0) was in step 2 for" in out
    # Each report says what it is, once: no torch traceback per rank that exited 124.
    assert "ProcessExitedException" not in out and "exit code 124" not in out.replace(
        "(exit code 124)", ""), out[-6000:]
    print(f"job exited {after_hang:.1f} s after the injected hang (timeout "
          f"{TIMEOUT_MINUTES * 60:g} s)")


def test_a_rank_that_raises_ends_the_job_with_its_error_not_as_a_hang(dataset, tmp_path):
    # pp=2: rank 1 raises as step 2 begins, while rank 0 sends it activations. Rank 1 must not
    # wait for its peers at the end (they are waiting on it): the job ends on its error, named
    # as such, instead of hanging until the watchdog calls it a hang with the error lost.
    env = dict(os.environ, OMP_NUM_THREADS="1", **faults.env(raise_at="1:2"))
    proc = subprocess.run([sys.executable, "-m", "bloomtrain", "train", "--config",
                           str(_config(tmp_path, dataset)), "--nproc", "2"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=TIMEOUT_MINUTES * 60 + 300)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert f"ValueError: {faults.RAISE_ENV}: rank 1 raises in step 2" in out, out[-6000:]
    assert "hung" not in out and "exit code 124" not in out, out[-6000:]


def test_a_restarted_rank_forgets_its_previous_attempts_report(tmp_path, monkeypatch):
    """After a restart the launcher's summary must read this attempt's reports only: a rank
    that hung in attempt 0 was shown, with its peer waiting on it, as the reason attempt 1
    failed (a ValueError, which the stale report also hid from the "a rank raised" check).
    A worker removes its pointer when it starts; the watchdog moves an old report aside; a
    report names its attempt."""
    pointers = tmp_path / "launcher"
    pointers.mkdir()
    monkeypatch.setenv(watchdog.REPORTS_ENV, str(pointers))
    dog = _dog(tmp_path, rank=1)
    dog.report(watchdog.Hang("outside", 6.3, 2, thread_id=threading.get_ident()))
    assert set(watchdog.read_pointers(pointers)) == {1}
    assert watchdog.read_report(tmp_path / "hang" / "1.txt")["attempt"] == "0"

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    watchdog.forget_pointer(1)
    watchdog.forget_pointer(0)  # a rank with none: nothing to do
    assert watchdog.read_pointers(pointers) == {}
    topo = Topology.describe_rank(ParallelLayout(pp=2, dp=2), 1)
    Watchdog.start(topo, tmp_path, 3.0).stop()
    assert not (tmp_path / "hang" / "1.txt").exists()
    assert (tmp_path / "hang" / "1.previous.txt").exists()
    again = _dog(tmp_path, rank=1)
    again.report(watchdog.Hang("outside", 1.0, 5, thread_id=threading.get_ident()))
    assert watchdog.read_pointers(pointers)[1]["attempt"] == "1"


def test_a_harness_evaluation_stops_the_step_clock(monkeypatch):
    """Rank 0 alone imports lm-eval and reads its tasks' datasets while the other ranks wait
    in the command channel's broadcast: 12 s on a tiny model, both ranks ended as hung at a
    2.4 s hang timeout. The evaluation is a long phase, as a checkpoint's write."""
    from bloomtrain.eval.training import HarnessHook
    hook = object.__new__(HarnessHook)
    seen = []
    monkeypatch.setattr(HarnessHook, "_run", lambda self, *a: seen.append(
        comm.INFLIGHT.in_long_phase))
    assert not comm.INFLIGHT.in_long_phase
    hook.run(None, None, None, None, None)
    assert seen == [True] and not comm.INFLIGHT.in_long_phase


def test_the_launcher_leaves_out_torchs_record_of_a_rank_its_watchdog_ended():
    """torch logs a ProcessExitedException traceback per rank that exits 124; the reports and
    the launcher's summary already say it, as for a worker's UserError."""
    import logging

    from bloomtrain.launch import _AgentNoise  # noqa: PLC2701 - the filter is what is tested
    noise = _AgentNoise()

    def record(code):
        try:
            raise RuntimeError(f"process 0 terminated with exit code {code}")
        except RuntimeError:
            info = sys.exc_info()
        return logging.LogRecord("torch.multiprocessing.spawn", logging.ERROR, __file__, 1,
                                 _AgentNoise.WORKER_FAILED, (code, 0, 4242, "fn", "spawn"),
                                 info)
    assert not noise.filter(record(watchdog.HANG_EXIT_CODE))
    assert noise.filter(record(1))  # any other failure's traceback is still shown
