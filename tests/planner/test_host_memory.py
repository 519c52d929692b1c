"""ZeRO-Offload's host memory, planned and checked (bloomtrain/planner/host.py): `bloomtrain plan`
prints the host bytes of a node and refuses offload layouts that do not fit it; what it prints is
what a real CPU run allocates; `bloomtrain train` refuses, in one line and before anything is
allocated, a run whose offloaded states the host cannot hold (a small host simulated with
BLOOMTRAIN_HOST_MEMORY), and a pinned part over the locked-memory limit."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.layout import ParallelLayout
from bloomtrain.model.presets import resolve_model_config
from bloomtrain.planner import host as host_mod
from bloomtrain.planner.hardware import PROCESS_HOST_BYTES
from bloomtrain.planner.host import (HOST_MEMORY_ENV, available_host_memory, cgroup_memory_left,
                                     check_host, node_host, node_ranks, parse_bytes)
from tests.dist import spawn_ranks

MIB, GIB = 2 ** 20, 2 ** 30
# A model whose states dwarf what a process allocates besides them (~20 MB: the data's indices,
# gloo, Python objects), so that 5% of them is a real bound: 39.9M parameters, 479 MB per rank.
MODEL = {"preset": None, "hidden_size": 640, "num_layers": 8, "num_heads": 8, "vocab_size": 256}


def _config(dataset, tmp, model=None, **parallel) -> dict:
    return {"model": model or {"preset": "tiny", "vocab_size": 256},
            "parallel": {"offload_optimizer": True, **parallel},
            "data": {"paths": [dataset], "seq_length": 32, "split": "90,10,0"},
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2,
                      "precision": "bf16", "device": "cpu", "log_interval": 1},
            "run_dir": str(tmp / "run")}


def _write(tmp, d) -> str:
    path = tmp / "cfg.json"  # JSON is YAML
    path.write_text(json.dumps(d))
    return str(path)


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "bloomtrain", *args], capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# ---- the plan against a real run ---------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def _allocating_rank(rank, world, cfg):
    from bloomtrain.train import Trainer
    before = _rss()
    trainer = Trainer(Config.from_dict(cfg), log=lambda *a: None)
    after = _rss()
    return {"allocated": after - trainer.host_resident, "before": before,
            "at_check": trainer.host_resident, "after": after,
            "engine": trainer.engine.memory_report()["measured"], "checked": trainer.host.total}


def test_plan_prints_the_host_bytes_a_real_cpu_run_allocates(dataset, tmp_path, monkeypatch):
    """Two CPU processes (one node) of a 40M-parameter model under ZeRO-1 with offload: each
    holds its compute copy and gradients (the CPU device is host memory), half the masters and
    moments, and the staging ring. What `bloomtrain plan` prints for that node, less the process
    overhead it plans (what a process holds before it allocates, not an allocation), is within 5%
    of the resident memory the two processes gained from the Trainer's host check, before it
    allocates, to the end of its build (measured in fresh processes, RSS).

    glibc's mmap threshold is fixed for them: by default it rises to the largest block freed
    (materializing frees a parameter-sized temporary per piece), and the heap then keeps ~30 MB
    of freed blocks resident, which is the allocator's slack, not an allocation (the planned
    process overhead covers it in a real run)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # read at process start
    cfg = _config(dataset, tmp_path, MODEL, zero_stage=1)
    out = _cli("plan", "--config", _write(tmp_path, cfg), "--gpu", "cpu", "--gpus", "2",
               "--gpus-per-node", "2", "--layout", "dp=2 zero=1 mbs=2 offload", "--json")
    assert out.returncode == 0, out.stderr
    host = json.loads(out.stdout)["host_per_node"]
    printed = _cli("plan", "--config", _write(tmp_path, cfg), "--gpu", "cpu", "--gpus", "2",
                   "--gpus-per-node", "2", "--layout", "dp=2 zero=1 mbs=2 offload").stdout
    assert f"({host['total']:,.0f} bytes, the node that needs the most)" in printed
    for item in ("optimizer_states", "staging_ring", "device_model_states", "process_overhead"):
        assert item in printed

    ranks = spawn_ranks(2, _allocating_rank, cfg)
    allocated = sum(r["allocated"] for r in ranks)
    planned = host["total"] - host["process_overhead"]
    assert host["process_overhead"] == 2 * PROCESS_HOST_BYTES["cpu"]
    assert planned > 900e6  # the states dominate: 5% of them is more than the noise
    assert allocated == pytest.approx(planned, rel=0.05), (allocated, host, ranks)
    # The train check saw the same node: the same items, the process overhead past what each
    # process held already.
    for r in ranks:
        assert r["checked"] == host["total"]


