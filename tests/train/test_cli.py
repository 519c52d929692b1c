"""`bloomtrain train`'s launch decision (bloomtrain.train.cli.launch_spec)."""
import argparse

import pytest

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.train.cli import launch_spec

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID")


def _args(**over):
    base = dict(nproc=None, nnodes=1, node_rank=0, rdzv_endpoint=None, rdzv_timeout=None,
                max_restarts=0, local_addr=None)
    return argparse.Namespace(**{**base, **over})


@pytest.fixture
def cfg():
    return Config.load(None, ["train.train_iters=10"])


def test_a_task_of_srun_or_torchrun_launches_nothing_of_its_own(cfg, monkeypatch):
    """Under a plain `srun -n 16` (no WORLD_SIZE until env_from_slurm) each task made a launch
    of its own: 16 independent jobs writing one run directory; `--nproc 8` started 8 workers
    per task. Under torchrun, --nproc was ignored without a word."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    # The batch script of a 16-task allocation (no step id) may run bloomtrain's launcher.
    assert launch_spec(_args(nproc=2), cfg).nproc == 2
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task srun started
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launch_spec(_args(), cfg) is None  # a worker of srun's job
    for given, flag in (({"max_restarts": 1}, "--max-restarts"), ({"nproc": 8}, "--nproc")):
        with pytest.raises(UserError, match=f"{flag} are bloomtrain's launcher options.*"
                                            f"srun started 16 tasks"):
            launch_spec(_args(**given), cfg)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # an allocation's single task runs the launcher
    assert launch_spec(_args(nproc=2), cfg).nproc == 2
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="--nproc are .*WORLD_SIZE is set"):
        launch_spec(_args(nproc=4), cfg)


def test_a_worker_of_nodes_with_different_nproc_says_so(cfg, monkeypatch):
    """Two nodes launched with --nproc 2 and --nproc 1 make a job of 3 workers, which the
    launcher validated as 4 (--nproc x --nnodes): node 0 failed with the planner's "--gpus (3)
    is not a whole number of nodes", node 1 with a C++ traceback."""
    from bloomtrain.train.cli import worker_entry
    from bloomtrain.validate import validate

    run = validate(cfg, 4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match=r"the job has 3 workers, but this node's launcher was "
                                        r"started for 4 \(--nproc x --nnodes\): give every node "
                                        r"the same --nproc"):
        worker_entry(None, [], run)
