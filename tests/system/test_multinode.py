"""Two nodes on one machine: two `bloomtrain train --nnodes 2 --node-rank {0,1} --nproc 2
--rdzv-endpoint 127.0.0.1:PORT` processes (torch's c10d rendezvous, node 0 hosting its store)
train tp2·dp2 together and match one process; a node that never arrives makes the other fail
after --rdzv-timeout with a message that says how many nodes came and what to check; and the
launcher's options are checked before anything starts. The README's "Multi-node" section shows
these commands."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bloomtrain.cli import main as cli_main
from bloomtrain.config import Config
from bloomtrain.train import train
from tests.chaos import Job, group_left_after
from tests.dist import free_port
from tests.synthetic import tiny_job_yaml

# fp32, dropout 0: tp2·dp2 differs from one process only in the summation order of the
# all-reduced partial matmuls and gradients (~1e-7 relative per step); over 6 AdamW steps the
# loss stays within 1e-5 relative, as in tests/system/test_train_parallel.py.
LOSS_RTOL = 1e-5
RDZV_TIMEOUT = 5  # seconds; the launcher's own start-up comes on top


def _config(tmp_path, dataset):
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(tiny_job_yaml(dataset, tmp_path / "one"))
    return cfg


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]


def _node(cfg, rank: int, endpoint: str, *extra: str) -> Job:
    return Job(["train", "--config", str(cfg), "--nnodes", "2", "--node-rank", str(rank),
                "--nproc", "2", "--rdzv-endpoint", endpoint, *extra])


def _finish(jobs: list[Job], timeout: float) -> list[int]:
    try:
        codes = [job.wait(timeout) for job in jobs]
        for job in jobs:
            assert group_left_after(job.pgid) == []
        return codes
    finally:
        for job in jobs:
            job.kill()


def test_two_nodes_on_one_machine_match_one_process(dataset, tmp_path):
    cfg = _config(tmp_path, dataset)
    train(Config.load(str(cfg), []), log=lambda *a: None)  # the reference: one process, here
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [_node(cfg, rank, endpoint, "parallel.tp=2", f"run_dir={tmp_path / 'two'}")
             for rank in (0, 1)]
    codes = _finish(nodes, 900)
    assert codes == [0, 0], "\n\n".join(job.output()[-4000:] for job in nodes)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 6
    np.testing.assert_allclose(two, one, rtol=LOSS_RTOL)
    first = json.loads(open(tmp_path / "two" / "metrics.jsonl").readline())
    assert "tp=2 pp=1 dp=2" in first["layout"]


def test_a_node_that_never_arrives_fails_the_other_with_a_clear_message(dataset, tmp_path):
    cfg = _config(tmp_path, dataset)
    # Node 0 alone: it hosts the store and waits for node 1. Node 1 alone (another job): it
    # waits for node 0's store. Both at once, to pay for the start-up once.
    host_port, orphan_port = free_port(), free_port()
    alone = _node(cfg, 0, f"127.0.0.1:{host_port}", "--rdzv-timeout", str(RDZV_TIMEOUT),
                  "parallel.tp=2")
    orphan = _node(cfg, 1, f"127.0.0.1:{orphan_port}", "--rdzv-timeout", str(RDZV_TIMEOUT),
                   "parallel.tp=2")
    codes = _finish([alone, orphan], 600)
    assert codes == [2, 2], alone.output()[-4000:] + orphan.output()[-4000:]
    assert alone.last_line() == (
        f"bloomtrain train: error: the rendezvous at 127.0.0.1:{host_port} timed out after "
        f"{RDZV_TIMEOUT} s: 1 of 2 nodes arrived; node(s) [1] never did. Start `bloomtrain "
        f"train` on every node with --nnodes 2, --rdzv-endpoint 127.0.0.1:{host_port} and its "
        f"own --node-rank (0 to 1); check that each node can reach 127.0.0.1:{host_port} "
        f"(hostname, firewall) and runs the same --nproc, and raise --rdzv-timeout if nodes "
        f"start far apart"), alone.output()[-4000:]
    last = orphan.last_line()
    assert last.startswith(f"bloomtrain train: error: node 1 could not reach the rendezvous "
                           f"store of node 0 at 127.0.0.1:{orphan_port} within {RDZV_TIMEOUT} "
                           f"s ("), orphan.output()[-4000:]
    assert "runs `bloomtrain train` with --node-rank 0 on the host 127.0.0.1" in last


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
     "--node-rank 2 is outside 0..1 (--nnodes 2)"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h"],
     "--rdzv-endpoint 'h': give HOST:PORT"),
    (["--nproc", "0"], "--nproc 0: give the number of workers"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout 0: give the seconds"),
    (["--max-restarts", "1", "checkpoint.resume=none", "checkpoint.dir=ck"],
     "set checkpoint.dir and checkpoint.resume=auto"),
    (["--max-restarts", "1"], "with no checkpoint.dir"),
    (["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "parallel.tp=3"],
     "parallel.tp"),  # the layout is checked against both nodes' workers
    (["--nnodes", "2", "--rdzv-endpoint", "no-such-node.invalid:1"],
     "--rdzv-endpoint no-such-node.invalid:1: cannot resolve 'no-such-node.invalid' on this "
     "node"),
    (["--local-addr", "10.0.0.1"], "--local-addr 10.0.0.1 is the address the other nodes reach "
                                   "this one at; it needs --nnodes > 1"),
    (["--nnodes", "2", "--max-restarts", "1", "--rdzv-endpoint", "127.0.0.1:1",
      "--rdzv-timeout", "60", "checkpoint.dir=ck"],
     "the rendezvous timeout (60 s, parallel.rdzv_timeout_minutes or --rdzv-timeout) must "
     "exceed the hang timeout (540 s"),
])
def test_launcher_options_are_checked_before_anything_starts(dataset, tmp_path, capsys,
                                                             monkeypatch, args, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _config(tmp_path, dataset)
    assert cli_main(["train", "--config", str(cfg), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bloomtrain train: error: ") and message in err, err


def test_launcher_options_under_torchrun_are_refused(dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _config(tmp_path, dataset)
    assert cli_main(["train", "--config", str(cfg), "--nnodes", "2", "--max-restarts", "3"]) == 2
    err = capsys.readouterr().err
    assert "--nnodes --max-restarts are bloomtrain's launcher options" in err, err
    assert "give them to torchrun" in err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_waiting_for_the_other_nodes_ends_the_wait(dataset, tmp_path, sig):
    # No worker runs yet: the first Ctrl-C only asked workers that did not exist to save, and
    # the launcher waited out --rdzv-timeout, then failed with a timeout (exit 2).
    import signal
    import socket
    import time

    cfg = _config(tmp_path, dataset)
    port = free_port()
    alone = _node(cfg, 0, f"127.0.0.1:{port}", "--rdzv-timeout", "300", "parallel.tp=2")
    try:
        deadline = time.monotonic() + 120
        while True:  # node 0's store is up: its launcher waits in the rendezvous
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and alone.proc.poll() is None, alone.output()
            time.sleep(0.2)
        time.sleep(1)
        alone.proc.send_signal(getattr(signal, sig))
        code = alone.wait(timeout=time.monotonic() - alone.started + 30)
        assert code == 128 + getattr(signal, sig), alone.output()[-4000:]
        assert alone.last_line() == (
            f"bloomtrain: {sig} while no worker of this node ran (waiting for the other nodes "
            f"to join): nothing trained, nothing to save; exit code {code}")
        assert group_left_after(alone.pgid) == []
    finally:
        alone.kill()
