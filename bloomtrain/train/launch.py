"""Starting a training job: the device, the process group, SLURM's variables and the local
launcher. Under torchrun (or srun with the torchrun variables) every process joins the job from
the environment; `launch_local` starts N local workers through torch's elastic launcher, the
machinery behind torchrun, and after they exit prints what the hang watchdog of each rank
reported (bloomtrain.train.watchdog), if any did: who waited in what, on whom.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from bloomtrain.config import Config, UserError
from bloomtrain.train import watchdog


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def env_from_slurm(env=os.environ) -> None:
    """Under a plain `srun` (one task per GPU, no torchrun), translate SLURM's task variables into
    torchrun's. MASTER_ADDR/MASTER_PORT must come from the job script (see the README)."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UserError(f"running under srun with {env['SLURM_NTASKS']} tasks but {missing} "
                        f"unset: export MASTER_ADDR (the first node's hostname) and MASTER_PORT "
                        f"in the job script, or launch through torchrun")
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_group_backend(setting: str, device: torch.device) -> str:
    """The backend string for `parallel.backend` on `device`. On CUDA it is per-device,
    `cpu:gloo,cuda:nccl`: training collectives run on NCCL, and a collective on a CPU tensor
    (object collectives, a control value computed on the host) is served by gloo instead of
    failing, so the control plane is NCCL-safe by construction rather than by care at every call
    site (bloomtrain.parallel.comm checks each tensor's device against this)."""
    if setting == "gloo":
        if device.type == "cuda":
            raise UserError("parallel.backend=gloo cannot carry the CUDA training tensors; use "
                            "parallel.backend=auto (NCCL for CUDA tensors, gloo for CPU ones) or "
                            "train.device=cpu")
        return "gloo"
    if device.type == "cuda":  # auto or nccl
        return "cpu:gloo,cuda:nccl"
    if setting == "nccl":
        raise UserError("parallel.backend=nccl needs CUDA devices (train.device=cuda); use "
                        "parallel.backend=auto on CPU")
    return "gloo"


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the job. resolve_device has already called torch.cuda.set_device, so every NCCL
    communicator is created on this rank's own GPU; `device_id` binds the group to it (eager
    NCCL init, and barriers and object collectives know the device instead of guessing it from
    the rank)."""
    if world_size_from_env() == 1 or dist.is_initialized():
        return
    backend = process_group_backend(cfg.parallel.backend, device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timedelta(minutes=cfg.parallel.timeout_minutes), **kw)


def launch_local(nproc: int, entry, *args) -> None:
    """Start `nproc` workers running `entry(*args)` (a module-level function) on this machine
    with torch's elastic launcher (what torchrun uses), on a free localhost port."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                      run_id=f"bloomtrain-{os.getpid()}", rdzv_backend="c10d",
                      rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, monitor_interval=0.2,
                      start_method="spawn")
    with tempfile.TemporaryDirectory(prefix="bloomtrain-hang-") as reports, \
            _environ(watchdog.REPORTS_ENV, reports):
        try:
            elastic_launch(lc, entry)(*args)
        except ChildFailedError as e:
            hung = watchdog.summarize(watchdog.read_pointers(reports), nproc)
            if hung:
                print("\n".join(hung), file=sys.stderr, flush=True)
            first = min(e.failures)
            raise UserError(f"worker rank {first} failed (of {len(e.failures)} failed): "
                            f"{e.failures[first].message}"
                            f"{'; the job hung (see the reports above)' if hung else ''}") \
                from None


@contextlib.contextmanager
def _environ(key: str, value: str):
    """`key=value` in the environment the workers inherit, for the block only."""
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