def test_plan_refuses_offload_layouts_that_do_not_fit_the_host(tmp_path):
    """bloom-7b1 offloaded on one H200 (ZeRO-1): 79 GiB of states fit a 125.8 GiB host (the
    issue's machine), not a 64 GiB one; a search with only offload layouts then finds none and
    says so."""
    args = ["plan", "--model", "bloom-7b1", "--gpus", "1", "--gpu", "h200", "--global-batch",
            "8", "--seq", "2048"]
    layout = ["--layout", "zero=1 mbs=1 recompute=full offload"]
    fits = _cli(*args, *layout, "--host-memory-gib", "125.8")
    small = _cli(*args, *layout, "--host-memory-gib", "64")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "host memory per node (offload), GiB: 82.0" in fits.stdout  # 79 + ring + process
    assert small.returncode == 1
    assert "fits: NO: out of host memory: offload needs 82.0 GiB per node of 57.6 GiB" \
        in small.stdout
    none = _cli(*args, "--only", "offload", "--host-memory-gib", "64")
    assert none.returncode == 2 and "out of host memory" in none.stderr, none.stderr


def test_a_node_sums_its_own_ranks():
    """pp=2 over two nodes of 2 ranks (tp=1, dp=2): each node holds one stage's two dp ranks,
    3 blocks on the first, 1 on the last; the node figure is the sum of its ranks'."""
    cfg = Config.from_dict({"model": {"preset": "tiny", "vocab_size": 256},
                            "parallel": {"pp": 2, "pp_partition": "3,1", "zero_stage": 1,
                                         "offload_optimizer": True},
                            "train": {"train_iters": 1, "global_batch_size": 4}})
    shape = resolve_model_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.parallel, 4)
    nodes = [node_host(shape, layout, r, "bf16", 25.0, False, "cuda") for r in ([0, 1], [2, 3])]
    one = [node_host(shape, layout, [r], "bf16", 25.0, False, "cuda") for r in range(4)]
    for node, (a, b) in zip(nodes, ([0, 1], [2, 3])):
        assert node.total == one[a].total + one[b].total
    assert nodes[0].total > nodes[1].total


# ---- the check before a run ---------------------------------------------------------------------

def test_train_refuses_a_small_host_before_allocating_anything(dataset, tmp_path, monkeypatch):
    """BLOOMTRAIN_HOST_MEMORY says the host has 2 MiB: the Trainer raises one line naming the
    bytes needed and available and what to change, before any process group or buffer exists
    (the engine's buffers would raise if built)."""
    import torch.distributed as dist

    from bloomtrain.parallel.zero import buffers
    from bloomtrain.train import Trainer

    def never(*a, **k):
        raise AssertionError("the flat buffers were allocated")
    monkeypatch.setattr(buffers.FlatBuffers, "__init__", never)
    monkeypatch.setenv(HOST_MEMORY_ENV, "2MiB")
    for stage in (0, 1):
        cfg = Config.from_dict(_config(dataset, tmp_path, zero_stage=stage))
        with pytest.raises(UserError) as e:
            Trainer(cfg, log=lambda *a: None)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith("ZeRO-Offload needs ") and " of host memory on this node " in msg
        needed = int(msg.split(" bytes) of host memory")[0].rsplit("(", 1)[1].replace(",", ""))
        assert needed > 2 * MIB
        assert f"more than the 2.00 MiB ({2 * MIB:,} bytes) available ({HOST_MEMORY_ENV})" \
            in msg
        # One process (dp 1): only more nodes help. ZeRO-1 shards nothing at dp 1, there are
        # no fewer processes than one, and on a CPU device offload moves nothing off the host.
        assert msg.endswith("; use more nodes (a larger dp gives each rank a smaller shard"
                            + (" at zero_stage >= 1)" if stage == 0 else ")")
                            + " (train.ignore_plan=true starts anyway)"), msg
        assert not dist.is_initialized()
    # The same run on a host that holds it gets past the check (to the buffers).
    monkeypatch.setenv(HOST_MEMORY_ENV, "64GiB")
    with pytest.raises(AssertionError, match="flat buffers were allocated"):
        Trainer(Config.from_dict(_config(dataset, tmp_path, zero_stage=1)), log=lambda *a: None)


