"""The local launcher's output (bloomtrain.runtime.launch_local): torch's elastic agent logs a
warning per worker it signals ("W... Closing process 4242 via signal SIGTERM"); bloomtrain
leaves those out and says in its last line what happened."""
from __future__ import annotations

import inspect
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from bloomtrain.runtime import _AgentNoise
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


def _train(tmp_path, *overrides):
    dataset = write_synthetic_dataset(tmp_path / "data" / "synth_text_document")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "bloomtrain", "train", "--nproc", "2", "model.preset=tiny",
         "model.vocab_size=256", f"data.paths=[{dataset}]", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.precision=fp32", "train.log_interval=1",
         "train.device=cpu", f"run_dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_signalled_launcher_ends_in_one_line(tmp_path):
    proc = _train(tmp_path, "train.train_iters=100000", "optim.decay_samples=10000000",
                  f"checkpoint.dir={tmp_path / 'ck'}")
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step"):
            break
    else:
        raise AssertionError("training ended early:\n" + "".join(seen))
    proc.send_signal(signal.SIGTERM)  # the launcher, as a terminal's kill or a scheduler does
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=180) == 128 + signal.SIGTERM, out
    assert not NOISE.search(out), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"bloomtrain: SIGTERM: torch's elastic agent passed it to this node's 2 "
                        r"worker\(s\) and ended them( \(2 still running 30 s later, with "
                        r"SIGKILL\))?; a training worker saves a checkpoint at the end of its "
                        r"step first \(the \[checkpoint\] lines above\); exit code 143", last), last
    assert "[checkpoint] saved" in out


@pytest.mark.slow
def test_a_failed_worker_ends_in_its_own_line(tmp_path):
    # rank 0 cannot create its run directory; rank 1, waiting in a collective, is stopped.
    (tmp_path / "a_file").write_text("")
    proc = _train(tmp_path, "train.train_iters=4", f"run_dir={tmp_path / 'a_file' / 'run'}")
    out = proc.stdout.read()
    assert proc.wait(timeout=180) == 2, out
    assert not re.search(r"Closing process|Terminating process|closing signal", out), out
    assert out.strip().splitlines()[-1].startswith(
        "bloomtrain train: error: rank 0 (local rank 0, pid "), out
