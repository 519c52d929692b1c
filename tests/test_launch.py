"""The local launcher's output (bloomtrain.launch.launch_local): torch's elastic agent logs a
warning per worker it signals ("W... Closing process 4242 via signal SIGTERM"); bloomtrain
leaves those out and says in its last line what happened.

Ctrl-C under `bloomtrain train --nproc 2`, from a terminal (the whole process group gets SIGINT)
or as `kill -INT` to the launcher alone: the workers finish the step they are in and save it,
the launcher's last line names that checkpoint and it exits 130, and a resume from it ends
bitwise equal to an uninterrupted run. A second Ctrl-C during that save ends the workers at
once: no checkpoint of the step appears, the previous one is still the newest, and a resume
from it is bitwise equal too."""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bloomtrain import checkpoint as ckpt
from bloomtrain import launch
from bloomtrain.launch import _AgentNoise
from tests import faults
from tests.chaos import Job, alive, compare, group_left_after, group_members
from tests.helpers import read_rest
from tests.synthetic import write_synthetic_dataset

NOISE = re.compile(r"Closing process|Terminating process|closing signal|death signal|"
                   r"Unable to shutdown|Traceback")


def test_the_filtered_messages_are_torchs_own():
    # Worded as torch words them (a torch that rewords one fails here, not silently in a user's
    # terminal), on the loggers torch logs them to.
    import importlib
    agent, processes, spawn = map(importlib.import_module, _AgentNoise.LOGGERS)  # their modules
    source = "".join(inspect.getsource(m) for m in (agent, processes, spawn))
    for message in _AgentNoise.MESSAGES + _AgentNoise.FORCED:
        assert f'"{message}"' in source, message
    assert {agent.logger.name, processes.logger.name, spawn.log.name} == set(_AgentNoise.LOGGERS)


def test_a_workers_user_error_is_its_last_line_alone():
    """torch logs a failed worker's traceback (about 30 lines) before the launcher's last line;
    for a UserError that line is the whole story. Other failures keep their traceback."""
    import inspect as ins

    import torch.distributed.elastic.multiprocessing.api as api

    assert " ".join(_AgentNoise.WORKER_FAILED.split()) in " ".join(
        ins.getsource(api).replace('"\n', "").replace('"', "").split())
    noise = _AgentNoise()

    def record(error):
        try:
            raise error
        except Exception:
            return logging.LogRecord("torch.distributed.elastic.multiprocessing.api",
                                     logging.ERROR, __file__, 1, _AgentNoise.WORKER_FAILED,
                                     (1, 0, 4242, "worker_entry", "spawn"), sys.exc_info())
    refused = RuntimeError("Traceback (most recent call last):\n  ...\n"
                           "bloomtrain.errors.UserError: ck is in use by another run")
    assert not noise.filter(record(refused))
    assert noise.filter(record(RuntimeError("Traceback ...\nZeroDivisionError: division by zero")))


def test_the_noise_is_left_out_and_the_rest_kept():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    handler = Keep()
    logger.addHandler(handler)
    try:
        with _AgentNoise().installed() as noise:
            logger.warning("Closing process %s via signal %s", 4242, "SIGTERM")
            logger.warning("Unable to shutdown process %s via %s, forcefully exiting via %s",
                           4242, 15, 9)
            logger.warning("something else: %s", 1)
        logger.warning("Closing process %s via signal %s", 4243, "SIGTERM")  # filter removed
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else: 1", "Closing process 4243 via signal SIGTERM"]
    assert noise.forced == 1


def _train(tmp_path, *overrides, stdout=subprocess.PIPE, start_new_session=False, env=None):
    """`bloomtrain train --nproc 2` of the tiny model in tmp_path/run; the launcher's Popen
    (start_new_session: its own process group, the workers' too, to look for after)."""
    dataset = write_synthetic_dataset(tmp_path / "data" / "synth_text_document")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "bloomtrain", "train", "--nproc", "2", "model.preset=tiny",
         "model.vocab_size=256", f"data.paths=[{dataset}]", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.precision=fp32", "train.log_interval=1",
         "train.device=cpu", f"run_dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True,
        start_new_session=start_new_session)