# bloomtrain.cli.main in a fresh interpreter: its exit code, stderr, and whether torch was
# imported (the launcher imports it to start workers: no torch means no worker started).
MAIN_PROBE = (
    "import contextlib, io, json, sys\n"
    "from bloomtrain.cli import main\n"
    "err = io.StringIO()\n"
    "with contextlib.redirect_stderr(err):\n"
    "    code = main(sys.argv[1:])\n"
    "print(json.dumps({'code': code, 'stderr': err.getvalue(), 'torch': 'torch' in sys.modules}))\n")


def test_bloomtrain_train_refuses_in_one_line_before_any_worker(dataset, tmp_path):
    """Under --nproc 2 the launcher refuses before torch is imported (no worker started); alone
    the process refuses before it allocates. One line each, exit 2, no traceback."""
    cfg = _write(tmp_path, _config(dataset, tmp_path, zero_stage=1))
    env = {**os.environ, HOST_MEMORY_ENV: "1MiB", "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", MAIN_PROBE, "train", "--config", cfg,
                            "--nproc", "2"], capture_output=True, text=True, timeout=300, env=env)
    got = json.loads(probe.stdout.splitlines()[-1])
    assert got["code"] == 2 and not got["torch"], got
    assert got["stderr"].count("\n") == 1 and "Traceback" not in got["stderr"]
    assert got["stderr"].startswith("bloomtrain train: error: ZeRO-Offload needs ")
    assert "on this node (2 ranks: " in got["stderr"]
    alone = _cli("train", "--config", cfg, env={HOST_MEMORY_ENV: "1MiB"})
    assert alone.returncode == 2 and alone.stdout == ""
    assert alone.stderr.count("\n") == 1 and "(1 rank: " in alone.stderr, alone.stderr
    assert not (tmp_path / "run").exists()


