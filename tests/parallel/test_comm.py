"""The NCCL-safety of the control plane, shown on CPU.

NCCL serves only CUDA tensors, so a collective on a CPU tensor over an NCCL group raises on a
cluster and never on a laptop. comm.py checks every tensor against what its group's backend
serves; here a gloo group is *declared* CUDA-only (comm.declare_devices), which is exactly what an
NCCL group is, and the two bugs the GPU-path issue found by reading (the stop flag all-reduced and
the save flag broadcast as CPU tensors) are shown to be caught, as is every other wrapper. The
process-group setup for CUDA (per-device backends, device_id, barriers naming the device) is
checked by recording the calls it makes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bloomtrain.config import CheckpointConfig, Config, TrainConfig, UserError
from bloomtrain.parallel import comm
from bloomtrain.train import launch
from bloomtrain.train.control import RunControl
from tests.dist import run_ranks


def _expect_device_error(fn, *words) -> str:
    with pytest.raises(comm.CommDeviceError) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def _declared_cuda_world(rank, world):
    world_group = comm.world_group()
    comm.declare_devices(world_group, {"cuda"})  # as an NCCL group would serve
    cpu = torch.device("cpu")
    messages = {}
    # Bug 1: the per-step stop decision all-reduced as a CPU int32 tensor.
    control = RunControl(TrainConfig(train_iters=1), CheckpointConfig(), cpu)
    messages["stop"] = _expect_device_error(control.should_stop, "all_reduce", "'control'",
                                            "cpu")
    # Bug 2: the time-based save decision broadcast from rank 0 as a CPU tensor.
    control = RunControl(TrainConfig(train_iters=1),
                         CheckpointConfig(dir="x", save_interval_minutes=1.0), cpu)
    messages["save"] = _expect_device_error(lambda: control.time_to_save(1), "broadcast",
                                            "'control'", "cpu")
    # Every other wrapper checks too (nothing is sent: the check comes first).
    t = torch.zeros(4)
    peer = 1 - rank
    for op, call in [
        ("all_gather", lambda: comm.all_gather_into_tensor(torch.zeros(8), t, world_group, "dp")),
        ("reduce_scatter", lambda: comm.reduce_scatter_tensor(torch.zeros(2), t, world_group,
                                                              "dp")),
        ("send", lambda: comm.isend(t, peer, "pp")),
        ("recv", lambda: comm.irecv(t, peer, "pp")),
        ("batch_isend_irecv", lambda: comm.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, peer)], "pp")),
    ]:
        _expect_device_error(call, op)
    # Declared CPU again (what gloo serves), the same controls work and agree across ranks.
    comm.declare_devices(world_group, None)
    assert comm.group_devices(world_group) == frozenset({"cpu"})
    control = RunControl(TrainConfig(train_iters=1), CheckpointConfig(), cpu)
    control.signal = 15 if rank == 1 else None  # one rank was signalled: both stop
    messages["agreed"] = control.should_stop()
    return messages


def test_cpu_control_tensors_on_a_cuda_only_group_are_caught():
    out = run_ranks(2, _declared_cuda_world)
    for m in out:
        assert m["agreed"] == "signal"
    assert "move the tensor to the training device" in out[0]["stop"]


@pytest.mark.parametrize("backend,served", [
    ("nccl", {"cuda"}), ("gloo", {"cpu"}), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("cpu:gloo", {"cpu"})])
def test_what_each_backend_serves(backend, served):
    assert comm.backend_devices(backend) == served


def test_cuda_jobs_get_per_device_backends_bound_to_their_device(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cuda = torch.device("cuda", 1)
    launch.init_distributed(Config(), cuda)
    (args, kw), = calls
    assert args == ("cpu:gloo,cuda:nccl",) and kw["device_id"] == cuda
    # CPU control tensors are legal on every group of such a job; CUDA ones too.
    assert comm.backend_devices(args[0]) == {"cpu", "cuda"}
    assert launch.process_group_backend("auto", torch.device("cpu")) == "gloo"
    assert launch.process_group_backend("nccl", cuda) == "cpu:gloo,cuda:nccl"
    with pytest.raises(UserError, match="parallel.backend=auto"):
        launch.process_group_backend("gloo", cuda)
    with pytest.raises(UserError, match="needs CUDA"):
        launch.process_group_backend("nccl", torch.device("cpu"))
    # One process builds no group: the setting is still refused, not ignored.
    monkeypatch.setenv("WORLD_SIZE", "1")
    calls.clear()
    with pytest.raises(UserError, match="needs CUDA"):
        launch.init_distributed(Config.from_dict({"parallel": {"backend": "nccl"}}),
                                torch.device("cpu"))
    launch.init_distributed(Config(), torch.device("cpu"))
    assert not calls


def test_barriers_on_cuda_groups_name_the_device(monkeypatch):
    """NCCL guesses a barrier's device from the rank unless told; with ranks and devices numbered
    differently (a node's second job, CUDA_VISIBLE_DEVICES) the guess hangs."""
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    nccl_group, gloo_group = object(), object()
    comm.declare_devices(nccl_group, {"cuda"})
    comm.declare_devices(gloo_group, {"cpu"})
    try:
        comm.barrier(nccl_group, "test")
        comm.barrier(gloo_group, "test")
        comm.barrier(None, "test")  # a group of one: nothing to wait for
    finally:
        comm.declare_devices(nccl_group, None)
        comm.declare_devices(gloo_group, None)
    assert calls == [{"group": nccl_group, "device_ids": [3]}, {"group": gloo_group}]


def _coalesced(rank, world):
    """all_reduce_coalesced with a small threshold: two large tensors (one a strided view, which
    must go through the concatenation) among small ones."""
    group = comm.world_group()
    big = torch.full((40,), float(rank + 1))
    strided = torch.full((10, 8), float(rank + 1)).t()  # 80 elements, not contiguous
    small = [torch.full((3,), float(rank + 1) * 10), torch.full((2, 2), float(rank + 1))]
    storage = big.data_ptr()
    calls = []
    real, old = comm.all_reduce, comm.COALESCE_MAX_ELEMENTS
    comm.COALESCE_MAX_ELEMENTS = 32
    comm.all_reduce = lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k)
    try:
        comm.all_reduce_coalesced([small[0], big, strided, small[1]], group, "test")
    finally:
        comm.all_reduce, comm.COALESCE_MAX_ELEMENTS = real, old
    total = sum(range(1, world + 1))
    assert torch.equal(big, torch.full((40,), float(total))) and big.data_ptr() == storage
    assert torch.equal(strided, torch.full((8, 10), float(total)))
    assert torch.equal(small[0], torch.full((3,), 10.0 * total))
    assert torch.equal(small[1], torch.full((2, 2), float(total)))
    return calls


def test_large_tensors_are_reduced_in_place_not_concatenated():
    """Coalescing saves latency for small tensors; a large one (the tied embedding's gradient)
    is reduced where it lies, without a copy of its size."""
    for calls in run_ranks(2, _coalesced):
        assert calls == [40, 3 + 80 + 4]