def _long_run(tmp_path) -> tuple[str, ...]:
    """Overrides for a run that trains until stopped, saving to tmp_path/ck."""
    return ("train.train_iters=100000", "optim.decay_samples=10000000",
            f"checkpoint.dir={tmp_path / 'ck'}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_the_launcher_lets_the_workers_save_and_exit(tmp_path, sig):
    """SIGTERM or SIGUSR1 to the launcher alone (a terminal's kill, a pod's termination,
    `scancel --signal=USR1` to the batch step): the workers finish their step, save it and
    exit 0, and so does the launcher. torch's agent SIGKILLed the workers 30 s after a SIGTERM
    whatever they were doing (mid-save for a large model), and SIGUSR1 ended the launcher at
    once (exit 138), leaving its workers orphaned."""
    proc = _train(tmp_path, *_long_run(tmp_path), start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step"):
            break
    else:
        raise AssertionError("training ended early:\n" + "".join(seen))
    proc.send_signal(sig)
    out = "".join(seen) + read_rest(proc, 180)
    assert proc.wait(timeout=180) == 0, out
    assert group_left_after(proc.pid) == [], out  # no worker left behind
    assert not NOISE.search(out), out
    assert (f"bloomtrain: {signal.Signals(sig).name}: the workers finish their step, save a "
            f"checkpoint and exit") in out
    stopped = re.search(r"\[train\] stopping at step (\d+): signal; saving", out)
    assert stopped, out
    newest = ckpt.find_latest_valid(tmp_path / "ck", log=lambda *_: None)
    assert newest is not None and newest.name == f"step_{int(stopped.group(1)):08d}", out


def test_a_second_sigterm_ends_the_workers_at_once(tmp_path, monkeypatch, capfd):
    """The launcher's count of SIGTERMs, as of Ctrl-Cs: the first asks for the stop (the file
    the workers read holds its number), the second SIGKILLs them; SIGUSR1 only ever asks."""
    import contextlib as cl
    killed = []
    monkeypatch.setattr(launch, "_kill_children", lambda: killed.append(True))
    monkeypatch.setattr(launch, "_workers_running", lambda: True)
    stop = launch.SigintStop("stopping", lambda results: "the newest checkpoint is X")

    class Config:
        signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

    with cl.ExitStack() as stack:
        taker = launch._SignalTaker(stop, stack)
        lc = Config()
        env = taker.worker_env(lc)
        assert lc.signals_to_handle == "SIGHUP,SIGQUIT"  # torch's agent leaves them to us
        taker(signal.SIGUSR1, None)
        taker(signal.SIGUSR1, None)
        assert open(env[launch.SIGNAL_FILE_ENV]).read() == str(int(signal.SIGUSR1))
        taker(signal.SIGTERM, None)  # the file says what came first
        assert not killed
        with pytest.raises(launch._QuitNow):
            taker(signal.SIGTERM, None)
        assert killed
        with pytest.raises(SystemExit) as exited:
            taker.quit_now(2)
        assert exited.value.code == 128 + signal.SIGTERM
    assert ("bloomtrain: SIGTERM again: this node's 2 worker(s) ended at once (SIGKILL), "
            "without saving; the newest checkpoint is X; exit code 143") in capfd.readouterr().err


@pytest.mark.slow
def test_a_failed_worker_ends_in_its_own_line(tmp_path):
    # rank 0 cannot open its metrics log (a directory stands in its place, which nothing
    # before launch looks at); rank 1, waiting in a collective, is stopped.
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    proc = _train(tmp_path, "train.train_iters=4")
    out = read_rest(proc, 180)
    assert proc.wait(timeout=180) == 2, out
    assert not re.search(r"Closing process|Terminating process|closing signal", out), out
    assert out.strip().splitlines()[-1].startswith(
        "bloomtrain train: error: rank 0 (local rank 0, pid "), out


# ---- threads per worker -------------------------------------------------------------------------
def _report_threads(folder: str) -> None:
    """A worker: what OMP_NUM_THREADS it got and the intra-op threads torch took from it."""
    import json

    import torch
    rank = os.environ["RANK"]
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump([os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()], f)


def _threads_seen(tmp_path, worker_env=None) -> list:
    import json
    launch.launch_local(2, _report_threads, str(tmp_path), worker_env=worker_env)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]


def test_each_worker_gets_its_share_of_the_cores(tmp_path, monkeypatch, capfd):
    # As if the node had 4 cores: 2 workers take 2 threads each, not 4 each (torch's default is
    # every core, and N workers would run N times as many spinning threads as cores). Four, not
    # more: torch takes no more threads than the machine has cores, whatever the variable says.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    assert _threads_seen(tmp_path) == [["2", 2], ["2", 2]]
    assert ("bloomtrain: 2 workers on 4 CPU core(s): OMP_NUM_THREADS=2 each (set "
            "OMP_NUM_THREADS to choose)") in capfd.readouterr().err
    # More workers than cores: one thread each.
    assert launch.thread_env(3, {}) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert launch.thread_env(3, {}) == {"OMP_NUM_THREADS": "2"}
    assert launch.thread_env(1, {}) == {}  # one worker: torch's own default, as before


def test_a_users_omp_num_threads_is_kept(tmp_path, monkeypatch, capfd):
    # Two workers on two cores would get one thread each; the user's 2 stands, whether from
    # the environment or from the command (serve --threads passes it as the workers' own).
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert _threads_seen(tmp_path) == [["2", 2], ["2", 2]]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _threads_seen(tmp_path, {"OMP_NUM_THREADS": "2"}) == [["2", 2], ["2", 2]]
    assert "OMP_NUM_THREADS=" not in capfd.readouterr().err


def _report_job_start(folder: str) -> None:
    """A worker: the job's start its launcher gave it."""
    rank = os.environ["RANK"]
    with open(os.path.join(folder, f"start{rank}"), "w") as f:
        f.write(os.environ.get(launch.JOB_START_ENV, ""))


def test_the_workers_are_told_when_the_job_started(tmp_path, monkeypatch):
    """train.exit_duration_minutes counts from the job's start, which a restarted worker
    cannot know: the launcher gives every worker the same time, or passes on its own
    launcher's."""
    import time

    monkeypatch.delenv(launch.JOB_START_ENV, raising=False)
    before = time.time()
    launch.launch_local(2, _report_job_start, str(tmp_path))
    seen = {(tmp_path / f"start{r}").read_text() for r in range(2)}
    assert len(seen) == 1 and before <= float(seen.pop()) <= time.time()
    monkeypatch.setenv(launch.JOB_START_ENV, "1234.5")
    launch.launch_local(2, _report_job_start, str(tmp_path))
    assert {(tmp_path / f"start{r}").read_text() for r in range(2)} == {"1234.5"}


# ---- Ctrl-C -------------------------------------------------------------------------------------
STEPS = 8


@pytest.fixture(scope="module")
def sigint_job(tmp_path_factory):
    """The config of the Ctrl-C tests and the final checkpoint and run directory of its
    uninterrupted run (--nproc 2)."""
    root = tmp_path_factory.mktemp("sigint")
    dataset = write_synthetic_dataset(root / "data" / "synth_text_document")
    cfg = root / "sigint.yaml"
    # As tests/system/test_restart.py's: the lr changes every step, so a resume at the wrong place in
    # the schedule would show; dp=2 with ZeRO-1 shards the optimizer state over the workers.
    cfg.write_text(
        f"model: {{preset: tiny, vocab_size: 256}}\n"
        f"data: {{paths: ['{dataset}'], seq_length: 32, split: '90,10,0'}}\n"
        f"optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_samples: 16, decay_samples: {STEPS * 8}}}\n"
        f"train: {{micro_batch_size: 4, global_batch_size: 8, train_iters: {STEPS},"
        f" precision: fp32, log_interval: 1, device: cpu, eval_iters: 1}}\n"
        f"parallel: {{zero_stage: 1, timeout_minutes: 0.5}}\n"
        f"checkpoint: {{keep_last: 3, resume: auto}}\n")
    rc, out = _job(cfg, root / "ref")
    assert rc == 0, out[-6000:]
    return cfg, ckpt.resolve(root / "ref" / "ck"), root / "ref" / "run"


def _job(cfg, where, *extra, env=None, until=None) -> tuple[int, str]:
    """`bloomtrain train --nproc 2` of `cfg` into `where`, in a session of its own; `until(job)`
    drives it while it runs. Its exit code and output, once every process of it is gone."""
    job = Job(["train", "--config", str(cfg), "--nproc", "2", f"checkpoint.dir={where / 'ck'}",
               f"run_dir={where / 'run'}", *extra], env=env)
    try:
        if until is not None:
            until(job)
        # A job that does not end (a second Ctrl-C that did not end the workers sleeping in
        # their save) fails here, well before that sleep would have ended.
        rc = job.wait(300)
        assert group_left_after(job.pgid) == [], job.output()[-6000:]
    finally:
        job.kill()
        where.mkdir(parents=True, exist_ok=True)
        (where / "job.log").write_text(job.output())
    return rc, job.output()


def _when(job, text: str, timeout: float = 240) -> None:
    """Wait for the first line holding `text`."""
    deadline = time.monotonic() + timeout
    while job.first(text) is None:
        assert job.proc.poll() is None and time.monotonic() < deadline, \
            f"no line with {text!r}:\n{job.output()[-6000:]}"
        time.sleep(0.05)


def _ctrl_c(job, delivery: str) -> None:
    if delivery == "terminal":  # Ctrl-C: the terminal signals the whole foreground group
        os.killpg(job.pgid, signal.SIGINT)
    else:  # `kill -INT` of the launcher only
        job.proc.send_signal(signal.SIGINT)


def _resume_and_compare(sigint_job, where, resumed_at: int) -> None:
    """Resume `where` (checkpoint.resume=auto) to the end: bitwise what the uninterrupted run
    ended with."""
    cfg, ref_final, ref_run = sigint_job
    rc, out = _job(cfg, where)
    assert rc == 0, out[-6000:]
    assert re.search(rf"\[checkpoint\] resumed from \S+ at step {resumed_at},", out), out[-6000:]
    got_final = ckpt.resolve(where / "ck")
    assert got_final.name == ref_final.name == ckpt.step_dir_name(STEPS)
    problems, n_tensors = compare(ref_final, got_final, ref_run, where / "run")
    assert not problems and n_tensors > 0, problems


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["terminal", "kill"])
def test_ctrl_c_saves_the_step_it_was_in_and_resumes_bitwise(sigint_job, tmp_path, delivery):
    cfg = sigint_job[0]

    def interrupt(job):
        _when(job, f"{faults.SLEEP_ENV}: rank 0 sleeps")
        _ctrl_c(job, delivery)  # inside step 3, where rank 0 sleeps

    rc, out = _job(cfg, tmp_path, env=faults.env(sleep="0:3:5"), until=interrupt)
    assert rc == 130, out[-6000:]
    assert not NOISE.search(out), out
    assert ("bloomtrain: SIGINT: the workers stop at the end of this step and save a checkpoint; "
            "Ctrl-C again quits at once without saving") in out
    step = 3  # the step it was in, the last it logged
    assert re.findall(r"^step\s+(\d+) \|", out, re.M)[-1] == "3", out
    assert f"[train] stopping at step {step}: SIGINT; saving" in out, out
    path = tmp_path / "ck" / ckpt.step_dir_name(step)
    assert [p for _, p in ckpt.list_checkpoints(tmp_path / "ck")] == [path]
    assert ckpt.find_latest_valid(tmp_path / "ck") == ckpt.resolve(tmp_path / "ck") == path
    assert out.strip().splitlines()[-1] == (f"bloomtrain: SIGINT: stopped at the end of step "
                                            f"{step} and saved {path}; exit code 130")
    _resume_and_compare(sigint_job, tmp_path, step)


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_workers_at_once_without_a_partial_checkpoint(sigint_job,
                                                                             tmp_path):
    cfg = sigint_job[0]

    def interrupt_twice(job):
        _when(job, f"{faults.SLEEP_ENV}: rank 0 sleeps")
        _ctrl_c(job, "terminal")  # inside step 3, where rank 0 sleeps: it stops there
        _when(job, f"{faults.SAVE_SLEEP_ENV}: rank 0 sleeps")  # inside the save of step 3
        _ctrl_c(job, "terminal")

    # Step 2 is saved (every 2 steps); rank 0's save of step 3 would take 600 s.
    rc, out = _job(cfg, tmp_path, "checkpoint.save_interval=2",
                   env=faults.env(sleep="0:3:5", save_sleep="0:3:600"), until=interrupt_twice)
    assert rc == 130, out[-6000:]
    assert not NOISE.search(out), out
    assert "[train] stopping at step 3: SIGINT; saving" in out, out[-6000:]
    ck = tmp_path / "ck"
    two = ck / ckpt.step_dir_name(2)
    assert out.strip().splitlines()[-1] == (
        f"bloomtrain: SIGINT again: this node's 2 worker(s) ended at once (SIGKILL), without "
        f"saving; the newest checkpoint is {two}; exit code 130")
    # The save was cut short: its files are in its temporary directory, which nothing takes up.
    assert (ck / ".step_00000003.tmp").is_dir()
    assert [p for _, p in ckpt.list_checkpoints(ck)] == [two]
    assert ckpt.find_latest_valid(ck) == ckpt.resolve(ck) == two
    _resume_and_compare(sigint_job, tmp_path, 2)
    assert not list(ck.glob(".step_*")), sorted(p.name for p in ck.iterdir())  # cleaned up