def test_the_pinned_part_is_checked_against_the_locked_memory_limit(monkeypatch):
    """On CUDA the ring (and with offload_pin_memory the states) is page-locked: over the
    process's RLIMIT_MEMLOCK it is refused, naming ulimit -l; a CPU device pins nothing."""
    cfg = Config.from_dict({"model": {"preset": "tiny", "vocab_size": 256},
                            "parallel": {"zero_stage": 1, "offload_optimizer": True},
                            "train": {"train_iters": 1}})
    shape, layout = resolve_model_config(cfg.model), ParallelLayout.from_config(cfg.parallel, 1)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1TiB")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    pinned = node_host(shape, layout, [0], "bf16", 25.0, False, "cuda").pinned
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (pinned - 1, hard))
    try:
        with pytest.raises(UserError, match=r"over the locked-memory limit .* \(ulimit -l\)"):
            check_host(cfg, shape, layout, "cuda", [0])
        assert check_host(cfg, shape, layout, "cpu", [0]) is not None
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (pinned, hard))
        assert check_host(cfg, shape, layout, "cuda", [0]).pinned == pinned
        # Where the driver lets a process pin past the limit (tried just past it), the limit
        # does not hold and the run goes on.
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (pinned // 4, hard))
        tried = []
        monkeypatch.setattr(host_mod, "pins_past_the_limit", lambda n: tried.append(n) or True)
        assert check_host(cfg, shape, layout, "cuda", [0]).pinned == pinned
        assert tried == [min(pinned, pinned // 4 + host_mod.MEMLOCK_PROBE_EXTRA)]
        monkeypatch.setattr(host_mod, "pins_past_the_limit", lambda n: False)
        with pytest.raises(UserError, match=r"\(ulimit -l\)"):
            check_host(cfg, shape, layout, "cuda", [0])
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_the_host_size_comes_from_meminfo_or_the_variable(monkeypatch):
    monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    avail, source = available_host_memory()
    with open("/proc/meminfo") as f:
        meminfo = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    left = cgroup_memory_left()
    if left is not None and left < meminfo:  # a container's or a job's share of the node
        assert source == "the memory cgroup's limit" and abs(avail - left) < 256 * MIB
    else:
        assert source == "MemAvailable" and abs(avail - meminfo) < 256 * MIB
    monkeypatch.setenv(HOST_MEMORY_ENV, "1.5GiB")
    assert available_host_memory() == (int(1.5 * GIB), HOST_MEMORY_ENV)
    assert parse_bytes("123", "x") == 123 and parse_bytes("2 TiB", "x") == 2 << 40
    with pytest.raises(UserError, match="is not a size"):
        parse_bytes("lots", HOST_MEMORY_ENV)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_memory_cgroups_limit_is_what_is_left(tmp_path, version):
    """A SLURM job or a container gets a share of the node: its cgroup's limit less its usage,
    not the node's MemAvailable."""
    membership = tmp_path / "cgroup"
    if version == "v2":
        membership.write_text("0::/slurm/job_7/step_0\n")
        where, files = tmp_path / "slurm/job_7/step_0", ("memory.max", "memory.current")
    else:
        membership.write_text("12:cpuset:/x\n9:memory:/docker/abc\n")
        where = tmp_path / "memory/docker/abc"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    where.mkdir(parents=True)
    (where / files[0]).write_text(f"{8 * GIB}\n")
    (where / files[1]).write_text(f"{3 * GIB}\n")
    assert cgroup_memory_left(str(tmp_path), str(membership)) == 5 * GIB
    # Unlimited, unreadable or absent: no figure (MemAvailable stands).
    (where / files[0]).write_text("max\n" if version == "v2" else f"{(1 << 63) - 4096}\n")
    assert cgroup_memory_left(str(tmp_path), str(membership)) is None
    (where / files[1]).unlink()
    assert cgroup_memory_left(str(tmp_path), str(membership)) is None
    assert cgroup_memory_left(str(tmp_path), str(tmp_path / "absent")) is None


def test_offload_pin_memory_needs_offload():
    cfg = Config.from_dict({"parallel": {"offload_pin_memory": True},
                            "train": {"train_iters": 1}})
    with pytest.raises(UserError, match="parallel.offload_pin_memory pins the offloaded "
                                        "optimizer states: it needs parallel.offload_optimizer"):
        cfg.check()
    cfg.parallel.offload_optimizer = True
    cfg.check()


def test_the_node_is_torchruns_or_slurms():
    assert node_ranks(16, {"RANK": "13", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}) \
        == range(8, 16)
    assert node_ranks(16, {"RANK": "5", "LOCAL_RANK": "1", "SLURM_TASKS_PER_NODE": "4(x4)"}) \
        == range(4, 8)
    assert node_ranks(4, {}) == range(0, 4)
    # Nodes of different sizes (srun -n 5 over 2 nodes: "2,3"; "4(x2),1"): each node its own.
    slurm = {"SLURM_TASKS_PER_NODE": "2,3", "SLURM_NODEID": "1"}
    assert node_ranks(5, {"RANK": "4", "LOCAL_RANK": "2", **slurm}) == range(2, 5)
    assert node_ranks(9, {"RANK": "8", "LOCAL_RANK": "0", "SLURM_TASKS_PER_NODE": "4(x2),1",
                          "SLURM_NODEID": "2"}) == range(8, 9)
    # The srun translation gives the same LOCAL_WORLD_SIZE, which node_ranks then reads.
    from bloomtrain.launch import env_from_slurm
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "2", "MASTER_ADDR": "a",
           "MASTER_PORT": "1", "SLURM_STEP_ID": "0", **slurm}
    env_from_slurm(env)
    assert env["LOCAL_WORLD_SIZE"] == "3" and node_ranks(5, env) == range(2, 5)


def test_the_line_offers_only_what_makes_the_node_need_less(monkeypatch):
    """Two CPU processes at dp 2, stage 0: ZeRO-1 and fewer processes both help. Pinned states
    on CUDA (rounded up to powers of two): unpinning them is offered first."""
    cfg = Config.from_dict({"model": {"preset": "tiny", "vocab_size": 256},
                            "parallel": {"zero_stage": 0, "offload_optimizer": True},
                            "train": {"train_iters": 1}})
    shape, layout = resolve_model_config(cfg.model), ParallelLayout.from_config(cfg.parallel, 2)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1MiB")
    with pytest.raises(UserError) as e:
        check_host(cfg, shape, layout, "cpu", [0, 1])
    assert "use parallel.zero_stage=1 (shards the states over dp), or more nodes" in str(e.value)
    assert str(e.value).endswith(", or fewer processes per node (train.ignore_plan=true starts "
                                 "anyway)")
    cfg.parallel.offload_pin_memory = True
    monkeypatch.setattr(host_mod, "memlock_limit", lambda: None)  # ulimit -l unlimited
    with pytest.raises(UserError) as e:
        check_host(cfg, shape, ParallelLayout.from_config(cfg.parallel, 1), "cuda", [0])
    assert "; use parallel.offload_pin_memory=false (pinned states are rounded up to powers " \
           "of two), or more nodes" in str(e.value)


def test_error_feedbacks_residual_counts_on_a_cpu_device():
    """parallel.grad_error_feedback keeps a residual as large as the rank's gradients (4 bytes
    per local parameter) on the device that reduces: on a CPU device that is host memory, which
    the node's figure must hold, as the engine allocates it (FlatBuffers, built on meta)."""
    from bloomtrain.topology import Topology
    from tests import helpers
    for ef in (False, True):
        par = {"zero_stage": 1, "offload_optimizer": True, "grad_reduce_dtype": "bf16",
               "grad_error_feedback": ef}
        cfg = helpers.config(None, parallel=par, precision="bf16")
        layout = ParallelLayout.from_config(cfg.parallel, 2)
        shape = resolve_model_config(cfg.model)
        node = node_host(shape, layout, [0, 1], "bf16", cfg.parallel.bucket_size_mb, False,
                         "cpu", error_feedback=ef)
        allocated = 0
        for r in (0, 1):
            bufs = helpers.build(cfg, Topology.describe_rank(layout, r), device="meta").engine.bufs
            allocated += sum(bufs.nbytes().values()) + sum(bufs.host_nbytes().values())
        assert node.total - node.items["process_overhead"] == allocated, ef


def test_on_cuda_the_line_offers_the_device(monkeypatch):
    """A CUDA rank's host holds the states, the ring and its process (PROCESS_HOST_BYTES, not
    yet resident when the launcher checks): turning offload off puts the states on the GPU."""
    cfg = Config.from_dict({"model": {"preset": "tiny", "vocab_size": 256},
                            "parallel": {"zero_stage": 1, "offload_optimizer": True},
                            "train": {"train_iters": 1}})
    shape, layout = resolve_model_config(cfg.model), ParallelLayout.from_config(cfg.parallel, 1)
    monkeypatch.setenv(HOST_MEMORY_ENV, "1GiB")
    with pytest.raises(UserError) as e:
        check_host(cfg, shape, layout, "cuda", [0])
    msg = str(e.value)
    assert "(1 rank: optimizer states " in msg and "process overhead 3.00 GiB" in msg
    assert "device model states" not in msg
    assert "or parallel.offload_optimizer=false (the states on the device)" in msg