@pytest.mark.slow
def test_workers_of_a_killed_launcher_save_and_end(tmp_path):
    """SIGKILL to the --nproc launcher (the OOM killer, a hard scancel of the step): torch's
    death signal stops the workers, which save, but each then waited forever in torch's
    wrapper for the launcher to collect its result, an orphan holding its memory."""
    with open(tmp_path / "out.txt", "w") as out:
        proc = _train(tmp_path, *_long_run(tmp_path), stdout=out, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    text = _kill_launcher_once(tmp_path, proc, lambda: metrics.exists() and
                               metrics.read_text().strip(), 120)
    assert ckpt.find_latest_valid(tmp_path / "ck", log=lambda *_: None) is not None, text


def test_workers_of_a_launcher_killed_during_their_start_end(tmp_path):
    """The same kill while the workers still start (loading the model, the data, a checkpoint:
    minutes at scale): they ignored SIGINT until the training loop's handler was up, so the
    death signal was lost and the orphans trained the whole run."""
    from tests import faults

    with open(tmp_path / "out.txt", "w") as out:
        proc = _train(tmp_path, *_long_run(tmp_path), stdout=out, start_new_session=True,
                      env=faults.env(build_sleep=60))
    try:
        _kill_launcher_in_start(tmp_path, proc)
    finally:  # a failed test leaves no orphans training 100000 steps
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _kill_launcher_once(tmp_path, proc, ready, gone_within: float) -> str:
    """SIGKILL the launcher once `ready()`; its workers must be gone `gone_within` s later.
    Returns the job's output."""
    deadline = time.monotonic() + 120
    while not ready():
        assert time.monotonic() < deadline and proc.poll() is None, \
            (tmp_path / "out.txt").read_text()
        time.sleep(0.2)
    workers = [pid for pid in group_members(proc.pid) if pid != proc.pid]
    assert workers
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + gone_within
    while (left := [pid for pid in workers if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    text = (tmp_path / "out.txt").read_text()
    assert left == [], text
    return text


def _kill_launcher_in_start(tmp_path, proc) -> None:
    from tests import faults

    # Both workers in their start; gone well inside the 60 s it sleeps.
    text = _kill_launcher_once(tmp_path, proc, lambda: (tmp_path / "out.txt").read_text().count(
        faults.BUILD_SLEEP_ENV) >= 2, 30)
    assert "this worker stops before training" in text
    assert not (tmp_path / "ck").exists() or not ckpt.list_checkpoints(tmp_path / "ck")


def _config_rank(rank, world, tp_on_rank_1):
    from bloomtrain.config import Config
    from bloomtrain.errors import UserError
    from bloomtrain.train.launch import same_config_everywhere

    over = ["train.train_iters=4"] + ([f"parallel.tp={tp_on_rank_1}"] if rank == 1 else [])
    try:
        same_config_everywhere(Config.load(None, over))
    except UserError as e:
        return str(e)
    return None


def test_ranks_given_different_configs_are_refused_in_one_line():
    """A rank with another config (an override given to one task, a file edited between node
    starts) issued other collectives than its peers: both waited out parallel.timeout_minutes
    and ended with torch's tracebacks. One gather of the configs at the join says it."""
    from tests.dist import run_ranks

    assert run_ranks(2, _config_rank, 1) == [None, None]  # the same config: nothing said
    said = run_ranks(2, _config_rank, 2)
    assert said[0] == ("the job's ranks were given different configs: rank(s) [1] differ from "
                       "rank 0; start every rank with the same config and overrides")
    assert said[1] == ("the job's ranks were given different configs: rank(s) [1] differ from "
                       "rank 0 (this rank in parallel.tp); start every rank with the same "
                       "config and overrides")


def test_a_rank_that_never_joins_is_one_line(monkeypatch):
    """A rank waiting for one that never starts ended, after the timeout, in torch's
    DistStoreError traceback; it is a UserError naming the rank, the job and the address."""
    import socket

    import torch

    from bloomtrain.config import Config
    from bloomtrain.errors import UserError
    from bloomtrain.train.launch import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(key, value)
    cfg = Config.load(None, ["train.train_iters=1", "parallel.timeout_minutes=0.03"])
    with pytest.raises(UserError, match=rf"rank 0 of 2 could not join the job at "
                                        rf"127.0.0.1:{port} within parallel.timeout_minutes "
                                        rf"\(0.03\): .*every rank must start"):
        init_distributed(cfg, torch.device("cpu"))


def test_sigusr1_while_a_run_starts_ends_it_in_a_line(tmp_path):
    """SIGUSR1 (`scancel --signal=USR1`, save and stop) before the training loop took it: its
    default action killed the process without a word (exit -10); SIGTERM got one line."""
    from tests import faults

    dataset = write_synthetic_dataset(tmp_path / "data" / "synth_text_document")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **faults.env(build_sleep=60))
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bloomtrain", "train", "model.preset=tiny",
             "model.vocab_size=256", f"data.paths=[{dataset}]", "train.micro_batch_size=2",
             "train.global_batch_size=4", "train.precision=fp32", "train.device=cpu",
             f"run_dir={tmp_path / 'run'}", *_long_run(tmp_path)],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while faults.BUILD_SLEEP_ENV not in (tmp_path / "out.txt").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "out.txt").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=30) == 128 + signal.SIGUSR1
        text = (tmp_path / "out.txt").read_text()
        assert text.strip().splitlines()[-1] == "terminated (SIGUSR1)", text
        assert "Traceback" not in text
    finally:
        proc.kill()
